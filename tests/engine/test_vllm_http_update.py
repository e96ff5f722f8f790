"""Weight updates over HTTP to a running `vllm serve` (worker extension + middleware), with bad payloads."""

import os
import socket
import subprocess
import sys
import time

import pytest
import requests
import torch

pytestmark = pytest.mark.engine
pytest.importorskip("vllm")

sys.path.insert(0, os.path.dirname(__file__))
from sync_scenarios import learner_fn, load_dir  # noqa: E402

KEY = "grid-secret"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from mxfp8_learner_grid.common.tiny_model import save_model
    from mxfp8_learner_grid.vllm_plugin.client import GRID_MIDDLEWARE, GRID_WORKER
    root = tmp_path_factory.mktemp("http")
    a, b = str(save_model(root / "A", seed=0)), str(save_model(root / "B", seed=1))
    port = free_port()
    env = dict(os.environ, MXFP8_GRID_UPDATES="1", VLLM_LOGGING_LEVEL="WARNING", MXFP8_GRID_STALL_TIMEOUT_S="6")
    log = open(root / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "mxfp8_learner_grid.vllm_plugin.serve", a, "--quantization",
                             "mxfp8-learner-grid", "--dtype", "float32", "--max-model-len", "256",
                             "--gpu-memory-utilization", "0.1", "--enforce-eager", "--host", "127.0.0.1", "--port",
                             str(port), "--served-model-name", "tiny", "--api-key", KEY, "--enable-prefix-caching",
                             "--worker-extension-cls", GRID_WORKER, "--middleware", GRID_MIDDLEWARE],
                            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    t0 = time.time()
    while time.time() - t0 < 600:
        assert proc.poll() is None, (root / "server.log").read_text()[-5000:]
        try:
            if requests.get(url + "/health", timeout=2).status_code == 200:
                break
        except requests.RequestException:
            pass
        time.sleep(1)
    yield {"url": url, "A": a, "B": b}
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


PROMPTS = [[5, 17, 100, 3, 250, 9, 44, 12, 300, 7, 61, 2], [200, 201, 202, 19, 8, 77, 140, 33, 90, 11]]


def test_update_over_http(server):
    from mxfp8_learner_grid.vllm_plugin.client import connect
    learner_b = learner_fn(server["B"])
    long = torch.randint(1, 380, (240,), generator=torch.Generator().manual_seed(0)).tolist()
    client = connect(server["url"], api_key=KEY, model="tiny", probe_prompts=PROMPTS, learner_logprobs=learner_b,
                     cache_probe_prompt=long, digest="sampled", fraction=0.25, bucket_bytes=1 << 16)
    rep = client.update_weights(load_dir(server["B"]), format="bf16", version=1, kv_scales={0: (0.1, 0.2)})
    assert rep.ok, rep.summary()
    assert {c.name for c in rep.checks} >= {"completeness", "byte_identity", "layout", "derived_state",
                                           "storage_stability", "atomic_versioning", "cache_coherence", "probe"}
    r = requests.post(server["url"] + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                      json={"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 1, "echo": True, "logprobs": 0})
    assert r.headers["x-weight-version"] == "1"
    got = r.json()["choices"][0]["logprobs"]["token_logprobs"][1:len(PROMPTS[0])]
    want = learner_b([PROMPTS[0]])[0]
    assert max(abs(x - y) for x, y in zip(got, want)) < 2e-3

    # a malformed update (NaN in a norm weight) is refused and changes nothing
    bad = load_dir(server["A"])
    bad["model.norm.weight"][3] = float("nan")
    rep2 = client.update_weights(bad, format="bf16", version=2)
    assert not rep2.applied and "NaN" in (rep2.error or ""), rep2.summary()
    assert client.t.prompt_logprobs(PROMPTS)[0] == client.t.prompt_logprobs(PROMPTS)[0]
    assert max(abs(x - y) for x, y in zip(client.t.prompt_logprobs([PROMPTS[0]])[0][0], want)) < 2e-3
    assert requests.get(server["url"] + "/grid/version", headers={"Authorization": f"Bearer {KEY}"}).json() == \
        {"version": 1, "paused": False, "expired_updates": []}


@pytest.mark.parametrize("path,body,headers,status,needle", [
    ("/grid/rpc", {"method": "grid_state", "args": []}, {}, 401, "API key"),
    ("/grid/rpc", {"method": "collective_rpc", "args": []}, None, 400, "not a grid update method"),
    ("/grid/rpc", {"method": "grid_state", "args": [1]}, None, 400, "list of strings"),
    ("/grid/rpc", {"method": "grid_update_load", "args": ['{"kind": "cuda_ipc", "tensors": {}}']}, None, 400,
     "a bucket source must be"),
    ("/grid/rpc", {"method": "grid_update_load", "args": ['{"kind": "safetensors", "path": "/etc/passwd"}']}, None,
     400, "bucket path must be inside"),
    ("/grid/rpc", {"method": "grid_update_begin", "args": ["{not json"]}, None, 400, "manifest is not JSON"),
    ("/grid/nope", {}, None, 404, "no route"),
    # fuzzed payloads (issue #16): wrong types, huge numbers, path traversal -- each a 4xx naming the problem
    ("/grid/rpc", [1, 2], None, 400, "body must be"),
    ("/grid/rpc", b"\xff\xfe{", None, 400, "body is not JSON"),
    ("/grid/rpc", {"method": 5}, None, 400, "not a grid update method"),
    ("/grid/rpc", {"method": "grid_state", "args": "grid_state"}, None, 400, "list of strings"),
    ("/grid/rpc", {"method": "grid_update_load", "args": ['{"kind": "safetensors", "path": "/dev/shm/../../etc/passwd"}']},
     None, 400, "bucket path must be inside"),
    ("/grid/rpc", {"method": "grid_update_load", "args": ['{"kind": "nccl", "tensors": [["w", "torch.bfloat16", 7]]}']},
     None, 400, "an nccl bucket source is"),
    ("/grid/rpc", {"method": "grid_update_begin", "args": ["[]"]}, None, 400, "a manifest is an object"),
    ("/grid/rpc", {"method": "grid_update_begin", "args": ['{"version": 1e400, "format": "bf16"}']}, None, 400,
     "version must be an integer"),
    ("/grid/rpc", {"method": "grid_update_begin", "args": [
        '{"version": 5, "format": "bf16", "partial": true, "tensors": [{"name": "model.norm.weight", '
        '"shape": [99999999999999999999], "dtype": "torch.bfloat16"}]}']}, None, 400, "shape must be"),
    ("/grid/rpc", {"method": "grid_update_begin", "args": [
        '{"version": 5, "format": "bf16", "partial": true, "tensors": [{"name": "model.norm.weight", '
        '"shape": [7], "dtype": "torch.bfloat16"}]}']}, None, 422, "model.norm.weight"),
])
def test_bad_requests_get_4xx(server, path, body, headers, status, needle):
    h = {"Authorization": f"Bearer {KEY}"} if headers is None else headers
    if isinstance(body, bytes):
        r = requests.post(server["url"] + path, data=body, headers=h, timeout=60)
    else:
        r = requests.post(server["url"] + path, json=body, headers=h, timeout=60)
    assert r.status_code == status and needle in r.text, (r.status_code, r.text)
    assert requests.get(server["url"] + "/health", timeout=10).status_code == 200


def test_unknown_tensor_is_rejected_before_any_write(server):
    from mxfp8_learner_grid.common.sync.manifest import Manifest
    m = Manifest.of({"model.layers.0.mlp.bogus.weight": torch.zeros(2, 2)}, 9, "bf16", partial=True)
    r = requests.post(server["url"] + "/grid/rpc", headers={"Authorization": f"Bearer {KEY}"},
                      json={"method": "grid_update_begin", "args": [m.to_json(), "{}"]}, timeout=60)
    assert r.status_code == 422 and "unknown tensor" in r.text, r.text


@pytest.mark.parametrize("dies_after", ["first bucket", "finish"])
def test_a_trainer_that_dies_mid_update_leaves_the_engine_whole(server, dies_after):
    """The trainer pauses generation, begins an update, sends a bucket (or everything, and the
    checks pass) -- and dies before commit.  After MXFP8_GRID_STALL_TIMEOUT_S (6 s here) the server
    rolls the update back on every rank and resumes generation: the previous weights serve, whole;
    then a fresh client's update succeeds."""
    import json
    from mxfp8_learner_grid.common.sync.manifest import Manifest
    from mxfp8_learner_grid.common.sync.transport import buckets
    from mxfp8_learner_grid.vllm_plugin.client import HTTPTransport, connect
    h = {"Authorization": f"Bearer {KEY}"}
    t = HTTPTransport(server["url"], api_key=KEY, model="tiny")
    version = requests.get(server["url"] + "/grid/version", headers=h).json()["version"]
    lp0, fp0 = t.prompt_logprobs([PROMPTS[0]])[0][0], t.rpc("grid_fingerprints", "[]")
    new = load_dir(server["A"] if version == 1 else server["B"])
    t.pause()
    t.rpc("grid_update_begin", Manifest.of(new, version + 1, "bf16").to_json(), json.dumps({"digest": "off"}))
    for i, bucket in enumerate(buckets(new.items(), 1 << 16)):
        if dies_after == "first bucket" and i == 1:
            break
        src = t.stage(bucket)
        t.rpc("grid_update_load", json.dumps(src))
        t.release(src)
    if dies_after == "finish":
        assert all(r["checks"] for r in t.rpc("grid_update_finish"))
    t0 = time.time()                                       # ... and the trainer is gone
    while requests.get(server["url"] + "/grid/version", headers=h).json()["paused"]:
        assert time.time() - t0 < 60, "generation still paused a minute after the trainer died"
        time.sleep(1)
    state = requests.get(server["url"] + "/grid/version", headers=h).json()
    assert state["version"] == version and state["expired_updates"], state
    assert t.prompt_logprobs([PROMPTS[0]])[0][0] == lp0          # serving again, the previous weights
    assert t.rpc("grid_fingerprints", "[]") == fp0               # bytes whole
    client = connect(server["url"], api_key=KEY, model="tiny", bucket_bytes=1 << 16)
    rep = client.update_weights(new, format="bf16", version=version + 1)
    assert rep.ok, rep.summary()


def test_hostile_bucket_files_change_nothing(server, tmp_path):
    """Symlinks out of the staging dirs, truncated safetensors, a file whose tensor is not what the
    manifest announced: each refused with a 4xx naming the problem, the weights untouched."""
    import json
    import tempfile
    from safetensors.torch import save_file
    from mxfp8_learner_grid.common.sync.manifest import Manifest
    from mxfp8_learner_grid.vllm_plugin.client import HTTPTransport
    t = HTTPTransport(server["url"], api_key=KEY, model="tiny")
    fp0, lp0 = t.rpc("grid_fingerprints", "[]"), t.prompt_logprobs([PROMPTS[0]])[0][0]
    h = {"Authorization": f"Bearer {KEY}"}
    name = "model.norm.weight"
    good = load_dir(server["B"])[name]
    stage = tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    link = os.path.join(stage, "evil.safetensors")
    os.symlink("/etc/passwd", link)
    truncated = os.path.join(stage, "cut.safetensors")
    save_file({name: good}, truncated)
    with open(truncated, "r+b") as f:
        f.truncate(os.path.getsize(truncated) // 2)
    wrong = os.path.join(stage, "wrong.safetensors")
    save_file({name: torch.ones(good.numel() // 2)}, wrong)

    def rpc(method, *args):
        return requests.post(server["url"] + "/grid/rpc", headers=h, timeout=60,
                             json={"method": method, "args": list(args)})
    r = rpc("grid_update_load", json.dumps({"kind": "safetensors", "path": link}))
    assert r.status_code == 400 and "must be inside" in r.text, r.text
    for path, needle in ((truncated, ""), (wrong, name)):
        r = rpc("grid_update_begin", Manifest.of({name: good}, 99, "bf16", partial=True).to_json(), "{}")
        assert r.status_code == 200, r.text
        r = rpc("grid_update_load", json.dumps({"kind": "safetensors", "path": path}))
        assert r.status_code == 422 and needle in r.text, r.text
        rpc("grid_update_abort")
    assert t.rpc("grid_fingerprints", "[]") == fp0
    assert t.prompt_logprobs([PROMPTS[0]])[0][0] == lp0
    assert requests.get(server["url"] + "/health", timeout=10).status_code == 200


def test_no_request_mixes_versions_under_load(server):
    """8 concurrent completion requests keep running while 50 updates alternate between the two
    weight sets A and B (issue #16, on 2 CPU cores).  Every completed request -- prompt and
    generated tokens, float32 engine -- equals exactly one version's grid forward (< 2e-3 nats),
    never a mix, none fails because of an update, and its ``X-Weight-Version`` header names that
    same version.  Latency with and without updates is printed (p50 / p99)."""
    import statistics
    import threading
    from mxfp8_learner_grid.vllm_plugin.client import connect
    lf = {"A": learner_fn(server["A"]), "B": learner_fn(server["B"])}
    tensors = {"A": load_dir(server["A"]), "B": load_dir(server["B"])}
    client = connect(server["url"], api_key=KEY, model="tiny", digest="off", bucket_bytes=1 << 20)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, 380, (n,), generator=g).tolist() for n in (9, 17, 30, 12)]
    h = {"Authorization": f"Bearer {KEY}"}
    done, stop, lock = [], threading.Event(), threading.Lock()

    def worker(i):
        k = 0
        while not stop.is_set():
            p = prompts[(i + k) % len(prompts)]
            k += 1
            t0 = time.perf_counter()
            r = requests.post(server["url"] + "/v1/completions", headers=h, timeout=120,
                              json={"model": "tiny", "prompt": p, "max_tokens": 6, "temperature": 0, "echo": True,
                                    "logprobs": 0, "return_tokens_as_token_ids": True, "ignore_eos": True})
            with lock:
                done.append((updating.is_set(), time.perf_counter() - t0, p, r.status_code,
                             r.headers.get("x-weight-version"), r.json() if r.status_code == 200 else r.text))

    def phase(seconds=None, updates=0):
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
        stop.clear()
        for t in threads:
            t.start()
        if seconds:
            time.sleep(seconds)
        reps = []
        for u in range(updates):
            target = "A" if u % 2 == 0 else "B"
            reps.append((client.version + 1, target, client.update_weights(tensors[target], format="bf16")))
        stop.set()
        for t in threads:
            t.join()
        return reps

    updating = threading.Event()
    client.update_weights(tensors["B"], format="bf16")             # a known start: B
    phase(seconds=8)                                               # the same load without updates
    updating.set()
    reps = phase(updates=50)
    assert all(rep.ok for _, _, rep in reps), [rep.summary() for _, _, rep in reps if not rep.ok][:1]
    held = {v: t for v, t, _ in reps}
    held[reps[0][0] - 1] = "B"
    cache, verdicts = {}, []
    for during, secs, p, status, version, body in done:
        assert status == 200, (status, body)                        # no request fails because of an update
        ch = body["choices"][0]
        ids = [int(t.split(":")[1]) for t in ch["logprobs"]["tokens"]]
        got = ch["logprobs"]["token_logprobs"][1:]
        assert ids[:len(p)] == p
        match, diffs = [], {}
        for name in ("A", "B"):
            key = (name, tuple(ids))
            if key not in cache:
                cache[key] = lf[name]([ids])[0]
            d = [abs(a - b) for a, b in zip(got, cache[key])]
            prompt, gen = d[:len(p) - 1], d[len(p) - 1:]
            diffs[name] = (round(max(prompt), 5), round(max(gen), 5))
            # within a few activation-code flips of one version: under concurrent load the CPU GEMMs
            # see other batch sizes (float32 sums in another order) and decode attention runs another
            # kernel, and a last-bit difference can move one activation code (~0.05 nats); the two
            # versions differ by nats, a request that mixed them would be nats off both
            if max(prompt + gen) < 0.25:
                match.append(name)
        verdicts.append((during, secs, match, held.get(int(version)), diffs))
    mixed = [v for v in verdicts if len(v[2]) != 1]
    assert not mixed, f"{len(mixed)} of {len(verdicts)} requests match no single version: {mixed[:3]}"
    assert all(m[0] == h_ for _, _, m, h_, _ in verdicts), "X-Weight-Version names another version than the logprobs'"
    lat = {k: sorted(s for d, s, _, _, _ in verdicts if d == k) for k in (False, True)}
    assert len(lat[True]) >= 20 and {m[0] for d, _, m, _, _ in verdicts if d} == {"A", "B"}

    def pct(xs, q):
        return xs[min(len(xs) - 1, int(q * len(xs)))]
    exact = sum(1 for v in verdicts if max(v[4][v[2][0]]) < 2e-3)
    print(f"\nLOAD {exact} of {len(verdicts)} requests within 2e-3 nats of their version; requests without updates: {len(lat[False])}, p50 {statistics.median(lat[False]):.3f} s, "
          f"p99 {pct(lat[False], 0.99):.3f} s; with 50 updates: {len(lat[True])}, "
          f"p50 {statistics.median(lat[True]):.3f} s, p99 {pct(lat[True], 0.99):.3f} s", flush=True)

"""In-place weight updates of a live SGLang server through the project's client (a script, not a test).

    python tests/gpu/sglang_update_check.py [--kind dense|moe] --out result.json [--log server.log] [--port 30124]
    python tests/gpu/sglang_update_check.py --dry [--kind dense|moe] --out dry.json      # CPU, no server

Issue #12.  Two tiny seeded checkpoints A (seed 0) and B (seed 1) (``common.tiny_model.save_model``).
Live run (an H200 with SGLang 0.5.17 staged): starts ``python -m sglang.launch_server --model-path A
--quantization mxfp8-learner-grid --custom-weight-loader <GRID_LOADER>`` in bf16 with decode CUDA graphs
(the prefill CUDA graph off, as ``sglang_serve_check.py``; float32 cannot be served there), and this
process -- the trainer, on the same GPU -- drives it through ``sglang_plugin.client.HTTPTransport`` +
``common.sync.client.GridSyncClient`` (what ``connect(url)`` builds): the buckets are CUDA tensors of
this process, carried by SGLang's own ``/update_weights_from_tensor`` (its ``MultiprocessingSerializer``:
CUDA IPC handles) with ``load_format=GRID_LOADER``; 0.5.17 has no update sessions (``/begin_weight_update``
answers 404, the client then runs without them).  Steps:

1. ``before``: prompt + greedy-decode logprobs from ``/generate`` (one request per prompt, the decode steps
   in the CUDA graph) vs the learner's grid forward (``sync_scenarios.learner_fn``, float32, CPU) of A and B;
2. ``update_B_bf16``: B's BF16 tensors (quantized in the engine), digest "full" -- the seven checks; then
   the logprobs must be close to learner B, far from A;
3. ``update_B_mxfp8``: B again as the learner's wire bytes: the engine must hold the very same bytes (every
   parameter's fingerprint equal to after step 2) and serve the same logprobs;
4. faults, each with A's weights (so that a fault that got through would show): wrong shape, unknown
   tensor, missing tensor (full update), TE-padded scales, float32 scales, a replayed older version, a NaN
   weight (refused mid-load, rolled back) and GEMM-swizzled scales labelled compact (caught by byte
   identity after the writes, rolled back).  Each must be refused with a message naming the tensor (the
   version for the replay), the expected check failed, and afterwards every parameter's fingerprint, the
   weight versions (the grid's and SGLang's ``/model_info``) and the logprobs (and generated tokens) equal
   to before the fault;
5. ``recover_A``: a clean BF16 update to A: applied, seven checks ok, logprobs close to learner A.

Dry run (``--dry``, any CPU venv): the checkpoints, the learner forwards (A vs B distance), every payload
and fault payload, each fault's manifest against the checkpoint signature (``common.sync.manifest``); and
where SGLang is installed (``.venv-sglang``), the same step sequence through the same client against
SGLang's real Qwen3 / Qwen3-MoE on the CPU (the in-process transport of
``tests/sglang_engine/test_sglang_sync.py``, without sessions as in 0.5.17; no logprobs there -- SGLang has
no CPU attention backend -- the engine's bytes are compared with A's and B's wire tensors instead).

Prints one ``RESULT {...}`` line -- the summary: ``ok`` (all criteria), ``criteria`` (one boolean each), per
step the seven-check report, max / mean |engine - learner| vs A and B, each fault's refusal -- and writes the
same JSON to ``--out`` with the full record of every step added under ``details`` (reports, fingerprints
compared, probes, the server log's tail when not ok).  Exit 0 when it ran to the end
(criteria may have failed: see ``ok``), 2 on an unexpected exception, 3 when ``--deadline`` struck, 4 on
SIGTERM / SIGINT (in both the server's process group is killed and RESULT is still printed).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import urllib.request

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "engine"))          # sync_scenarios.learner_fn

GRID_LOADER = "mxfp8_learner_grid.sglang_plugin.updater.grid_loader"   # checked against the module when live
CONDITIONS = ("completeness", "byte_identity", "layout", "derived_state", "storage_stability",
              "atomic_versioning", "cache_coherence")                   # common.sync.report.CONDITIONS
PROBE = list(range(3, 40))                                              # the client's cache probe prompt
T0 = time.time()


def log(msg: str) -> None:
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


# -- checkpoints, learner, payloads (CPU) ------------------------------------------------------

def prompts_for(vocab: int) -> list:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(1, vocab - 1, (n,), generator=g).tolist() for n in (12, 30, 64, 7)]


def payloads(path: str) -> tuple[dict, dict]:
    """(bf16, wire) of the checkpoint at ``path`` under HF names, as a trainer sends them
    (``export_hf_state_dict``: fused experts split per expert; ``export_wire``: TE's fp8 bytes + scales)."""
    import transformers
    from mxfp8_learner_grid.common.learner import apply_learner_grid, export_hf_state_dict, export_wire
    m = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    apply_learner_grid(m)
    with torch.no_grad():
        wire = {n: t.detach().clone().contiguous() for n, t in export_wire(m).items()}
        bf16 = {n: t.detach().clone().contiguous() for n, t in export_hf_state_dict(m).items()}
    return bf16, wire


def fault_specs(bf16: dict, wire: dict) -> list[dict]:
    """Faults a trainer can send through the shipped client (no test hook in the engine), each built from
    A's tensors.  ``check``: the condition that must fail (None: the error names it); ``expect``: what the
    refusal must name; ``stage``: "manifest" (refused before any write) or "load" / "commit" (after writes,
    rolled back)."""
    from mxfp8_learner_grid.common import pad_scales, swizzle_scales
    from mxfp8_learner_grid.common.format import rowwise_scale_shape
    out = []

    def add(name, tensors, fmt, check, expect, stage, **kw):
        out.append(dict(name=name, tensors=tensors, format=fmt, check=check, expect=expect, stage=stage, **kw))

    n = "model.layers.0.self_attn.o_proj.weight"                     # K cut by one block of 32
    p = dict(bf16)
    p[n] = p[n][:, :-32].contiguous()
    add("wrong_shape", p, "bf16", "layout", n, "manifest")
    n = "model.layers.0.self_attn.bogus_proj.weight"
    p = dict(bf16)
    p[n] = torch.zeros(64, 128, dtype=torch.bfloat16)
    add("unknown_tensor", p, "bf16", "completeness", n, "manifest")
    n = "model.layers.1.self_attn.v_proj.weight"
    p = {k: v for k, v in bf16.items() if k != n}
    add("missing_tensor", p, "bf16", "completeness", n, "manifest")
    def padded(t):                                                    # TE's buffer: rows to 128, K/32 to 4
        return pad_scales(t, rowwise_scale_shape(t.shape[0], t.shape[1] * 32)).contiguous()
    # the first scale TE pads (dense: k_proj [64, 4] -> (128, 4); with the MoE model's head_dim 64 no
    # attention scale is padded, so an expert's gate_proj [64, 4] -> (128, 4))
    n = next(k for k, t in wire.items() if k.endswith("_scale_inv") and tuple(padded(t).shape) != tuple(t.shape))
    p = dict(wire)
    p[n] = padded(p[n])
    add("scale_padding", p, "mxfp8", "layout", n, "manifest")
    n = "model.layers.1.self_attn.q_proj.weight_scale_inv"
    p = dict(wire)
    p[n] = p[n].to(torch.float32).contiguous()
    add("scale_dtype", p, "mxfp8", "layout", n, "manifest")
    add("stale_version", dict(bf16), "bf16", "atomic_versioning", "older than the version", "manifest",
        version="previous")
    n = "model.layers.1.self_attn.o_proj.weight"
    p = dict(bf16)
    p[n] = p[n].clone()
    p[n][3, 5] = float("nan")
    add("nan_weight", p, "bf16", None, n, "load", expect_error="NaN")
    n = "model.layers.0.self_attn.q_proj.weight_scale_inv"            # [128, 4]: one 128 x 4 block
    p = dict(wire)
    p[n] = swizzle_scales(p[n]).contiguous()
    assert not torch.equal(p[n], wire[n]), "swizzling must move bytes"
    add("byte_identity", p, "mxfp8", "byte_identity", n, "commit", truth={(n, "scale"): wire[n]})
    return out


def manifest_precheck(model_dir: str, specs: list[dict], served_version: int = 2) -> dict:
    """Each fault's manifest against the checkpoint signature, as the engine's ``UpdateSession`` validates
    it before any write (CPU; the plugin's default module selection)."""
    import transformers
    from mxfp8_learner_grid.common.selection import ModuleSelection
    from mxfp8_learner_grid.common.sync.manifest import Manifest, checkpoint_signature, validate_by_condition
    sig = checkpoint_signature(transformers.AutoConfig.from_pretrained(model_dir), ModuleSelection())
    plain = {n: torch.bfloat16 for n, (_, g) in sig.items() if not g}
    out = {}
    for f in specs:
        version = served_version - 1 if f.get("version") == "previous" else served_version + 1
        m = Manifest.of(f["tensors"], version, f["format"])
        probs = validate_by_condition(m, sig, plain)
        if version < served_version:       # UpdateSession's own rule (not the manifest's): mirrored here
            probs.setdefault("atomic_versioning", []).append(f"version {version} is older than the version "
                                                             f"this rank serves ({served_version})")
        text = json.dumps(probs)
        out[f["name"]] = {"problems": probs,
                          "as_expected": (f["check"] in probs and f["expect"] in text) if f["stage"] == "manifest"
                          else not probs}
    return out


# -- comparisons -------------------------------------------------------------------------------

def dist(engine: list, learner: list) -> dict:
    d = [abs(a - b) for e, l in zip(engine, learner) for a, b in zip(e, l)]
    n_e, n_l = sum(map(len, engine)), sum(map(len, learner))
    return {"max": max(d), "mean": sum(d) / len(d), "tokens": len(d), "aligned": n_e == n_l == len(d)}


def closer(near: dict, far: dict) -> bool:
    """The engine computes ``near``'s function, not ``far``'s: bf16 noise (~0.1 nats mean, < 1 max on the
    H200's tiny models) against the distance of two different random models (nats)."""
    return near["aligned"] and far["aligned"] and near["mean"] < 0.5 * far["mean"] and near["max"] < far["max"] \
        and near["mean"] < 0.5


def same_probe(a: list, b: list) -> dict:
    """Two probes of the engine (same prompts, greedy): the same tokens generated, the same logprobs."""
    tokens = all(x["gen"] == y["gen"] for x, y in zip(a, b)) and len(a) == len(b)
    d = [abs(p - q) for x, y in zip(a, b) for p, q in zip(x["lp_in"] + x["lp_out"], y["lp_in"] + y["lp_out"])]
    return {"tokens_equal": tokens, "max_abs": max(d) if d else None}


def report_dict(rep) -> dict:
    checks = {c: [x.ok for x in rep.check(c)] for c in CONDITIONS + ("probe",)}
    seven = all(checks[c] and all(ok is True for ok in checks[c]) for c in CONDITIONS)
    failed_text = " | ".join(str(d) for c in rep.checks if c.ok is False for d in c.details)
    return {"ok": rep.ok, "applied": rep.applied, "rolled_back": rep.rolled_back, "version": rep.version,
            "error": rep.error, "failed": rep.failed(), "checks": checks, "seven_ok": seven,
            "message": ((rep.error or "") + (" | " if rep.error and failed_text else "") + failed_text)[:4000],
            "summary": rep.summary()[:6000], "timings": {k: round(v, 4) for k, v in rep.timings.items()}}


# -- engines -------------------------------------------------------------------------------------

_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))     # loopback: never through a proxy


def _http(url: str, body=None, timeout: float = 60):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with _OPENER.open(req, timeout=timeout) as r:
        return json.loads(r.read())


class LiveEngine:
    """A real ``sglang.launch_server`` on model A, and this process as its trainer (HTTP + CUDA IPC)."""

    live = True

    def __init__(self, args, model_dir: str):
        self.base = f"http://127.0.0.1:{args.port}"
        self.cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", model_dir,
                    "--quantization", "mxfp8-learner-grid", "--custom-weight-loader", GRID_LOADER,
                    "--host", "127.0.0.1", "--port", str(args.port), "--dtype", "bfloat16",
                    "--mem-fraction-static", "0.3", "--disable-prefill-cuda-graph", "--random-seed", "0"]
        if args.grid_options:         # plugin options, as SGLang takes them: the model's quantization_config
            opts = json.loads(args.grid_options)
            self.cmd += ["--json-model-override-args",
                         json.dumps({"quantization_config": dict(opts, quant_method="mxfp8-learner-grid")})]
        self.log_path = args.log
        self.logf = open(args.log, "w")
        # its own process group: the scheduler / detokenizer children go with it on stop()
        self.srv = subprocess.Popen(self.cmd, stdout=self.logf, stderr=subprocess.STDOUT, start_new_session=True)
        self.t = None
        self.new_tokens = args.new_tokens

    def wait(self, limit_s: float) -> float:
        t0 = time.time()
        while time.time() - t0 < limit_s:
            if self.srv.poll() is not None:
                raise RuntimeError(f"server exited with {self.srv.returncode} (log: {self.log_path})")
            try:
                _OPENER.open(self.base + "/health", timeout=2).read()
                return time.time() - t0
            except Exception:             # noqa: BLE001 -- not up yet
                time.sleep(1)
        raise RuntimeError(f"server not healthy after {limit_s:.0f} s (log: {self.log_path})")

    def client(self):
        from mxfp8_learner_grid.common.sync.client import GridSyncClient
        from mxfp8_learner_grid.sglang_plugin import updater
        from mxfp8_learner_grid.sglang_plugin.client import HTTPTransport
        assert updater.GRID_LOADER == GRID_LOADER, (updater.GRID_LOADER, GRID_LOADER)
        self.t = HTTPTransport(self.base, timeout=60)                    # what connect(url) builds
        self.t.s.trust_env = False                                        # loopback: never through a proxy
        return GridSyncClient(self.t, digest="full", cache_probe_prompt=PROBE)

    def server_info(self) -> dict:
        info = _http(self.base + "/server_info")
        return {k: info.get(k) for k in ("version", "custom_weight_loader", "tp_size", "dp_size", "pp_size",
                                         "disable_cuda_graph", "disable_prefill_cuda_graph", "attention_backend",
                                         "weight_version")}

    def to_trainer(self, d: dict) -> dict:
        """The trainer's tensors on the engine's GPU (their buckets then travel as CUDA IPC handles)."""
        return {n: t.to("cuda").contiguous() for n, t in d.items()}

    def fingerprints(self) -> dict:
        return self.t.rpc("grid_fingerprints", "[]")[0]

    def state(self) -> list:
        return self.t.rpc("grid_state")

    def weight_version(self):
        return _http(self.base + "/model_info").get("weight_version")

    def probe(self, prompts: list) -> list:
        """One /generate per prompt (deterministic batch shapes), greedy, logprobs from the first token."""
        out = []
        for p in prompts:
            r = _http(self.base + "/generate", {
                "input_ids": p, "return_logprob": True, "logprob_start_len": 0,
                "sampling_params": {"max_new_tokens": self.new_tokens, "temperature": 0, "ignore_eos": True}})
            mi = r["meta_info"]
            out.append({"gen": [int(t[1]) for t in mi["output_token_logprobs"]],
                        "lp_in": [float(t[0]) for t in mi["input_token_logprobs"][1:]],
                        "lp_out": [float(t[0]) for t in mi["output_token_logprobs"]],
                        "cached": int(mi.get("cached_tokens") or 0)})
        return out

    def holds(self) -> list:
        return []

    def log_tail(self, n: int = 40) -> list:
        try:
            with open(self.log_path, errors="replace") as f:
                return [ln.rstrip()[:300] for ln in f.readlines()[-n:]]
        except OSError:
            return []

    def kernels(self) -> list:
        try:
            with open(self.log_path, errors="replace") as f:
                return sorted({ln.split("-> kernel", 1)[1].strip()[:100] for ln in f if "-> kernel" in ln})
        except OSError:
            return []

    def graph_log(self) -> list:
        """The server's CUDA-graph capture lines (the decode steps of the probes replay those graphs)."""
        try:
            with open(self.log_path, errors="replace") as f:
                return [ln.strip()[-200:] for ln in f if "cuda graph" in ln.lower()][:4]
        except OSError:
            return []

    def stop(self) -> None:
        if self.t is not None:
            self.t.close()                # the client's reply dir under /dev/shm (os._exit skips finalizers)
        if self.srv.poll() is None:
            self.srv.terminate()
            try:
                self.srv.wait(20)
            except Exception:             # noqa: BLE001
                pass
        try:
            os.killpg(self.srv.pid, signal.SIGKILL)       # the group this script started (children too)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.logf.close()
        except Exception:                 # noqa: BLE001
            pass


class CpuEngine:
    """SGLang's real model on the CPU behind the in-process transport of test_sglang_sync.py (its
    ``WeightUpdater``, the payload through SGLang's serializer), without update sessions as in 0.5.17."""

    live = False

    def __init__(self, a_dir: str, bf16_a: dict, wires: dict):
        sys.path.insert(0, os.path.join(HERE, "..", "sglang_engine"))
        import sgl_helpers as H
        import transformers
        H.init_dist()
        from mxfp8_learner_grid.sglang_plugin.config import LearnerGridConfig
        from mxfp8_learner_grid.sglang_plugin.register import register
        register()
        self.H, self.wires = H, wires
        self.model = H.build_sglang_model(transformers.AutoConfig.from_pretrained(a_dir), LearnerGridConfig())
        H.load(self.model, bf16_a.items())
        self.t = None

    def wait(self, limit_s):
        return 0.0

    def client(self):
        from test_sglang_sync import _transport_class
        from mxfp8_learner_grid.common.sync.client import GridSyncClient
        self.t = _transport_class()(self.model, sessions=False)
        return GridSyncClient(self.t, digest="full", cache_probe_prompt=PROBE)

    def to_trainer(self, d):
        return d

    def fingerprints(self):
        return self.t.rpc("grid_fingerprints", "[]")[0]

    def state(self):
        return self.t.rpc("grid_state")

    def weight_version(self):
        return self.t.weight_version

    def probe(self, prompts):
        return None

    def holds(self) -> list:
        out = []
        for name, wire in self.wires.items():
            try:
                self.H.check_bytes(self.model, wire)
                out.append(name)
            except AssertionError:
                pass
        return out

    def log_tail(self, n=40):
        return []

    def kernels(self):
        return []

    def stop(self):
        if self.t is not None:
            self.t.close()


def step_summary(step: str, st: dict) -> dict:
    """One step, compactly, for the RESULT line (the full record is in --out's details)."""
    e: dict = {}
    if "exception" in st:
        e["exception"] = st["exception"][:300]
    rep = st.get("report")
    if rep:
        e["applied"] = rep["applied"]
        if step.startswith("fault_"):
            e["failed"] = rep["failed"]
            e["message"] = rep["message"][:200]
        else:
            e["seven_ok"] = rep["seven_ok"]
            e["checks"] = " ".join(f"{k}:" + ",".join({True: "ok", False: "FAIL", None: "skip"}[x] for x in v)
                                   for k, v in rep["checks"].items() if v)
    for k, v in (st.get("compare") or {}).items():
        if k.startswith("vs_"):
            e[k] = {"max": round(v["max"], 4), "mean": round(v["mean"], 4)}
    for k in ("same_as_before", "same_as_ref", "holds", "sglang_weight_version"):
        if k in st:
            e[k] = st[k]
    return e


# -- the run -------------------------------------------------------------------------------------

class Run:
    def __init__(self, args):
        self.args = args
        self.res: dict = {"kind": args.kind, "mode": "dry" if args.dry else "live", "steps": {}, "errors": []}
        self.lock = threading.RLock()      # re-entered by a signal handler while finishing: no deadlock
        self.done = False
        self.engine = None
        self.keep: list = []          # every tensor sent stays alive: CUDA IPC handles never see reused memory

    # the learner (float32, CPU) on the sequences the engine scored
    def learner(self, which: str, probe: list) -> list:
        seqs = [p + x["gen"] for p, x in zip(self.prompts, probe)]
        return self.learners[which](seqs)

    def compare(self, probe: list) -> dict:
        eng = [x["lp_in"] + x["lp_out"] for x in probe]
        out = {"generated": [x["gen"] for x in probe], "cached": [x["cached"] for x in probe]}
        for w in ("A", "B"):
            lrn = self.learner(w, probe)
            out[f"vs_{w}"] = dist(eng, lrn)                                   # prompt + decoded tokens
            out[f"prompt_vs_{w}"] = dist([x["lp_in"] for x in probe],       # the prompt tokens alone (prefill)
                                         [l[:len(x["lp_in"])] for x, l in zip(probe, lrn)])
        return out

    def step(self, name: str, fn):
        t0 = time.time()
        try:
            out = fn()
        except Exception as exc:          # noqa: BLE001 -- recorded; the next step still runs
            out = {"exception": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
            self.res["errors"].append(f"{name}: {type(exc).__name__}: {exc}"[:600])
            log(f"{name}: EXCEPTION {type(exc).__name__}: {exc}")
        out["wall_s"] = round(time.time() - t0, 2)
        self.res["steps"][name] = out
        return out

    def update(self, tensors, fmt, **kw):
        tensors = self.engine.to_trainer(tensors)
        self.keep.append(tensors)
        if kw.get("truth"):
            kw["truth"] = {k: self.engine.to_trainer({"t": v})["t"] for k, v in kw["truth"].items()}
            self.keep.append(kw["truth"])
        return self.client.update_weights(tensors, format=fmt, **kw)

    def observe(self) -> dict:
        """What the engine serves now: fingerprints, versions, logprobs (live) or bytes (CPU)."""
        out = {"fingerprints": self.engine.fingerprints(), "grid_versions": [s["version"] for s in self.engine.state()],
               "sglang_weight_version": self.engine.weight_version(), "holds": self.engine.holds()}
        out["probe"] = self.engine.probe(self.prompts)
        return out

    @staticmethod
    def public(obs: dict) -> dict:
        return {k: v for k, v in obs.items() if k not in ("fingerprints", "probe")}

    def main(self) -> None:
        from mxfp8_learner_grid.common.tiny_model import save_model
        from sync_scenarios import learner_fn
        args, res = self.args, self.res
        root = args.root or tempfile.mkdtemp(prefix="sgl-update-")
        moe = args.kind == "moe"
        # SGLang 0.5.17's qwen3_moe writes the KV cache inside its rotary kernel whenever the cache is
        # bf16, and its fallback rotary kernel (head sizes other than 64 / 128 / 256 / 512) cannot: the
        # tiny MoE model's head_dim 32 fails at CUDA-graph capture (seen on the H200), so 64 here
        shape = {"head_dim": 64} if moe else {}
        a_dir = str(save_model(os.path.join(root, "A"), moe=moe, seed=0, **shape))
        log(f"checkpoint A: {a_dir}")
        if not args.dry:                    # the server starts while the trainer side is prepared
            self.engine = LiveEngine(args, a_dir)
            res["cmd"] = " ".join(self.engine.cmd[1:])
            log("server starting")
        b_dir = str(save_model(os.path.join(root, "B"), moe=moe, seed=1, **shape))
        import transformers
        vocab = transformers.AutoConfig.from_pretrained(a_dir).vocab_size
        self.prompts = prompts_for(vocab)
        self.learners = {"A": learner_fn(a_dir), "B": learner_fn(b_dir)}
        lp = {k: f(self.prompts) for k, f in self.learners.items()}
        res["learner_A_vs_B"] = dist(lp["A"], lp["B"])             # the scale "far" is measured against
        bf16_a, wire_a = payloads(a_dir)
        bf16_b, wire_b = payloads(b_dir)
        specs = fault_specs(bf16_a, wire_a)
        res["tensors"] = {"bf16": len(bf16_b), "wire": len(wire_b)}
        res["manifest_precheck"] = manifest_precheck(a_dir, specs)
        log(f"trainer side ready: learner A vs B {res['learner_A_vs_B']}, {len(specs)} faults")

        if args.dry:
            import importlib.util
            if importlib.util.find_spec("sglang") is None:
                res["engine"] = "none (SGLang not installed: payloads, faults and manifests only)"
                return
            self.engine = CpuEngine(a_dir, bf16_a, {"A": wire_a, "B": wire_b})
            res["engine"] = "SGLang's model on the CPU, in-process transport, no sessions (0.5.17's behaviour)"
        else:
            torch.cuda.init()
            res["start_s"] = round(self.engine.wait(max(10.0, args.start_timeout - (time.time() - T0))), 1)
            log(f"server healthy after {res['start_s']} s")
            res["engine"] = "sglang.launch_server (HTTP), trainer on the same GPU (CUDA IPC)"
            try:
                res["server_info"] = self.engine.server_info()
            except Exception as exc:        # noqa: BLE001 -- informational
                res["server_info"] = f"{type(exc).__name__}: {exc}"
        self.client = self.engine.client()
        res["connect"] = {"client_version": self.client.version, "sessions": self.engine.t.sessions}
        live = self.engine.live

        def before():
            obs = self.observe()
            self.last = obs
            out = {**self.public(obs), **({"compare": self.compare(obs["probe"])} if live else {})}
            log(f"before: holds {out['holds']}, {out.get('compare', {}).get('vs_A')} / {out.get('compare', {}).get('vs_B')}")
            return out
        self.step("before", before)

        def clean(tensors, fmt, ref=None, **kw):
            def fn():
                rep = self.update(tensors, fmt, **kw)
                obs = self.observe()
                out = {"report": report_dict(rep), **self.public(obs)}
                if live:
                    out["compare"] = self.compare(obs["probe"])
                if ref is not None:
                    out["same_bytes_as_ref"] = obs["fingerprints"] == ref["fingerprints"]
                    if live:
                        out["same_as_ref"] = same_probe(ref["probe"], obs["probe"])
                self.last = obs
                cmp_ = out.get("compare") or {}
                log(f"clean {fmt}: {'applied' if rep.applied else 'NOT applied'}, seven_ok {out['report']['seven_ok']}, "
                    f"holds {out['holds']}, mean |engine - learner| A {cmp_.get('vs_A', {}).get('mean')} "
                    f"B {cmp_.get('vs_B', {}).get('mean')}")
                return out
            return fn
        self.step("update_B_bf16", clean(bf16_b, "bf16"))
        after_b = getattr(self, "last", None)
        self.step("update_B_mxfp8", clean(wire_b, "mxfp8", ref=after_b))

        for f in specs:
            def fault(f=f):
                pre = self.last
                kw = {}
                if f.get("version") == "previous":
                    kw["version"] = self.client.version - 1
                if f.get("truth"):
                    kw["truth"] = f["truth"]
                rep = self.update(f["tensors"], f["format"], **kw)
                obs = self.observe()
                r = report_dict(rep)
                out = {"report": r, **self.public(obs), "expected_check": f["check"], "expected_name": f["expect"],
                       "stage": f["stage"],
                       "refused": not rep.applied,
                       "named": f["expect"] in r["message"] and f.get("expect_error", "") in r["message"],
                       "check_failed": f["check"] is None or f["check"] in r["failed"],
                       "fingerprints_unchanged": obs["fingerprints"] == pre["fingerprints"],
                       "versions_unchanged": obs["grid_versions"] == pre["grid_versions"]
                       and obs["sglang_weight_version"] == pre["sglang_weight_version"],
                       "holds_unchanged": obs["holds"] == pre["holds"]}
                if live:
                    out["same_as_before"] = same_probe(pre["probe"], obs["probe"])
                    out["compare"] = self.compare(obs["probe"])
                log(f"fault {f['name']}: refused {out['refused']}, named {out['named']}, check {out['check_failed']}, "
                    f"unchanged {out['fingerprints_unchanged']} -- {r['message'][:200]}")
                self.last = obs
                return out
            self.step(f"fault_{f['name']}", fault)

        self.step("recover_A", clean(bf16_a, "bf16"))
        if live:
            res["kernels"] = self.engine.kernels()
            res["cuda_graph_log"] = self.engine.graph_log()

    # -- verdict ---------------------------------------------------------------------------------
    def criteria(self) -> dict:
        s, live = self.res["steps"], self.res["mode"] == "live"
        c = {"no_exceptions": not self.res["errors"]}
        pre = self.res.get("manifest_precheck", {})
        c["manifest_precheck"] = bool(pre) and all(v["as_expected"] for v in pre.values())
        if "engine" in self.res and self.res["engine"].startswith("none"):
            return c
        c["connected"] = "before" in s and "exception" not in s["before"]

        def served(step, want, other):
            st = s.get(step, {})
            if live:
                cmp_ = st.get("compare")
                return bool(cmp_) and closer(cmp_[f"vs_{want}"], cmp_[f"vs_{other}"])
            return st.get("holds") == [want]
        c["before_serves_A"] = served("before", "A", "B")
        for step, want, other in (("update_B_bf16", "B", "A"), ("update_B_mxfp8", "B", "A"), ("recover_A", "A", "B")):
            st = s.get(step, {})
            rep = st.get("report") or {}
            c[f"{step}_seven_ok"] = bool(rep.get("applied") and rep.get("ok") and rep.get("seven_ok"))
            c[f"{step}_serves_{want}"] = served(step, want, other)
            c[f"{step}_version"] = str(st.get("sglang_weight_version")) == str(rep.get("version")) \
                and st.get("grid_versions") == [rep.get("version")]
        m = s.get("update_B_mxfp8", {})
        c["mxfp8_same_bytes_as_bf16"] = bool(m.get("same_bytes_as_ref"))
        if live:
            same = m.get("same_as_ref") or {}
            c["mxfp8_same_logprobs_as_bf16"] = bool(same.get("tokens_equal")) and same.get("max_abs") is not None \
                and same["max_abs"] <= self.args.same_tol
        for name, st in s.items():
            if not name.startswith("fault_"):
                continue
            ok = all(st.get(k) for k in ("refused", "named", "check_failed", "fingerprints_unchanged",
                                         "versions_unchanged", "holds_unchanged"))
            if live:
                same = st.get("same_as_before") or {}
                ok = ok and bool(same.get("tokens_equal")) and same.get("max_abs") is not None \
                    and same["max_abs"] <= self.args.same_tol
            c[name] = bool(ok)
        return c

    def finish(self, why: str = "") -> dict:
        with self.lock:
            if self.done:
                return {}
            self.done = True
            res = self.res
            if why:
                res["errors"].append(why)
            res["wall_s"] = round(time.time() - T0, 1)
            try:
                steps = dict(res["steps"])          # a snapshot (the deadline fires from another thread)
                crit = self.criteria()
                summary = {"ok": all(crit.values()), "criteria": crit, "kind": res["kind"], "mode": res["mode"],
                           "wall_s": res["wall_s"], "start_s": res.get("start_s"), "errors": res["errors"][:6],
                           "learner_A_vs_B": res.get("learner_A_vs_B"),
                           "sglang": res["server_info"].get("version") if isinstance(res.get("server_info"), dict)
                           else None}
                for step, st in steps.items():
                    summary[step] = step_summary(step, st)
            except Exception as exc:          # noqa: BLE001 -- a RESULT line in any case
                summary = {"ok": False, "kind": res["kind"], "mode": res["mode"], "wall_s": res["wall_s"],
                           "errors": res["errors"][:6] + [f"summary failed: {type(exc).__name__}: {exc}"]}
            if not summary["ok"] and self.engine is not None:
                res["server_log_tail"] = self.engine.log_tail()
            print("RESULT " + json.dumps(summary, default=str), flush=True)
            if self.args.out:
                try:
                    with open(self.args.out, "w") as f:
                        json.dump({**summary, "details": res}, f, indent=1, default=str)
                except Exception as exc:      # noqa: BLE001
                    print(f"could not write {self.args.out}: {exc}", flush=True)
            return summary


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kind", choices=("dense", "moe"), default="dense")
    ap.add_argument("--dry", action="store_true", help="CPU only: no server (see the module docstring)")
    ap.add_argument("--port", type=int, default=30124)
    ap.add_argument("--out", default="sgl-update.json")
    ap.add_argument("--log", default="sgl-update-server.log")
    ap.add_argument("--root", default=None, help="where the checkpoints go (default: a new temp dir)")
    ap.add_argument("--new-tokens", type=int, default=8, help="greedy tokens per probe prompt (decode: CUDA graph)")
    ap.add_argument("--start-timeout", type=float, default=200.0, help="seconds from script start for the server")
    ap.add_argument("--deadline", type=float, default=262.0, help="seconds: then the server is killed, RESULT printed")
    ap.add_argument("--grid-options", default="",
                    help='plugin options as JSON, e.g. \'{"moe_single_copy": true}\' (the server\'s quantization_config)')
    ap.add_argument("--same-tol", type=float, default=1e-3,
                    help="max |logprob| change allowed where the weights must not have changed")
    args = ap.parse_args()
    run = Run(args)

    def stop(reason: str, code: int):     # one RESULT line, the server killed, then out
        log(reason)
        try:
            run.finish(reason)
        finally:
            if run.engine is not None:
                run.engine.stop()
            os._exit(code)

    def on_deadline():
        stop(f"deadline: {args.deadline:.0f} s passed", 3)

    def on_signal(signum, frame):         # e.g. the session's `timeout`: never leave the server running
        stop(f"killed by signal {signum}", 4)
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    timer = threading.Timer(max(1.0, args.deadline - (time.time() - T0)), on_deadline)   # from the script start
    timer.daemon = True
    timer.start()
    code = 0
    try:
        run.main()
    except Exception as exc:              # noqa: BLE001 -- a crash: still one RESULT line
        traceback.print_exc()
        run.res["errors"].append(f"crash: {type(exc).__name__}: {exc}"[:600])
        run.res["traceback"] = traceback.format_exc()[-4000:]
        code = 2
    finally:
        if run.engine is not None:
            run.engine.stop()
    timer.cancel()
    run.finish()
    return code


if __name__ == "__main__":
    sys.exit(main())

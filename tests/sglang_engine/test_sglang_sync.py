"""Grid weight updates on SGLang's real Qwen3 / Qwen3-MoE (CPU): the trainer's client, the
SGLang transport, the worker bridge and SGLang's own model-runner updater, end to end.

    client (common GridSyncClient) -> SGLangTransport (sglang_plugin/client.py) -> payload through
    SGLang's MultiprocessingSerializer -> SGLang's WeightUpdater.update_weights_from_tensor(
    load_format=GRID_LOADER) / load_weights_from_distributed / begin_weight_update /
    end_weight_update -> grid_loader + GridWorker (sglang_plugin/updater.py) -> UpdateSession over
    SGLangAdapter (sglang_plugin/sync_adapter.py) -> the model's own load_weights

What a running server adds on top is stood in by ``UpdaterTransport`` (below): the scheduler
handing one request to this process's TP rank, its session guard ("must run between
begin_weight_update() and end_weight_update()"), SGLang's weight_version, and a record of which
prompts the prefix cache holds (flush = forget them) -- so the client's cache probe can run; the
radix cache itself is not run here.

A clean bf16 and a clean mxfp8 update must pass all seven checks with the engine holding the
learner's bytes (and computing the grid forward); each injected fault must be named by its check
and -- unless it cannot be undone by a rollback -- leave the previous weights, whole.  TP=1 in
this process; TP=2 in two gloo processes running this file as a script (both ranks run the same
client in lockstep; the worker bridge all-gathers over SGLang's TP group).
"""

import contextlib
import json
import os
import queue
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import pytest  # noqa: E402

from sgl_env import sglang_installed  # noqa: E402

if not sglang_installed():
    pytest.skip("SGLang is not installed (tests/sglang_engine run in .venv-sglang)", allow_module_level=True)

import torch  # noqa: E402

from mxfp8_learner_grid.common.sync.report import CONDITIONS  # noqa: E402

sys.path.insert(0, os.path.join(HERE, ".."))
from fault_injection import FAULTS as _ALL_FAULTS, FaultyAdapterMixin  # noqa: E402   (test machinery)

# fault -> the check that must name it: the shared catalogue (tests/fault_injection.py), less
# skip_rebuild (run by the vLLM suite), plus a NaN weight refused mid-load (rollback verified)
FAULTS = {**{f: c for f, c in _ALL_FAULTS.items() if f != "skip_rebuild"}, "nan_tensor": "atomic_versioning"}
NOT_UNDONE = ("skip_version", "skipped_cache_flush")   # applied; a rollback cannot fix these
PROBE = list(range(3, 40))                             # the cache probe prompt


@contextlib.contextmanager
def _cpu_reductions():
    """SGLang's monkey_patch_torch_reductions (applied in this process by its WeightUpdater) pickles CUDA
    tensors only; trainer and engine share this process here, so serialize with torch's own reductions."""
    from torch.multiprocessing import reductions as R
    patched = R.reduce_tensor
    R.reduce_tensor = getattr(R, "_reduce_tensor_original", patched)
    R.init_reductions()
    try:
        yield
    finally:
        R.reduce_tensor = patched
        R.init_reductions()


def _transport_class():
    from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater
    from sglang.srt.utils import MultiprocessingSerializer

    from mxfp8_learner_grid.sglang_plugin.client import SGLangTransport
    from mxfp8_learner_grid.sglang_plugin.updater import GRID_LOADER

    class _UpdaterTransport(SGLangTransport):
        """The SGLang transport over this process's rank: SGLang's model-runner WeightUpdater does the
        work, the scheduler's bookkeeping is mimicked (see the module docstring)."""

        def __init__(self, model, rank=0, world=1, sessions=True, staging="tensor"):
            super().__init__({"tp_size": world, "custom_weight_loader": [GRID_LOADER]}, staging=staging)
            self.u = WeightUpdater(tp_rank=rank, device="cpu", gpu_id=0, model_config=None,
                                   custom_weight_loaders=[GRID_LOADER], get_model=lambda: model,
                                   update_model_fields=lambda **kw: None, recapture_cuda_graph=lambda: None,
                                   get_model_runner=lambda: None)
            self.has_sessions, self.open, self.weight_version = sessions, False, "default"
            self.cache, self.calls = set(), []
            if staging == "nccl":
                self.group = self.group_name = "pipe"
                self.pipe = queue.Queue(maxsize=1)

        def _update_from_tensor(self, named, weight_version):
            if self.has_sessions and not self.open:
                return False, "update_weights_from_tensor must run between begin_weight_update() and " \
                              "end_weight_update()"
            with _cpu_reductions():          # SGLang's payload round trip (its SafeUnpickler included)
                named = MultiprocessingSerializer.deserialize(MultiprocessingSerializer.serialize(named))
            ok, msg = self.u.update_weights_from_tensor(named_tensors=named, load_format=GRID_LOADER)
            if ok and weight_version is not None:
                self.weight_version = weight_version
            return ok, msg

        @property
        def send(self):
            if self.staging != "nccl":
                return None
            return lambda bucket, source: self.pipe.put([(n, t.clone()) for n, t in bucket], timeout=30)

        def _update_from_distributed(self, names, dtypes, shapes, group_name):
            received = self.pipe.get(timeout=30)          # what the broadcast delivers, in order
            assert [n for n, _ in received] == names and [list(t.shape) for _, t in received] == shapes
            return self.u.load_weights_from_distributed(received)

        def _session_call(self, which):
            if not self.has_sessions:
                return None                               # 0.5.17: no begin/end_weight_update
            self.calls.append(which)
            if which == "begin":
                if self.open:
                    return False, "a weight-update session is already open; call end_weight_update() first"
                self.u.begin_weight_update()
            else:
                if not self.open:
                    return False, "no weight-update session is open"
                self.u.end_weight_update(run_post_load=False)
            self.open = which == "begin"
            return True, "Success"

        def _pause_generation(self):
            self.calls.append("pause")

        def _continue_generation(self):
            self.calls.append("continue")

        def _flush(self):
            self.calls.append("flush")
            self.cache.clear()
            return True

        def cached_tokens(self, prompt):
            hit = len(prompt) if tuple(prompt) in self.cache else 0
            self.cache.add(tuple(prompt))
            return hit

    return _UpdaterTransport


# -- engine models and learners --------------------------------------------------------------

def build_engine(H, moe: bool, initial: dict):
    """SGLang's real model with the plugin (and its KV-cache method on every attention), loaded."""
    from mxfp8_learner_grid.patches.sglang_qwen3_kv_scales import attach_kv_method
    from mxfp8_learner_grid.sglang_plugin.config import LearnerGridConfig
    hf = H.build_model(moe=moe, seed=0)
    cfg = LearnerGridConfig()
    model = H.build_sglang_model(hf.config, cfg)
    for i, layer in enumerate(model.model.layers):
        attach_kv_method(layer.self_attn, cfg, f"model.layers.{i}.self_attn")
    H.load(model, initial.items())
    return model


def payloads(H, moe: bool) -> dict:
    """{"A"|"B": (wire, bf16)}: two learners (seeds 0 and 1)."""
    out = {}
    for name, seed in (("A", 0), ("B", 1)):
        _, wire, bf16 = H.learner_and_wire(moe, seed=seed)
        out[name] = (wire, bf16)
    return out


def megatron_source(payload):
    """A Megatron-Core trainer's parameters (TP = 1: Megatron's names and fused layouts, TE MXFP8
    Linear weights) of the learner whose (wire, bf16) payload is given, as ``MegatronTPSource``."""
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from megatron_layout import megatron_shards
    from mxfp8_learner_grid.common.sync.megatron import MegatronTPSource
    from mxfp8_learner_grid.common.tiny_model import DENSE, MOE
    wire, bf16 = payload
    moe = any(".experts." in n for n in bf16)
    plain = wire["model.norm.weight"].dtype                        # the dtype the engine holds plain tensors in
    sd = {n: t.to(plain) for n, t in bf16.items()}
    cfg = dict(MOE if moe else DENSE, vocab_size=sd["model.embed_tokens.weight"].shape[0])
    return MegatronTPSource(megatron_shards(sd, cfg, moe, 0, 1, True, cfg["vocab_size"]), cfg)


def scenario(sc: str, serving: str, p: dict):
    """(target learner, format, tensors, client kwargs, faults) of one scenario."""
    from mxfp8_learner_grid.common import pad_scales, swizzle_scales
    from mxfp8_learner_grid.common.format import rowwise_scale_shape
    other = "B" if serving == "A" else "A"
    if sc == "clean_stream":              # a re-iterable stream (common.sync.sources.StreamSource)
        return other, "bf16", (lambda: iter(p[other][1].items())), {}, []
    if sc == "clean_megatron":            # Megatron-Core / TE names, layouts and MXFP8 tensors (common.sync.megatron)
        return other, "mxfp8", megatron_source(p[other]), {}, []
    if sc.startswith("clean_mxfp8"):
        return other, "mxfp8", p[other][0], {}, []
    if sc.startswith("clean_bf16") or sc in ("skip_version", "skipped_cache_flush"):
        kw = {"flush_cache": False} if sc == "skipped_cache_flush" else {}
        return other, "bf16", p[other][1], kw, [sc] if sc == "skip_version" else []
    if sc in ("padding_not_stripped", "swizzled_as_compact"):
        wire = dict(p[other][0])
        scales = [n for n in wire if n.endswith("weight_scale_inv") and wire[n].dim() == 2]
        if sc == "padding_not_stripped":     # TE's (round_up(N,128), round_up(K/32,4)) buffer
            name = next(n for n in scales if rowwise_scale_shape(wire[n].shape[0], wire[n].shape[1] * 32)
                        != tuple(wire[n].shape))
            s = wire[name]
            wire[name] = pad_scales(s, rowwise_scale_shape(s.shape[0], s.shape[1] * 32))
        else:                                # a (128 x 4k) block, swizzled for the GEMM, labelled compact
            name = next(n for n in scales if wire[n].shape[0] % 128 == 0 and wire[n].shape[1] % 4 == 0)
            wire[name] = swizzle_scales(wire[name])
        return other, "mxfp8", wire, {"truth": {(name, "scale"): p[other][0][name]}}, []
    if sc.startswith("nan_tensor"):
        bf16 = dict(p[other][1])
        name = "model.layers.1.self_attn.o_proj.weight"
        bf16[name] = bf16[name].clone()
        bf16[name][3, 5] = float("nan")
        return other, "bf16", bf16, {}, []
    return other, "bf16", p[other][1], {}, [sc.split("@")[0]]


def install_faulty_worker(model) -> None:
    """This rank's grid worker, with the faulty adapter and ``grid_set_faults`` (test machinery:
    ``updater.worker_for`` returns the worker kept on the model, so this one serves every call)."""
    from mxfp8_learner_grid.sglang_plugin.sync_adapter import SGLangAdapter
    from mxfp8_learner_grid.sglang_plugin.updater import GridWorker

    class FaultySGLangAdapter(FaultyAdapterMixin, SGLangAdapter):
        pass

    class FaultyGridWorker(GridWorker):
        adapter_cls = FaultySGLangAdapter
        faulty = True

        def call(self, method, args, tensors):
            if method == "grid_set_faults":
                return self.adapter.set_faults(json.loads(args[0]))
            return super().call(method, args, tensors)

    if not getattr(vars(model).get("_mxfp8_grid_worker"), "faulty", False):
        w = model._mxfp8_grid_worker = FaultyGridWorker(model)
        w.adapter.skip_version_rank = w.world - 1           # the last TP rank lies about its version


def run_scenarios(H, model, p: dict, scenarios: list, rank: int = 0, world: int = 1) -> dict:
    """Drive each scenario through the client; per scenario: the report's verdict and what the
    engine holds afterwards (bytes vs both learners, fingerprints before/after)."""
    from mxfp8_learner_grid.common.sync.client import GridSyncClient
    install_faulty_worker(model)
    cls = _transport_class()
    serving, out = "A", {}
    for step, sc in enumerate(scenarios, 1):
        staging = "nccl" if sc.endswith("@nccl") else "tensor"
        t = cls(model, rank, world, sessions=not sc.endswith("@0.5.17"), staging=staging)
        client = GridSyncClient(t, digest="full", bucket_bytes=1 << 16, cache_probe_prompt=PROBE)
        target, fmt, tensors, kw, faults = scenario(sc, serving, p)
        kw["kv_scales"] = {i: (0.01 * step, 0.02 * step) for i in range(2)}   # new scales with every update
        t.rpc("grid_set_faults", json.dumps(faults))
        before, kv_before = t.rpc("grid_fingerprints", "[]")[rank], model_kv(model)
        if sc == "skipped_cache_flush":
            t.cached_tokens(PROBE)               # the probe prefix is cached, computed with the old weights
        rep = client.update_weights(tensors, format=fmt, **kw)
        t.rpc("grid_set_faults", "[]")
        after = t.rpc("grid_fingerprints", "[]")[rank]
        holds = [name for name in ("A", "B") if _holds(H, model, p[name][0], rank, world)]
        if rep.applied:
            serving = target
        state = t.rpc("grid_state")
        out[sc] = {"applied": rep.applied, "rolled_back": rep.rolled_back, "error": rep.error,
                   "failed": rep.failed(), "checks": {c: [x.ok for x in rep.check(c)] for c in CONDITIONS},
                   "summary": rep.summary(), "unchanged": before == after, "holds": holds, "serving": serving,
                   "target": target, "versions": [s["version"] for s in state], "client_version": client.version,
                   "sglang_weight_version": t.weight_version, "open": any(s["open"] for s in state),
                   "calls": t.calls, "in_session": t.in_session,
                   "kv_restored": model_kv(model) == kv_before,
                   "kv": {str(k): v for k, v in model_kv(model).items()}, "kv_sent": kw["kv_scales"][0]}
        t.close()
    return out


def model_kv(model) -> dict:
    return {i: (layer.self_attn.attn.k_scale_float, layer.self_attn.attn.v_scale_float)
            for i, layer in enumerate(model.model.layers)}


def _holds(H, model, wire, rank, world) -> bool:
    try:
        H.check_bytes(model, wire, rank, world)
        return True
    except AssertionError:
        return False


# -- assertions ------------------------------------------------------------------------------

def assert_clean(res):
    assert res["applied"] and res["error"] is None and not res["failed"], res["summary"]
    for c in CONDITIONS:            # all seven ran and passed (engine side: one per rank; client side)
        assert res["checks"][c] and all(ok is True for ok in res["checks"][c]), (c, res["summary"])
    assert res["holds"] == [res["target"]], res          # the engine holds the learner's bytes
    assert not res["open"] and not res["in_session"] and res["versions"] == [res["client_version"]] * len(
        res["versions"])
    assert res["sglang_weight_version"] == str(res["client_version"])
    assert all(abs(k - res["kv_sent"][0]) <= 1e-6 * abs(res["kv_sent"][0])       # fp32 scalars
               and abs(v - res["kv_sent"][1]) <= 1e-6 * abs(res["kv_sent"][1]) for k, v in [res["kv"]["0"]]), res["kv"]


def assert_caught(res, fault, previous):
    check = FAULTS[fault]
    assert check in res["failed"] or (fault in ("crash_midway", "nan_tensor") and res["error"]), \
        (fault, res["summary"])
    if fault in ("crash_midway", "nan_tensor"):
        assert res["checks"][check] and res["checks"][check][0] is True, res["summary"]   # rollback verified
        assert ("halfway" if fault == "crash_midway" else "NaN") in res["error"], res["error"]
    if fault not in NOT_UNDONE:
        assert not res["applied"] and res["rolled_back"] and res["unchanged"], res["summary"]
        assert res["holds"] == [previous] and res["serving"] == previous, res
        assert res["kv_restored"], res                    # KV scales (and the backends' float copies) too
        assert res["sglang_weight_version"] == "default"  # a rejected commit carries no weight_version
    assert not res["open"] and not res["in_session"], res


# -- TP=1 ------------------------------------------------------------------------------------

@pytest.fixture(scope="module", autouse=True)
def fp8_kv_server():
    """These scenarios run as a server with an FP8 KV cache, so that the trainer's KV scales are
    used (and checked, and the skip_kv fault can be caught); with a BF16 cache SGLang's layers get
    no scales at all (``LearnerGridConfig.kv_cache_method``)."""
    from mxfp8_learner_grid.sglang_plugin import compat
    old = compat.server_kv_cache_dtype
    compat.server_kv_cache_dtype = lambda: "fp8_e4m3"
    yield
    compat.server_kv_cache_dtype = old


@pytest.fixture(scope="module")
def dense(sgl):
    p = payloads(sgl, moe=False)
    return build_engine(sgl, False, p["A"][1]), p


@pytest.fixture(scope="module")
def moe(sgl):
    p = payloads(sgl, moe=True)
    return build_engine(sgl, True, p["A"][1]), p


def test_dense_clean_updates_and_faults(sgl, dense):
    model, p = dense
    order = ["clean_bf16", "clean_mxfp8", "swap_kv", "duplicate_shard", "padding_not_stripped",
             "swizzled_as_compact", "realloc", "crash_midway", "nan_tensor", "skip_kv", "skip_version",
             "skipped_cache_flush", "clean_bf16@0.5.17", "clean_stream"]
    res = run_scenarios(sgl, model, p, order)
    assert_clean(res["clean_bf16"])                   # BF16, quantized in the engine (TE-exact)
    assert_clean(res["clean_stream"])                 # the same from a stream, through the shared sources
    assert_clean(res["clean_mxfp8"])                  # the learner's fp8 bytes + scales, copied
    calls = res["clean_mxfp8"]["calls"]               # SGLang's session spans the update; the flush is inside
    i = calls.index("pause")
    assert calls[i:i + 5] == ["pause", "begin", "flush", "end", "continue"], calls
    for f in order[2:10]:
        assert_caught(res[f], f, "A")
    assert res["padding_not_stripped"]["error"] and "TE padding not stripped" in res["padding_not_stripped"]["error"]
    assert res["skip_version"]["applied"] and res["skip_version"]["checks"]["atomic_versioning"][-1] is False
    assert res["skipped_cache_flush"]["applied"] and "cache_coherence" in res["skipped_cache_flush"]["failed"]
    last = res["clean_bf16@0.5.17"]                   # no update sessions (0.5.17): same result
    assert last["applied"] and not last["failed"] and last["holds"] == [last["target"]], last["summary"]
    assert last["calls"] == ["pause", "flush", "continue"]
    sgl.check_forward(model, p[res["clean_stream"]["target"]][0])      # the last update's weights, computed


def test_moe_clean_updates_and_faults(sgl, moe):
    model, p = moe
    order = ["clean_bf16", "clean_mxfp8@nccl", "skip_expert", "crash_midway", "nan_tensor@nccl", "swap_kv"]
    res = run_scenarios(sgl, model, p, order)
    assert_clean(res["clean_bf16"])
    assert_clean(res["clean_mxfp8@nccl"])             # buckets through SGLang's load_weights_from_distributed
    sgl.check_forward(model, p[res["clean_mxfp8@nccl"]["target"]][0])
    for f in order[2:]:
        assert_caught(res[f], f.split("@")[0], "A")
    res = run_scenarios(sgl, model, p, ["clean_megatron"])       # the engine serves A here
    assert_clean(res["clean_megatron"])               # a Megatron/TE trainer's own parameters, bytes and all
    assert res["clean_megatron"]["target"] == "B"
    sgl.check_forward(model, p["B"][0])


def test_unknown_method_and_missing_loader_are_refused(sgl, dense):
    from mxfp8_learner_grid.common.sync.recorder import UpdateRejected
    from mxfp8_learner_grid.sglang_plugin.client import SGLangTransport
    model, _ = dense
    t = _transport_class()(model)
    with pytest.raises(RuntimeError, match="ValueError: 'grid_shutdown' is not a grid method"):
        t.rpc("grid_shutdown")
    with pytest.raises(RuntimeError, match="no grid update is open"):
        t.rpc("grid_update_finish")
    with pytest.raises(UpdateRejected, match="unknown tensor"):
        from mxfp8_learner_grid.common.sync.manifest import Manifest
        t.rpc("grid_update_begin", Manifest.of({"x.weight": torch.ones(2)}, 1, "bf16", partial=True).to_json())
    t.close()
    with pytest.raises(ValueError, match="--custom-weight-loader"):
        SGLangTransport({"tp_size": 1, "custom_weight_loader": []})
    from mxfp8_learner_grid.sglang_plugin.updater import _reply_path_ok
    assert not _reply_path_ok("/etc/cron.d/x.json") and not _reply_path_ok(os.path.join(t.reply_dir, "x.txt"))
    assert _reply_path_ok(os.path.join(t.reply_dir, "x.json"))


# -- TP=2 ------------------------------------------------------------------------------------

TP2_ORDER = ["clean_bf16", "clean_mxfp8", "skip_expert", "swap_kv", "crash_midway", "skip_version"]


def test_tp2_moe_updates_and_faults():
    from sgl_helpers import free_port
    port = str(free_port())
    env = dict(os.environ, SGLANG_NCCL_SO_PATH="/nonexistent")
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), str(r), "2", port], cwd=HERE, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    results = []
    for p, (out, err) in zip(procs, outs):
        lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
        assert p.returncode == 0 and lines, (out + err)[-6000:]
        results.append(json.loads(lines[-1][len("RESULT "):]))
    for res in results:                                # both ranks saw the same gathered results
        assert_clean(res["clean_bf16"])
        assert_clean(res["clean_mxfp8"])
        for f in TP2_ORDER[2:5]:
            assert_caught(res[f], f, "A")
        sv = res["skip_version"]
        assert sv["applied"] and sv["checks"]["atomic_versioning"][-1] is False and sv["versions"][1] != \
            sv["versions"][0], sv["summary"]
    for sc in TP2_ORDER:                               # one decision, taken identically on both ranks
        assert results[0][sc]["checks"] == results[1][sc]["checks"], sc


def _tp_main(rank: int, world: int, port: int) -> None:
    import sgl_helpers as H
    H.init_dist(rank, world, port)
    from mxfp8_learner_grid.sglang_plugin import compat
    from mxfp8_learner_grid.sglang_plugin.register import register
    register()
    compat.server_kv_cache_dtype = lambda: "fp8_e4m3"       # as the TP=1 fixture fp8_kv_server
    p = payloads(H, moe=True)
    model = build_engine(H, True, p["A"][1])
    res = run_scenarios(H, model, p, TP2_ORDER, rank, world)
    print("RESULT " + json.dumps(res, default=str), flush=True)


if __name__ == "__main__":
    _tp_main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))

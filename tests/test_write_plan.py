"""The ranks' write plan (common/sync/plan.py) on a plain PyTorch 'engine' whose loader fuses two learner
tensors into one parameter: after a clean commit the same tensors are written by replay -- the same
writes, attributed and boxed as the loader's, the loader not called -- and the plan is dropped whenever it
may not describe the engine any more."""

import pytest
import torch

from mxfp8_learner_grid.common.sync.manifest import Manifest
from mxfp8_learner_grid.common.sync.plan import WritePlan
from mxfp8_learner_grid.common.sync.recorder import UpdateRejected
from mxfp8_learner_grid.common.sync.session import EngineAdapter, UpdateSession


class FusedAdapter(EngineAdapter):
    """'q' and 'k' [8, 32] land in rows 0-7 / 8-15 of one fused [16, 32] parameter; 'norm' as is."""

    def __init__(self):
        self.m = torch.nn.Module()
        self.m.qk = torch.nn.Parameter(torch.zeros(16, 32), requires_grad=False)
        self.m.norm = torch.nn.Parameter(torch.zeros(32), requires_grad=False)
        self.plan = WritePlan()
        self.loader_calls = 0

    def model(self):
        return self.m

    def load(self, named):
        self.load_planned(named, self._engine_load)

    def _engine_load(self, named):
        for n, t in named:
            self.loader_calls += 1
            if n in ("q", "k"):
                self.m.qk.data.narrow(0, 0 if n == "q" else 8, 8).copy_(t)
            elif n == "norm":
                self.m.norm.data.copy_(t)

    def signature(self):
        return ({"q": ((8, 32), False), "k": ((8, 32), False), "norm": ((32,), False)},
                {"q": torch.float32, "k": torch.float32, "norm": torch.float32}, set())

    def scope(self, touched):
        return dict(self.m.named_parameters())


def _update(ad, version, tensors, replay=True):
    s = UpdateSession(ad, Manifest.of(tensors, version, "bf16"), digest="full", replay=replay)
    s.load(list(tensors.items()))
    rep = s.finish()
    assert not rep.failed(), rep.summary()
    assert s.commit(True)
    return s


def _tensors(seed):
    g = torch.Generator().manual_seed(seed)
    return {"q": torch.randn(8, 32, generator=g), "k": torch.randn(8, 32, generator=g), "norm": torch.randn(32, generator=g)}


def _writes(s):
    return [(w.source, w.role, w.src_box, w.param, w.dest_box) for w in s.recorder.writes]


def test_a_committed_update_is_replayed_with_the_loaders_writes():
    ad = FusedAdapter()
    first = _update(ad, 1, _tensors(0))
    assert ad.loader_calls == 3 and first.timings["replayed"] == 0 and set(ad.plan.entries) == {"q", "k", "norm"}
    new = _tensors(1)
    second = _update(ad, 2, new)
    assert ad.loader_calls == 3 and second.timings["replayed"] == 3       # the loader was not called
    assert torch.equal(ad.m.qk[:8], new["q"]) and torch.equal(ad.m.qk[8:], new["k"]) and torch.equal(ad.m.norm, new["norm"])
    assert _writes(second) == _writes(first)                              # same attribution and boxes
    # a tensor of another shape or dtype, or a client that turns replay off: the loader
    third = _update(ad, 3, _tensors(2), replay=False)
    assert ad.loader_calls == 6 and third.timings["replayed"] == 0


def test_the_plan_is_dropped_when_it_may_not_describe_the_engine():
    ad = FusedAdapter()
    _update(ad, 1, _tensors(0))
    # a failed update (a NaN refused mid-load): dropped, the next one through the loader
    bad = _tensors(1)
    bad["k"][0, 0] = float("nan")
    s = UpdateSession(ad, Manifest.of(bad, 2, "bf16"))
    with pytest.raises(UpdateRejected, match="k: holds NaN"):
        s.load(list(bad.items()))
    assert ad.plan.entries == {}
    _update(ad, 3, _tensors(2))
    assert ad.loader_calls == 6 and ad.plan.entries
    # a parameter rebound to new storage (what storage_stability catches): not replayed into the old one
    ad.m.qk = torch.nn.Parameter(ad.m.qk.data.clone(), requires_grad=False)
    assert not ad.plan.valid()
    new = _tensors(4)
    s = UpdateSession(ad, Manifest.of(new, 4, "bf16"), digest="full")
    s.load(list(new.items()))
    assert ad.loader_calls == 9 and s.timings["replayed"] == 0 and torch.equal(ad.m.qk[:8], new["q"])


def test_a_parameter_reshaped_in_place_invalidates_the_plans_kept_views():
    ad = FusedAdapter()
    _update(ad, 1, _tensors(0))
    assert ad.plan.entries["k"].views[0] == ((8, 32), (32, 1), 256)        # rows 8-15 of qk, kept at capture
    ptr = ad.m.qk.data_ptr()
    ad.m.qk.data = ad.m.qk.data.as_strided((16, 32), (1, 16))    # same object, storage and data_ptr; column-major
    assert ad.m.qk.data_ptr() == ptr and not ad.plan.valid()
    new = _tensors(2)
    s = UpdateSession(ad, Manifest.of(new, 2, "bf16"), digest="full")
    s.load(list(new.items()))
    assert s.timings["replayed"] == 0 and ad.loader_calls == 6               # the loaders, not the old views
    assert torch.equal(ad.m.qk[8:], new["k"]) and torch.equal(ad.m.qk[:8], new["q"])


def test_an_update_pauses_the_cyclic_gc_and_restores_it_even_when_refused():
    import gc

    from mxfp8_learner_grid.common.sync.session import gc_paused

    class Watching(FusedAdapter):
        def _engine_load(self, named):
            self.seen = gc.isenabled()
            super()._engine_load(named)
    ad = Watching()
    assert gc.isenabled()
    _update(ad, 1, _tensors(0), replay=False)
    assert ad.seen is False and gc.isenabled()                 # off inside the loaders, back on after
    bad = _tensors(1)
    bad["q"][0, 0] = float("inf")
    s = UpdateSession(ad, Manifest.of(bad, 2, "bf16"))
    with pytest.raises(UpdateRejected):
        s.load(list(bad.items()))
    assert gc.isenabled()                                       # a refused load restores it too
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()                               # off before: left off
    finally:
        gc.enable()


def test_writes_the_plan_cannot_describe_stay_with_the_loader():
    class Transposing(FusedAdapter):
        def _engine_load(self, named):          # 'k' read through a transposing view: not a box of the source
            for n, t in named:
                self.loader_calls += 1
                if n == "k":
                    self.m.qk.data.narrow(0, 8, 8).copy_(t.as_strided((8, 32), (1, 8)))
                elif n == "q":
                    self.m.qk.data.narrow(0, 0, 8).copy_(t)
                else:
                    self.m.norm.data.copy_(t)
    ad = Transposing()
    _update(ad, 1, _tensors(0))
    assert "q" in ad.plan.entries and "norm" in ad.plan.entries and "k" not in ad.plan.entries
    s = _update(ad, 2, _tensors(1))
    assert s.timings["replayed"] == 2 and ad.loader_calls == 4


def test_the_plan_keeps_no_engine_memory_alive():
    import gc
    import weakref
    ad = FusedAdapter()
    _update(ad, 1, _tensors(0))
    ref = weakref.ref(ad.m.qk)
    ad.m.qk = torch.nn.Parameter(torch.zeros(16, 32), requires_grad=False)   # an engine rebuilding the layer
    gc.collect()
    assert ref() is None and not ad.plan.valid()


def test_a_replay_passes_nothing_through_the_recorders_mode_and_is_still_accounted_for(monkeypatch):
    """Each aten op under the recorder's dispatch mode costs tens of microseconds of Python: a replay of a
    checked bucket passes none (its writes are recorded by the plan, its copies made in one
    ``_foreach_copy_``), yet the recorder holds the same writes, attributed and boxed, and the backups."""
    from mxfp8_learner_grid.common.sync.recorder import WriteRecorder
    seen = []
    real = WriteRecorder.__torch_dispatch__

    def counting(self, func, types, args=(), kwargs=None):
        seen.append(func)
        return real(self, func, types, args, kwargs)
    ad = FusedAdapter()
    first = _update(ad, 1, _tensors(0))
    before = {n: p.detach().clone() for n, p in ad.m.named_parameters()}
    monkeypatch.setattr(WriteRecorder, "__torch_dispatch__", counting)
    new = _tensors(1)
    s = UpdateSession(ad, Manifest.of(new, 2, "bf16"), digest="full")
    s.load(list(new.items()))
    assert s.timings["replayed"] == 3 and _writes(s) == _writes(first) and seen == []
    assert set(s.recorder.backups) == {"qk", "norm"}
    assert all(torch.equal(s.recorder.backups[n], before[n]) for n in before)
    assert torch.equal(ad.m.qk[8:], new["k"])
    rep = s.finish()
    assert not rep.failed(), rep.summary()


def test_a_replay_outside_a_checked_bucket_goes_through_the_recorders_mode():
    """A plan called with tensors the recorder does not hold as checked sources (no session, or a caller
    that skipped the bucket's content rules): each copy is seen by the mode, which runs the rules."""
    from mxfp8_learner_grid.common.sync.recorder import WriteRecorder
    ad = FusedAdapter()
    _update(ad, 1, _tensors(0))
    bad = _tensors(1)
    bad["norm"][3] = float("inf")
    rec = WriteRecorder(dict(ad.m.named_parameters()))
    for n, t in bad.items():
        rec.add_source(t, n, "plain")               # registered, not checked
    with pytest.raises(UpdateRejected, match="norm: holds NaN or Inf"):
        with rec:
            ad.load(list(bad.items()))
    assert ad.plan.replayed == 3 and len(rec.writes) == 3 and set(rec.backups) == {"qk", "norm"}
    assert rec.rollback() and torch.isfinite(ad.m.norm).all()


def test_the_recorders_own_accounting_keeps_the_dtype_rule():
    """``WriteRecorder.record`` -- how a replay accounts for a write it copies outside the mode -- refuses a
    source whose dtype would be cast into the parameter, naming both, before anything is recorded or
    backed up (the plan records a bucket's writes before it copies any)."""
    from mxfp8_learner_grid.common.sync.recorder import Write, WriteRecorder
    norm = torch.nn.Parameter(torch.zeros(32), requires_grad=False)
    rec = WriteRecorder({"norm": norm}, backup="host")
    with pytest.raises(UpdateRejected, match="norm: dtype torch.float64 would be cast into norm"):
        rec.record(Write("norm", "plain", None, "norm", None, (32,)), norm.data, torch.ones(32, dtype=torch.float64))
    assert rec.writes == [] and rec.backups == {} and not norm.any()
    rec.record(Write("norm", "plain", None, "norm", None, (32,)), norm.data, torch.ones(32))
    assert len(rec.writes) == 1 and torch.equal(rec.backups["norm"], torch.zeros(32))


def test_a_replayed_commit_keeps_its_entries_and_a_loaded_tensor_is_captured_afresh():
    """After a commit, a tensor the update replayed keeps its entry as it was (the replay wrote exactly it; the
    commit does not regroup its writes); one that went through the loaders is captured from their writes."""
    ad = FusedAdapter()
    _update(ad, 1, _tensors(0))
    before = dict(ad.plan.entries)
    second = _update(ad, 2, _tensors(1))
    assert second.timings["replayed"] == 3 and ad.plan.replayed_names == set()
    assert all(ad.plan.entries[n] is before[n] for n in before)
    del ad.plan.entries["k"]                                   # 'k' not described: the loader writes it
    third = _update(ad, 3, _tensors(2))
    assert third.timings["replayed"] == 2 and ad.loader_calls == 4
    assert ad.plan.entries["q"] is before["q"] and ad.plan.entries["norm"] is before["norm"]
    assert ad.plan.entries["k"] is not before["k"] and ad.plan.entries["k"].writes == before["k"].writes
    fourth = _update(ad, 4, _tensors(3))
    assert fourth.timings["replayed"] == 3 and ad.loader_calls == 4
    assert torch.equal(ad.m.qk[8:], _tensors(3)["k"])


class QuantizingAdapter(FusedAdapter):
    """Grid parameters written from BF16 tensors the loader quantizes (``note_derived_source``, as the plugin's
    loaders do): four experts' [16, 64] into w [4, 16, 64] / ws [4, 16, 2], and an 'o' [8, 64] of another shape."""

    def __init__(self):
        super().__init__()
        self.m = torch.nn.Module()
        for name, shape, dtype in (("w", (4, 16, 64), torch.float8_e4m3fn), ("ws", (4, 16, 2), torch.uint8),
                                   ("o", (8, 64), torch.float8_e4m3fn), ("os", (8, 2), torch.uint8)):
            setattr(self.m, name, torch.nn.Parameter(torch.zeros(shape, dtype=dtype), requires_grad=False))

    def _engine_load(self, named):
        from mxfp8_learner_grid.common import quantize_rows
        from mxfp8_learner_grid.common.sync.recorder import note_derived_source
        for n, t in named:
            self.loader_calls += 1
            q, s = quantize_rows(t)
            note_derived_source(q, t, "data")
            note_derived_source(s, t, "scale")
            if n == "o":
                self.m.o.data.copy_(q)
                self.m.os.data.copy_(s)
            else:
                self.m.w.data[int(n[1:])].copy_(q)
                self.m.ws.data[int(n[1:])].copy_(s)

    def signature(self):
        shapes = {**{f"e{i}": ((16, 64), True) for i in range(4)}, "o": ((8, 64), True)}
        return shapes, {n: torch.bfloat16 for n in shapes}, set()


def _bf16(seed):
    g = torch.Generator().manual_seed(seed)
    return {**{f"e{i}": torch.randn(16, 64, generator=g).bfloat16() for i in range(4)},
            "o": torch.randn(8, 64, generator=g).bfloat16()}


def test_a_replay_quantizes_equal_shapes_stacked_with_the_per_tensor_bytes(monkeypatch):
    """A replay of BF16 grid tensors quantizes the tensors of one shape in stacked calls (a MoE layer's experts:
    hundreds of equal tensors, each call's host time above its bytes'), in stacks bounded in bytes; the bytes
    written are each tensor's own quantize_rows."""
    import mxfp8_learner_grid.common as C
    from mxfp8_learner_grid.common.sync import plan as P
    ad = QuantizingAdapter()
    _update(ad, 1, _bf16(0))
    assert ad.loader_calls == 5 and all(e.quantized for e in ad.plan.entries.values())
    calls, real = [], C.quantize_rows
    monkeypatch.setattr(C, "quantize_rows", lambda x, *a, **k: calls.append(tuple(x.shape)) or real(x, *a, **k))
    monkeypatch.setattr(P, "QUANTIZE_STACK_BYTES", 3 * 16 * 64 * 2)          # stacks of three experts
    new = _bf16(1)
    s = _update(ad, 2, new)
    assert s.timings["replayed"] == 5 and ad.loader_calls == 5
    assert sorted(calls) == sorted([(3, 16, 64), (16, 64), (8, 64)])          # 3 + 1 experts, and 'o' alone
    monkeypatch.undo()
    for i in range(4):
        q, sc = real(new[f"e{i}"])
        assert torch.equal(ad.m.w[i].view(torch.uint8), q.view(torch.uint8)) and torch.equal(ad.m.ws[i], sc)
    q, sc = real(new["o"])
    assert torch.equal(ad.m.o.view(torch.uint8), q.view(torch.uint8)) and torch.equal(ad.m.os, sc)


def test_on_cpu_large_tensors_are_quantized_one_call_each(monkeypatch):
    from mxfp8_learner_grid.common.sync import plan as P
    import mxfp8_learner_grid.common as C
    calls, real = [], C.quantize_rows
    monkeypatch.setattr(C, "quantize_rows", lambda x, *a, **k: calls.append(tuple(x.shape)) or real(x, *a, **k))
    ts = [torch.randn(16, 64).bfloat16() for _ in range(3)]
    P.quantize_grouped(ts)
    assert calls == [(3, 16, 64)]
    calls.clear()
    monkeypatch.setattr(P, "CPU_STACK_MAX_BYTES", 16 * 64 * 2 - 1)         # above it on CPU: no stack
    out = P.quantize_grouped(ts)
    assert calls == [(16, 64)] * 3 and all(torch.equal(out[id(t)][1], real(t)[1]) for t in ts)

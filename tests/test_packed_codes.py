"""PackedCodes: a MoE layer's codes held once, in Marlin's layout, read and written through the checkpoint's.

Every test holds a plain [E, N, K] reference beside the packed tensor and applies the same ops to both:
after each write the packed bytes must equal Marlin's packing of the reference (``marlin_weights_batched``,
itself held equal to vLLM's packing in ``test_marlin_repack.py``), and every read must equal the reference's.
"""

import pytest
import torch

from mxfp8_learner_grid.common.grid_kernels.marlin import marlin_weights_batched
from mxfp8_learner_grid.common.packed_codes import PackedCodes, hold_packed, plain
from mxfp8_learner_grid.common.sync.recorder import WriteRecorder
from mxfp8_learner_grid.common.sync.regions import slice_box, view_box

E, N, K = 3, 192, 64


def _codes(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    b = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
    b[(b & 0x7F) == 0x7F] = 0x11                # no NaN codes
    return b.view(torch.float8_e4m3fn)


def _pair(seed=0):
    ref = _codes(E, N, K, seed=seed)
    return ref, PackedCodes(marlin_weights_batched(ref), N)


def _same(p, ref):
    assert torch.equal(p.packed, marlin_weights_batched(ref)), "packed bytes are not the reference's packing"
    assert torch.equal(plain(p).view(torch.uint8), ref.view(torch.uint8))


def test_reads_unpack_only_the_box_and_equal_the_reference():
    ref, p = _pair()
    _same(p, ref)
    for view, want in ((p[1], ref[1]), (p[0:2, 64:128], ref[0:2, 64:128]), (p[2, :, 16:48], ref[2, :, 16:48]),
                       (p.data[1].narrow(0, 10, 7), ref[1].narrow(0, 10, 7)), (p[-1, -5:], ref[-1, -5:]),
                       (p[1:1], ref[1:1])):
        assert isinstance(view, PackedCodes) and view.shape == want.shape and view.stride() == want.stride()
        assert view.storage_offset() == want.storage_offset()
        assert torch.equal(view.clone().view(torch.uint8), want.view(torch.uint8))
        assert torch.equal(view.to("cpu", copy=True).view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(p, ref) and not torch.equal(p[0], ref[1])
    assert all(isinstance(x, PackedCodes) and torch.equal(x, ref[i]) for i, x in enumerate(p))     # unbind
    out = torch.zeros(N, K, dtype=torch.float8_e4m3fn)
    assert out.copy_(p[2]) is out and torch.equal(out.view(torch.uint8), ref[2].view(torch.uint8))   # into plain
    assert torch.equal(p.float(), ref.float())
    assert view_box(p.data[2].narrow(0, 64, 64), p.shape, p.storage_offset()) == ((2, 1), (64, 64), (0, K))
    assert p.data_ptr() == p.packed.data_ptr() == p[2].data_ptr()
    assert p.untyped_storage().data_ptr() == p.packed.untyped_storage().data_ptr()


def test_writes_repack_in_place_through_every_loader_pattern():
    ref, p = _pair(1)
    ptr = p.packed.data_ptr()
    steps = [
        (lambda t: t.data[1].narrow(0, 64, 64), (64, K)),            # 64-row group over all K: packed straight in
        (lambda t: t.data[0].narrow(0, 0, N), (N, K)),               # a whole expert
        (lambda t: t[0:2], (2, N, K)),                               # whole experts
        (lambda t: t.data[2].narrow(0, 10, 20), (20, K)),            # unaligned rows: read-modify-write
        (lambda t: t.data[2].narrow(1, 16, 16), (N, 16)),            # part of K
        (lambda t: t[1, 128:192], (64, K)),                          # the last group
        (lambda t: t, (E, N, K)),                                    # everything
    ]
    for i, (view, shape) in enumerate(steps):
        x = _codes(*shape, seed=100 + i)
        view(p).copy_(x)
        view(ref).copy_(x)
        _same(p, ref)
    p[2, 5].copy_(_codes(K, seed=7)[None][0])                        # a single row
    ref[2, 5].copy_(_codes(K, seed=7))
    _same(p, ref)
    p.data[1].narrow(0, 0, 64).zero_()                               # a loader zeroing padding
    ref[1].narrow(0, 0, 64).zero_()
    p.data[2].narrow(0, 3, 2).fill_(1.5)
    ref[2].narrow(0, 3, 2).copy_(torch.full((2, K), 1.5).to(ref.dtype))
    _same(p, ref)
    p.data[0].narrow(0, 64, 64).copy_(_codes(K, seed=8))             # broadcast along the rows, as copy_ does
    ref[0].narrow(0, 64, 64).copy_(_codes(K, seed=8))
    _same(p, ref)
    assert p.packed.data_ptr() == ptr


def test_foreach_copy_and_packed_sources():
    ref, p = _pair(2)
    other_ref, other = _pair(3)
    plain_dest = torch.zeros(N, K, dtype=torch.float8_e4m3fn)
    xs = [_codes(64, K, seed=20), _codes(N, K, seed=21)]
    torch._foreach_copy_([p.data[0].narrow(0, 128, 64), p.data[1], plain_dest], [xs[0], xs[1], other[2]])
    ref[0].narrow(0, 128, 64).copy_(xs[0])
    ref[1].copy_(xs[1])
    _same(p, ref)
    assert torch.equal(plain_dest.view(torch.uint8), other_ref[2].view(torch.uint8))
    p[2].copy_(other[0])                                             # PackedCodes into PackedCodes
    ref[2].copy_(other_ref[0])
    _same(p, ref)


def test_what_would_miss_the_packed_bytes_raises():
    _, p = _pair()
    for op in (lambda: p.view(torch.uint8), lambda: p.reshape(-1), lambda: p[0].t(), lambda: p.expand(2, E, N, K),
               lambda: p[0].add_(1), lambda: p[::2], lambda: p[0].index_put_((torch.tensor([1]),), _codes(K)),
               lambda: p.view(E * N, K)):
        with pytest.raises(NotImplementedError):
            op()
    with pytest.raises(IndexError):
        p[E]
    with pytest.raises(ValueError, match="contiguous int32"):
        PackedCodes(marlin_weights_batched(_codes(2, N, K)), N // 2)


def test_a_parameter_held_packed_keeps_its_attributes():
    layer = torch.nn.Module()
    ref = _codes(E, N, K, seed=4)
    layer.w13_weight = torch.nn.Parameter(ref.clone(), requires_grad=False)
    layer.w13_weight.weight_loader = loader = object()
    packed = marlin_weights_batched(ref)
    new = hold_packed(layer, "w13_weight", packed)
    assert layer.w13_weight is new and isinstance(new, torch.nn.Parameter) and isinstance(new, PackedCodes)
    assert new.weight_loader is loader and new.packed is packed and not new.requires_grad
    assert dict(layer.named_parameters())["w13_weight"] is new
    _same(new, ref)
    assert hold_packed(layer, "w13_weight", packed) is new               # held already: unchanged
    with pytest.raises(ValueError, match="another packed buffer"):
        hold_packed(layer, "w13_weight", packed.clone())


@pytest.mark.parametrize("backup", ["host", "device"])
def test_the_recorder_attributes_backs_up_and_rolls_back_packed_writes(backup):
    """The update's recorder sees a loader's copy into a packed parameter as any other: attributed to its
    source, with the parameter's box; its backup and rollback restore the packed bytes."""
    ref, p = _pair(5)
    param = torch.nn.Parameter(p, requires_grad=False)
    before = param.packed.clone()
    x = _codes(64, K, seed=9)
    rec = WriteRecorder({"experts.w13_weight": param}, backup=backup)
    rec.add_source(x, "experts.1.up_proj.weight", "data")
    with rec:
        param.data[1].narrow(0, 64, 64).copy_(x)
    (w,) = rec.writes
    assert (w.source, w.param, w.dest_box) == ("experts.1.up_proj.weight", "experts.w13_weight",
                                               ((1, 1), (64, 64), (0, K)))
    ref[1, 64:128].copy_(x)
    _same(param, ref)
    assert torch.equal(plain(slice_box(param, w.dest_box)).view(torch.uint8), x.view(torch.uint8)[None])
    assert rec.rollback() == ["experts.w13_weight"]
    assert torch.equal(param.packed, before)


# --- a whole update session over a packed-held parameter: loader, replay, checks, refusal, rollback ---

from test_write_plan import FusedAdapter  # noqa: E402

from mxfp8_learner_grid.common.sync.manifest import Manifest  # noqa: E402
from mxfp8_learner_grid.common.sync.recorder import UpdateRejected  # noqa: E402
from mxfp8_learner_grid.common.sync.session import UpdateSession  # noqa: E402

I = 64                           # "intermediate": gate rows 0..63, up rows 64..127 of each expert's w13


class ExpertsAdapter(FusedAdapter):
    """One MoE layer as an engine's expert loader writes it (``param.data[e].narrow(0, offset, I).copy_``): fp8
    gate / up [I, 64] of each expert into a w13 [E, 2I, 64], held packed (``held``), by default two experts and a
    plain 'norm' parameter beside them (test_write_plan's adapter otherwise).  ``down=True`` adds w2 [E, 64, I]
    (``benchmarks/bench_packed_replay.py``'s layer of many experts)."""

    def __init__(self, experts: int = 2, down: bool = False, norm: bool = True, held: bool = True):
        super().__init__()
        self.e, self.down, self.norm = experts, down, norm
        self.m = torch.nn.Module()
        self.m.w13 = torch.nn.Parameter(torch.zeros(experts, 2 * I, 64, dtype=torch.float8_e4m3fn),
                                        requires_grad=False)
        if down:
            self.m.w2 = torch.nn.Parameter(torch.zeros(experts, 64, I, dtype=torch.float8_e4m3fn),
                                           requires_grad=False)
        for attr in ("w13", "w2")[:1 + down] if held else ():
            hold_packed(self.m, attr, marlin_weights_batched(getattr(self.m, attr).data))
        if norm:
            self.m.norm = torch.nn.Parameter(torch.zeros(64), requires_grad=False)

    def _engine_load(self, named):
        for n, t in named:
            self.loader_calls += 1
            if n == "norm":
                self.m.norm.data.copy_(t)
                continue
            e, proj = n.split(".")
            if proj == "down":
                self.m.w2.data[int(e)].copy_(t)
            else:
                self.m.w13.data[int(e)].narrow(0, 0 if proj == "gate" else I, I).copy_(t)

    def projections(self):
        return ("gate", "up", "down")[:2 + self.down]

    def signature(self):
        shapes = {f"{e}.{p}": (((64, I) if p == "down" else (I, 64)), False)
                  for e in range(self.e) for p in self.projections()}
        dtypes = {n: torch.float8_e4m3fn for n in shapes}
        if not self.norm:
            return shapes, dtypes, set()
        return {**shapes, "norm": ((64,), False)}, {**dtypes, "norm": torch.float32}, set()

    def tensors(self, seed):
        """One update's tensors for this layer (``seed`` picks the values)."""
        projs = self.projections()
        out = {f"{e}.{p}": _codes(*((64, I) if p == "down" else (I, 64)), seed=seed * 10_000 + len(projs) * e + i)
               for e in range(self.e) for i, p in enumerate(projs)}
        if self.norm:
            out["norm"] = torch.randn(64, generator=torch.Generator().manual_seed(seed))
        return out


def _expert_tensors(seed):
    return ExpertsAdapter().tensors(seed)


def _assembled(t):
    return torch.stack([torch.cat([t[f"{e}.gate"], t[f"{e}.up"]]) for e in (0, 1)])


def _committed(ad, version, tensors):
    s = UpdateSession(ad, Manifest.of(tensors, version, "bf16"), digest="full")
    s.load(list(tensors.items()))
    rep = s.finish()
    assert not rep.failed(), rep.summary()
    assert s.commit(True)
    return s


def test_an_update_session_writes_checks_replays_and_rolls_back_packed_codes():
    ad = ExpertsAdapter()
    ptr = ad.m.w13.data_ptr()
    first = _committed(ad, 1, _expert_tensors(1))
    _same(ad.m.w13, _assembled(_expert_tensors(1)))
    assert ad.loader_calls == 5 and {w.dest_box for w in first.recorder.writes if w.param == "w13"} == {
        ((e, 1), (r, I), (0, 64)) for e in (0, 1) for r in (0, I)}
    second = _committed(ad, 2, _expert_tensors(2))                      # the plan's replay, through _foreach_copy_
    assert second.timings["replayed"] == 5 and ad.loader_calls == 5
    _same(ad.m.w13, _assembled(_expert_tensors(2)))
    assert ad.m.w13.data_ptr() == ptr
    bad = _expert_tensors(3)
    bad["1.up"] = bad["1.up"].view(torch.uint8).clone()
    bad["1.up"][3, 3] = 0x7F                                              # a NaN code: refused, nothing kept
    bad["1.up"] = bad["1.up"].view(torch.float8_e4m3fn)
    s = UpdateSession(ad, Manifest.of(bad, 3, "bf16"), digest="full")
    with pytest.raises(UpdateRejected, match="1.up: fp8 weight holds NaN codes"):
        s.load(list(bad.items()))
    _same(ad.m.w13, _assembled(_expert_tensors(2)))
    # a committed-then-refused update (the trainer's accept=False): rolled back to version 2's bytes
    s = UpdateSession(ad, Manifest.of(_expert_tensors(4), 4, "bf16"), digest="full")
    s.load(list(_expert_tensors(4).items()))
    assert not s.finish().failed()
    _same(ad.m.w13, _assembled(_expert_tensors(4)))
    s.commit(False)
    _same(ad.m.w13, _assembled(_expert_tensors(2)))
    assert ad.m.w13.data_ptr() == ptr


def test_a_write_plans_replay_packs_its_boxes_straight_without_reading_the_experts_back(monkeypatch):
    """The plan's boxes keep the expert dim ([1, 64, 64] into w13, from a [64, 64] source): such a write is still
    whole 64-row groups over all of K, packed straight -- no read-modify-write of its expert.  (A shape test that
    wanted equal shapes sent every replayed write of the first GPU run through an unpack and a repack of its
    expert: the rank's loader time went 0.40 -> 1.13 s on the 30B-A3B shape.)"""
    from mxfp8_learner_grid.common.grid_kernels import marlin as M
    ad = ExpertsAdapter()
    _committed(ad, 1, _expert_tensors(1))
    unpacks, packs = [], []
    real_unpack, real_pack = M.marlin_unpack_batched, M.marlin_weights_batched
    monkeypatch.setattr(M, "marlin_unpack_batched", lambda *a, **k: unpacks.append(1) or real_unpack(*a, **k))
    monkeypatch.setattr(M, "marlin_weights_batched",
                        lambda w, out=None: packs.append(tuple(w.shape)) or real_pack(w, out=out))
    s = UpdateSession(ad, Manifest.of(_expert_tensors(2), 2, "bf16"), digest="sampled")
    s.load(list(_expert_tensors(2).items()))
    assert s.timings["replayed"] == 5
    assert not unpacks, "a replayed write read its expert back"
    assert packs == [(2, I, 64), (2, I, 64)]            # gate rows of both experts, then up rows: one pack each
    assert not s.finish().failed() and s.commit(True)
    monkeypatch.undo()
    _same(ad.m.w13, _assembled(_expert_tensors(2)))


def test_slice_box_of_packed_codes_is_the_narrowed_view_in_one_step():
    ref, p = _pair(seed=7)
    for box in (((1, 1), (64, 64), (0, K)), ((0, E), (0, N), (0, K)), ((2, 1), (3, 10), (16, 32))):
        v, w = slice_box(p, box), p
        for d, (s0, n) in enumerate(box):
            w = w.narrow(d, s0, n)
        assert isinstance(v, PackedCodes) and (v.shape, v.stride(), v.storage_offset()) == (
            w.shape, w.stride(), w.storage_offset())
        assert v.box() == w.box() == box
        assert torch.equal(plain(v).view(torch.uint8), slice_box(ref, box).view(torch.uint8))
    inner = slice_box(slice_box(p, ((1, 2), (0, N), (0, K))), ((1, 1), (64, 64), (0, K)))
    assert inner.box() == ((2, 1), (64, 64), (0, K))      # a box of a box: in the whole codes' coordinates
    with pytest.raises(IndexError, match="outside its shape"):
        slice_box(p, ((0, 1), (N - 8, 16), (0, K)))


def test_a_replayed_bucket_packs_each_row_group_of_many_experts_at_once(monkeypatch):
    """_foreach_copy_ with many packed writes (a MoE layer's gate / up shards, expert by expert, and plain
    parameters beside them): grouped by rows, packed together (in chunks), bytes equal to one write at a time;
    overlapping boxes keep their order."""
    from mxfp8_learner_grid.common.grid_kernels import marlin as M
    calls = []
    real = M.marlin_weights_batched

    def counted(w, out=None):
        calls.append(tuple(w.shape))
        return real(w, out=out)
    monkeypatch.setattr(M, "marlin_weights_batched", counted)
    e, n, k = 6, 128, 64
    ref = _codes(e, n, k, seed=30)
    p = PackedCodes(real(ref), n)
    other = torch.zeros(4, 8)
    dests, srcs = [], []
    for ex in range(e):
        for r0 in (0, 64):
            x = _codes(64, k, seed=40 + 2 * ex + r0)
            dests.append(p.data[ex].narrow(0, r0, 64))
            srcs.append(x)
            ref[ex, r0:r0 + 64].copy_(x)
    x = _codes(10, k, seed=99)                                        # unaligned: on its own
    dests.append(p.data[2].narrow(0, 64 + 3, 10))
    srcs.append(x)
    dests.append(other)
    srcs.append(torch.ones(4, 8))
    torch._foreach_copy_(dests, srcs)
    ref[2, 67:77].copy_(x)
    # the aligned rows in one stacked pack per row group; but the unaligned box overlaps expert 2's up rows:
    # then every write runs on its own, in order -- the same bytes as the reference in both cases
    _same(p, ref)
    assert torch.equal(other, torch.ones(4, 8))
    calls.clear()
    torch._foreach_copy_(dests[:-2], srcs[:-2])                        # no overlap: two grouped packs
    for ex in range(e):
        ref[ex].copy_(torch.cat([srcs[2 * ex], srcs[2 * ex + 1]]))
    _same(p, ref)
    assert calls[:2] == [(e, 64, k), (e, 64, k)]
    monkeypatch.setattr(M, "REPACK_CHUNK_BYTES", 2 * 64 * k)           # chunks of two experts
    calls.clear()
    new = [_codes(64, k, seed=200 + i) for i in range(2 * e)]
    torch._foreach_copy_(dests[:-2], new)
    for ex in range(e):
        ref[ex].copy_(torch.cat([new[2 * ex], new[2 * ex + 1]]))
    _same(p, ref)
    assert calls[:6] == [(2, 64, k)] * 6


def test_a_packed_parameter_saves_and_pickles_as_its_checkpoint_layout_codes(tmp_path):
    import io
    ref, p = _pair(6)
    layer = torch.nn.Module()
    layer.w13_weight = torch.nn.Parameter(ref.clone(), requires_grad=False)
    hold_packed(layer, "w13_weight", p.packed)
    torch.save(layer.state_dict(), tmp_path / "sd.pt")
    back = torch.load(tmp_path / "sd.pt")["w13_weight"]
    assert type(back) in (torch.Tensor, torch.nn.Parameter) and torch.equal(back.view(torch.uint8), ref.view(torch.uint8))
    buf = io.BytesIO()
    torch.save(p[1], buf)                   # a view: its box (plain pickle of fp8 tensors fails in torch itself)
    buf.seek(0)
    again = torch.load(buf)
    assert type(again) is torch.Tensor and torch.equal(again.view(torch.uint8), ref[1].view(torch.uint8))

"""The Triton glue of the on-grid MoE layer (``common/kernels/moe_triton.py``) under Triton's CPU
interpreter, against references written here independently:

* the slot order: an explicit counting sort per expert (segments in expert order, slots in id
  order, padded with the sentinel ``numel`` to the block, vLLM's buffer sizes), with and without
  an expert map (expert parallel);
* ``silu_mul_qdq``: the torch reference ``qdq_rows_reference(silu(g) * u)`` bit for bit, NaN / inf
  / -0.0 included;
* ``moe_combine``: an FP32 loop over k, invalid slots (garbage rows) skipped.

The GPU side (bit equality with the torch glue and vLLM's align on the H200) is in
tests/gpu/test_fast_path.py.
"""

import textwrap

import pytest
from interpreter import run_ok

SCRIPT = textwrap.dedent("""
    import torch, torch.nn.functional as Fn
    from mxfp8_learner_grid.common.kernels.moe_triton import ALIGN_MAX_SLOTS, align_sizes, moe_align, moe_combine, silu_mul_qdq
    from mxfp8_learner_grid.common.kernels.qdq_triton import qdq_rows_reference

    def ref_align(topk_ids, bs, E, El, emap):
        ids = topk_ids.reshape(-1).long()
        numel = ids.numel()
        if emap is not None:
            ids = torch.where(ids >= 0, emap.long()[ids.clamp_min(0)], -1)
        n = numel + E * (bs - 1)
        if numel < E:
            n = min(numel * bs, n)
        s = torch.full((n,), numel, dtype=torch.int32)
        eb = torch.full((-(-n // bs),), -1, dtype=torch.int32)
        pos = 0
        for e in range(El):
            sl = [i for i in range(numel) if int(ids[i]) == e]
            if not sl:
                continue
            s[pos:pos + len(sl)] = torch.tensor(sl, dtype=torch.int32)
            pe = -(-len(sl) // bs) * bs
            eb[pos // bs:(pos + pe) // bs] = e
            pos += pe
        return s, eb, pos

    g = torch.Generator().manual_seed(0)
    for m, topk, E, bs, ep in [(1, 8, 128, 8, False), (16, 8, 128, 8, False), (64, 8, 128, 8, True),
                               (5, 2, 4, 16, False), (300, 4, 16, 64, True), (3, 8, 64, 8, False), (512, 8, 8, 64, False), (40, 8, 16, 48, False)]:
        El = E // 2 if ep else E
        emap = None
        if ep:
            emap = torch.full((E,), -1, dtype=torch.int32)
            emap[E // 2:] = torch.arange(El, dtype=torch.int32)
        ids = torch.topk(torch.randn(m, E, generator=g), topk).indices.to(torch.int32)
        got = moe_align(ids, bs, E, El, emap)
        if m * topk > ALIGN_MAX_SLOTS:
            assert got is None
            continue
        s, eb, nt = got
        rs, reb, rn = ref_align(ids, bs, E, El, emap)
        assert (s.numel(), eb.numel()) == align_sizes(ids.numel(), bs, E)
        assert int(nt) == rn, (m, int(nt), rn)
        assert torch.equal(s, rs), (m, topk, E, bs, ep)
        assert torch.equal(eb, reb), (m, topk, E, bs, ep)

    for S, I in [(8, 768), (37, 96), (300, 128)]:
        gu = (torch.randn(S, 2 * I, generator=g) * 3).to(torch.bfloat16)
        gu[0, 5] = float("nan"); gu[1, 3] = float("inf"); gu[1, I + 4] = 0; gu[2, 7] = -float("inf")
        gu[3, :32] = 0; gu[3, I:I + 32] = -0.0; gu[4, 40] = 1e-38; gu[5, I + 9] = 3e38
        y = silu_mul_qdq(gu, I)
        gg, uu = gu.chunk(2, -1)
        r = qdq_rows_reference(Fn.silu(gg) * uu, torch.bfloat16)
        same = (y.view(torch.int16) == r.view(torch.int16)) | (y.isnan() & r.isnan())
        assert bool(same.all()), (S, I, int((~same).sum()))

    m, topk, H = 7, 4, 300
    d = torch.randn(m * topk, H, generator=g).to(torch.bfloat16)
    w = torch.rand(m, topk, generator=g)
    for emap in (None, torch.tensor([0, -1, 1, -1, 2, 3, -1, 4], dtype=torch.int32)):
        ids = torch.randint(-1 if emap is None else 0, 8, (m, topk), generator=g).int()
        valid = (ids >= 0) if emap is None else (emap[ids.long()] >= 0)
        dd = d.clone()
        dd.view(m, topk, H)[~valid] = float("nan")          # rows the GEMM never wrote
        y = moe_combine(dd, w, ids, emap)
        ref = torch.zeros(m, H, dtype=torch.float32)
        for k in range(topk):
            ref += torch.where(valid[:, k, None], dd.view(m, topk, H)[:, k].float() * w[:, k, None], torch.zeros(()))
        assert torch.equal(y.view(torch.int16), ref.to(torch.bfloat16).view(torch.int16))
    print("OK")
""")


def test_moe_glue_under_the_interpreter():
    pytest.importorskip("triton")
    run_ok(SCRIPT, timeout=900)

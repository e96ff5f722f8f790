"""Every kernel's decode, walked over all 256 E8M0 scale bytes and all 256 E4M3 codes.

The reference is ``common/format.py``'s decode, ``dequantize_blocks`` (``decode_e4m3(q) *
e8m0_to_float(e)`` per 1x32 block): the value table ``R[e, c]`` of every (scale byte, code)
pair.  One subprocess under Triton's CPU interpreter (``TRITON_INTERPRET=1`` must be set
before Triton decorates the kernels) runs every check and reports per-check results; the tests
below read them.  How each kernel's output is made to expose single decoded values:

* the decode helpers themselves (``gemm_triton._e4m3_to_f32`` / ``_e8m0_to_f32``,
  ``gemv_triton._pow2`` / ``_word_pow2``): a probe kernel writes ``code * scale`` for all 65536
  pairs; compared bit for bit (-0.0 distinguished, NaN as NaN), and byte 255 must give exactly
  ``format.F32_NAN_BITS``;
* ``dequant_rows_bf16``: an elementwise decode; the whole table, bit for bit against
  ``R.to(bfloat16)``;
* the dot kernels (``grid_gemm``, ``grid_gemv`` chunk / deq, scale words and scale bytes,
  ``grid_moe_gemm``, ``moe_gemv``, ``w8a16_gemm``): ``y = P T^T`` with a probe operand P whose rows are the
  identity (grid value exactly 1.0: code 0x38, scale byte 127) plus one all-ones block per block
  position, and a test operand T that holds the table, one scale byte per 32-block.  Then
  ``y[m, n] = T[n, m]`` exactly: one exact product, the other terms 0.  A row of T may hold at
  most one non-finite value (0 * Inf and 0 * NaN are NaN and would spread over its row), so the
  table is split: finite rows (all finite pairs; non-finite codes of a scale replaced by 0) and
  one row per non-finite pair (NaN codes at every scale, the Inf of large codes at scales >= 247,
  compared only at its own position).  A block of scale byte 255 is NaN in the reference
  whatever its codes; the all-ones probe against a block of 1.0 codes at byte 255 tells a NaN
  decode (NaN) from an Inf decode (Inf) also where a NaN code row would not.  Both operand sides
  are walked (T as the weight, and T as the activation).  Zero signs are not observable through
  these kernels -- the FP32 accumulator starts at +0.0 and +0.0 + -0.0 = +0.0 -- so their zeros
  are compared as zeros;
* the qdq kernels (``qdq_rows``, ``silu_mul_qdq``) decode what they just quantized: inputs are
  built so that block (e, codes) quantizes to exactly those codes and that scale byte (a 0x7E code
  sets the amax), and the output is compared with the table.  Their domain is what the quantizer
  can write: bytes 0..247 from finite inputs, 254 from a block holding +-Inf; 248..253 need a
  block amax >= 2^128 (not a finite fp32) and 255 a NaN amax (the amax skips NaN), so no input
  reaches them (asserted on the reference quantizer).
"""

from __future__ import annotations

import json
import os
import time
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from mxfp8_learner_grid.common import format as F  # noqa: E402
from mxfp8_learner_grid.common.kernels import gemm_triton as GT  # noqa: E402
from mxfp8_learner_grid.common.kernels import gemv_triton as GV  # noqa: E402

ONE_CODE = 0x38            # E4M3 1.0
ONE_BYTE = F.E8M0_BIAS     # E8M0 2^0
K_TEST = 128               # 4 blocks per row: one int32 scale word (gemv word path, w8a16)
NB_TEST = K_TEST // F.BLOCK_SIZE


# --- reference table and comparisons ------------------------------------------------------------

def value_table() -> torch.Tensor:
    """R[e, c]: fp32 value of code c under scale byte e, by format.py's reference decode."""
    from mxfp8_learner_grid.common import dequantize_blocks
    q = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(256, 1)
    s = torch.arange(256, dtype=torch.int32).to(torch.uint8)[:, None].repeat(1, 256 // F.BLOCK_SIZE)
    return dequantize_blocks(q.view(F.FP8_DTYPE), s)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (-0.0 != +0.0), NaN positions compared as NaN."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    an, bn = torch.isnan(a.float()), torch.isnan(b.float())
    it = {2: torch.int16, 4: torch.int32}[a.element_size()]
    return torch.equal(an, bn) and torch.equal(a.view(it)[~an], b.view(it)[~bn])


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values (+-Inf exact, +0.0 == -0.0), NaN positions compared as NaN."""
    an, bn = torch.isnan(a.float()), torch.isnan(b.float())
    return a.shape == b.shape and torch.equal(an, bn) and bool((a.float()[~an] == b.float()[~bn]).all())


def _first_diff(a, b):
    a, b = a.float().reshape(-1), b.float().reshape(-1)
    bad = ~((a == b) | (torch.isnan(a) & torch.isnan(b)))
    i = int(bad.nonzero()[0]) if bad.any() else -1
    return None if i < 0 else [i, repr(a[i].item()), repr(b[i].item())]


# --- the decode helpers, all 65536 pairs -----------------------------------------------------------

@triton.jit
def _decode_probe_kernel(q_ptr, e_ptr, ew_ptr, v_ptr, c_ptr, d_ptr, p_ptr, w_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    q = tl.load(q_ptr + offs)
    e = tl.load(e_ptr + offs)
    c = GT._e4m3_to_f32(q, False)
    d = GT._e8m0_to_f32(e)
    tl.store(c_ptr + offs, c)
    tl.store(d_ptr + offs, d)
    tl.store(v_ptr + offs, c * d)
    tl.store(p_ptr + offs, GV._pow2(e.to(tl.int32) << 23))
    wo = tl.arange(0, N // 4)
    word = tl.load(ew_ptr + wo)
    for C in tl.static_range(4):
        tl.store(w_ptr + wo * 4 + C, GV._word_pow2(word, C))


def check_helpers(res, R):
    n = 65536
    e = torch.arange(256, dtype=torch.int32).repeat_interleave(256).to(torch.uint8)
    q = torch.arange(256, dtype=torch.int32).repeat(256).to(torch.uint8)
    outs = [torch.empty(n, dtype=torch.float32) for _ in range(5)]
    _decode_probe_kernel[(1,)](q, e, e.view(torch.int32), *outs, N=n)
    v, c, d, p, w = outs
    ref_c = F.decode_e4m3(q)
    ref_d = F.e8m0_to_float(e)
    res["helpers"].append(["e4m3_to_f32", same_bits(c, ref_c), _first_diff(c, ref_c)])
    res["helpers"].append(["e8m0_to_f32", same_bits(d, ref_d), _first_diff(d, ref_d)])
    res["helpers"].append(["code*scale", same_bits(v, R.reshape(-1)), _first_diff(v, R.reshape(-1))])
    res["helpers"].append(["gemv _pow2", same_bits(p, ref_d), _first_diff(p, ref_d)])
    res["helpers"].append(["gemv _word_pow2", same_bits(w, ref_d), _first_diff(w, ref_d)])
    # one NaN pattern: byte 255 decodes to exactly F32_NAN_BITS, in the reference and every helper
    nan_bits = [int(t[e == F.E8M0_NAN].view(torch.int32)[0]) for t in (ref_d, d, p, w)]
    res["nan_pattern"].append(["e8m0 255 -> F32_NAN_BITS", all(b == F.F32_NAN_BITS for b in nan_bits),
                               [hex(b & 0xFFFFFFFF) for b in nan_bits]])


# --- the dot kernels: probe operand x test operand -------------------------------------------------

def probe_operand(k=K_TEST):
    """Identity rows (1.0 at (m, m)) then one all-ones block per block position; scales 2^0."""
    nb = k // F.BLOCK_SIZE
    q = torch.zeros(k + nb, k, dtype=torch.uint8)
    q[torch.arange(k), torch.arange(k)] = ONE_CODE
    for b in range(nb):
        q[k + b, b * F.BLOCK_SIZE:(b + 1) * F.BLOCK_SIZE] = ONE_CODE
    return q, torch.full((k + nb, nb), ONE_BYTE, dtype=torch.uint8)


def table_operand(R, k=K_TEST, nonfinite_every=1):
    """(codes (N, k), scales (N, k/32), checks [(m, n)...] as two index tensors, expected values).

    Finite rows, then one row per non-finite pair, then byte-255 rows (see the module doc)."""
    nb = k // F.BLOCK_SIZE
    finite = torch.isfinite(R)
    blocks = []                                      # (scale byte, 32 codes), finite values only
    for e in range(F.E8M0_NAN):
        for j in range(256 // F.BLOCK_SIZE):
            codes = torch.arange(j * F.BLOCK_SIZE, (j + 1) * F.BLOCK_SIZE)
            codes = torch.where(finite[e, codes], codes, torch.zeros_like(codes))
            blocks.append((e, codes))
    rows_q, rows_s, mm, nn = [], [], [], []
    for r in range(0, len(blocks), nb):
        n = len(rows_q)
        rq = torch.zeros(k, dtype=torch.uint8)
        rs = torch.full((nb,), ONE_BYTE, dtype=torch.uint8)
        for b, (e, codes) in enumerate(blocks[r:r + nb]):
            rq[b * F.BLOCK_SIZE:(b + 1) * F.BLOCK_SIZE] = codes.to(torch.uint8)
            rs[b] = e
        rows_q.append(rq)
        rows_s.append(rs)
        mm += list(range(k))
        nn += [n] * k
    # one row per non-finite pair (e <= 254: the NaN codes at every scale, the overflowing codes
    # at scales >= 247): its value at position p, compared only there
    nf = (~finite[:F.E8M0_NAN]).nonzero().tolist()[::nonfinite_every]
    for i, (e, c) in enumerate(nf):
        n = len(rows_q)
        b = i % nb
        p = b * F.BLOCK_SIZE + c % F.BLOCK_SIZE
        rq = torch.zeros(k, dtype=torch.uint8)
        rs = torch.full((nb,), ONE_BYTE, dtype=torch.uint8)
        rq[p] = c
        rs[b] = e
        rows_q.append(rq)
        rows_s.append(rs)
        mm.append(p)
        nn.append(n)
    # byte 255: every code (8 rows), NaN at every position of the block; and blocks of 1.0 codes
    # against the all-ones probe (an Inf decode of 255 would give +Inf there, not NaN)
    for j in range(256 // F.BLOCK_SIZE):
        n = len(rows_q)
        b = j % nb
        rq = torch.zeros(k, dtype=torch.uint8)
        rs = torch.full((nb,), ONE_BYTE, dtype=torch.uint8)
        rq[b * F.BLOCK_SIZE:(b + 1) * F.BLOCK_SIZE] = torch.arange(j * F.BLOCK_SIZE, (j + 1) * F.BLOCK_SIZE)
        rs[b] = F.E8M0_NAN
        rows_q.append(rq)
        rows_s.append(rs)
        mm += list(range(b * F.BLOCK_SIZE, (b + 1) * F.BLOCK_SIZE))
        nn += [n] * F.BLOCK_SIZE
    for b in range(nb):
        n = len(rows_q)
        rq = torch.zeros(k, dtype=torch.uint8)
        rs = torch.full((nb,), ONE_BYTE, dtype=torch.uint8)
        rq[b * F.BLOCK_SIZE:(b + 1) * F.BLOCK_SIZE] = ONE_CODE
        rs[b] = F.E8M0_NAN
        rows_q.append(rq)
        rows_s.append(rs)
        mm += list(range(b * F.BLOCK_SIZE, (b + 1) * F.BLOCK_SIZE)) + [k + b]
        nn += [n] * (F.BLOCK_SIZE + 1)
    q = torch.stack(rows_q)
    s = torch.stack(rows_s)
    pad = (-q.shape[0]) % 64                         # whole tiles (zeros, scale 2^0; not checked)
    q = torch.cat([q, torch.zeros(pad, k, dtype=torch.uint8)])
    s = torch.cat([s, torch.full((pad, nb), ONE_BYTE, dtype=torch.uint8)])
    from mxfp8_learner_grid.common import dequantize_blocks
    tv = dequantize_blocks(q.view(F.FP8_DTYPE), s)               # (N, k) reference values
    mm, nn = torch.tensor(mm), torch.tensor(nn)
    # the expected output at (m, n): T[n, m] for an identity probe row, NaN for an all-ones row
    # (only checked against blocks of 1.0 at byte 255)
    want = torch.where(mm < k, tv[nn, mm.clamp(max=k - 1)], torch.full(mm.shape, float("nan")))
    return q, s, (mm, nn), want


def check_dot(res, key, tag, fn, probe, test, w_side=True):
    """fn(aq, as, wq, ws) -> y (M, N): T as the weight (y = P T^T) or as the activation (y = T P^T)."""
    pq, ps = probe
    tq, ts, (mm, nn), want = test
    t0 = time.time()
    if w_side:
        y = fn(pq, ps, tq, ts)
        got = y[mm, nn]
    else:
        y = fn(tq, ts, pq, ps)
        got = y[nn, mm]
    print(f"  {tag}: {time.time() - t0:.1f} s", flush=True)
    ok = same_values(got.float(), want) if got.dtype == torch.float32 else same_values(got, want.to(got.dtype))
    res[key].append([tag, ok, None if ok else _first_diff(got, want.to(got.dtype))])


def check_dot_kernels(res, R):
    from mxfp8_learner_grid.common.kernels.gemm_triton import grid_gemm, grid_moe_gemm, moe_align
    from mxfp8_learner_grid.common.kernels.gemv_triton import GemvConfig, grid_gemv
    from mxfp8_learner_grid.common.kernels.w8a16_triton import w8a16_gemm
    probe = probe_operand()
    test = table_operand(R)
    f32 = torch.float32
    f8 = lambda t: t.view(F.FP8_DTYPE)        # noqa: E731
    # large tiles: the interpreter's cost is per program (the tile shape does not touch the decode)
    gemm = lambda aq, as_, wq, ws: grid_gemm(f8(aq), as_, f8(wq), ws, None, f32,     # noqa: E731
                                             config=(64, 64, 128, 4, 1, 4, 1))
    for side in (True, False):
        check_dot(res, "gemm", f"grid_gemm {'W' if side else 'x'} side", gemm, probe, test, side)
    for variant in ("chunk", "deq"):
        for chunks, path in ((4, "scale words"), (2, "scale bytes")):
            cfg = GemvConfig(variant, 64, 128, chunks, 1, 4, 1)
            fn = lambda aq, as_, wq, ws, cfg=cfg: grid_gemv(f8(aq), as_, f8(wq), ws, None, f32, config=cfg)  # noqa: E731
            for side in (True, False):
                check_dot(res, "gemv", f"grid_gemv {variant} {path} {'W' if side else 'x'} side", fn, probe, test, side)

    def moe_w(aq, as_, wq, ws):
        # every probe token routed to both experts; the test rows split over the two experts
        t, n2 = aq.shape[0], wq.shape[0] // 2
        ids = torch.tensor([[0, 1]] * t, dtype=torch.int32)
        bm = 64
        sid, bexp = moe_align(ids, 2, bm)
        y = grid_moe_gemm(aq, as_, wq.reshape(2, n2, -1), ws.reshape(2, n2, -1), sid, bexp, 2 * t, 2,
                          True, None, f32, bm)
        return torch.cat([y[0::2], y[1::2]], dim=1)

    def moe_x(aq, as_, wq, ws):
        # one slot per test row (A rows are slots), one expert holding the probe
        s = aq.shape[0]
        ids = torch.zeros((s, 1), dtype=torch.int32)
        bm = 64
        sid, bexp = moe_align(ids, 1, bm)
        return grid_moe_gemm(aq, as_, wq[None], ws[None], sid, bexp, s, 1, False, None, f32, bm)

    check_dot(res, "moe", "grid_moe_gemm W side", moe_w, probe, test, True)
    check_dot(res, "moe", "grid_moe_gemm A side", moe_x, probe, test, False)

    # moe_gemv (one routed slot per program, the dense GEMV's chunk step and scale words): slot s =
    # activation row s, all slots on one expert.  Weight side only: its program count is the slot
    # count, so the activation side (one slot per test row) costs minutes in the interpreter; that
    # side decodes with the same gemv_triton._word_pow2 / _chunk_step as grid_gemv's x side above
    from mxfp8_learner_grid.common.kernels.moe_gemv_triton import moe_gemv

    def moe_gemv_fn(aq, as_, wq, ws, block_n):
        s = aq.shape[0]
        return moe_gemv(f8(aq), as_, torch.arange(s), f8(wq)[None], ws[None], torch.zeros(s, dtype=torch.int64),
                        f32, block_n=block_n)

    # (every 8th non-finite pair: the program count is the slot count times the weight tiles)
    check_dot(res, "moe", "moe_gemv W side", lambda *a: moe_gemv_fn(*a, 1024), probe,
              table_operand(R, nonfinite_every=8), True)

    # W8A16: the activation is bf16 grid values (the probe's 1.0s); the weight decode is rounded
    # once to bf16 (RNE), so the output is R.to(bf16): exact for scale bytes >= 3
    # (qdq_triton.BF16_EXACT_MIN_SCALE) -- below that the layer refuses the weight at load
    # (grid_weight_bf16, checked in check_bf16_domain)
    def w8a16(aq, as_, wq, ws):
        from mxfp8_learner_grid.common import dequantize_blocks
        x = dequantize_blocks(f8(aq), as_).to(torch.bfloat16)
        return w8a16_gemm(x, f8(wq), ws, config=(128, 64, 1, 4, 1))

    check_dot(res, "w8a16", "w8a16_gemm W side", w8a16, probe, test, True)


# --- dequant to bf16: the whole table, elementwise ------------------------------------------------

def check_dequant(res, R):
    from mxfp8_learner_grid.common.kernels.dequant_triton import dequant_rows_bf16
    q = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(256, 1)
    s = torch.arange(256, dtype=torch.int32).to(torch.uint8)[:, None].repeat(1, 256 // F.BLOCK_SIZE)
    y = dequant_rows_bf16(q.view(F.FP8_DTYPE), s)
    want = R.to(torch.bfloat16)
    res["dequant"].append(["dequant_rows_bf16 = R.to(bf16)", same_bits(y, want), _first_diff(y, want)])
    nanc = (q == F.E4M3_NAN_BYTE) | (q == (F.E4M3_NAN_BYTE | F.E4M3_SIGN_MASK))
    res["dequant"].append(["NaN codes write BF16_NAN_BITS",
                           bool((y.view(torch.int16)[nanc] == F.BF16_NAN_BITS).all()), None])


def check_bf16_domain(res, R):
    """The documented bf16 domain: R.to(bf16) is exact from byte BF16_EXACT_MIN_SCALE up (finite
    values), not below; grid_weight_bf16 refuses a non-zero block below it and accepts the rest."""
    from mxfp8_learner_grid.common.kernels.qdq_triton import BF16_EXACT_MIN_SCALE, grid_weight_bf16
    fin = torch.isfinite(R)
    exact = (R.to(torch.bfloat16).float() == R) | ~fin
    lo = BF16_EXACT_MIN_SCALE
    res["bf16_domain"].append(["exact from byte 3", bool(exact[lo:].all()), None])
    res["bf16_domain"].append(["inexact somewhere below byte 3", not bool(exact[:lo].all()), None])
    q = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    q = torch.where((q & 0x7F) == F.E4M3_NAN_BYTE, torch.zeros_like(q), q).repeat(1, 1)
    for e in range(0, 8):
        try:
            grid_weight_bf16(q.view(F.FP8_DTYPE), torch.full((1, 8), e, dtype=torch.uint8))
            refused = False
        except ValueError:
            refused = True
        res["bf16_domain"].append([f"grid_weight_bf16 byte {e} refused={refused}", refused == (e < lo), None])


# --- qdq: inputs that quantize to chosen (scale byte, codes) ---------------------------------------

def qdq_inputs(R, scales, amax_code=F.E4M3_MAX_BYTE):
    """fp32 x (rows, 288) whose blocks quantize to scale byte e (one row per e) and to every
    finite code; block position 0 holds the amax code.  Returns (x, codes, scale bytes)."""
    others = [c for c in range(256) if (c & 0x7F) != F.E4M3_NAN_BYTE and c != amax_code]
    per = F.BLOCK_SIZE - 1
    nblk = -(-len(others) // per)
    k = nblk * F.BLOCK_SIZE
    xs, qs, ss = [], [], []
    for e in scales:
        amax = R[e, amax_code]
        codes = torch.zeros(k, dtype=torch.int64)
        for b in range(nblk):
            blk = others[b * per:(b + 1) * per]
            codes[b * F.BLOCK_SIZE] = amax_code
            codes[b * F.BLOCK_SIZE + 1:b * F.BLOCK_SIZE + 1 + len(blk)] = torch.tensor(blk)
        # a code must not exceed the amax: keep only those below it (others become 0)
        codes = torch.where(R[e, codes].abs() <= amax, codes, torch.zeros_like(codes))
        x = R[e, codes].clone()
        # code 0x80 (-0.0): an exact -0.0 input encodes as 0x00 (the negative-zero rule); a negative
        # value below half the smallest subnormal encodes as 0x80 -- where fp32 holds one
        tiny = R[e, 0x01] / 4
        negz = codes == F.E4M3_SIGN_MASK
        if tiny > 0:
            x[negz] = -tiny
        else:
            codes[negz] = 0
        xs.append(x)
        qs.append(codes.to(torch.uint8))
        ss.append(torch.full((nblk,), e, dtype=torch.uint8))
    return torch.stack(xs), torch.stack(qs), torch.stack(ss)


def check_qdq(res, R):
    from mxfp8_learner_grid.common import quantize_rows
    from mxfp8_learner_grid.common.kernels.qdq_triton import exact_in, qdq_rows, qdq_rows_reference
    # the quantizer's reach: the largest finite block gets byte 247; +-Inf gets 254; NaN never 255
    top = torch.full((1, 32), torch.finfo(torch.float32).max)
    res["qdq"].append(["max fp32 block -> 247", int(quantize_rows(top, backend="torch")[1]) == 247, None])
    nanblk = torch.full((1, 32), float("nan"))
    res["qdq"].append(["NaN block -> not 255", int(quantize_rows(nanblk, backend="torch")[1]) != F.E8M0_NAN, None])
    x1, q1, s1 = qdq_inputs(R, range(0, 247))
    x2, q2, s2 = qdq_inputs(R, [247], amax_code=0x77)        # 240 * 2^120: the largest code below 2^128
    # byte 254: a block holding +Inf; its other values c * 2^127 are finite only for |c| < 2
    x3, q3, s3 = qdq_inputs(R, [254], amax_code=0x3F)
    x3[:, 0::F.BLOCK_SIZE] = float("inf")
    q3[:, 0::F.BLOCK_SIZE] = F.E4M3_MAX_BYTE
    x3[:, 1] = float("-inf")
    q3[:, 1] = F.E4M3_MAX_BYTE | F.E4M3_SIGN_MASK
    k = max(x1.shape[1], x2.shape[1], x3.shape[1])
    pad = lambda t, v: torch.cat([t, torch.full((t.shape[0], k - t.shape[1]), v, dtype=t.dtype)], 1)  # noqa: E731
    x = torch.cat([pad(x1, 0.0), pad(x2, 0.0), pad(x3, 0.0)])
    q = torch.cat([pad(q1, 0), pad(q2, 0), pad(q3, 0)])
    s = torch.cat([pad(s1, ONE_BYTE), pad(s2, 0), pad(s3, 0)])[:, :k // F.BLOCK_SIZE]
    # a NaN input: code 0x7F, decoded NaN, written as F32_NAN_BITS (row 0, block 1 position 1)
    x[0, F.BLOCK_SIZE + 1] = float("nan")
    q[0, F.BLOCK_SIZE + 1] = F.E4M3_NAN_BYTE
    qr, sr = quantize_rows(x, backend="torch")
    res["qdq"].append(["inputs quantize as built (reference)",
                       torch.equal(qr.view(torch.uint8), q) and torch.equal(sr, s), None])
    from mxfp8_learner_grid.common import dequantize_blocks
    want = dequantize_blocks(q.view(F.FP8_DTYPE), s)
    for od in (torch.float32, torch.bfloat16, torch.float16):
        y, yq, ys = qdq_rows(x, od, return_codes=True)
        ref = qdq_rows_reference(x, od)
        res["qdq"].append([f"qdq_rows {od} = reference", same_bits(y, ref), _first_diff(y, ref)])
        res["qdq"].append([f"qdq_rows {od} codes, scales", torch.equal(yq.view(torch.uint8), q) and torch.equal(ys, s),
                           None])
        ex = exact_in(od, s).repeat_interleave(F.BLOCK_SIZE, dim=1)
        res["qdq"].append([f"qdq_rows {od} = table where exact", same_bits(y.float()[ex], want[ex]),
                           _first_diff(y.float()[ex], want[ex])])
        if od == torch.float32:
            nan_bits = y.view(torch.int32)[0, F.BLOCK_SIZE + 1].item()
            res["nan_pattern"].append(["qdq fp32 NaN out = F32_NAN_BITS", nan_bits == F.F32_NAN_BITS, hex(nan_bits)])
    # silu_mul_qdq: gate 32.0 (silu(32) = 32 exactly in fp32), up = x / 32 in bf16: the product is
    # x again.  Exact in bf16 for bytes >= 8 (x / 32 must hold the lowest bit 2^(e-141)); the -0.0
    # stand-in -2^(e-138) needs e >= 10 in bf16 -- below, code 0x80 comes from an exact -0.0 (-> 0x00)
    from mxfp8_learner_grid.common.kernels.moe_triton import silu_mul_qdq
    xs, qs, ss = qdq_inputs(R, range(10, 247))
    u = (xs / 32).to(torch.bfloat16)
    ok_in = torch.equal((u.float() * 32), xs)
    gu = torch.cat([torch.full_like(u, 32.0), u], dim=1)
    y = silu_mul_qdq(gu, xs.shape[1])
    ref = qdq_rows_reference(xs.to(torch.bfloat16), torch.bfloat16)
    res["qdq"].append(["silu_mul_qdq inputs exact in bf16", ok_in, None])
    res["qdq"].append(["silu_mul_qdq = qdq reference", same_bits(y, ref), _first_diff(y, ref)])
    want = dequantize_blocks(qs.view(F.FP8_DTYPE), ss).to(torch.bfloat16)
    res["qdq"].append(["silu_mul_qdq = table", same_bits(y, want), _first_diff(y, want)])


def _run_checks() -> dict:
    res = {k: [] for k in ("helpers", "nan_pattern", "dequant", "bf16_domain", "gemm", "gemv", "moe", "w8a16",
                           "qdq")}
    R = value_table()
    for fn in (check_helpers, check_dequant, check_bf16_domain, check_dot_kernels, check_qdq):
        t0 = time.time()
        fn(res, R)
        print(f"{fn.__name__}: {time.time() - t0:.1f} s", flush=True)
    return res


@pytest.fixture(scope="module")
def interp():
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, os.path.abspath(__file__), "--interpreter-checks"], env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULTS ")][-1]
    return json.loads(line[len("RESULTS "):])


def _failures(entries):
    return [e for e in entries if not e[1]]


@pytest.mark.parametrize("key, least", [
    ("helpers", 5), ("nan_pattern", 2), ("dequant", 2), ("bf16_domain", 10), ("gemm", 2), ("gemv", 8),
    ("moe", 3), ("w8a16", 1), ("qdq", 14),
])
def test_decode_equals_reference(interp, key, least):
    assert len(interp[key]) >= least, interp[key]
    assert not _failures(interp[key]), _failures(interp[key])


if __name__ == "__main__" and "--interpreter-checks" in sys.argv:
    out = _run_checks()
    for key, entries in out.items():
        for e in entries:
            if not e[1]:
                print("FAIL", key, e)
    print("RESULTS " + json.dumps(out))


# --- no format rule re-typed as a literal in the kernels ----------------------------------------

#: values that encode a rule of the format (common/format.py names each): 448, 0x7E, 0x7F / 127,
#: 0xFE / 254, 0xFF / 255, the 1/448 bits and value, the NaN / Inf / 2^-127 / sign bit patterns,
#: the fp32 mantissa mask, the E4M3 -> fp32 exponent rebias (120) and smallest normal (121),
#: the subnormal unit 2^-9 and the rounding constant 2^23.  Block size 32 and the 128 / 4 of the
#: layouts are not listed: the same numbers are tile shapes in the launch configs.
FORBIDDEN = {448, 0x7E, 0x7F, 0xFE, 0xFF, F.RCP_E4M3_BITS, 0x7FC00000, 0x7FFFFFFF, 0x00400000, 0x7F800000,
             0x7FC0, 0x7E00, 0x7FFFFF, 1 << 31, 120, 121, 2.0 ** -9, 2.0 ** 23}


def _format_literals(src: str):
    """(line, token) of every number token of Python source ``src`` (comments and strings --
    docstrings -- skipped) whose value is in FORBIDDEN or is 1/448."""
    import io
    import tokenize
    hits = []
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type != tokenize.NUMBER:
            continue
        v = float(eval(tok.string.replace("_", "")))      # noqa: S307 - a number literal
        if v in FORBIDDEN or abs(v - 1 / 448) < 1e-9:
            hits.append((tok.start[0], tok.string))
    return hits


def _kernel_sources():
    import glob
    import mxfp8_learner_grid.common as C
    root = os.path.dirname(os.path.abspath(C.__file__))
    return sorted(glob.glob(os.path.join(root, "kernels", "*.py"))) + [os.path.join(root, "layout.py")]


def test_literal_scan_catches_a_literal():
    src = ('"""448 and 0xFE in a docstring"""\n# 255 in a comment\ny = tl.minimum(x, -448.0)\n'
           'e = tl.where(exp == 0xFE, 254, e)\nb = 0x7FC00000\nr = x * 0.002232142857142857\n')
    assert [t for _, t in _format_literals(src)] == ["448.0", "0xFE", "254", "0x7FC00000", "0.002232142857142857"]


def _scan_kernels(scan) -> dict:
    """{kernel file: hits} of ``scan`` (a source -> hits function) over every kernel source."""
    hits = {}
    for p in _kernel_sources():
        with open(p) as f:
            h = scan(f.read())
        if h:
            hits[os.path.basename(p)] = h
    return hits


def test_no_format_literals_in_kernels():
    assert len(_kernel_sources()) >= 9
    hits = _scan_kernels(_format_literals)
    assert not hits, f"format rules typed as literals (name them in common/format.py): {hits}"


#: the block size (32) and the K of one int32 scale word (128) inside jit code: FORBIDDEN leaves them out
#: (they are tile shapes in the launch configs), but in a kernel body they are the format's block and
#: scale-word rules -- read as ``gemv_triton._BLOCK`` / ``_WORD_K`` (or the kernel's own constexpr names)
JIT_FORBIDDEN = {32, 128}


def _jit_literals(src: str, values=JIT_FORBIDDEN):
    """(function, line, token) of every number token in ``values`` inside a ``@triton.jit`` function of
    Python source ``src`` (comments and docstrings skipped)."""
    import ast
    import io
    import tokenize
    lines = src.splitlines(keepends=True)
    hits = []
    for node in ast.walk(ast.parse(src)):
        if not isinstance(node, ast.FunctionDef) or not any("jit" in ast.unparse(d) for d in node.decorator_list):
            continue
        body = "".join(lines[node.lineno - 1:node.end_lineno])
        for tok in tokenize.generate_tokens(io.StringIO(body).readline):
            if tok.type == tokenize.NUMBER and float(eval(tok.string.replace("_", ""))) in values:  # noqa: S307
                hits.append((node.name, node.lineno - 1 + tok.start[0], tok.string))
    return hits


def test_jit_literal_scan_catches_a_block_literal():
    src = ('import triton\nimport triton.language as tl\nK_STEP = 128\n\n'
           '@triton.jit\ndef k(p, K):\n    """32 in a docstring"""\n    offs = tl.arange(0, 32)  # 128 in a comment\n'
           '    for k0 in range(0, K, 128):\n        pass\n\ndef host():\n    return 32\n')
    assert [(f, t) for f, _, t in _jit_literals(src)] == [("k", "32"), ("k", "128")]


def test_no_block_literals_in_jit_code():
    """The kernels' jit bodies name the block size and the scale word (moe_gemv_triton included: it
    reads gemv_triton's ``_BLOCK`` / ``_WORD_K``)."""
    assert any(p.endswith(os.sep + "moe_gemv_triton.py") for p in _kernel_sources())
    hits = _scan_kernels(_jit_literals)
    assert not hits, f"block size / scale-word K typed as literals in jit code (use _BLOCK / _WORD_K): {hits}"

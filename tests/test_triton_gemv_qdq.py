"""The fused qdq kernel and the decode GEMV under Triton's CPU interpreter, against common/'s reference.

One subprocess (``TRITON_INTERPRET=1`` must be set before Triton decorates the kernels) runs
every check and reports per-check results; the tests below read them.  The same helpers
(hard input rows, the error bound, NaN-aware bit equality) are used by the GPU tests in
``tests/gpu/test_cuda_gemv_qdq.py``.

qdq: output bits equal ``dequantize_blocks(*quantize_rows(x)).to(out_dtype)`` (NaN payloads
are canonical in the kernel, so NaN positions are compared, not payloads); codes and scales
equal ``quantize_rows``.

GEMV tolerance.  Both operands are exact grid values; each product x_i * w_i (<= 4 + 4
significant bits) is exact in fp32.  The kernel's result is an fp32 sum of the K products
(plus bias) in a particular order: a 32-term dot per chunk (<= 31 roundings), accumulator
updates (``chunk``: one per 32-chunk; ``deq`` passes the accumulator through every 16-wide MMA
step: K/16), then SPLIT_K partial sums, then the bias.  Any term passes through at most
n = 31 + K/16 + SPLIT_K + 1 roundings (the chunk scale multiply is exact), so the classic
summation bound gives |y - exact| <= gamma_n * (sum_i |x_i w_i| + |b|), gamma_n = n*u/(1-n*u),
u = 2^-24 for IEEE fp32 additions (the interpreter); tensor cores that truncate instead of
rounding are covered by u = 2^-23 (GPU tests).  An output cast to bf16/fp16 adds at most one
rounding of the output: 2^-8 (bf16) / 2^-11 (fp16) relative.  The exact value is computed in
float64 (products exact, error of the float64 sum ~K * 2^-53 relative, far below the bound).
"""

from __future__ import annotations

import json
import math
import os
import struct
import subprocess
import sys

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

# --- helpers shared with the GPU tests --------------------------------------------------------


def f32(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits & 0xFFFFFFFF))[0]


def _next(v: float, dtype: torch.dtype, up: bool) -> float:
    t = torch.tensor([v], dtype=dtype)
    it = torch.int32 if dtype == torch.float32 else torch.int16
    b = t.view(it)
    b += 1 if up == (v >= 0) else -1
    return float(b.view(dtype).item())


def hard_rows(dtype: torch.dtype, k: int = 64) -> torch.Tensor:
    """Rows of hard blocks (K = 64: two 32-blocks per row): the hand-derived cases of
    test_quantize_bytes, amax at / one ulp around 448 * 2^j, tiny scale bytes (0 .. 4), zero,
    NaN and Inf blocks, -0.0, and every E4M3 value / midpoint / neighbour at scale 1."""
    from test_quantize_bytes import CASES, DTYPES
    name = {v: k_ for k_, v in DTYPES.items()}[dtype]
    blocks = []

    def add(vals):
        b = torch.zeros(32, dtype=torch.float64)
        vals = torch.tensor(vals, dtype=torch.float64)[:32]
        b[: len(vals)] = vals
        blocks.append(b)

    for _, dts, values, _, _ in CASES:
        if name in dts.split():
            add(values)
    finfo = torch.finfo(dtype)
    for j in (-133, -130, -127, -126, -124, -120, -60, -20, -9, -1, 0, 1, 8, 15, 20, 60, 100, 118):
        a = 448.0 * 2.0 ** j
        if not (finfo.tiny * 2.0 ** -10 < a < finfo.max):
            continue
        a = float(torch.tensor(a, dtype=dtype).item())
        for amax in (a, _next(a, dtype, True), _next(a, dtype, False)):
            if amax == 0 or not math.isfinite(amax):
                continue
            add([amax, -amax / 3, amax / 7, -amax * 2.0 ** -7, amax * 2.0 ** -9, amax * 2.0 ** -10,
                 amax * 0.75, -amax * 1.5 / 2, amax / 448 * 1.0625, amax / 448 * 1.1875])
    for e in range(0, 6):                       # blocks whose scale byte is tiny (bf16/fp32 only)
        amax = 448.0 * 2.0 ** (e - 127)
        if amax > finfo.tiny * 2.0 ** -8:
            add([amax * 0.99, -amax * 0.5, amax * 2.0 ** -5, amax * 2.0 ** -9, amax * 2.0 ** -8 * 3])
    # subnormal inputs (fp32 and bf16 hold them): amax 2^-128 -> scale byte 0, s = 2^127, nonzero codes
    add([2.0 ** -128, 2.0 ** -131, -(2.0 ** -133), 2.0 ** -129 * 3])
    add([-(2.0 ** -126) * 0.75, 2.0 ** -140, 2.0 ** -135])
    nan, inf = float("nan"), float("inf")
    add([0.0] * 32)
    add([nan] * 32)
    add([nan, 1.0, -3.0, nan])
    add([inf, -2.0, 1.0])
    add([-inf, inf, 5.0, -0.0])
    add([-0.0, 0.0, -1e-3, 2.0])
    # every E4M3 value, midpoint and fp32 neighbour at s = 1 (the block's first value is 448)
    from test_format_rules import _e4m3_probe_values
    probe = _e4m3_probe_values()
    probe = probe[np.abs(probe) <= 448]
    for i in range(0, len(probe), 31):
        add([448.0] + probe[i: i + 31].astype(np.float64).tolist())
    if len(blocks) % (k // 32):
        blocks += [torch.zeros(32, dtype=torch.float64)] * (k // 32 - len(blocks) % (k // 32))
    x = torch.stack(blocks).reshape(-1, k)
    return x.to(torch.float32).to(dtype) if dtype != torch.float32 else x.to(torch.float32)


def random_input(shape, dtype, seed=0, specials=True) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    lo, hi = (-40, 36) if dtype == torch.float32 else (-30, 30) if dtype == torch.bfloat16 else (-6, 4)
    x = (x * torch.logspace(lo, hi, shape[-1], dtype=torch.float64)).to(dtype)
    if specials and x.numel() > 200:
        f = x.view(-1)
        f[3] = float("nan")
        f[40] = float("inf")
        f[70] = -0.0
        f[100:132] = 0
        f[150] = -float("inf")
    return x


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality, NaN positions compared as NaN (payloads are not specified)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    a, b = a.cpu(), b.cpu()
    an, bn = torch.isnan(a.float()), torch.isnan(b.float())
    it = {2: torch.int16, 4: torch.int32}[a.element_size()]
    return torch.equal(an, bn) and torch.equal(a.view(it)[~an], b.view(it)[~bn])


def exact_linear(xq, xs, wq, ws, bias):
    """(exact y in float64, sum_i |x_i w_i| + |b| in float64), both (M, N), on xq's device."""
    from mxfp8_learner_grid.common import dequantize_blocks
    a = dequantize_blocks(xq, xs).double()
    w = dequantize_blocks(wq, ws).double()
    y = a @ w.t()
    s = a.abs() @ w.abs().t()
    if bias is not None:
        y = y + bias.double()
        s = s + bias.double().abs()
    return y, s


def gemv_bound(sum_abs, exact, k, split, u=2.0 ** -24, out_dtype=torch.float32):
    """Bound on |y - exact| for an fp32 sum with at most 31 + K/16 + SPLIT + 1 roundings (+ output cast)."""
    n = 31 + k // 16 + split + 1
    b = (n * u / (1 - n * u)) * sum_abs
    out_u = {torch.float32: 0.0, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}[out_dtype]
    return b + out_u * (exact.abs() + b) + 1e-300


def counters_zero() -> bool:
    from mxfp8_learner_grid.common.kernels import gemv_triton
    return all(int(b.abs().sum()) == 0 for b in gemv_triton._KEEP_ALIVE)


# --- the interpreter run -------------------------------------------------------------------

def _run_checks() -> dict:
    from mxfp8_learner_grid.common import quantize_rows
    from mxfp8_learner_grid.common.linear import mxfp8_linear_reference
    from mxfp8_learner_grid.common.kernels.gemv_triton import GemvConfig, grid_gemv
    from mxfp8_learner_grid.common.kernels.qdq_triton import exact_in, qdq_rows, qdq_rows_reference
    res = {"qdq": [], "qdq_codes": [], "qdq_exact": [], "gemv": [], "gemv_ref": [], "gemv_det": [],
           "counters": []}
    dtypes = (torch.bfloat16, torch.float16, torch.float32)

    def qdq_check(tag, x):
        q_ref, s_ref = quantize_rows(x, backend="torch")
        for od in (None, torch.bfloat16, torch.float32, torch.float16):
            want = qdq_rows_reference(x, od)
            out = torch.full(x.shape, float("nan"), dtype=od or x.dtype)      # poisoned
            y, q, s, mn = qdq_rows(x, od, return_codes=True, return_min_scale=True, out=out)
            ok = same_bits(y, want) and y.data_ptr() == out.data_ptr()
            res["qdq"].append([f"{tag} out={od}", ok])
            okc = (torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)
                   and int(mn.item()) == (int(s_ref.min()) if s_ref.numel() else 255))
            res["qdq_codes"].append([f"{tag} out={od}", okc])
            # exactness claims: blocks exact in out_dtype give exactly the fp32 grid values
            od_ = od or x.dtype
            exact_blocks = exact_in(od_, s_ref).repeat_interleave(32, dim=-1)
            g = qdq_rows_reference(x, torch.float32)
            fin = torch.isfinite(g) & exact_blocks
            res["qdq_exact"].append([f"{tag} out={od}", bool(torch.equal(y.float()[fin], g[fin]))])

    for dt in dtypes:
        for shape in ((37, 160), (1, 64), (3, 5, 96), (16, 256)):
            qdq_check(f"random {dt} {shape}", random_input(shape, dt, seed=sum(shape)))
        qdq_check(f"hard {dt}", hard_rows(dt))
    g = torch.Generator().manual_seed(1)
    bits = torch.randint(-2 ** 31, 2 ** 31 - 1, (48, 256), generator=g, dtype=torch.int64).to(torch.int32)
    qdq_check("fp32 bit patterns", bits.view(torch.float32))
    bits16 = torch.randint(-2 ** 15, 2 ** 15 - 1, (48, 256), generator=g, dtype=torch.int64).to(torch.int16)
    qdq_check("bf16 bit patterns", bits16.view(torch.bfloat16))
    qdq_check("fp16 bit patterns", bits16.view(torch.float16))
    # small config / multi-tile grid
    x = random_input((40, 384), torch.bfloat16, seed=7)
    want = qdq_rows_reference(x, torch.bfloat16)
    res["qdq"].append(["config (16,64,4)", same_bits(qdq_rows(x, torch.bfloat16, config=(16, 64, 4)), want)])

    # GEMV: (m, n, k, variant, split, bias, out dtype, scale wide range)
    cases = [
        (1, 64, 128, "chunk", 1, False, torch.float32, False),
        (1, 64, 128, "deq", 2, True, torch.bfloat16, False),
        (5, 40, 256, "chunk", 2, True, torch.float32, False),
        (5, 40, 256, "deq", 1, False, torch.float32, False),
        (17, 33, 96, "chunk", 1, True, torch.float32, False),       # K % 128 != 0: byte scales, masked K
        (17, 33, 96, "deq", 3, True, torch.bfloat16, False),
        (33, 48, 512, "chunk", 4, True, torch.float32, True),       # 3 M-tiles, split 4, wide scale range
        (33, 48, 512, "deq", 3, False, torch.float16, False),
        (64, 32, 384, "chunk", 3, False, torch.bfloat16, True),
        (2, 24, 160, "chunk", 2, True, torch.float32, False),       # N < BLOCK_N
        (3, 40, 256, None, None, True, torch.float32, False),       # choose_config
        (9, 32, 128, "sliced", 1, True, torch.float32, False),      # unaligned scales: byte path, EVEN_K
        (6, 64, 256, "chunk_swap", 2, True, torch.float32, False),  # SWAP (W x^T) variants
        (20, 40, 96, "deq_swap", 1, False, torch.bfloat16, True),
    ]
    for i, (m, n, k, var, split, has_bias, od, wide) in enumerate(cases):
        g = torch.Generator().manual_seed(100 + i)
        x = torch.randn(m, k, generator=g)
        w = torch.randn(n, k, generator=g) * 0.05
        if wide:     # per-block magnitudes from 2^-60 to 2^60 on both operands
            x = x * torch.logspace(-18, 18, k // 32).repeat_interleave(32)
            w = w * torch.logspace(18, -18, k // 32).repeat_interleave(32)
        b = torch.randn(n, generator=g) if has_bias else None
        xq, xs = quantize_rows(x)
        wq, ws = quantize_rows(w)
        cfg = None
        if var == "sliced":
            xs_big = torch.zeros(m, k // 32 + 1, dtype=torch.uint8)
            xs_big[:, 1:] = xs
            xs = xs_big[:, 1:]                      # data_ptr % 4 != 0: not int32-viewable
            cfg = GemvConfig("chunk", 16, 32, 4, split, 4, 1)
        elif var is not None and var.endswith("_swap"):
            cfg = GemvConfig(var[:-5], 16, 32, 4, split, 4, 1, swap=True)
        elif var is not None:
            cfg = GemvConfig(var, 16, 32, 4, split, 4, 1)
        exact, sabs = exact_linear(xq, xs, wq, ws, b)
        out = torch.full((m, n), float("nan"), dtype=od)
        y = grid_gemv(xq, xs, wq, ws, b, od, cfg, out=out)
        eff_split = 1 if cfg is None else split
        bound = gemv_bound(sabs, exact, k, eff_split, out_dtype=od)
        err = (y.double() - exact).abs()
        ok = bool(torch.isfinite(y).all()) and bool((err <= bound).all()) and y.data_ptr() == out.data_ptr()
        tag = f"m={m} n={n} k={k} {var} split={split} bias={has_bias} {od} wide={wide}"
        res["gemv"].append([tag, ok, float((err / bound).max())])
        y2 = grid_gemv(xq, xs, wq, ws, b, od, cfg)
        res["gemv_det"].append([tag, bool(torch.equal(y, y2))])
        res["counters"].append([tag, counters_zero()])
        if od == torch.float32 and not wide:
            # the project's definition end to end (it quantizes x itself); its own fp32 matmul
            # may sum in any order: allow the loose K*u bound for it on top of ours
            ref = mxfp8_linear_reference(x, wq, ws, b)
            loose = k * 2.0 ** -24 * sabs
            res["gemv_ref"].append([tag, bool(((y.double() - ref.double()).abs() <= bound + loose).all())])
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


def test_qdq_bits_equal_reference(interp):
    assert len(interp["qdq"]) >= 60
    assert not _failures(interp["qdq"])


def test_qdq_codes_and_scales_equal_quantize_rows(interp):
    assert not _failures(interp["qdq_codes"])


def test_qdq_exact_where_documented(interp):
    assert not _failures(interp["qdq_exact"])


def test_gemv_within_summation_bound(interp):
    assert len(interp["gemv"]) >= 12
    assert not _failures(interp["gemv"]), _failures(interp["gemv"])


def test_gemv_matches_linear_reference(interp):
    assert interp["gemv_ref"] and not _failures(interp["gemv_ref"])


def test_gemv_deterministic_and_counters_rearmed(interp):
    assert not _failures(interp["gemv_det"])
    assert not _failures(interp["counters"])


def test_config_chooser():
    from mxfp8_learner_grid.common.kernels import gemv_triton as G
    if G.interpreting():
        pytest.skip("chooser's GPU branch")
    G._NUM_SMS[0] = 132                          # the rules, with the SM count of an H200
    c = lambda m, n, k, name=None: G.choose_config(m, n, k, name, device="cuda:0")   # noqa: E731
    assert c(1, 24576, 4096).astuple() == ("chunk", 16, 128, 4, 2, 4, 4, False)      # 384 programs
    assert c(16, 6144, 4096).split_k == 8 and c(32, 6144, 4096).block_m == 32
    assert c(64, 4096, 4096).variant == "deq" and c(64, 4096, 4096).block_m == 64
    assert c(64, 4096, 4096, "chunk").num_warps == 8                                 # BM 64 chunk: 8 warps
    assert c(4, 2048, 4096, "chunk_n64").block_n == 64
    for m in (1, 4, 16, 32, 64):
        for n, k in ((6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288), (5120, 2048), (2048, 4096)):
            cfg = c(m, n, k)
            progs = -(-m // cfg.block_m) * -(-n // cfg.block_n) * cfg.split_k
            assert progs >= 0.9 * 132 and 8 * cfg.split_k * m <= k, (m, n, k, cfg)
            assert cfg.split_k * min(m, cfg.block_m) * cfg.block_n * 4 <= 65536
    with pytest.raises(ValueError):
        G.choose_config(1, 64, 64, "nope")


if __name__ == "__main__" and "--interpreter-checks" in sys.argv:
    out = _run_checks()
    for key, entries in out.items():
        for e in entries:
            if not e[1]:
                print("FAIL", key, e)
    print("RESULTS " + json.dumps(out))

"""Diagnostic (GPU): which humming band call crashes or hangs.  Each case runs in its own process with a
deadline, printing each step, so a segfault or a hang ends one case only.

    source benchmarks/humming_env.sh .carry/humming && python benchmarks/humming_diag.py [CASE ...]

Cases ``cfg:N:K:BN:BK:STAGES:M`` run one humming kernel (N x K weights, M rows, tile (BN, BK), STAGES pipeline
stages, the band's other settings) and wait at most 10 s after its launch for it to finish, polling an event: a
kernel that never finishes is reported as ``HANG`` (exit 4), one that finishes is checked against the exact result
rounded once.  ``configs`` runs the set in ``CONFIGS`` (thirteenth session: 256 x 256, M = 16, tile (64, 64), 4 stages
never finished), ``--jobs J`` cases at a time.

On the H200 (eleventh session) the band was exact inside the ``w8a16`` kernel (table from row 1), but
``test_band_inside_marlin_kernel`` (band [17, 129]) segfaulted in humming's launcher, and
``exp_humming.py`` stopped making progress after its first kernel.
"""

import subprocess
import sys
import time

PRE = """
import faulthandler, sys, time, torch
faulthandler.enable(); faulthandler.dump_traceback_later({deadline}, exit=True)
t0 = time.time()
def step(s): print(f"  [{{time.time() - t0:6.1f}} s] {{s}}", flush=True)
sys.path.insert(0, "tests/gpu"); sys.path.insert(0, "benchmarks")
from grid_checks import grid_layer, setup_kernel, check_fp32_accumulation, x_grid
from mxfp8_learner_grid.common import dequantize_blocks
def band(kernel, rows, n=6144, k=4096, ms=(17, 64)):
    layer = grid_layer(n, k)
    kern = setup_kernel(layer, kernel=kernel, humming_rows=rows, gemv_rows=0); step(f"set up {{kern.describe()}}")
    w = dequantize_blocks(layer.weight, layer.weight_scale_inv)
    for m in ms:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        y = kern.apply(layer, x); torch.cuda.synchronize(); step(f"M={{m}} ran")
        check_fp32_accumulation(y, x_grid(x), w); step(f"M={{m}} exact")
def vllm_ops():
    from mxfp8_learner_grid.vllm_plugin import compat
    compat.register_kernel_providers(); step("vLLM providers registered")
"""

CASES = {
    "w8a16_from1": "band('w8a16', [1, 129])",
    "w8a16_from17": "band('w8a16', [17, 129])",
    "vllm_then_w8a16_from1": "vllm_ops(); band('w8a16', [1, 129])",
    "marlin_from1": "vllm_ops(); band('marlin', [1, 129])",
    "marlin_from17": "vllm_ops(); band('marlin', [17, 129])",
    "exp_quantize_first": """
from exp_humming import humming_layer, tile_config, run, configs
from mxfp8_learner_grid.common import quantize_rows
q, s = quantize_rows(torch.randn(6144, 4096, device="cuda") * 0.02); step("quantized first")
p = humming_layer(*quantize_rows(torch.randn(256, 256, device="cuda") * 0.02)); step("probe layer")
run(p, torch.randn(16, 256, device="cuda", dtype=torch.bfloat16), tile_config(16, 64, 64)); step("probe ran")
q2, s2 = quantize_rows(torch.randn(6144, 4096, device="cuda") * 0.03); torch.cuda.synchronize(); step("quantized after humming")
h = humming_layer(q, s); torch.cuda.synchronize(); step("humming layer 6144x4096")
run(h, torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16), configs(h, 64)["bn128k64"]); torch.cuda.synchronize(); step("ran")
""",
    "probe256_sync": """
from exp_humming import humming_layer, tile_config, run
from mxfp8_learner_grid.common import quantize_rows
p = humming_layer(*quantize_rows(torch.randn(256, 256, device="cuda") * 0.02)); torch.cuda.synchronize(); step("probe layer")
run(p, torch.randn(16, 256, device="cuda", dtype=torch.bfloat16), tile_config(16, 64, 64)); step("probe launched")
torch.cuda.synchronize(); step("probe finished on the GPU")
""",
    "exp_steps": """
from exp_humming import humming_layer, tile_config, run, configs, precompile
from mxfp8_learner_grid.common import quantize_rows
p = humming_layer(*quantize_rows(torch.randn(256, 256, device="cuda") * 0.02)); step("probe layer")
run(p, torch.randn(16, 256, device="cuda", dtype=torch.bfloat16), tile_config(16, 64, 64)); step("probe ran")
vllm_ops()
q, s = quantize_rows(torch.randn(6144, 4096, device="cuda") * 0.02); step("quantized")
h = humming_layer(q, s); torch.cuda.synchronize(); step("humming layer 6144x4096")
print("  precompile", precompile(h, [16, 64]), flush=True); step("precompiled")
for name, cfg in configs(h, 64).items():
    run(h, torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16), cfg); torch.cuda.synchronize(); step(f"ran {name}")
""",
}

CFG = """
import os
from exp_humming import humming_layer, tile_config, run
from mxfp8_learner_grid.common import quantize_rows
n, k, bn, bk, stages, m = {args}
q, s = quantize_rows(torch.randn(n, k, device="cuda") * 0.02)
p = humming_layer(q, s); torch.cuda.synchronize(); step(f"layer {{n}} x {{k}}")
cfg = tile_config(m, bn, bk); cfg["num_stages"] = stages
xg = x_grid(torch.randn(m, k, device="cuda", dtype=torch.bfloat16))
y = run(p, xg, cfg); ev = torch.cuda.Event(); ev.record(); t1 = time.time(); step(f"launched {{cfg}} ({{k // bk}} K-tiles)")
while not ev.query():
    if time.time() - t1 > 10:
        step(f"HANG: not finished 10 s after launch ({{k // bk}} K-tiles, {{stages}} stages)"); os._exit(4)
    time.sleep(0.02)
step("finished")
check_fp32_accumulation(y, xg, dequantize_blocks(q, s)); step("exact")
"""

#: (N, K, BN, BK, stages, M): the 256 x 256 control that hung, K-tiles per stage count around it, the band's shapes
CONFIGS = [(256, 256, 64, 64, 4, 16), (256, 512, 64, 64, 4, 16), (256, 1024, 64, 64, 4, 16),
           (256, 256, 64, 64, 2, 16), (1024, 256, 128, 64, 4, 16), (256, 4096, 64, 64, 4, 16),
           (1024, 4096, 128, 64, 4, 16), (1024, 4096, 128, 64, 4, 64)]


def code_of(name: str, deadline: int) -> str:
    if name.startswith("cfg:"):
        return PRE.format(deadline=deadline) + CFG.format(args=", ".join(name.split(":")[1:]))
    return PRE.format(deadline=deadline) + CASES[name]


def run_case(name: str, deadline: int) -> str:
    t = time.time()
    lines = [f"== {name}"]
    try:
        r = subprocess.run([sys.executable, "-c", code_of(name, deadline)], capture_output=True, text=True,
                           timeout=deadline + 15)
        out = (r.stdout + r.stderr).strip().splitlines()
        keep = [l for l in out if l.startswith("  ") or "Error" in l or "File " in l or "Fatal" in l or "Timeout" in l]
        lines += keep[-25:] + [f"== {name}: rc {r.returncode} in {time.time() - t:.0f} s"]
    except subprocess.TimeoutExpired:
        lines.append(f"== {name}: killed after {deadline + 15} s")
    return "\n".join(lines)


def main():
    import argparse
    from concurrent.futures import ThreadPoolExecutor
    ap = argparse.ArgumentParser()
    ap.add_argument("cases", nargs="*")
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--deadline", type=int, default=75)
    a = ap.parse_args()
    names = []
    for c in a.cases or list(CASES):
        names += ["cfg:" + ":".join(map(str, c)) for c in CONFIGS] if c == "configs" else [c]
    with ThreadPoolExecutor(a.jobs) as pool:
        for text in pool.map(lambda nm: run_case(nm, a.deadline), names):
            print(text, flush=True)


if __name__ == "__main__":
    main()

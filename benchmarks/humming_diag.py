"""Diagnostic (GPU): which humming band call crashes or hangs.  Each case runs in its own process with a
deadline, printing each step, so a segfault or a hang ends one case only.

    source benchmarks/humming_env.sh .carry/humming && python benchmarks/humming_diag.py [CASE ...]

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


def main():
    names = sys.argv[1:] or list(CASES)
    deadline = 75
    for name in names:
        t = time.time()
        print(f"== {name}", flush=True)
        code = PRE.format(deadline=deadline) + CASES[name]
        try:
            r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=deadline + 15)
            out = (r.stdout + r.stderr).strip().splitlines()
            keep = [l for l in out if l.startswith("  ") or "Error" in l or "File " in l or "Fatal" in l or "Timeout" in l]
            print("\n".join(keep[-25:]), flush=True)
            print(f"== {name}: rc {r.returncode} in {time.time() - t:.0f} s", flush=True)
        except subprocess.TimeoutExpired:
            print(f"== {name}: killed after {deadline + 15} s", flush=True)


if __name__ == "__main__":
    main()

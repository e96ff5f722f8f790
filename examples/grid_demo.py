"""A tour of the grid core: TE-exact MXFP8 bytes, layouts, and a Linear forward on the learner's grid.

    python examples/grid_demo.py
"""

import torch

from mxfp8_learner_grid.common import (dequantize_mxfp8, mxfp8_linear_reference, quantize_mxfp8, quantize_rows,
                                       swizzle_scales, unswizzle_scales)


def main():
    torch.manual_seed(0)
    x = torch.randn(96, 160, dtype=torch.bfloat16)
    x[0, :4] = torch.tensor([448.0, 450.0, float("nan"), -0.0])
    q = quantize_mxfp8(x, rowwise=True, columnwise=True)
    print("input", tuple(x.shape), x.dtype)
    print("rowwise data   ", tuple(q.rowwise_data.shape), q.rowwise_data.dtype)
    print("rowwise scales ", tuple(q.rowwise_scale_inv.shape), "(round_up(M,128), round_up(K/32,4)), padding 0x00")
    print("colwise scales ", tuple(q.columnwise_scale_inv.shape), "(round_up(M/32,4), round_up(K,128))")
    print("first block: scale byte", q.rowwise_scale_inv[0, 0].item(),
          "codes", [hex(c) for c in q.rowwise_data[0, :4].view(torch.uint8).tolist()],
          "(450 -> e=128: 448 -> 224=0x76, NaN -> 0x7f, -0.0 -> 0x00)")
    sw = swizzle_scales(q.rowwise_scale_inv)
    print("swizzle round trip:", torch.equal(unswizzle_scales(sw), q.rowwise_scale_inv))
    d = dequantize_mxfp8(q)
    finite = torch.isfinite(x.float())
    rel = ((d - x.float())[finite].norm() / x.float()[finite].norm()).item()
    print(f"dequantized relative error {rel:.4f} (E4M3: ~2^-5)")

    w = torch.randn(256, 160, dtype=torch.bfloat16) * 0.05
    wq, ws = quantize_rows(w)                  # the learner's bytes: fp8 [N, K] + E8M0 [N, K/32]
    a = torch.randn(4, 160, dtype=torch.bfloat16)
    y_grid = mxfp8_linear_reference(a, wq, ws)
    y_bf16 = a @ w.t()
    print(f"Linear on the grid vs BF16: max |diff| {(y_grid.float() - y_bf16.float()).abs().max().item():.4f}")
    print("OK")


if __name__ == "__main__":
    main()

"""One rank of the TP=2 test (tests/sglang_engine/test_sglang_layers.py spawns two of these).

    python sgl_tp_worker.py RANK WORLD PORT

Builds SGLang's real Qwen3 and Qwen3-MoE models at TP=WORLD over gloo with the plugin,
loads them from the learner's BF16 state dict and from its wire export, and checks every
on-grid module (bytes = this rank's slice of the wire tensors; forward = the grid
reference on those bytes, exactly), then one all-reduced row-parallel output.  Prints
``RESULT <json>`` on success; any failure raises (non-zero exit, message on stderr).
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import sgl_helpers as H  # noqa: E402


def main(rank: int, world: int, port: int) -> None:
    H.init_dist(rank, world, port)
    from mxfp8_learner_grid.common import mxfp8_linear_reference
    from mxfp8_learner_grid.sglang_plugin.config import LearnerGridConfig
    from mxfp8_learner_grid.sglang_plugin.register import register
    register()
    counts = {}
    for moe in (False, True):
        hf, wire, bf16 = H.learner_and_wire(moe)
        for kind, src in (("bf16", bf16), ("wire", wire)):
            model = H.build_sglang_model(hf.config, LearnerGridConfig())
            H.load(model, src.items())
            counts[f"{'moe' if moe else 'dense'}-{kind}"] = (H.check_bytes(model, wire, rank, world),
                                                             H.check_forward(model, wire, rank, world))
        # the all-reduced output of a row-parallel layer: the sum of the ranks' partials
        o_proj = model.model.layers[0].self_attn.o_proj
        k = o_proj.input_size
        x = torch.randn(3, k, generator=torch.Generator().manual_seed(5)).to(H.DTYPE)
        partials = []
        for r in range(world):
            p = H.expected_params(wire, "model.layers.0.self_attn.o_proj", r, world)
            partials.append(mxfp8_linear_reference(H._cols(x, r, world), p["weight"], p["weight_scale_inv"]))
        # SGLang builds o_proj with reduce_results=False (the decoder layer reduces): do its all-reduce
        from sglang.srt.distributed import tensor_model_parallel_all_reduce
        got = tensor_model_parallel_all_reduce(o_proj(H._cols(x, rank, world).contiguous())[0])
        want = partials[0]
        for part in partials[1:]:
            want = want + part
        assert torch.equal(got, want), (f"all-reduced o_proj differs from the sum of the ranks' grid partials "
                                        f"(max {float((got.float() - want.float()).abs().max())})")
    print("RESULT " + json.dumps({"rank": rank, "counts": counts}), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))

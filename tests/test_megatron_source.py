"""Megatron-Core / TE tensor-parallel shards (common/sync/megatron.py): two gloo TP ranks hold a
tiny Qwen3 (dense and MoE) split the way Megatron splits it -- written here from the HF weights,
independently of the gathering code -- and the source hands back the HF state dict: the same
tensors (bf16 format), or, from TE MXFP8 shards, the bytes and scales of the whole tensors
quantized at once (a column split moves whole 1x32 blocks)."""

import os
import socket

import pytest
import torch

from megatron_layout import megatron_shards
from mxfp8_learner_grid.common import quantize_rows
from mxfp8_learner_grid.common.sync.megatron import MegatronTPSource, tp_rule
from mxfp8_learner_grid.common.sync.recorder import UpdateRejected

CFG = {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "hidden_size": 64,
       "intermediate_size": 128, "moe_intermediate_size": 64, "vocab_size": 100, "num_hidden_layers": 2,
       "num_experts": 4}
PADDED_VOCAB = 128                       # Megatron pads the vocabulary (make_vocab_size_divisible_by * tp)


def hf_state(moe: bool, seed=0):
    g = torch.Generator().manual_seed(seed)
    h, nh, nkv, hd = CFG["hidden_size"], CFG["num_attention_heads"], CFG["num_key_value_heads"], CFG["head_dim"]

    def r(*shape):
        return (torch.randn(*shape, generator=g) * 0.1).to(torch.bfloat16)
    sd = {"model.embed_tokens.weight": r(CFG["vocab_size"], h), "lm_head.weight": r(CFG["vocab_size"], h),
          "model.norm.weight": r(h)}
    for i in range(CFG["num_hidden_layers"]):
        p = f"model.layers.{i}"
        sd.update({f"{p}.self_attn.q_proj.weight": r(nh * hd, h), f"{p}.self_attn.k_proj.weight": r(nkv * hd, h),
                   f"{p}.self_attn.v_proj.weight": r(nkv * hd, h), f"{p}.self_attn.o_proj.weight": r(h, nh * hd),
                   f"{p}.self_attn.q_norm.weight": r(hd), f"{p}.self_attn.k_norm.weight": r(hd),
                   f"{p}.input_layernorm.weight": r(h), f"{p}.post_attention_layernorm.weight": r(h)})
        if moe:
            sd[f"{p}.mlp.gate.weight"] = r(CFG["num_experts"], h)
            for e in range(CFG["num_experts"]):
                i2 = CFG["moe_intermediate_size"]
                sd.update({f"{p}.mlp.experts.{e}.gate_proj.weight": r(i2, h),
                           f"{p}.mlp.experts.{e}.up_proj.weight": r(i2, h),
                           f"{p}.mlp.experts.{e}.down_proj.weight": r(h, i2)})
        else:
            i1 = CFG["intermediate_size"]
            sd.update({f"{p}.mlp.gate_proj.weight": r(i1, h), f"{p}.mlp.up_proj.weight": r(i1, h),
                       f"{p}.mlp.down_proj.weight": r(h, i1)})
    return sd


def expected(sd, mxfp8):
    if not mxfp8:
        return dict(sd)
    out = {}
    for n, t in sd.items():
        if n.endswith("_proj.weight"):
            q, s = quantize_rows(t)
            out[n], out[n[: -len(".weight")] + ".weight_scale_inv"] = q, s
        else:
            out[n] = t
    return out


def same(a, b):
    if a.dtype == torch.float8_e4m3fn:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def flat(src, bucket_bytes):
    out, n = {}, 0
    for b in src.buckets(bucket_bytes):
        n += 1
        for name, t in b:
            assert name not in out
            out[name] = t.clone()
    return out, n


def test_tp_rules():
    assert tp_rule("module.decoder.layers.3.self_attention.linear_qkv.weight") == "rows"
    assert tp_rule("decoder.layers.3.mlp.linear_fc1.weight") == "gated"
    assert tp_rule("decoder.layers.3.mlp.experts.linear_fc2.weight7") == "cols"
    assert tp_rule("decoder.layers.3.mlp.experts.local_experts.7.linear_fc1.weight") == "gated"
    assert tp_rule("decoder.layers.3.mlp.experts.linear_fc2.weight7", expert_tensor_parallel=False) is None
    assert tp_rule("output_layer.weight") == "vocab" and tp_rule("decoder.layers.0.mlp.router.weight") is None


@pytest.mark.parametrize("mxfp8", [False, True])
def test_one_rank_gives_the_hf_state(mxfp8):
    """TP = 1 (no process group): the renames, the row splits, the vocabulary cut, the wire pairs."""
    sd = hf_state(moe=True)
    src = MegatronTPSource(megatron_shards(sd, CFG, True, 0, 1, mxfp8, PADDED_VOCAB), CFG)
    want = expected(sd, mxfp8)
    got, _ = flat(src, 1 << 20)
    assert got.keys() == want.keys() and all(same(got[n], want[n]) for n in want)
    assert {n: (s, d) for n, s, d in src.metadata()} == {n: (tuple(t.shape), t.dtype) for n, t in want.items()}


def test_an_unknown_parameter_or_a_wrong_layout_is_refused_by_name():
    with pytest.raises(UpdateRejected, match="decoder.layers.0.mystery.weight"):
        MegatronTPSource({"decoder.layers.0.mystery.weight": torch.ones(2)}, CFG)
    with pytest.raises(UpdateRejected, match=r"linear_qkv.weight: local shape \(100, 64\) on 1 TP ranks does not fit"):
        MegatronTPSource({"decoder.layers.0.self_attention.linear_qkv.weight": torch.ones(100, 64)}, CFG)
    with pytest.raises(UpdateRejected, match="linear_fc1.weight: a gated fc1 shard needs an even number of rows"):
        MegatronTPSource({"decoder.layers.0.mlp.linear_fc1.weight": torch.ones(7, 64)}, CFG)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank, world, port, out_dir, moe, mxfp8):
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        src = MegatronTPSource(megatron_shards(hf_state(moe, seed=5), CFG, moe, rank, world, mxfp8, PADDED_VOCAB), CFG)
        if rank == 0:
            got, n = flat(src, 16 << 10)
            looked = dict(src.lookup(["model.layers.1.self_attn.k_proj.weight"]))
            src.close()
            torch.save({"got": got, "buckets": n, "looked": looked, "meta": src.metadata()},
                       os.path.join(out_dir, "rank0.pt"))
        else:
            torch.save({"followed": src.follow()}, os.path.join(out_dir, "rank1.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("moe,mxfp8", [(False, False), (False, True), (True, True)])
def test_two_tp_ranks_are_gathered_into_the_hf_state(tmp_path, moe, mxfp8):
    import torch.multiprocessing as mp
    mp.spawn(_rank, args=(2, _free_port(), str(tmp_path), moe, mxfp8), nprocs=2, join=True)
    r0, r1 = torch.load(tmp_path / "rank0.pt"), torch.load(tmp_path / "rank1.pt")
    want = expected(hf_state(moe, seed=5), mxfp8)
    got = r0["got"]
    assert got.keys() == want.keys()
    assert [n for n in want if not same(got[n], want[n])] == []
    assert {n: (s, d) for n, s, d in r0["meta"]} == {n: (tuple(t.shape), t.dtype) for n, t in want.items()}
    assert same(r0["looked"]["model.layers.1.self_attn.k_proj.weight"], want["model.layers.1.self_attn.k_proj.weight"])
    assert r1["followed"] == r0["buckets"] + 1 and r0["buckets"] >= 3     # one gather per bucket, followed

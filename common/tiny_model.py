"""Tiny seeded Qwen3 / Qwen3-MoE checkpoints, generated on the spot (no hub, no network).

Used by the tests, the README's demo and the examples.  Every linear dimension is a
multiple of 32, also after a 2-way tensor-parallel split.  A byte-level BPE tokenizer is
trained on a fixed text, so the checkpoints load in vLLM and SGLang like any Hugging Face
model directory.  Needs ``transformers`` and ``tokenizers`` (both come with the engines).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

CORPUS = """
def quantize(x, block=32):
    amax = max(abs(v) for v in x)
    scale = 2 ** math.ceil(math.log2(amax / 448))
    return [round(v / scale) for v in x], scale

class Linear:
    def __init__(self, weight, bias=None):
        self.weight = weight
        self.bias = bias

    def forward(self, x):
        return x @ self.weight.T + (self.bias if self.bias is not None else 0)

for step in range(10):
    loss = model(batch).mean()
    loss.backward()
    optimizer.step()
    print("step", step, "loss", float(loss))
The sampler and the learner compute on the same grid of numbers.
"""

DENSE = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32)
MOE = dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2,
           norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])


def make_tokenizer(path: Path, vocab_size: int = 384):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([CORPUS] * 4, trainer)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
        "bos_token": None, "pad_token": "<|endoftext|>", "model_max_length": 2048}))
    return tok.get_vocab_size()


def build_model(moe: bool = False, seed: int = 0, std: float = 0.08, vocab_size: int = 384, **overrides):
    """A transformers Qwen3(-MoE) model with seeded random bf16 weights (std chosen so that
    the next-token distribution is peaked enough for greedy decoding to be stable).
    ``overrides``: config fields to change (e.g. ``head_dim``)."""
    import transformers
    cfg_cls = transformers.Qwen3MoeConfig if moe else transformers.Qwen3Config
    model_cls = transformers.Qwen3MoeForCausalLM if moe else transformers.Qwen3ForCausalLM
    cfg = cfg_cls(vocab_size=vocab_size, max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=10000.0,
                  tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=0,
                  torch_dtype="bfloat16", **{**(MOE if moe else DENSE), **overrides})
    torch.manual_seed(seed)
    model = model_cls(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    return model.to(torch.bfloat16).eval()


def save_model(path: os.PathLike, moe: bool = False, seed: int = 0, **overrides) -> Path:
    """Write a BF16 HF checkpoint (config, safetensors, tokenizer) to ``path``; returns it.
    ``overrides``: config fields to change (``build_model``)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    vocab = make_tokenizer(path)
    model = build_model(moe=moe, seed=seed, vocab_size=vocab, **overrides)
    model.save_pretrained(path, safe_serialization=True)
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 0}))
    return path

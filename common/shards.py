"""Writing a checkpoint directory: safetensors shards (with their index) and ``config.json``.

:class:`ShardWriter` collects tensors into ``model-NNNNN.safetensors`` files of at most about
``MAX_SHARD_BYTES`` each and writes ``model.safetensors.index.json`` (or, for one shard, names it
``model.safetensors``); :func:`write_config` writes the HF config with the wire format's
``quantization_config`` and copies the tokenizer and generation files (``AUX_FILES``).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Optional

import torch

from .selection import ModuleSelection
from .wire import quantization_config

AUX_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json",
             "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja")
MAX_SHARD_BYTES = 4 << 30


class ShardWriter:
    """Tensors -> safetensors shards under ``dst``; :meth:`close` writes the last shard and the index."""

    def __init__(self, dst: Path, max_bytes: Optional[int] = None):
        self.dst, self.buf, self.size, self.n, self.index = Path(dst), {}, 0, 0, {}
        self.max_bytes = max_bytes

    def add(self, name: str, t: torch.Tensor) -> None:
        self.buf[name] = t.contiguous()
        self.size += t.numel() * t.element_size()
        if self.size >= (self.max_bytes if self.max_bytes is not None else MAX_SHARD_BYTES):
            self.flush()

    def flush(self) -> None:
        from safetensors.torch import save_file
        if not self.buf:
            return
        self.n += 1
        fname = f"model-{self.n:05d}.safetensors"
        save_file(self.buf, str(self.dst / fname), metadata={"format": "pt"})
        for k in self.buf:
            self.index[k] = fname
        self.buf, self.size = {}, 0

    def close(self) -> None:
        self.flush()
        if self.n == 1:
            os.replace(self.dst / "model-00001.safetensors", self.dst / "model.safetensors")
        else:
            total = sum((self.dst / f).stat().st_size for f in set(self.index.values()))
            (self.dst / "model.safetensors.index.json").write_text(
                json.dumps({"metadata": {"total_size": total}, "weight_map": self.index}, indent=1))


def write_config(src_cfg_dir: os.PathLike, dst: os.PathLike, selection: ModuleSelection, **extra) -> None:
    """``dst/config.json``: the HF config of ``src_cfg_dir`` with the wire format's ``quantization_config``
    (``extra`` goes into it); the tokenizer / generation files are copied alongside."""
    src_cfg_dir, dst = Path(src_cfg_dir), Path(dst)
    cfg = json.loads((src_cfg_dir / "config.json").read_text())
    cfg["quantization_config"] = quantization_config(selection, **extra)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    for f in AUX_FILES:
        if (src_cfg_dir / f).exists():
            shutil.copy(src_cfg_dir / f, dst / f)

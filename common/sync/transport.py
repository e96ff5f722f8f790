"""Moving update buckets from a trainer to an engine rank.

A *source* is a small JSON-able dict the engine's RPC can carry (strings only, so that the
same call works in-process and over HTTP); the bytes travel beside it:

* ``{"kind": "safetensors", "path": ...}`` -- a file; under ``/dev/shm`` that is shared memory
  (the CPU path, and any host-local trainer).
* ``{"kind": "cuda_ipc", "tensors": {name: handle}}`` -- colocated on one GPU: the engine
  maps the trainer's CUDA buffers (``torch.multiprocessing`` IPC handles), no copy.

``read_source`` returns {name: tensor} on the engine side.
"""

from __future__ import annotations

import base64
import json
import os
import pickle
import tempfile
from typing import Iterable, Iterator

import torch


def buckets(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group tensors into buckets of about ``bucket_bytes`` (a tensor larger than that travels alone)."""
    cur, size = [], 0
    for name, t in named:
        n = t.numel() * t.element_size()
        if cur and size + n > bucket_bytes:
            yield cur
            cur, size = [], 0
        cur.append((name, t))
        size += n
    if cur:
        yield cur


def staging_dir() -> str:
    d = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
    return d


def write_safetensors_bucket(bucket: list[tuple[str, torch.Tensor]], directory: str | None = None) -> dict:
    from safetensors.torch import save_file
    fd, path = tempfile.mkstemp(prefix="mxfp8-grid-bucket-", suffix=".safetensors", dir=directory or staging_dir())
    os.close(fd)
    save_file({n: t.detach().contiguous().cpu() for n, t in bucket}, path)
    return {"kind": "safetensors", "path": path}


def cuda_ipc_source(bucket: list[tuple[str, torch.Tensor]]) -> dict:
    from torch.multiprocessing.reductions import reduce_tensor
    handles = {n: base64.b64encode(pickle.dumps(reduce_tensor(t.detach().contiguous()))).decode() for n, t in bucket}
    return {"kind": "cuda_ipc", "tensors": handles}


def read_source(source: dict | str, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    if isinstance(source, str):
        source = json.loads(source)
    kind = source.get("kind")
    if kind == "safetensors":
        from safetensors.torch import load_file
        return load_file(source["path"], device=str(device))
    if kind == "cuda_ipc":
        out = {}
        for name, h in source["tensors"].items():
            fn, args = pickle.loads(base64.b64decode(h))
            out[name] = fn(*args)
        return out
    raise ValueError(f"unknown update source kind {kind!r}")

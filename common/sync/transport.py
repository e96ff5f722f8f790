"""Moving update buckets from a trainer to an engine rank.

A *source* is a small JSON-able dict the engine's RPC can carry (strings only, so that the
same call works in-process and over HTTP); the bytes travel beside it:

* ``{"kind": "safetensors", "path": ...}`` -- a file; under ``/dev/shm`` that is shared memory
  (the CPU path, and any host-local trainer).
* ``{"kind": "cuda_ipc", "tensors": {name: handle}}`` -- colocated on one GPU: the engine
  maps the trainer's CUDA buffers (``torch.multiprocessing`` IPC handles), no copy.
* ``{"kind": "nccl", "tensors": [[name, dtype, shape], ...]}`` -- the trainer on another GPU
  broadcasts the tensors, in this order, over an NCCL group it formed with the engine's
  workers (rank 0 = the trainer); each worker receives into fresh buffers.  The engine
  supplies the group (``read_source(..., nccl=group)``): anything with vLLM's
  ``PyNcclCommunicator.broadcast(tensor, src, stream)``.

``read_source`` returns {name: tensor} on the engine side; :class:`Stager` is the trainer side
(stage, send, release) for a transport.
"""

from __future__ import annotations

import base64
import json
import os
import pickle
import tempfile
import threading
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


def nccl_source(bucket: list[tuple[str, torch.Tensor]]) -> dict:
    return {"kind": "nccl", "tensors": [[n, str(t.dtype).removeprefix("torch."), list(t.shape)] for n, t in bucket]}


def nccl_send(group, bucket: list[tuple[str, torch.Tensor]]) -> None:
    """Trainer side of an ``nccl`` source: broadcast the bucket from rank 0, in order."""
    stream = torch.cuda.current_stream() if torch.cuda.is_available() else None
    for _, t in bucket:
        group.broadcast(t.detach().contiguous(), src=0, stream=stream)


def _nccl_receive(source: dict, device, group) -> dict[str, torch.Tensor]:
    if group is None:
        raise RuntimeError("an nccl bucket arrived but this worker has no NCCL group with the trainer "
                           "(call the client's init_nccl first)")
    out = {}
    stream = torch.cuda.current_stream(device) if torch.device(device).type == "cuda" else None
    for name, dtype, shape in source["tensors"]:
        dt = getattr(torch, str(dtype), None)
        if not isinstance(dt, torch.dtype):
            raise ValueError(f"{name}: unknown dtype {dtype!r} in an nccl bucket")
        t = torch.empty([int(x) for x in shape], dtype=dt, device=device)
        group.broadcast(t, src=0, stream=stream)
        out[name] = t
    return out


def read_source(source: dict | str, device: torch.device | str = "cpu", nccl=None) -> dict[str, torch.Tensor]:
    if isinstance(source, str):
        source = json.loads(source)
    kind = source.get("kind")
    if kind == "nccl":
        return _nccl_receive(source, device, nccl)
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


def run_beside(fn, *args):
    """Start ``fn(*args)`` in a thread; the returned ``join()`` waits and re-raises its exception.

    A push transport (NCCL) must send while the engine's blocking load RPC is receiving."""
    box: dict = {}

    def target():
        try:
            box["result"] = fn(*args)
        except BaseException as exc:          # noqa: BLE001 -- re-raised in join
            box["error"] = exc

    th = threading.Thread(target=target, daemon=True)
    th.start()

    def join():
        th.join()
        if "error" in box:
            raise box["error"]
        return box.get("result")
    return join


class Stager:
    """The trainer side of the bucket sources above, for a transport to mix in: ``stage`` a bucket
    (``"shm"``: a safetensors file in shared memory; ``"cuda_ipc"``: IPC handles, the trainer's
    buffers kept alive until ``release``; ``"nccl"``: a description, the bytes pushed by ``send``
    over ``self.nccl``, the group the transport formed), ``release`` it after the load."""

    STAGINGS = ("shm", "cuda_ipc", "nccl")

    def __init__(self, staging: str):
        if staging not in self.STAGINGS:
            raise ValueError(f"staging must be one of {self.STAGINGS}; got {staging!r}")
        self.staging = staging
        self._keep = []
        self.nccl = None

    def stage(self, bucket) -> dict:
        if self.staging == "nccl":
            if self.nccl is None:
                raise RuntimeError("staging='nccl' needs init_nccl() first (connect(..., nccl={...}) does it)")
            return nccl_source(bucket)
        if self.staging == "cuda_ipc":
            self._keep = [t for _, t in bucket]       # the trainer's buffers must outlive the load
            return cuda_ipc_source(bucket)
        return write_safetensors_bucket(bucket)

    def send(self, bucket, source) -> None:
        """Push the bytes of a staged bucket while the engine's load call is running (nccl only)."""
        if source.get("kind") == "nccl":
            nccl_send(self.nccl, bucket)

    def release(self, source) -> None:
        if source.get("kind") == "safetensors":
            try:
                os.unlink(source["path"])
            except FileNotFoundError:
                pass
        self._keep = []

"""Fingerprints of tensor bytes that both sides of a weight sync compute independently.

``fingerprint(t)`` is a 64-bit position-weighted sum of the tensor's bytes (row-major
order of its logical elements, read as little-endian 64-bit words, zero-padded):
``len + sum_i w_i * m_i  mod 2^64`` with ``m_i`` an odd 64-bit mix of the word position ``i``.  Integer addition and multiplication modulo 2^64 are
exact and associative, so any device and any reduction order give the same value -- a GPU
computes it in one pass over the weights (no host copy), a CPU learner over its own tensor.
Any single changed byte changes it (m_i is odd); swapped bytes, shifted rows, wrong
offsets or a different layout change it with probability ~1 - 2^-64.  It is an integrity
check against accidents, not a cryptographic hash.  (A ``sampled`` digest samples whole
write regions, seeded -- ``UpdateSession``'s ``digest=`` -- and fingerprints each in full.)
"""

from __future__ import annotations

from typing import Union

import torch

from ..packed_codes import plain

Flag = Union[bool, torch.Tensor]      # a decided answer, or a 0-dim bool tensor not yet read


def read_flags(flags: list[Flag]) -> list[bool]:
    """Resolve checks queued on devices: one ``stack(...).tolist()`` (one synchronization) per device.
    The derived-state check, ``engine_as_found`` and the write recorder's content checks use it."""
    out: list[bool] = [f if isinstance(f, bool) else False for f in flags]
    by_device: dict[torch.device, list[int]] = {}
    for i, f in enumerate(flags):
        if not isinstance(f, bool):
            by_device.setdefault(f.device, []).append(i)
    for idx in by_device.values():
        for i, v in zip(idx, torch.stack([flags[i] for i in idx]).tolist()):
            out[i] = bool(v)
    return out

_MUL = -7046029254386353131          # 0x9E3779B97F4A7C15 as int64
_MUL2 = -4658895280553007687         # 0xBF58476D1CE4E5B9 as int64


def _mix(idx: torch.Tensor, seed: int) -> torch.Tensor:
    z = idx * _MUL + seed
    z = (z ^ (z >> 31)) * _MUL2
    z = z ^ (z >> 29)
    return z | 1


def fingerprint(t: torch.Tensor, seed: int = 0, chunk: int = 1 << 24) -> int:
    """64-bit fingerprint of ``t``'s bytes in logical (row-major) order; any dtype, any device."""
    flat = plain(t.detach()).contiguous().reshape(-1).view(torch.uint8)
    n = flat.numel()
    if n % 8:
        flat = torch.cat([flat, flat.new_zeros(8 - n % 8)])
    words = flat.view(torch.int64)
    total = torch.full((), n, dtype=torch.int64, device=flat.device)
    for start in range(0, words.numel(), chunk):
        w = words[start:start + chunk]
        idx = torch.arange(start, start + w.numel(), dtype=torch.int64, device=flat.device)
        total = total + (w * _mix(idx, seed)).sum()
    return int(total.item()) & 0xFFFFFFFFFFFFFFFF


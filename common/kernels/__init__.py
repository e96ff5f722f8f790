"""GPU kernels for the grid (Triton).  Imported lazily: the package works without Triton or CUDA.

Each kernel computes exactly the rules of ``common/format.py``; its tests compare bytes
with the torch reference (``common/quantize.py``) on the GPU, and, where Triton's
interpreter can run it (``TRITON_INTERPRET=1``), on the CPU.
"""

from __future__ import annotations

import functools
import os

import torch


@functools.lru_cache(maxsize=None)
def _have_triton() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:
        return False
    return True


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_available(x: torch.Tensor) -> bool:
    """Can a Triton kernel run on this tensor? (CUDA tensor, or the interpreter on CPU)."""
    if not _have_triton():
        return False
    return x.is_cuda or interpreting()

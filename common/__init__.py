"""mxfp8_learner_grid.common: the learner's MXFP8 grid (Transformer Engine's bytes), engine-free.

Knows nothing of vLLM or SGLang.  Public API::

    from mxfp8_learner_grid.common import quantize_mxfp8, swizzle_scales, dequantize_mxfp8
    q = quantize_mxfp8(x, rowwise=True, columnwise=False)
    q.rowwise_data, q.rowwise_scale_inv, q.columnwise_data, q.columnwise_scale_inv
"""

from . import format
from .grid_weight import GridWeight
from .layout import pad_scales, strip_padding, swizzle_scales, unswizzle_scales
from .linear import check_weight, dequantize_weight, mxfp8_linear_reference
from .quantize import MXFP8Quantizer, quantize_mxfp8, quantize_rows
from .selection import ModuleSelection
from .tensor import MXFP8Tensor, dequantize_blocks, dequantize_mxfp8

__all__ = [
    "format", "MXFP8Tensor", "MXFP8Quantizer", "ModuleSelection",
    "quantize_mxfp8", "quantize_rows", "dequantize_mxfp8", "dequantize_blocks",
    "swizzle_scales", "unswizzle_scales", "pad_scales", "strip_padding",
    "mxfp8_linear_reference", "dequantize_weight", "check_weight", "GridWeight",
]

"""Weight-only quantized products: GGUF blocks kept packed and dequantized inside the product
(docs/decisions.md items 125-127).

`gguf_blocks.repack` turns a GGUF tensor's raw blocks into `BlockWeights` (integer values with
per-group float scales and offsets); `block_matmul.block_linear` computes x W^T + b from them on
every backend.
"""

from attnkit.kernels.quantized.block_matmul import block_linear, dequantize
from attnkit.kernels.quantized.gguf_blocks import PACKED_TYPES, BlockWeights, repack

__all__ = ["BlockWeights", "PACKED_TYPES", "block_linear", "dequantize", "repack"]

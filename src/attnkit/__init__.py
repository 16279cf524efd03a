"""attnkit: attention and the Transformer from first principles, as Keras 3 layers.

Runs on PyTorch (default), JAX and TensorFlow. Masks: True = may attend (see `attnkit.ops.masks`).
"""

from attnkit import _backend  # noqa: F401  (must run before Keras is imported)
from attnkit.layers import AdditiveAttention, DotProductAttention, MultiHeadAttention
from attnkit.ops import (
    MaskDtypeError,
    causal_mask,
    combine_masks,
    from_hide_mask,
    from_key_padding_mask,
    fused_attention,
    padding_mask,
    scaled_dot_product_attention,
)

__version__ = "0.1.0"

__all__ = [
    "AdditiveAttention",
    "DotProductAttention",
    "MaskDtypeError",
    "MultiHeadAttention",
    "causal_mask",
    "combine_masks",
    "from_hide_mask",
    "from_key_padding_mask",
    "fused_attention",
    "padding_mask",
    "scaled_dot_product_attention",
]

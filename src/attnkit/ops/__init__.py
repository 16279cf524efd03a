"""Pure attention functions and masks on `keras.ops`."""

from attnkit.ops.attention import (
    fused_attention,
    masked_softmax,
    max_scores_bytes,
    scaled_dot_product_attention,
    set_max_scores_bytes,
)
from attnkit.ops.linear import linear
from attnkit.ops.masks import (
    MaskDtypeError,
    broadcast_mask,
    causal_mask,
    combine_masks,
    from_hide_mask,
    from_key_padding_mask,
    padding_mask,
)

__all__ = [
    "MaskDtypeError",
    "broadcast_mask",
    "causal_mask",
    "combine_masks",
    "from_hide_mask",
    "from_key_padding_mask",
    "fused_attention",
    "linear",
    "masked_softmax",
    "max_scores_bytes",
    "padding_mask",
    "scaled_dot_product_attention",
    "set_max_scores_bytes",
]

"""Keras layers, one public class per file."""

from attnkit.layers.additive_attention import AdditiveAttention
from attnkit.layers.dot_product_attention import DotProductAttention
from attnkit.layers.multi_head_attention import MultiHeadAttention

__all__ = ["AdditiveAttention", "DotProductAttention", "MultiHeadAttention"]

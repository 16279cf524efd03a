"""`DotProductAttention`: scaled dot-product attention as a layer (seed 000; paper section 3.2.1).

Legend: `...` leading dims (batch, heads), T_q/T_k query/key lengths, d_k/d_v widths.
"""

import math

import keras
from keras import ops

from attnkit._validation import positive_int, rate
from attnkit.layers._call_checks import CheckedCall
from attnkit.layers._keras_mask import keras_mask_of
from attnkit.ops.attention import fused_attention, scaled_dot_product_attention
from attnkit.ops.masks import broadcast_mask, combine_masks


@keras.saving.register_keras_serializable(package="attnkit")
class DotProductAttention(CheckedCall, keras.layers.Layer):
    """softmax(Q K^T / sqrt(d_k)) V, with no weights of its own.

    Args:
        dropout: dropout rate on the attention weights, in [0, 1). Default 0.
        seed: optional int seed for the dropout.
        **kwargs: base `keras.layers.Layer` arguments (name, dtype, ...).

    Call arguments:
        queries: (..., T_q, d_k).
        keys: (..., T_k, d_k).
        values: (..., T_k, d_v).
        d_k: the width used for the 1/sqrt(d_k) scale, as in seed 000; default `queries.shape[-1]`.
        mask: optional keep-mask, True = may attend, broadcastable to (..., T_q, T_k). A Keras mask
            on the keys or values (from `Embedding(mask_zero=True)`, (B, T_k)) is honoured as key
            padding, combined with `mask`.
        causal: also apply the bottom-right look-ahead mask. Default False.
        return_attention_weights: also return the weights. Default False.
        training: whether dropout is active.

    Returns:
        output (..., T_q, d_v), and weights (..., T_q, T_k) when `return_attention_weights`.

    Example:
    >>> q = keras.random.normal((64, 8, 5, 64))
    >>> DotProductAttention()(q, q, q, 64).shape  # (64, 8, 5, 64)
    """

    _call_checks = dict(
        floats=("queries", "keys", "values"), masks=("mask",), flags=("causal", "return_attention_weights"), ints=("d_k",)
    )
    _non_tensor_positionals = True  # the seeds call `attention(queries, keys, values, d_k)`, d_k an int

    def __init__(self, *, dropout=0.0, seed=None, **kwargs):
        super().__init__(**kwargs)
        self.dropout = rate("dropout", dropout)
        self.seed = seed
        self.seed_generator = keras.random.SeedGenerator(seed) if self.dropout > 0 else None
        self.supports_masking = True
        self.built = True

    def call(
        self, queries, keys, values, d_k=None, mask=None, *, causal=False,
        return_attention_weights=False, training=None, queries_mask=None, keys_mask=None, values_mask=None,
    ):
        scale = None if d_k is None else 1.0 / math.sqrt(positive_int("d_k", d_k))
        key_padding = keys_mask if keys_mask is not None else values_mask  # filled by Keras, (B, T_k)
        if key_padding is not None:
            for _ in range(len(queries.shape) - 2):
                key_padding = ops.expand_dims(key_padding, 1)  # (B, 1, ..., 1, T_k)
            scores_shape = (*queries.shape[:-1], keys.shape[-2])
            mask = key_padding if mask is None else combine_masks(
                broadcast_mask(mask, scores_shape, query_length=ops.shape(queries)[-2]), key_padding
            )
        options = dict(
            causal=causal, scale=scale, dropout=self.dropout, training=bool(training), seed=self.seed_generator
        )
        if return_attention_weights:
            return scaled_dot_product_attention(queries, keys, values, mask, **options)
        return fused_attention(queries, keys, values, mask, **options)

    def compute_mask(self, inputs, previous_mask=None):
        return keras_mask_of(inputs)

    def compute_output_shape(self, queries_shape, keys_shape=None, values_shape=None):
        return tuple(queries_shape[:-1]) + (tuple(values_shape)[-1] if values_shape else queries_shape[-1],)

    def compute_output_spec(
        self, queries, keys, values, d_k=None, mask=None, *, return_attention_weights=False, **kwargs
    ):
        # Symbolic calls (functional models) must see the weights too when they are asked for.
        output = keras.KerasTensor((*queries.shape[:-1], values.shape[-1]), dtype=self.compute_dtype)
        if not return_attention_weights:
            return output
        return output, keras.KerasTensor((*queries.shape[:-1], keys.shape[-2]), dtype=self.compute_dtype)

    def get_config(self):
        return {**super().get_config(), "dropout": self.dropout, "seed": self.seed}

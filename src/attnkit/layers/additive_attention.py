"""`AdditiveAttention`: Bahdanau attention (Bahdanau, Cho & Bengio 2015; seed 003).

    score(q, k) = v^T tanh(W_q q + W_k k),   weights = softmax(score),   context = weights V

Legend: B batch, T_q query steps, T_k key/value length, d_q/d_k/d_v input widths, `units` the width of
the hidden scoring layer.
"""

import keras
from keras import ops

from attnkit._validation import positive_int
from attnkit.layers._call_checks import CheckedCall
from attnkit.layers._keras_mask import keras_mask_of
from attnkit.layers._shapes import check_positive_widths
from attnkit.layers._policies import SublayerPolicies
from attnkit import kernels
from attnkit.ops.attention import masked_softmax
from attnkit.ops.masks import shape_str, broadcast_mask, combine_masks
from attnkit.layers.linear import Linear


@keras.saving.register_keras_serializable(package="attnkit")
class AdditiveAttention(CheckedCall, SublayerPolicies, keras.layers.Layer):
    """Additive (Bahdanau) attention with learned W_q, W_k and v.

    Args:
        units: width of the hidden scoring layer.
        kernel_initializer: initializer of W_q, W_k and v. Default "glorot_uniform".
        **kwargs: base `keras.layers.Layer` arguments.

    Call arguments:
        query: (B, T_q, d_q), or (B, d_q) for a single step (e.g. a decoder state).
        key: (B, T_k, d_k); `d_k` may differ from `d_q`.
        value: (B, T_k, d_v).
        mask: optional keep-mask, True = may attend: (B, T_k), (T_k,), (B, T_q, T_k), ... Keras masks
            on `key` or `value` (from `Embedding(mask_zero=True)`) are honoured as key padding.

    Returns:
        (context, weights): context (B, T_q, d_v) and weights (B, T_q, T_k); for a 2-D query,
        context (B, d_v) and weights (B, 1, T_k), as in seed 003.

    Example:
    >>> layer = AdditiveAttention(32)
    >>> context, weights = layer(keras.random.normal((4, 50)), keys, values)  # (4, 70), (4, 1, 12)

    References:
        Bahdanau et al., "Neural Machine Translation by Jointly Learning to Align and Translate", 2015.
    """

    _call_checks = dict(floats=("query", "key", "value"), masks=("mask",))

    def __init__(self, units, *, kernel_initializer="glorot_uniform", **kwargs):
        super().__init__(**kwargs)
        self.units = positive_int("units", units)
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        dense = dict(use_bias=False, kernel_initializer=self.kernel_initializer, dtype=self.dtype_policy)
        self.W_q = Linear(self.units, name="W_q", **dense)
        self.W_k = Linear(self.units, name="W_k", **dense)
        self.v = Linear(1, name="v", **dense)
        self.supports_masking = True

    def build(self, query_shape, key_shape=None, value_shape=None):
        check_positive_widths({"query": query_shape, "key": key_shape, "value": value_shape})
        self.W_q.build(query_shape)
        self.W_k.build(key_shape or query_shape)
        self.v.build((None, self.units))

    def call(self, query, key, value, mask=None, key_mask=None, value_mask=None):
        single_step = len(query.shape) == 2
        if single_step:
            query = ops.expand_dims(query, 1)  # (B, d_q) -> (B, 1, d_q)
        self._check_inputs(query, key, value)
        q = ops.expand_dims(self.W_q(query), 2)  # (B, T_q, 1, units)
        k = ops.expand_dims(self.W_k(key), 1)  # (B, 1, T_k, units)
        scores = ops.squeeze(self.v(ops.tanh(q + k)), -1)  # (B, T_q, T_k)
        keep = None if mask is None else broadcast_mask(mask, tuple(scores.shape))
        key_padding = key_mask if key_mask is not None else value_mask
        if key_padding is not None:
            # Keras filled the keys' (B, T_k) padding mask (e.g. from `Embedding(mask_zero=True)`).
            keep = combine_masks(keep, ops.expand_dims(key_padding, 1))  # (B, T_q, T_k) or (B, 1, T_k)
        weights = masked_softmax(scores, keep)  # (B, T_q, T_k)
        context = kernels.matmul(weights, value)  # (B, T_q, d_v); float64 stays float64 on torch
        if single_step:
            context = ops.squeeze(context, 1)  # (B, d_v)
        return context, weights

    def _check_inputs(self, query, key, value):
        for name, x in (("query", query), ("key", key), ("value", value)):
            if len(x.shape) != 3:
                raise ValueError(
                    f"`{name}` must have rank 3 (rank 2 for a single query step). "
                    f"Received: {name}.shape={shape_str(x.shape)}"
                )
        batch = {x.shape[0] for x in (query, key, value) if x.shape[0] is not None}
        if len(batch) > 1:
            raise ValueError(
                "`query`, `key` and `value` must have the same batch size. Received shapes: "
                f"query={shape_str(query.shape)}, key={shape_str(key.shape)}, value={shape_str(value.shape)}"
            )
        if None not in (key.shape[1], value.shape[1]) and key.shape[1] != value.shape[1]:
            raise ValueError(
                "`key` and `value` must have the same length T_k. Received shapes: "
                f"key={shape_str(key.shape)}, value={shape_str(value.shape)}"
            )
        check_positive_widths({"query": query.shape, "key": key.shape, "value": value.shape})

    def compute_mask(self, inputs, previous_mask=None):
        return keras_mask_of(inputs) if len(inputs.shape) == 3 else None  # per query step

    def compute_output_shape(self, query_shape, key_shape=None, value_shape=None):
        value_shape = value_shape or key_shape or query_shape
        if len(query_shape) == 2:
            return (query_shape[0], value_shape[-1]), (query_shape[0], 1, value_shape[1])
        return (*query_shape[:2], value_shape[-1]), (*query_shape[:2], value_shape[1])

    def get_config(self):
        return {
            **super().get_config(),
            "units": self.units,
            "kernel_initializer": keras.initializers.serialize(self.kernel_initializer),
        }

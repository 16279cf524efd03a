"""`EncoderLayer`: one layer of the Transformer encoder (paper section 3.1; seed 002).

    post-LN (the paper, default):  x = LayerNorm(x + Dropout(MultiHead(x, x, x)))
                                   x = LayerNorm(x + Dropout(FFN(x)))
    pre-LN (norm_first=True):      x = x + Dropout(MultiHead(LN(x), LN(x), LN(x)))
                                   x = x + Dropout(FFN(LN(x)))

Each line is one `Residual` block around its sub-layer (docs/decisions.md item 45).

Legend: B batch, T sequence length, h heads, d_k/d_v per-head widths, d_model model width, d_ff inner
width of the feed-forward network.
"""

import keras
from keras import ops

from attnkit.layers._call_checks import CheckedCall
from attnkit.layers._keras_mask import keras_mask_of
from attnkit.layers._policies import SublayerPolicies
from attnkit.layers._shapes import check_model_width, weights_spec
from attnkit.layers._stack_config import LAYER_FIELDS, StackConfig
from attnkit.layers._sublayer import call_sublayer
from attnkit.layers.feed_forward import FeedForward
from attnkit.layers.multi_head_attention import MultiHeadAttention
from attnkit.layers.residual import AttentionSublayer, residual_block
from attnkit.ops.masks import as_bool_mask, broadcast_mask


def key_padding(x, padding_mask, name="padding_mask", queries=None):
    """The attention mask of a layer's mask argument, or of the Keras mask of `x`; or None.

    Every mask argument of the layers follows the one rule of `attnkit.ops.broadcast_mask`
    (docs/decisions.md items 1 and 18): (T_k,), (B, T_k), (T_q, T_k), (B, T_q, T_k) or
    (B, h, T_q, T_k), and a 2-D mask whose first size is both the batch size and the query length is
    refused as ambiguous. A Keras mask is known to be padding, (B, T_k), and is never ambiguous.

    Args:
        x: the keys (B, T_k, d_model).
        padding_mask: None or a keep-mask of one of the shapes above.
        name: the argument's name in the error messages.
        queries: the queries (B, T_q, d_model); default `x` (self-attention).

    Returns:
        None, a (B, 1, T_k) mask from the Keras mask, or `padding_mask` broadcastable to (B, h, T_q, T_k).
    """
    if padding_mask is None:
        padding_mask = keras_mask_of(x)
        if padding_mask is None:
            return None
        return ops.expand_dims(as_bool_mask(padding_mask, name), 1)  # (B, 1, T_k)
    queries = x if queries is None else queries
    scores_shape = (x.shape[0], None, queries.shape[1], x.shape[1])  # (B, h, T_q, T_k), any h
    return broadcast_mask(padding_mask, scores_shape, name, query_length=ops.shape(queries)[1])


@keras.saving.register_keras_serializable(package="attnkit")
class EncoderLayer(StackConfig, CheckedCall, SublayerPolicies, keras.layers.Layer):
    """Self-attention then a feed-forward network, each with dropout, a residual and a layer norm.

    Dropout is applied to each sub-layer's output before the residual addition (paper section
    5.4), only when `training` is true. The attention weights themselves get no dropout.

    Args:
        h: number of attention heads.
        d_k: per-head width of queries and keys (d_model / h in the paper).
        d_v: per-head width of values.
        d_model: width of the input and output.
        d_ff: inner width of the feed-forward network.
        rate: dropout rate in [0, 1).
        norm_first: False (default) for post-LN as in the paper; True for pre-LN, which trains more
            stably in deep stacks (then end the stack with a layer norm, as `Encoder` does).
        activation: "relu" (default), "gelu" (exact), "gelu_tanh" or "silu" in the feed-forward network.
        epsilon: layer norm epsilon. Default 1e-6.
        **kwargs: base `keras.layers.Layer` arguments (name, dtype, ...).

    Call arguments:
        x: (B, T, d_model).
        padding_mask: optional keep-mask, True (or nonzero) = may attend: (B, 1, T) for padding,
            or any shape `attnkit.ops.broadcast_mask` takes ((B, T), (T, T), (B, T, T), ...); a 2-D
            mask when B == T is ambiguous and refused. Default: the Keras mask carried by `x` (e.g.
            from `Embedding(mask_zero=True)`), if any.
        training: whether dropout is active.
        return_attention_weights: keyword-only; also return the attention weights. Default False.

    Returns:
        (B, T, d_model), and the weights (B, h, T, T) when `return_attention_weights`.

    Raises:
        ValueError: bad sizes or rate, an unknown activation; an input whose width is not d_model; a
            padding mask that does not broadcast, or an ambiguous 2-D one.
        TypeError: non-integer sizes, a non-floating `x`, a padding mask neither boolean nor integer,
            a non-bool `return_attention_weights`.

    Example:
    >>> layer = EncoderLayer(h=8, d_k=64, d_v=64, d_model=512, d_ff=2048, rate=0.1)
    >>> x = keras.random.normal((64, 5, 512))
    >>> out, weights = layer(x, return_attention_weights=True)  # (64, 5, 512), (64, 8, 5, 5)

    References:
        Vaswani et al., "Attention Is All You Need", 2017, sections 3.1 and 5.4; Xiong et al., "On
        Layer Normalization in the Transformer Architecture", 2020 (pre-LN).
    """

    _call_checks = dict(floats=("x",), masks=("padding_mask",), flags=("return_attention_weights",))
    _positional_training = True  # the seeds call `layer(x, padding_mask, training)`
    _config_fields = LAYER_FIELDS

    def __init__(
        self, h, d_k, d_v, d_model, d_ff, rate, *, norm_first=False, activation="relu", epsilon=1e-6, **kwargs
    ):
        super().__init__(**kwargs)
        self.set_sizes(
            h=h, d_k=d_k, d_v=d_v, d_model=d_model, d_ff=d_ff, rate=rate, norm_first=norm_first,
            activation=activation, epsilon=epsilon,
        )
        self.supports_masking = True
        policy = self.dtype_policy
        # `key_padding` decides which keys are hidden; the attention adds no Keras mask of its own.
        self.multihead_attention = MultiHeadAttention(
            h, d_k, d_v, d_model, join_keras_mask=False, name="multihead_attention", dtype=policy
        )
        self.attention_block = residual_block(self, "attention")
        self.feed_forward = FeedForward(d_ff, d_model, activation=activation, name="feed_forward", dtype=policy)
        self.feed_forward_block = residual_block(self, "feed_forward")

    @property
    def norms(self):
        """The two layer norms, of the attention and of the feed-forward sub-layer, in that order."""
        return self.attention_block.norm, self.feed_forward_block.norm

    def build(self, x_shape, padding_mask_shape=None):
        x_shape = tuple(x_shape)
        check_model_width("x", x_shape, self.d_model)
        self.multihead_attention.build(x_shape)
        self.attention_block.build(x_shape)
        self.feed_forward.build(x_shape)
        self.feed_forward_block.build(x_shape)

    def call(self, x, padding_mask=None, training=None, *, return_attention_weights=False):
        check_model_width("x", x.shape, self.d_model)
        mask = key_padding(x, padding_mask)  # (B, 1, T) or None
        attention = AttentionSublayer(self.multihead_attention, mask, training, return_attention_weights)
        x = call_sublayer(self.attention_block, x, sublayer=attention, training=training)  # (B, T, d_model)
        x = call_sublayer(self.feed_forward_block, x, sublayer=self._feed_forward, training=training)  # (B, T, d_model)
        return (x, attention.weights) if return_attention_weights else x

    def _feed_forward(self, x):
        return call_sublayer(self.feed_forward, x)  # (B, T, d_model)

    def compute_output_shape(self, x_shape, padding_mask_shape=None):
        return tuple(x_shape)

    def compute_output_spec(self, x, padding_mask=None, training=None, *, return_attention_weights=False, **kwargs):
        # Symbolic calls (functional models) must see the weights too when they are asked for.
        output = keras.KerasTensor(self.compute_output_shape(x.shape), dtype=self.compute_dtype)
        if not return_attention_weights:
            return output
        return output, weights_spec(self, x.shape[0], x.shape[1], x.shape[1])


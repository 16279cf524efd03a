"""`Residual`: the paper's residual connection around a sub-layer (Vaswani et al. 2017, section 5.4).

    norm-after (the paper, "post-LN"):  y = Norm(x + Dropout(Sublayer(x)))
    norm-first ("pre-LN", GPT-2, Llama): y = x + Dropout(Sublayer(Norm(x)))

One layer for both arrangements and any norm (LayerNorm, RMSNorm) and any sub-layer (attention,
feed-forward): the encoder, decoder, BERT and decoder-only layers all use it (docs/decisions.md
item 45).

Legend: B batch, T length, d_model width.
"""

import keras

from attnkit._validation import boolean, rate
from attnkit.layers._policies import SublayerPolicies
from attnkit.layers._sublayer import call_layer_norm, call_sublayer
from attnkit.ops.masks import shape_str


@keras.saving.register_keras_serializable(package="attnkit")
class Residual(SublayerPolicies, keras.layers.Layer):
    """A normalization around a sub-layer's residual connection, with dropout on the sub-layer's output.

    The sub-layer is passed to `call` as a callable (the parent owns and tracks it), so one Residual
    wraps attention with its masks and cache as easily as a feed-forward network.

    Args:
        norm: the normalization layer (e.g. `keras.layers.LayerNormalization` or `RMSNorm`).
        norm_first: True for x + Sublayer(Norm(x)), False (default, the paper) for Norm(x + Sublayer(x)).
        dropout: rate of the dropout on the sub-layer's output, in [0, 1). Default 0.
        seed: optional int seed for the dropout.
        **kwargs: base `keras.layers.Layer` arguments (name, dtype, ...).

    Call arguments:
        x: (B, T, d_model), the sub-layer's input.
        sublayer: a callable of one tensor (B, T, d_model) -> (B, T, d_model), passed by keyword
            (Keras takes only tensors positionally).
        training: whether dropout is active.

    Returns:
        (B, T, d_model).

    Raises:
        ValueError: a bad dropout rate; a sub-layer output of another shape than x.
        TypeError: `sublayer` not callable.

    Example:
    >>> ffn = FeedForward(d_ff=64, d_model=16)
    >>> Residual(RMSNorm(), norm_first=True)(keras.random.normal((2, 5, 16)), sublayer=ffn).shape  # (2, 5, 16)
    """

    def __init__(self, norm, *, norm_first=False, dropout=0.0, seed=None, **kwargs):
        super().__init__(**kwargs)
        if not isinstance(norm, keras.layers.Layer):
            raise TypeError(f"`norm` must be a Keras layer. Received: norm of type {type(norm).__name__}")
        self.norm = norm
        self.norm_first = bool(boolean("norm_first", norm_first))
        self.dropout_rate = rate("dropout", dropout)
        self.seed = seed
        self.dropout = keras.layers.Dropout(self.dropout_rate, seed=seed, dtype=self.dtype_policy)
        self.supports_masking = True

    def build(self, x_shape):
        if not self.norm.built:  # a norm deserialized from a config comes built (its build_config)
            self.norm.build(x_shape)

    def call(self, x, sublayer=None, training=None):
        if not callable(sublayer):
            raise TypeError(f"`sublayer` must be callable. Received: sublayer of type {type(sublayer).__name__}")
        inner = call_layer_norm(self.norm, x) if self.norm_first else x
        out = sublayer(inner)
        if tuple(out.shape) != tuple(x.shape):
            raise ValueError(
                "The sub-layer's output must have the shape of its input to be added. "
                f"Received: x.shape={shape_str(x.shape)}, sublayer output shape={shape_str(out.shape)}"
            )
        if self.dropout_rate > 0 and training:
            out = call_sublayer(self.dropout, out, training=training)
        if self.norm_first:
            return x + out  # (B, T, d_model)
        return call_layer_norm(self.norm, x + out)  # (B, T, d_model)

    def compute_output_shape(self, x_shape):
        return tuple(x_shape)

    def get_config(self):
        return {
            **super().get_config(),
            "norm": keras.saving.serialize_keras_object(self.norm),
            "norm_first": self.norm_first,
            "dropout": self.dropout_rate,
            "seed": self.seed,
        }

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        config["norm"] = keras.saving.deserialize_keras_object(config["norm"])
        return cls(**config)


def residual_block(layer, sublayer):
    """The `Residual` block around `layer`'s sub-layer named `sublayer` ("attention", ...): a layer norm
    of `layer.epsilon`, `layer.norm_first`, and dropout at `layer.rate` on the sub-layer's output."""
    norm = keras.layers.LayerNormalization(epsilon=layer.epsilon, name=f"{sublayer}_norm", dtype=layer.dtype_policy)
    return Residual(
        norm, norm_first=layer.norm_first, dropout=layer.rate, name=f"{sublayer}_block", dtype=layer.dtype_policy
    )


class AttentionSublayer:
    """A multi-head attention as the one-tensor sub-layer a `Residual` block calls: `(q) -> output`,
    keeping the weights when asked for (`self.weights`, else None).

    Args:
        attention: the `MultiHeadAttention`.
        mask: its keep-mask, or None. training: whether dropout is active.
        with_weights: also compute the weights (this forces the explicit path).
        keys: the keys and values of a cross-attention; default None, the queries themselves.
        **options: further keywords of the attention's call (`causal`, `keys_mask`).
    """

    def __init__(self, attention, mask, training, with_weights, keys=None, **options):
        self.attention, self.keys, self.with_weights = attention, keys, with_weights
        self.options = dict(mask=mask, training=training, **options)
        self.weights = None

    def __call__(self, q):
        keys = () if self.keys is None else (self.keys, self.keys)
        if not self.with_weights:
            return call_sublayer(self.attention, q, *keys, **self.options)  # (B, T, d_model)
        out, self.weights = call_sublayer(self.attention, q, *keys, return_attention_weights=True, **self.options)
        return out  # (B, T, d_model)

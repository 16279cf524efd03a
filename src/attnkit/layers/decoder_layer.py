"""`DecoderLayer`: one layer of the Transformer decoder (paper section 3.1; seed 001).

    post-LN (the paper, default):  x = LayerNorm(x + Dropout(MaskedSelfAttention(x)))
                                   x = LayerNorm(x + Dropout(CrossAttention(x, encoder_output)))
                                   x = LayerNorm(x + Dropout(FFN(x)))
    pre-LN (norm_first=True):      x = x + Dropout(MaskedSelfAttention(LN(x))), and so on.

Each line is one `Residual` block around its sub-layer (docs/decisions.md item 45).

The self-attention is always causal (the look-ahead mask): position t sees positions <= t. The
cross-attention lets every target position look at every real source position.

Legend: B batch, T target length, S source length, h heads, d_k/d_v per-head widths, d_model.
"""

import keras
from keras import ops

from attnkit.layers._call_checks import CheckedCall
from attnkit.layers._keras_mask import keras_mask_of
from attnkit.layers._policies import SublayerPolicies
from attnkit.layers._shapes import check_model_width, weights_spec
from attnkit.layers._stack_config import LAYER_FIELDS, StackConfig
from attnkit.layers._sublayer import call_sublayer, in_own_scope
from attnkit.layers.encoder_layer import key_padding
from attnkit.layers.feed_forward import FeedForward
from attnkit.layers.multi_head_attention import MultiHeadAttention
from attnkit.layers.residual import AttentionSublayer, residual_block
from attnkit.ops.masks import shape_str, broadcast_mask


@keras.saving.register_keras_serializable(package="attnkit")
class DecoderLayer(StackConfig, CheckedCall, SublayerPolicies, keras.layers.Layer):
    """Masked self-attention, cross-attention over the encoder output, then a feed-forward network.

    Args:
        h, d_k, d_v, d_model, d_ff, rate: as in `EncoderLayer`.
        norm_first: False (default) for post-LN as in the paper; True for pre-LN.
        activation: "relu" (default), "gelu", "gelu_tanh" or "silu" in the feed-forward network.
        epsilon: layer norm epsilon. Default 1e-6.
        **kwargs: base `keras.layers.Layer` arguments.

    Call arguments:
        x: (B, T, d_model) target embeddings.
        encoder_output: (B, S, d_model).
        lookahead_mask: optional keep-mask of the self-attention, combined with the built-in causal
            mask (the seeds pass the combined "hide" mask here; attnkit always applies the causal
            part itself): (B, 1, T) for target padding, or any shape `attnkit.ops.broadcast_mask`
            takes; a 2-D mask when B == T is ambiguous and refused (docs/decisions.md item 18).
        padding_mask: optional keep-mask of the cross-attention, (B, 1, S) for source padding, or any
            shape `broadcast_mask` takes against (B, h, T, S).
        training: whether dropout is active.
        return_attention_weights: also return the self- and cross-attention weights.

    Returns:
        (B, T, d_model); with `return_attention_weights`, (output, self_weights (B, h, T, T),
        cross_weights (B, h, T, S)).

    Example:
    >>> layer = DecoderLayer(h=8, d_k=64, d_v=64, d_model=512, d_ff=2048, rate=0.1)
    >>> layer(keras.random.normal((2, 7, 512)), keras.random.normal((2, 9, 512))).shape  # (2, 7, 512)
    """

    _call_checks = dict(
        floats=("x", "encoder_output"), masks=("lookahead_mask", "padding_mask"), flags=("return_attention_weights",)
    )
    _positional_training = True  # the seeds call `layer(x, encoder_output, lookahead, padding, training)`
    _non_tensor_positionals = True
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
        # `lookahead_mask` overrides the padding: the self-attention adds no Keras mask of its own.
        self.self_attention = MultiHeadAttention(
            h, d_k, d_v, d_model, join_keras_mask=False, name="self_attention", dtype=policy
        )
        self.self_attention_block = residual_block(self, "self_attention")
        self.cross_attention = MultiHeadAttention(h, d_k, d_v, d_model, name="cross_attention", dtype=policy)
        self.cross_attention_block = residual_block(self, "cross_attention")
        self.feed_forward = FeedForward(d_ff, d_model, activation=activation, name="feed_forward", dtype=policy)
        self.feed_forward_block = residual_block(self, "feed_forward")

    @property
    def norms(self):
        """The three layer norms, of the self-attention, cross-attention and feed-forward sub-layers."""
        return self.self_attention_block.norm, self.cross_attention_block.norm, self.feed_forward_block.norm

    def build(self, x_shape, encoder_output_shape=None, *args, **kwargs):
        x_shape = tuple(x_shape)
        encoder_output_shape = tuple(encoder_output_shape or x_shape)
        check_model_width("x", x_shape, self.d_model)
        check_model_width("encoder_output", encoder_output_shape, self.d_model)
        self.self_attention.build(x_shape)
        self.cross_attention.build(x_shape, encoder_output_shape, encoder_output_shape)
        self.feed_forward.build(x_shape)
        for block in (self.self_attention_block, self.cross_attention_block, self.feed_forward_block):
            block.build(x_shape)

    def call(
        self, x, encoder_output, lookahead_mask=None, padding_mask=None, training=None, *,
        return_attention_weights=False,
    ):
        self_attention, cross_attention = self._attentions(x, encoder_output, lookahead_mask, padding_mask, training,
                                                           return_attention_weights)
        x = call_sublayer(self.self_attention_block, x, sublayer=self_attention, training=training)  # (B, T, d_model)
        x = call_sublayer(self.cross_attention_block, x, sublayer=cross_attention, training=training)
        x = call_sublayer(self.feed_forward_block, x, sublayer=self._feed_forward, training=training)
        return (x, self_attention.weights, cross_attention.weights) if return_attention_weights else x

    def _attentions(self, x, encoder_output, lookahead_mask, padding_mask, training, with_weights):
        """The masked self-attention and the cross-attention of `call`, as one-tensor sub-layers."""
        self._check(x, encoder_output)
        self_mask = key_padding(x, lookahead_mask, "lookahead_mask")  # broadcasts to (B, h, T, T), or None
        cross_mask = None if padding_mask is None else key_padding(encoder_output, padding_mask, queries=x)
        # The encoder output's own Keras mask (source padding) joins `padding_mask`, as `__call__` would.
        keys_mask = keras_mask_of(encoder_output)
        self_attention = AttentionSublayer(self.self_attention, self_mask, training, with_weights, causal=True)
        cross_attention = AttentionSublayer(
            self.cross_attention, cross_mask, training, with_weights, keys=encoder_output, keys_mask=keys_mask
        )
        return self_attention, cross_attention

    def _feed_forward(self, x):
        return call_sublayer(self.feed_forward, x)  # (B, T, d_model)

    @in_own_scope
    def decode_step(
        self, x, cross_keys_values, padding_mask=None, *, cache, layer_index, start, keep=None, causal=False,
        return_attention_weights=False,
    ):
        """One step of cached (incremental) decoding; inference only.

        Args:
            x: (B, T_new, d_model), the embeddings of the newest target positions (usually T_new = 1).
            cross_keys_values: (k, v) of the encoder output from `project_encoder_output`.
            padding_mask: optional keep-mask of the cross-attention, as in `call`: (B, 1, S) for
                the real source tokens.
            cache: the decoder's `KVCache`; this layer's self-attention keys and values of the new
                positions are written at slots [start, start + T_new).
            layer_index: this layer's index in the cache.
            start: the cache slot of the first new position.
            keep, causal: the self-attention's mask over the cache's attended slots, as
                `kv_cache.keep_mask` gives them: a (B, 1, T_new, S_c) keep-mask or None, and whether
                the bottom-right causal mask applies.
            return_attention_weights: also return the cross-attention weights (B, h, T_new, S).

        Returns:
            output (B, T_new, d_model), plus the cross-attention weights when asked.
        """
        x = ops.convert_to_tensor(x)  # a plain method, not `__call__`: Keras does not convert NumPy here
        if padding_mask is not None:  # the one rule of every mask argument (docs/decisions.md item 18)
            scores_shape = (x.shape[0], None, x.shape[1], cross_keys_values[0].shape[2])  # (B, h, T_new, S)
            padding_mask = broadcast_mask(padding_mask, scores_shape, "padding_mask")

        def self_attend(q):
            k, v = self.self_attention.project_keys_values(q, q)  # (B, h, T_new, d)
            k, v = cache.update(layer_index, k, v, start)  # (B, h, S_c, d): every position so far
            return self.self_attention.attend_projected(q, k, v, keep, causal=causal)

        cross_weights = []

        def cross_attend(q):
            result = self.cross_attention.attend_projected(
                q, *cross_keys_values, padding_mask, return_attention_weights=return_attention_weights
            )
            if not return_attention_weights:
                return result
            cross_weights.append(result[1])
            return result[0]

        x = call_sublayer(self.self_attention_block, x, sublayer=self_attend, training=False)
        x = call_sublayer(self.cross_attention_block, x, sublayer=cross_attend, training=False)
        x = call_sublayer(self.feed_forward_block, x, sublayer=self._feed_forward, training=False)
        return (x, cross_weights[0]) if return_attention_weights else x

    @in_own_scope
    def project_encoder_output(self, encoder_output):
        """The cross-attention's keys and values, computed once per source sentence for decoding."""
        return self.cross_attention.project_keys_values(encoder_output, encoder_output)

    def _check(self, x, encoder_output):
        check_model_width("x", x.shape, self.d_model)
        check_model_width("encoder_output", encoder_output.shape, self.d_model)
        if None not in (x.shape[0], encoder_output.shape[0]) and x.shape[0] != encoder_output.shape[0]:
            raise ValueError(
                "`x` and `encoder_output` must have the same batch size. Received shapes: "
                f"x={shape_str(x.shape)}, encoder_output={shape_str(encoder_output.shape)}"
            )

    def compute_output_shape(self, x_shape, *args, **kwargs):
        return tuple(x_shape)

    def compute_output_spec(
        self, x, encoder_output, lookahead_mask=None, padding_mask=None, training=None, *,
        return_attention_weights=False, **kwargs,
    ):
        # Symbolic calls (functional models) must see the weights too when they are asked for.
        output = keras.KerasTensor(self.compute_output_shape(x.shape), dtype=self.compute_dtype)
        if not return_attention_weights:
            return output
        B, T, S = x.shape[0], x.shape[1], encoder_output.shape[1]
        return output, weights_spec(self, B, T, T), weights_spec(self, B, T, S)  # self-, cross-attention

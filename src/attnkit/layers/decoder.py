"""`Decoder`: the Transformer decoder, target embeddings then N decoder layers (section 3.1; seed 001).

    y = Dropout(Embedding(target_ids) * sqrt(d_model) + PE)
    y = DecoderLayer_n(... DecoderLayer_1(y, encoder_output))     (then LayerNorm(y) when norm_first)

Legend: B batch, T target length, S source length, h heads, d_model, n number of layers (the paper's N).
"""

import keras
import numpy as np
from keras import ops

from attnkit._validation import positive_int

from attnkit.layers._call_checks import CheckedCall
from attnkit.layers._policies import SublayerPolicies
from attnkit.layers._shapes import check_model_width, weights_spec
from attnkit.layers._stack_config import STACK_FIELDS, StackConfig
from attnkit.layers._sublayer import call_layer_norm, call_sublayer, in_own_scope
from attnkit.layers._token_ids import check_token_ids
from attnkit.layers.decoder_layer import DecoderLayer
from attnkit.layers.kv_cache import KVCache, keep_mask
from attnkit.layers.position_embedding import position_embedding


@keras.saving.register_keras_serializable(package="attnkit")
class Decoder(StackConfig, CheckedCall, SublayerPolicies, keras.layers.Layer):
    """Embeddings, dropout and a stack of `n` `DecoderLayer`s.

    Args:
        vocab_size: size of the target vocabulary.
        sequence_length: longest target sequence.
        h, d_k, d_v, d_model, d_ff, n, rate: as in `Encoder`.
        pad_id: the target padding id (default 0); padded target positions are hidden as keys.
        norm_first, activation, epsilon, position: as in `Encoder`.
        **kwargs: base `keras.layers.Layer` arguments.

    Call arguments:
        output_target: (B, T) target token ids (shifted right: they start with the start token).
        encoder_output: (B, S, d_model).
        lookahead_mask: optional keep-mask of the self-attention, combined with the causal part,
            which is always applied: (B, 1, T) for target padding, (T, T), (B, T, T), or any shape
            `attnkit.ops.broadcast_mask` takes; a 2-D mask when B == T is ambiguous and refused
            (docs/decisions.md item 18). Default: target ids != pad_id.
        padding_mask: optional keep-mask of the cross-attention: (B, 1, S) for source padding, or
            any shape `broadcast_mask` takes against (B, h, T, S); (B, S) is ambiguous when B == T.
        training: whether dropout is active.
        return_attention_weights: also return the lists of n self- and n cross-attention weights.

    Returns:
        (B, T, d_model); with `return_attention_weights`, (output, [n x (B, h, T, T)],
        [n x (B, h, T, S)]).

    Example:
    >>> decoder = Decoder(20, 5, h=8, d_k=64, d_v=64, d_model=512, d_ff=2048, n=6, rate=0.1)
    >>> decoder(target_ids, encoder_output).shape  # (B, 5, 512)
    """

    _call_checks = dict(
        ids=("output_target",), floats=("encoder_output",), masks=("lookahead_mask", "padding_mask"),
        flags=("return_attention_weights",),
    )
    _positional_training = True  # the seeds call `decoder(ids, encoder_output, lookahead, padding, training)`
    _non_tensor_positionals = True  # and pass their masks positionally
    _config_fields = STACK_FIELDS

    def __init__(
        self, vocab_size, sequence_length, h, d_k, d_v, d_model, d_ff, n, rate, *, pad_id=0, norm_first=False,
        activation="relu", epsilon=1e-6, position="sinusoidal", **kwargs,
    ):
        super().__init__(**kwargs)
        self.set_sizes(
            vocab_size=vocab_size, sequence_length=sequence_length, h=h, d_k=d_k, d_v=d_v, d_model=d_model,
            d_ff=d_ff, n=n, rate=rate, norm_first=norm_first, activation=activation, epsilon=epsilon,
        )
        self.supports_masking = True
        policy = self.dtype_policy
        self.pos_encoding = position_embedding(
            position, sequence_length, vocab_size, d_model, pad_id=pad_id, name="pos_encoding", dtype=policy
        )
        self.pad_id, self.position = self.pos_encoding.pad_id, self.pos_encoding.position
        self.dropout = keras.layers.Dropout(self.rate, name="dropout", dtype=policy)
        self.decoder_layers = [
            DecoderLayer(
                h, d_k, d_v, d_model, d_ff, rate, norm_first=norm_first, activation=activation, epsilon=epsilon,
                name=f"decoder_layer_{i}", dtype=policy,
            )
            for i in range(self.n)
        ]
        self.final_norm = (
            keras.layers.LayerNormalization(epsilon=self.epsilon, name="final_norm", dtype=policy)
            if self.norm_first else None
        )

    def build(self, output_target_shape, encoder_output_shape=None, *args, **kwargs):
        self.pos_encoding.build(output_target_shape)
        x_shape = tuple(output_target_shape) + (self.d_model,)  # (B, T, d_model)
        encoder_output_shape = tuple(encoder_output_shape) if encoder_output_shape else x_shape
        check_model_width("encoder_output", encoder_output_shape, self.d_model)
        for layer in self.decoder_layers:
            layer.build(x_shape, encoder_output_shape)
        if self.final_norm is not None:
            self.final_norm.build(x_shape)

    def call(
        self, output_target, encoder_output, lookahead_mask=None, padding_mask=None, training=None, *,
        return_attention_weights=False,
    ):
        ids = check_token_ids(output_target, self.vocab_size, self.sequence_length, "output_target")  # (B, T)
        if lookahead_mask is None:
            lookahead_mask = self.pos_encoding.compute_mask(ids)  # (B, T) or None
            lookahead_mask = None if lookahead_mask is None else ops.expand_dims(lookahead_mask, 1)  # (B, 1, T)
        y = self.dropout(self.pos_encoding(ids), training=training)  # (B, T, d_model)
        self_weights, cross_weights = [], []
        for layer in self.decoder_layers:
            if return_attention_weights:
                y, s, c = call_sublayer(
                    layer, y, encoder_output, lookahead_mask, padding_mask, training=training,
                    return_attention_weights=True,
                )
                self_weights.append(s)
                cross_weights.append(c)
            else:
                y = call_sublayer(layer, y, encoder_output, lookahead_mask, padding_mask, training=training)  # (B, T, d_model)
        if self.final_norm is not None:
            y = call_layer_norm(self.final_norm, y)
        return (y, self_weights, cross_weights) if return_attention_weights else y

    @in_own_scope
    def project_encoder_output(self, encoder_output):
        """Every layer's cross-attention keys and values, computed once per source for decoding."""
        if not self.built:  # decoding may start here, before any call has built the layers
            self.build((encoder_output.shape[0], 1), tuple(encoder_output.shape))
        return [layer.project_encoder_output(encoder_output) for layer in self.decoder_layers]

    def new_cache(self, batch, max_length=None):
        """An empty `KVCache` of every layer's self-attention, for `batch` sequences of up to
        `max_length` positions (default `sequence_length`)."""
        max_length = self.sequence_length if max_length is None else positive_int("max_length", max_length)
        return KVCache(self.n, positive_int("batch", batch), self.h, max_length, self.d_k, self.compute_dtype, d_v=self.d_v)

    @in_own_scope
    def decode_step(self, target_ids, cache, cross_keys_values, padding_mask=None, *, return_attention_weights=False):
        """Cached decoding: the decoder output at the newest target positions only.

        Args:
            target_ids: (B, T_new) ids of the newest target positions; they follow the `cache.length`
                positions already cached.
            cache: a `KVCache` from `new_cache`, updated in place.
            cross_keys_values: from `project_encoder_output`.
            padding_mask: optional keep-mask of the cross-attention, (B, 1, S) for the real source tokens.
            return_attention_weights: also return the n cross-attention weights (B, h, T_new, S).

        Returns:
            output (B, T_new, d_model), plus the list of cross weights when asked.
        """
        start = cache.length
        y = self._embed(target_ids, start)  # (B, T_new, d_model)
        B, T = y.shape[0], y.shape[1]
        cache.advance(np.ones((B, T), bool))
        keep, causal = keep_mask(cache.valid[:, : cache.attended], np.arange(start, start + T))  # over S_c slots
        cross_weights = []
        for i, (layer, cross_kv) in enumerate(zip(self.decoder_layers, cross_keys_values)):
            result = layer.decode_step(
                y, cross_kv, padding_mask, cache=cache, layer_index=i, start=start, keep=keep, causal=causal,
                return_attention_weights=return_attention_weights,
            )
            y = result[0] if return_attention_weights else result
            if return_attention_weights:
                cross_weights.append(result[1])
        if self.final_norm is not None:
            y = call_layer_norm(self.final_norm, y)  # once per generated token: no Keras dispatch
        return (y, cross_weights) if return_attention_weights else y

    def _embed(self, ids, start):
        """Token embeddings of `ids` (B, T_new) at positions start .. start + T_new - 1."""
        ids = ops.convert_to_tensor(ids, "int32")
        length = ids.shape[1]
        if start + length > self.sequence_length:
            raise ValueError(
                f"Decoding past the decoder's sequence_length={self.sequence_length}. "
                f"Received: start={start} with {length} new positions"
            )
        return self.pos_encoding.embed_at(ids, start)  # (B, T_new, d_model)

    @property
    def token_embeddings(self):
        """The target token embedding table, a (vocab_size, d_model) variable: what output tying shares."""
        return self.pos_encoding.token_embeddings

    def compute_mask(self, output_target, *args, **kwargs):
        return self.pos_encoding.compute_mask(output_target)

    def compute_output_shape(self, output_target_shape, *args, **kwargs):
        return tuple(output_target_shape) + (self.d_model,)

    def compute_output_spec(
        self, output_target, encoder_output, lookahead_mask=None, padding_mask=None, training=None, *,
        return_attention_weights=False, **kwargs,
    ):
        # Symbolic calls (functional models) must see the weights too: n self- and n cross-attention.
        output = keras.KerasTensor(self.compute_output_shape(output_target.shape), dtype=self.compute_dtype)
        if not return_attention_weights:
            return output
        B, T, S = output_target.shape[0], output_target.shape[1], encoder_output.shape[1]
        self_weights = [weights_spec(self, B, T, T) for _ in range(self.n)]
        return output, self_weights, [weights_spec(self, B, T, S) for _ in range(self.n)]

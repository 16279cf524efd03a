"""`Encoder`: the Transformer encoder, embeddings then a stack of N encoder layers (section 3.1; seed 002).

    x = Dropout(Embedding(ids) * sqrt(d_model) + PE)
    x = EncoderLayer_n(... EncoderLayer_1(x))        (then LayerNorm(x) when norm_first)

Legend: B batch, T sequence length, h heads, d_k/d_v per-head widths, d_model model width, d_ff inner
width, n number of layers (the paper's N).
"""

import keras

from attnkit.layers._call_checks import CheckedCall
from attnkit.layers._keras_mask import keras_mask_of, with_keras_mask
from attnkit.layers._policies import SublayerPolicies
from attnkit.layers._shapes import weights_spec
from attnkit.layers._stack_config import STACK_FIELDS, StackConfig
from attnkit.layers._sublayer import as_in_own_call, call_layer_norm, call_layer_stack
from attnkit.layers._token_ids import check_token_ids
from attnkit.layers.encoder_layer import EncoderLayer
from attnkit.layers.position_embedding import position_embedding


@keras.saving.register_keras_serializable(package="attnkit")
class Encoder(StackConfig, CheckedCall, SublayerPolicies, keras.layers.Layer):
    """Maps a batch of token ids to one d_model vector per token.

    Padding never changes the outputs at real tokens: without an explicit `padding_mask`, the
    positions whose id is `pad_id` are masked out of every layer's attention. The output carries
    that (B, T) mask as a Keras mask, so masking layers that follow (pooling, losses) skip padding.

    `encode` runs the layer stack alone on embeddings you computed yourself; `encoder_layers` is the
    list of the n `EncoderLayer`s and `final_norm` the closing layer norm (None in post-LN).

    Args:
        vocab_size: number of token ids; ids must be in [0, vocab_size).
        sequence_length: the longest input accepted.
        h: number of attention heads.
        d_k: per-head width of queries and keys.
        d_v: per-head width of values.
        d_model: width of the embeddings and of every layer's output.
        d_ff: inner width of the feed-forward networks.
        n: number of encoder layers.
        rate: dropout rate in [0, 1), after the embeddings and after every sub-layer.
        pad_id: id of the padding token, or None when no id is padding. Default 0.
        norm_first: pre-LN layers and a final layer norm (as torch's `TransformerEncoder(norm=...)`)
            instead of the paper's post-LN. Default False.
        activation: "relu" (default), "gelu" (exact), "gelu_tanh" or "silu" in the feed-forward networks.
        epsilon: layer norm epsilon. Default 1e-6.
        position: "sinusoidal" (default, fixed) or "learned" position embeddings.
        **kwargs: base `keras.layers.Layer` arguments (name, dtype, ...).

    Call arguments:
        input_sentence: token ids (B, T), T <= sequence_length; integers, or floats holding whole
            numbers.
        padding_mask: optional keep-mask, True = may attend: (B, 1, T) for padding, or any shape
            `attnkit.ops.broadcast_mask` takes; a 2-D mask when B == T is ambiguous and refused
            (docs/decisions.md item 18). Default: ids != pad_id.
        training: whether dropout is active.
        return_attention_weights: keyword-only; also return every layer's attention weights.

    Returns:
        (B, T, d_model); with `return_attention_weights`, (output, weights) where weights is a list
        of n arrays (B, h, T, T).

    Raises:
        ValueError: bad sizes or rate, an unknown activation or position kind, a `pad_id` outside the
            vocabulary; token ids that are not rank 2, longer than sequence_length, negative,
            >= vocab_size or fractional (values are checked when they are concrete).
        TypeError: non-integer sizes, token ids of a non-numeric dtype, a float padding mask.

    Example:
    >>> encoder = Encoder(20, 5, h=8, d_k=64, d_v=64, d_model=512, d_ff=2048, n=6, rate=0.1)
    >>> ids = keras.random.randint((64, 5), 0, 20)
    >>> encoder(ids, None, True).shape  # (64, 5, 512)

    References:
        Vaswani et al., "Attention Is All You Need", 2017, section 3.1.
    """

    _call_checks = dict(ids=("input_sentence",), masks=("padding_mask",), flags=("return_attention_weights",))
    _positional_training = True  # the seeds call `encoder(ids, padding_mask, training)`
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
        self.encoder_layers = [
            EncoderLayer(
                h, d_k, d_v, d_model, d_ff, rate, norm_first=norm_first, activation=activation, epsilon=epsilon,
                name=f"encoder_layer_{i}", dtype=policy,
            )
            for i in range(self.n)
        ]
        self.final_norm = (
            keras.layers.LayerNormalization(epsilon=self.epsilon, name="final_norm", dtype=policy)
            if self.norm_first else None
        )

    def build(self, input_sentence_shape, padding_mask_shape=None):
        self.pos_encoding.build(input_sentence_shape)
        x_shape = tuple(input_sentence_shape) + (self.d_model,)  # (B, T, d_model)
        for layer in self.encoder_layers:
            layer.build(x_shape)
        if self.final_norm is not None:
            self.final_norm.build(x_shape)

    def call(self, input_sentence, padding_mask=None, training=None, *, return_attention_weights=False):
        ids = check_token_ids(input_sentence, self.vocab_size, self.sequence_length, "input_sentence")  # (B, T)
        if padding_mask is None:
            padding_mask = _padding(self.pos_encoding.compute_mask(ids))  # (B, 1, T) or None
        x = self.dropout(self.pos_encoding(ids), training=training)  # (B, T, d_model)
        return self.encode(x, padding_mask, training=training, return_attention_weights=return_attention_weights)

    def encode(self, x, padding_mask=None, *, training=None, return_attention_weights=False):
        """Runs the n encoder layers (and the final norm) on embeddings, skipping the embedding stage.

        Args:
            x: (B, T, d_model) embeddings.
            padding_mask: optional keep-mask, as in `call`. Default: the Keras mask of `x`.
            training: whether dropout is active.
            return_attention_weights: also return the list of n weight arrays (B, h, T, T).

        Returns:
            (B, T, d_model), or (output, weights) with `return_attention_weights`.
        """
        keras_mask = keras_mask_of(x)
        if padding_mask is None:
            padding_mask = _padding(keras_mask)  # what Keras's __call__ would fill in for every layer
        with as_in_own_call(self, x) as x:  # called directly: converted and scoped as by `__call__`
            result = call_layer_stack(self.encoder_layers, x, padding_mask, training, return_attention_weights)
            x, weights = result if return_attention_weights else (result, None)
            if self.final_norm is not None:
                x = call_layer_norm(self.final_norm, x)
        if keras_mask is not None:
            x = with_keras_mask(x, keras_mask)  # as the layers' `__call__` would have propagated it
        return (x, weights) if return_attention_weights else x

    def compute_mask(self, input_sentence, previous_mask=None):
        return self.pos_encoding.compute_mask(input_sentence)

    def compute_output_shape(self, input_sentence_shape, padding_mask_shape=None):
        return tuple(input_sentence_shape) + (self.d_model,)

    def compute_output_spec(
        self, input_sentence, padding_mask=None, training=None, *, return_attention_weights=False, **kwargs
    ):
        # Symbolic calls (functional models) must see the weights too: one (B, h, T, T) per layer.
        output = keras.KerasTensor(self.compute_output_shape(input_sentence.shape), dtype=self.compute_dtype)
        if not return_attention_weights:
            return output
        B, T = input_sentence.shape[0], input_sentence.shape[1]
        return output, [weights_spec(self, B, T, T) for _ in range(self.n)]



def _padding(mask):
    """A (B, T) padding mask as (B, 1, T), the shape no layer can read as a (T_q, T_k) mask; None stays None."""
    return None if mask is None else keras.ops.expand_dims(mask, 1)

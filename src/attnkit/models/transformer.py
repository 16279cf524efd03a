"""`Transformer`: the paper's encoder-decoder model, returning next-token logits (section 3).

    logits = Linear(Decoder(target_ids, Encoder(source_ids)))

Legend: B batch, S source length, T target length, V target vocabulary size, d_model.
"""

import keras
from keras import ops

from attnkit._validation import boolean, positive_int
from attnkit.layers._call_checks import CheckedCall
from attnkit.layers._policies import SublayerPolicies
from attnkit.layers._sublayer import in_own_scope
from attnkit.layers.decoder import Decoder
from attnkit.layers.encoder import Encoder
from attnkit.layers.linear import Linear
from attnkit.layers.position_embedding import embedding_table

STACK_SIZES = ("h", "d_k", "d_v", "d_model", "d_ff", "n", "rate")  # the stacks' own names, checked by them


@keras.saving.register_keras_serializable(package="attnkit")
class Transformer(CheckedCall, SublayerPolicies, keras.Model):
    """Encoder, decoder and the final linear layer to the target vocabulary.

    Args:
        enc_vocab_size, dec_vocab_size: source and target vocabulary sizes.
        enc_seq_length, dec_seq_length: longest source and target sequences (the target including
            its start token).
        h, d_k, d_v, d_model, d_ff, n, rate: as in `Encoder` (both stacks have n layers).
        pad_id: padding id of both vocabularies. Default 0.
        norm_first, activation, epsilon: as in `Encoder`.
        tie_weights: share the decoder's token embedding with the output layer (logits = y E^T + b),
            as the paper does (section 3.4). Default False.
        **kwargs: base `keras.Model` arguments.

    Call arguments:
        encoder_input: (B, S) source ids; or the pair (encoder_input, decoder_input), as `fit` passes it.
        decoder_input: (B, T) target ids shifted right (starting with the start token).
        training: whether dropout is active.

    Returns:
        (B, T, V) float32 logits of the next target token at every position.

    Example:
    >>> model = Transformer(40, 40, 32, 12, h=4, d_k=16, d_v=16, d_model=64, d_ff=256, n=2, rate=0.1)
    >>> model((source_ids, target_in)).shape  # (B, 12, 40)
    """

    _call_checks = dict(ids=("encoder_input", "decoder_input"))

    def __init__(
        self, enc_vocab_size, dec_vocab_size, enc_seq_length, dec_seq_length, h, d_k, d_v, d_model, d_ff, n, rate,
        *, pad_id=0, norm_first=False, activation="relu", epsilon=1e-6, tie_weights=False, **kwargs,
    ):
        super().__init__(**kwargs)
        # Checked here under the model's own names (the stacks would name `dec_seq_length` "sequence_length")
        # and kept as the Python values the layers and `get_config` take (docs/decisions.md item 84).
        enc_vocab_size, dec_vocab_size, enc_seq_length, dec_seq_length = (
            positive_int(name, value) for name, value in (
                ("enc_vocab_size", enc_vocab_size), ("dec_vocab_size", dec_vocab_size),
                ("enc_seq_length", enc_seq_length), ("dec_seq_length", dec_seq_length),
            )
        )
        shared = dict(pad_id=pad_id, norm_first=norm_first, activation=activation, epsilon=epsilon)
        # Every sub-layer computes in the model's dtype policy (mixed precision included).
        policy = self.dtype_policy
        self.encoder = Encoder(
            enc_vocab_size, enc_seq_length, h, d_k, d_v, d_model, d_ff, n, rate, name="encoder", dtype=policy, **shared
        )
        self.decoder = Decoder(
            dec_vocab_size, dec_seq_length, h, d_k, d_v, d_model, d_ff, n, rate, name="decoder", dtype=policy, **shared
        )
        self.tie_weights = bool(boolean("tie_weights", tie_weights))
        if not self.tie_weights:
            self.model_last_layer = Linear(dec_vocab_size, name="model_last_layer", dtype=self.dtype_policy)
        self._config = dict(
            enc_vocab_size=enc_vocab_size, dec_vocab_size=dec_vocab_size, enc_seq_length=enc_seq_length,
            dec_seq_length=dec_seq_length, tie_weights=self.tie_weights,
            **{name: getattr(self.encoder, name) for name in (*STACK_SIZES, "pad_id", "norm_first", "activation", "epsilon")},
        )
        self.pad_id = self.encoder.pad_id

    def build(self, encoder_input_shape, decoder_input_shape=None):
        if decoder_input_shape is None:  # fit passes the pair of shapes as one argument
            encoder_input_shape, decoder_input_shape = _pair(encoder_input_shape)
        self.encoder.build(encoder_input_shape)
        enc_out = tuple(encoder_input_shape) + (self.decoder.d_model,)
        self.decoder.build(decoder_input_shape, enc_out)
        if self.tie_weights:
            self.output_bias = self.add_weight(
                shape=(self.decoder.vocab_size,), initializer="zeros", name="output_bias"
            )
        else:
            self.model_last_layer.build(tuple(decoder_input_shape) + (self.decoder.d_model,))
        self.built = True

    def call(self, encoder_input, decoder_input=None, training=None):
        if decoder_input is None:
            encoder_input, decoder_input = _pair(encoder_input)
        encoder_output, source_mask = self.encode(encoder_input, training=training)
        y = self.decoder(decoder_input, encoder_output, None, source_mask, training=training)  # (B, T, d_model)
        return self.logits(y)

    def encode(self, encoder_input, training=None):
        """(encoder output (B, S, d_model), source keep-mask (B, 1, S) or None) for `encoder_input` (B, S).

        The mask is (B, 1, S), padding in the shape no layer reads as (T_q, T_k) (docs/decisions.md item 18).
        """
        source_mask = self.encoder.compute_mask(encoder_input)  # (B, S) or None
        source_mask = None if source_mask is None else ops.expand_dims(source_mask, 1)  # (B, 1, S)
        return self.encoder(encoder_input, source_mask, training=training), source_mask

    @in_own_scope
    def logits(self, y):
        """Decoder outputs (..., d_model) -> float32 logits (..., V)."""
        if not self.built:
            raise ValueError(
                "`Transformer.logits` needs a built model: call it once on (source ids, target ids), or call "
                "`build(source_shape, target_shape)`, first."
            )
        if self.tie_weights:
            embeddings = embedding_table(self.decoder.pos_encoding.token_embedding, y.dtype)  # (V, d_model), dequantized
            logits = ops.matmul(y, ops.transpose(embeddings)) + ops.cast(self.output_bias, y.dtype)
        else:
            logits = self.model_last_layer(y)
        # Under mixed precision the softmax cross-entropy wants float32 logits.
        return ops.cast(logits, "float32")

    def compute_output_shape(self, encoder_input_shape, decoder_input_shape=None):
        if decoder_input_shape is None:
            encoder_input_shape, decoder_input_shape = encoder_input_shape
        return tuple(decoder_input_shape) + (self.decoder.vocab_size,)

    def get_config(self):
        base = {k: v for k, v in super().get_config().items() if k in ("name", "trainable", "dtype")}
        return {**base, **self._config}

    @classmethod
    def from_config(cls, config):
        return cls(**config)


def _pair(value):
    """(encoder input, decoder input) from the one argument Keras's fit passes, or a clear error."""
    if isinstance(value, (list, tuple)) and len(value) == 2 and not all(isinstance(v, (int, type(None))) for v in value):
        return value
    raise ValueError(
        "A Transformer takes (encoder_input, decoder_input): two (B, S) and (B, T) id tensors, as two "
        f"arguments or one pair. Received: one argument of {_describe(value)}"
    )


def _describe(value):
    shape = getattr(value, "shape", value if isinstance(value, (tuple, list)) else None)  # build gets shapes
    return f"shape {tuple(shape)}" if shape is not None else repr(value)

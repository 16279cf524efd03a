"""`PositionEmbeddingFixedWeights`: token embeddings plus position encodings (paper section 3.4, 3.5).

    x = Embedding(token) * sqrt(d_model) + PE(position)

Legend: B batch, T sequence length, d_model embedding width.
"""

import math
import numbers

import keras
from keras import ops

from attnkit._validation import boolean, positive_int
from attnkit.layers._call_checks import CheckedCall
from attnkit.layers._policies import SublayerPolicies
from attnkit.layers._token_ids import check_token_ids
from attnkit.layers.sinusoidal_position_encoding import SinusoidalPositionEncoding

POSITION_KINDS = ("sinusoidal", "learned")


def embedding_table(embedding, dtype):
    """E (V, d_model) of a `keras.layers.Embedding` in `dtype`, as its lookups read it: what a tied
    output projection multiplies by. A quantized embedding (Keras's `quantize`) stores integers and
    scales, which its `embeddings` property returns as they are (int8 values read as E gave logits
    thousands of times too large); its rows are dequantized by looking every id up, which the layer
    does exactly for each of its modes (docs/decisions.md item 90)."""
    if embedding.quantization_mode is None:
        return ops.cast(embedding.embeddings, dtype)  # LoRA included, by the property
    return ops.cast(embedding(ops.arange(embedding.input_dim, dtype="int32")), dtype)


@keras.saving.register_keras_serializable(package="attnkit")
class PositionEmbeddingFixedWeights(CheckedCall, SublayerPolicies, keras.layers.Layer):
    """Embeds token ids and adds their positions: the input stage of the Transformer encoder.

    The token embedding is learned and, as in the paper (section 3.4), multiplied by sqrt(d_model) so
    that it is not drowned by the position encoding. Positions are the paper's fixed sinusoids by
    default (the "fixed weights" of the name); `position="learned"` learns one vector per position
    instead, as BERT-family models do (they also skip the scaling: `scale_embeddings=False`).

    The layer produces the padding mask of what follows: its output carries a Keras mask (B, T),
    True at real tokens and False where the id is `pad_id`, as `Embedding(mask_zero=True)` does.

    Args:
        sequence_length: the longest sequence of token ids the layer accepts.
        vocab_size: number of token ids; ids must be in [0, vocab_size).
        d_model: width of the embeddings.
        position: "sinusoidal" (default, fixed) or "learned".
        pad_id: id of the padding token, masked out in the Keras mask; None for no mask. Default 0.
        scale_embeddings: multiply the token embeddings by sqrt(d_model). Default True.
        embeddings_initializer: initializer of the embedding tables. Default "uniform".
        **kwargs: base `keras.layers.Layer` arguments (name, dtype, ...).

    Call arguments:
        inputs: token ids (B, T), T <= sequence_length. Integer dtype; floats holding whole numbers
            are accepted and cast.

    Returns:
        (B, T, d_model) embeddings, carrying a (B, T) Keras mask when `pad_id` is not None.

    Raises:
        ValueError: non-positive sizes, an unknown `position`, a `pad_id` outside the vocabulary;
            token ids that are not rank 2, longer than sequence_length, negative, >= vocab_size or
            fractional (values are checked when they are concrete, i.e. not inside a traced function).
        TypeError: non-integer sizes, token ids that are neither integers nor floats.

    Example:
    >>> layer = PositionEmbeddingFixedWeights(sequence_length=5, vocab_size=20, d_model=512)
    >>> ids = keras.ops.convert_to_tensor([[3, 7, 1, 0, 0]])
    >>> layer(ids).shape  # (1, 5, 512)
    >>> layer.compute_mask(ids)  # [[True, True, True, False, False]]

    References:
        Vaswani et al., "Attention Is All You Need", 2017, sections 3.4 and 3.5.
    """

    _call_checks = dict(ids=("inputs",))

    def __init__(
        self, sequence_length, vocab_size, d_model, *, position="sinusoidal", pad_id=0,
        scale_embeddings=True, embeddings_initializer="uniform", **kwargs,
    ):
        super().__init__(**kwargs)
        self.sequence_length = positive_int("sequence_length", sequence_length)
        self.vocab_size = positive_int("vocab_size", vocab_size)
        self.d_model = positive_int("d_model", d_model)
        if position not in POSITION_KINDS:
            raise ValueError(f"`position` must be one of {POSITION_KINDS}. Received: position={position!r}")
        self.position = position
        if pad_id is not None and (
            isinstance(pad_id, bool) or not isinstance(pad_id, numbers.Integral) or not 0 <= pad_id < self.vocab_size
        ):
            raise ValueError(
                f"`pad_id` must be None or an integer in [0, vocab_size={self.vocab_size}). Received: pad_id={pad_id!r}"
            )
        self.pad_id = None if pad_id is None else int(pad_id)
        self.scale_embeddings = bool(boolean("scale_embeddings", scale_embeddings))
        self.embeddings_initializer = keras.initializers.get(embeddings_initializer)
        self.supports_masking = True
        # Keras's "auto" then compiles models holding this layer without XLA on tensorflow, where the
        # token-id assertions run (XLA removes them): docs/decisions.md item 20.
        self.supports_jit = keras.backend.backend() != "tensorflow"
        embedding = dict(embeddings_initializer=self.embeddings_initializer, dtype=self.dtype_policy)
        self.token_embedding = keras.layers.Embedding(
            self.vocab_size, self.d_model, name="token_embedding", **embedding
        )
        if self.position == "learned":
            self.position_embedding = keras.layers.Embedding(
                self.sequence_length, self.d_model, name="position_embedding", **embedding
            )
        else:
            self.position_encoding = SinusoidalPositionEncoding(
                self.sequence_length, self.d_model, name="position_encoding", dtype=self.dtype_policy
            )

    def build(self, inputs_shape):
        self.token_embedding.build(inputs_shape)
        if self.position == "learned":
            self.position_embedding.build((self.sequence_length,))

    def call(self, inputs):
        ids = check_token_ids(inputs, self.vocab_size, self.sequence_length, "inputs")  # (B, T)
        tokens = self._tokens(ids)  # (B, T, d_model)
        if self.position == "learned":
            positions = self.position_embedding(ops.arange(ops.shape(ids)[1]))  # (T, d_model)
            return tokens + positions[None]  # (B, T, d_model)
        return self.position_encoding(tokens)  # (B, T, d_model)

    @property
    def token_embeddings(self):
        """The token embedding table, a (vocab_size, d_model) variable: what output tying shares.

        Raises:
            ValueError: the layer is not built yet (the table does not exist before).
        """
        if not self.token_embedding.built:
            raise ValueError(f"The token embeddings of `{self.name}` exist once it is built; call or build it first")
        return self.token_embedding.embeddings

    def embed_at(self, ids, start=0, position_ids=None):
        """The embeddings of token ids at given positions, for cached decoding and RoBERTa's positions.

        A plain method: the ids are the caller's to check (`call` checks them).

        Args:
            ids: (B, T) integer token ids.
            start: the position of the first of them; the others follow. Default 0.
            position_ids: optional (B, T) positions of each id, instead of `start` (learned positions).

        Returns:
            (B, T, d_model).

        Raises:
            ValueError: `position_ids` with sinusoidal positions.
        """
        tokens = self._tokens(ids)  # (B, T, d_model)
        if position_ids is not None:
            if self.position != "learned":
                raise ValueError("`position_ids` needs learned positions. Received: position='sinusoidal'")
            return tokens + self.position_embedding(position_ids)  # (B, T, d_model)
        length = ids.shape[1]
        if self.position == "learned":
            positions = self.position_embedding(ops.arange(start, start + length))  # (T, d_model)
        else:
            positions = ops.slice(self.position_encoding.table(), (start, 0), (length, self.d_model))
        return tokens + ops.cast(positions, tokens.dtype)[None]  # (B, T, d_model)

    def _tokens(self, ids):
        """The token embeddings of ids (B, T), scaled by sqrt(d_model) when `scale_embeddings`."""
        tokens = self.token_embedding(ids)  # (B, T, d_model)
        if self.scale_embeddings:
            # Section 3.4: the paper multiplies the embedding weights by sqrt(d_model).
            tokens = tokens * ops.cast(math.sqrt(self.d_model), tokens.dtype)
        return tokens

    def compute_mask(self, inputs, previous_mask=None):
        if self.pad_id is None:
            return None
        ids = ops.convert_to_tensor(inputs)
        return ops.not_equal(ids, ops.cast(self.pad_id, ids.dtype))  # (B, T), True at real tokens

    def compute_output_shape(self, inputs_shape):
        return tuple(inputs_shape) + (self.d_model,)

    def get_config(self):
        return {
            **super().get_config(),
            "sequence_length": self.sequence_length,
            "vocab_size": self.vocab_size,
            "d_model": self.d_model,
            "position": self.position,
            "pad_id": self.pad_id,
            "scale_embeddings": self.scale_embeddings,
            "embeddings_initializer": keras.initializers.serialize(self.embeddings_initializer),
        }


@keras.saving.register_keras_serializable(package="attnkit")
class LearnedPositionEmbedding(PositionEmbeddingFixedWeights):
    """Token embeddings plus one learned vector per position, as BERT-family models embed their input.

        x = Embedding(token) (* sqrt(d_model) when scale_embeddings) + Embedding(position)

    `PositionEmbeddingFixedWeights(..., position="learned")` under its own name: the same weights
    (`token_embedding`, `position_embedding`), call, mask and methods (docs/decisions.md item 47).

    Args:
        sequence_length: number of learned positions, the longest input accepted.
        vocab_size: number of token ids.
        d_model: width of the embeddings.
        pad_id: id of the padding token, masked out in the Keras mask; None for no mask. Default 0.
        scale_embeddings: multiply the token embeddings by sqrt(d_model). Default True (BERT: False).
        embeddings_initializer: initializer of both tables. Default "uniform".
        **kwargs: base `keras.layers.Layer` arguments (name, dtype, ...).

    Call arguments, Returns, Raises: as `PositionEmbeddingFixedWeights`.

    Example:
    >>> layer = LearnedPositionEmbedding(512, 30522, 384, pad_id=None, scale_embeddings=False)
    >>> layer(keras.ops.convert_to_tensor([[101, 7592, 102]])).shape  # (1, 3, 384)
    """

    def __init__(
        self, sequence_length, vocab_size, d_model, *, pad_id=0, scale_embeddings=True,
        embeddings_initializer="uniform", **kwargs,
    ):
        super().__init__(
            sequence_length, vocab_size, d_model, position="learned", pad_id=pad_id,
            scale_embeddings=scale_embeddings, embeddings_initializer=embeddings_initializer, **kwargs,
        )

    def get_config(self):
        config = super().get_config()
        del config["position"]
        return config


def position_embedding(position, sequence_length, vocab_size, d_model, **kwargs):
    """The embedding layer of a `position` kind: `LearnedPositionEmbedding` for "learned", else the
    seeds' `PositionEmbeddingFixedWeights` (which refuses an unknown kind)."""
    if position == "learned":
        return LearnedPositionEmbedding(sequence_length, vocab_size, d_model, **kwargs)
    return PositionEmbeddingFixedWeights(sequence_length, vocab_size, d_model, position=position, **kwargs)

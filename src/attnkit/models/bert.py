"""`BertEncoder`: a BERT-architecture encoder built from attnkit's own layers (Devlin et al., 2019).

    x = Dropout(LayerNorm(WordEmbedding(ids) + PositionEmbedding(positions) + TokenTypeEmbedding(types)))
    x = Projection(x)                                only when embedding_size differs from d_model
    x = EncoderLayer_n(... EncoderLayer_1(x))        post-LN layers, GELU (exact erf) feed-forward

This is the paper's encoder with learned positions, a second (segment) embedding and a layer norm on
the embeddings. The options cover the BERT family's variants as attnkit's own layers (docs/decisions.md
item 27): no token types (DistilBERT, `type_vocab_size=0`), positions counted past the padding id
(RoBERTa and XLM-R, `positions="after_padding"`), narrower embeddings projected up (ELECTRA,
`embedding_size`). `attnkit.load_pretrained` fills it with a Hugging Face checkpoint's weights.

Legend: B batch, T sequence length, h heads, d_k/d_v per-head widths, d_model model width, d_ff inner
width, n number of layers.
"""

import keras
from keras import ops

from attnkit._validation import positive_int
from attnkit.layers._policies import SublayerPolicies
from attnkit.layers._stack_config import StackConfig
from attnkit.layers._sublayer import call_layer_stack
from attnkit.layers._token_ids import check_token_ids
from attnkit.layers.encoder_layer import EncoderLayer
from attnkit.layers.linear import Linear
from attnkit.layers.position_embedding import LearnedPositionEmbedding


POSITION_KINDS = ("absolute", "after_padding")


@keras.saving.register_keras_serializable(package="attnkit")
class BertEncoder(StackConfig, SublayerPolicies, keras.Model):
    """Maps token ids (and token types) to one d_model vector per token, as BERT does.

    Args:
        vocab_size: number of token ids; ids must be in [0, vocab_size).
        sequence_length: number of learned positions, the longest input accepted.
        h: number of attention heads.
        d_k: per-head width of queries and keys.
        d_v: per-head width of values.
        d_model: width of the embeddings and of every layer's output.
        d_ff: inner width of the feed-forward networks.
        n: number of encoder layers.
        rate: dropout rate in [0, 1), after the embeddings and after every sub-layer. Default 0.1.
        type_vocab_size: number of token types (segments); 0 for no token-type embedding. Default 2.
        epsilon: layer norm epsilon (BERT: 1e-12). Default 1e-12.
        activation: "gelu" (default, exact erf), "gelu_tanh" (tanh approximation), "relu" or "silu" in the
            feed-forward networks.
        pad_id: id of the padding token, masked out when no `padding_mask` is given; None for none.
            Default 0.
        positions: "absolute" (default): token t has position t. "after_padding": as RoBERTa,
            real tokens count from pad_id + 1 and padding tokens take position pad_id, so inputs
            hold at most sequence_length - pad_id - 1 tokens.
        embedding_size: width of the embeddings when it differs from d_model (ELECTRA): they are
            normalised at that width, then projected to d_model. Default None: d_model.
        **kwargs: base `keras.Model` arguments (name, dtype, ...).

    Call arguments:
        token_ids: (B, T) integer ids, T <= `max_length`.
        padding_mask: optional keep-mask, (B, 1, T) True at real tokens, or any shape `EncoderLayer`
            takes (a 2-D mask when B == T is ambiguous and refused). Default: ids != pad_id.
        training: whether dropout is active.
        token_type_ids: keyword-only, (B, T) segment ids; default all 0.
        return_attention_weights: keyword-only; also return every layer's attention weights.

    Returns:
        (B, T, d_model); with `return_attention_weights`, (output, weights), weights a list of n
        arrays (B, h, T, T).

    Raises:
        ValueError: bad sizes or rate, an unknown activation; token ids that are not rank 2, longer
            than sequence_length or out of the vocabulary.
        TypeError: non-integer sizes, a float padding mask.

    Example:
    >>> bert = BertEncoder(30522, 512, h=12, d_k=32, d_v=32, d_model=384, d_ff=1536, n=6)
    >>> bert(keras.ops.convert_to_tensor([[101, 7592, 102]])).shape  # (1, 3, 384)

    References:
        Devlin et al., "BERT: Pre-training of Deep Bidirectional Transformers for Language
        Understanding", 2019; Vaswani et al., "Attention Is All You Need", 2017.
    """

    _config_fields = (
        "vocab_size", "sequence_length", "h", "d_k", "d_v", "d_model", "d_ff", "n", "rate", "type_vocab_size",
        "epsilon", "activation", "pad_id", "positions", "embedding_size",
    )

    def __init__(
        self, vocab_size, sequence_length, h, d_k, d_v, d_model, d_ff, n, rate=0.1, *, type_vocab_size=2,
        epsilon=1e-12, activation="gelu", pad_id=0, positions="absolute", embedding_size=None, **kwargs,
    ):
        super().__init__(**kwargs)
        self.set_sizes(
            vocab_size=vocab_size, sequence_length=sequence_length, h=h, d_k=d_k, d_v=d_v, d_model=d_model,
            d_ff=d_ff, n=n, rate=rate,
        )
        no_types = type_vocab_size == 0 and not isinstance(type_vocab_size, bool)
        self.type_vocab_size = 0 if no_types else positive_int("type_vocab_size", type_vocab_size)
        self.set_sizes(epsilon=epsilon, activation=activation)
        self.pad_id = pad_id
        if positions not in POSITION_KINDS:
            raise ValueError(f"`positions` must be one of {POSITION_KINDS}. Received: positions={positions!r}")
        if positions == "after_padding" and (pad_id is None or self.sequence_length <= pad_id + 1):
            raise ValueError(
                "`positions='after_padding'` needs a pad_id below sequence_length - 1. "
                f"Received: pad_id={pad_id!r}, sequence_length={self.sequence_length}"
            )
        self.positions = positions
        self.embedding_size = None if embedding_size is None else positive_int("embedding_size", embedding_size)
        width = self.embedding_size or self.d_model
        policy = self.dtype_policy
        # BERT adds learned positions to unscaled token embeddings; the padding mask is passed explicitly.
        self.token_position_embedding = LearnedPositionEmbedding(
            sequence_length, vocab_size, width, pad_id=None, scale_embeddings=False,
            name="token_position_embedding", dtype=policy,
        )
        self.token_type_embedding = None
        if self.type_vocab_size:
            self.token_type_embedding = keras.layers.Embedding(
                self.type_vocab_size, width, name="token_type_embedding", dtype=policy
            )
        self.embedding_norm = keras.layers.LayerNormalization(epsilon=self.epsilon, name="embedding_norm", dtype=policy)
        self.embedding_projection = None
        if self.embedding_size is not None and self.embedding_size != self.d_model:
            self.embedding_projection = Linear(self.d_model, name="embedding_projection", dtype=policy)
        self.dropout = keras.layers.Dropout(self.rate, name="dropout", dtype=policy)
        self.encoder_layers = [
            EncoderLayer(
                h, d_k, d_v, d_model, d_ff, self.rate, activation=activation, epsilon=self.epsilon,
                name=f"encoder_layer_{i}", dtype=policy,
            )
            for i in range(self.n)
        ]

    @property
    def max_length(self):
        """The longest input in tokens: sequence_length, less the positions below pad_id + 1 with
        `positions="after_padding"`."""
        if self.positions == "after_padding":
            return self.sequence_length - self.pad_id - 1
        return self.sequence_length

    def build(self, token_ids_shape, padding_mask_shape=None):
        self.token_position_embedding.build(token_ids_shape)
        if self.token_type_embedding is not None:
            self.token_type_embedding.build(token_ids_shape)
        embedded_shape = tuple(token_ids_shape) + (self.embedding_size or self.d_model,)  # (B, T, width)
        self.embedding_norm.build(embedded_shape)
        if self.embedding_projection is not None:
            self.embedding_projection.build(embedded_shape)
        x_shape = tuple(token_ids_shape) + (self.d_model,)  # (B, T, d_model)
        for layer in self.encoder_layers:
            layer.build(x_shape)
        self.built = True

    def call(
        self, token_ids, padding_mask=None, training=None, *, token_type_ids=None, return_attention_weights=False
    ):
        ids = check_token_ids(token_ids, self.vocab_size, self.max_length, "token_ids")  # (B, T)
        if padding_mask is None and self.pad_id is not None:
            padding_mask = ops.not_equal(ids, ops.cast(self.pad_id, ids.dtype))[:, None, :]  # (B, 1, T)
        if self.positions == "after_padding":
            # RoBERTa's create_position_ids_from_input_ids: real tokens count from pad_id + 1, padding
            # tokens (by id, whatever the mask) stay at pad_id.
            real = ops.cast(ops.not_equal(ids, ops.cast(self.pad_id, ids.dtype)), "int32")  # (B, T)
            position_ids = ops.cumsum(real, axis=1) * real + self.pad_id  # (B, T)
            x = self.token_position_embedding.embed_at(ids, position_ids=position_ids)  # (B, T, width)
        else:
            x = self.token_position_embedding(ids)  # (B, T, width)
        if self.token_type_embedding is not None:
            if token_type_ids is None:
                token_type_ids = ops.zeros_like(ids)
            x = x + self.token_type_embedding(token_type_ids)  # (B, T, width)
        elif token_type_ids is not None:
            raise ValueError("`token_type_ids` was given, but this encoder has no token types (type_vocab_size=0)")
        x = self.embedding_norm(x)
        if self.embedding_projection is not None:
            x = self.embedding_projection(x)  # (B, T, d_model)
        x = self.dropout(x, training=training)
        return call_layer_stack(self.encoder_layers, x, padding_mask, training, return_attention_weights)

    def compute_output_shape(self, token_ids_shape, padding_mask_shape=None):
        return tuple(token_ids_shape) + (self.d_model,)

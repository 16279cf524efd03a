"""Keras layers, one public class per file."""

from attnkit.layers.add_normalization import AddNormalization
from attnkit.layers.additive_attention import AdditiveAttention
from attnkit.layers.decoder import Decoder
from attnkit.layers.decoder_layer import DecoderLayer
from attnkit.layers.dot_product_attention import DotProductAttention
from attnkit.layers.encoder import Encoder
from attnkit.layers.encoder_layer import EncoderLayer
from attnkit.layers.feed_forward import FeedForward
from attnkit.layers.linear import Linear
from attnkit.layers.multi_head_attention import MultiHeadAttention
from attnkit.layers.position_embedding import LearnedPositionEmbedding, PositionEmbeddingFixedWeights
from attnkit.layers.sinusoidal_position_encoding import SinusoidalPositionEncoding

__all__ = [
    "AddNormalization",
    "AdditiveAttention",
    "Decoder",
    "DecoderLayer",
    "DotProductAttention",
    "Encoder",
    "EncoderLayer",
    "FeedForward",
    "LearnedPositionEmbedding",
    "Linear",
    "MultiHeadAttention",
    "PositionEmbeddingFixedWeights",
    "SinusoidalPositionEncoding",
]

"""attnkit: attention and the Transformer from first principles, as Keras 3 layers.

Runs on PyTorch (default), JAX and TensorFlow. Masks: True = may attend (see `attnkit.ops.masks`).
"""

from attnkit import _backend  # noqa: F401  (must run before Keras is imported)
from attnkit.layers import (
    AdditiveAttention,
    AddNormalization,
    Decoder,
    DecoderLayer,
    DotProductAttention,
    Encoder,
    EncoderLayer,
    FeedForward,
    Linear,
    MultiHeadAttention,
    PositionEmbeddingFixedWeights,
    LearnedPositionEmbedding,
    SinusoidalPositionEncoding,
)
from attnkit.models.bert import BertEncoder
from attnkit.models.causal_lm import CausalLM
from attnkit.models.decoding import Decoded, beam_search, greedy_decode
from attnkit.models.transformer import Transformer
from attnkit.ops import (
    MaskDtypeError,
    causal_mask,
    combine_masks,
    from_hide_mask,
    from_key_padding_mask,
    fused_attention,
    padding_mask,
    scaled_dot_product_attention,
)
from attnkit.ops.position_encoding import sinusoidal_position_encoding
from attnkit.pipelines.causal_checkpoint import load_causal_lm
from attnkit.pipelines.causal_lm import PretrainedCausalLM
from attnkit.pipelines.encoder import PretrainedEncoder, load_pretrained

__version__ = "0.1.0"

__all__ = [
    "AddNormalization",
    "AdditiveAttention",
    "BertEncoder",
    "CausalLM",
    "Decoded",
    "Decoder",
    "DecoderLayer",
    "DotProductAttention",
    "Encoder",
    "EncoderLayer",
    "FeedForward",
    "Linear",
    "MaskDtypeError",
    "MultiHeadAttention",
    "PositionEmbeddingFixedWeights",
    "LearnedPositionEmbedding",
    "PretrainedCausalLM",
    "PretrainedEncoder",
    "SinusoidalPositionEncoding",
    "Transformer",
    "beam_search",
    "causal_mask",
    "combine_masks",
    "from_hide_mask",
    "from_key_padding_mask",
    "fused_attention",
    "greedy_decode",
    "load_causal_lm",
    "load_pretrained",
    "padding_mask",
    "scaled_dot_product_attention",
    "sinusoidal_position_encoding",
]

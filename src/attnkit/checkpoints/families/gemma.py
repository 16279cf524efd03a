"""Gemma (model_type gemma): GeGLU with GELU's tanh approximation, RMSNorms scaling by 1 + weight,
embeddings multiplied by sqrt(d_model) in the model's dtype, tied embeddings and head_dim 256 by default.

Gemma 2 and 3 (soft-capping, alternating sliding windows, extra norms) are other model_types, refused
by name by the registry. llama.cpp's Gemma files store the norms plus one and a SentencePiece
tokenizer: not read (no `gguf` entry)."""

from attnkit.checkpoints.families import _decoder_fields
from attnkit.checkpoints.families.decoder_family import LLAMA_LAYER, DecoderFamily

# GemmaConfig turns the legacy "gelu" into gelu_pytorch_tanh; gelu_pytorch_tanh is its default.
GELU_TANH = {"gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu_tanh"}


def arguments(source, config):
    args = _decoder_fields.common_arguments(source, config, activations=GELU_TANH, head_dim=256, tie=True)
    _decoder_fields.refuse(source, config, "use_bidirectional_attention", (None, False), "attention over later tokens")
    biased = _decoder_fields.field(source, config, "attention_bias", _decoder_fields.BOOLEAN, False)  # W_q, W_k, W_v and W_o
    return dict(args, attention_bias=biased, output_bias=biased, mlp_bias=False, norm_offset=1.0,
                embedding_scale=args["d_model"] ** 0.5, sliding_windows=[None] * args["n"])


FAMILY = DecoderFamily(
    name="Gemma",
    model_types=("gemma",),
    arguments=arguments,
    layer_weights=LLAMA_LAYER,
    joined={},
    tokenizer_classes={"gemma": "GemmaTokenizer"},
    gguf={},
)

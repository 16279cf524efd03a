"""Llama, Mistral and Qwen2 (model_type llama, mistral, qwen2): Llama's block with SiLU, plain RMSNorm,
biases and sliding windows as each model_type's transformers class has them."""

from attnkit.checkpoints.families import _decoder_fields
from attnkit.checkpoints.families.decoder_family import LLAMA_GGUF_LAYER, LLAMA_LAYER, DecoderFamily, Gguf

SILU = {"silu": "silu", "swish": "silu"}  # transformers' ACT2FN maps "swish" to torch's SiLU too


def arguments(source, config):
    model_type = config["model_type"]
    args = _decoder_fields.common_arguments(source, config, activations=SILU)
    n = args["n"]
    if model_type == "llama":  # attention_bias biases W_q, W_k, W_v and W_o; no sliding window is read
        biased = _decoder_fields.field(source, config, "attention_bias", _decoder_fields.BOOLEAN, False)
        windows, output_bias = [None] * n, biased
        mlp_bias = _decoder_fields.field(source, config, "mlp_bias", _decoder_fields.BOOLEAN, False)
    else:  # Qwen2: W_q, W_k, W_v biased, W_o not; neither MLP has biases whatever mlp_bias says
        _decoder_fields.field(source, config, "mlp_bias", _decoder_fields.BOOLEAN, False)
        biased, output_bias, mlp_bias = model_type == "qwen2", False, False
        if model_type == "mistral":
            windows = _decoder_fields.every_layer_windows(source, config, n, 4096)  # MistralConfig's default
        else:
            windows = _decoder_fields.qwen_windows(source, config, n)
    return dict(args, attention_bias=biased, output_bias=output_bias, mlp_bias=mlp_bias, sliding_windows=windows)


FAMILY = DecoderFamily(
    name="Llama",
    model_types=("llama", "mistral", "qwen2"),
    arguments=arguments,
    layer_weights=LLAMA_LAYER,
    joined={},
    tokenizer_classes={"mistral": "TokenizersBackend", "qwen2": "Qwen2Tokenizer"},
    gguf={"llama": Gguf(True, LLAMA_GGUF_LAYER), "qwen2": Gguf(False, LLAMA_GGUF_LAYER)},
)

"""Qwen3 (model_type qwen3): Qwen2's block without its q/k/v biases, with an RMSNorm over each head's
queries and keys before RoPE (q_norm, k_norm), head_dim 128 by default."""

from attnkit.checkpoints.families import _decoder_fields
from attnkit.checkpoints.families.decoder_family import LLAMA_GGUF_LAYER, LLAMA_LAYER, DecoderFamily, Gguf
from attnkit.checkpoints.families.llama import SILU


def arguments(source, config):
    args = _decoder_fields.common_arguments(source, config, activations=SILU, head_dim=128)  # Qwen3Config's head_dim
    biased = _decoder_fields.field(source, config, "attention_bias", _decoder_fields.BOOLEAN, False)  # W_q, W_k, W_v and W_o
    return dict(args, attention_bias=biased, output_bias=biased, mlp_bias=False, qk_norm=True,
                sliding_windows=_decoder_fields.qwen_windows(source, config, args["n"]))


NORMS = {"q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm"}

FAMILY = DecoderFamily(
    name="Qwen3",
    model_types=("qwen3",),
    arguments=arguments,
    layer_weights={**LLAMA_LAYER, **NORMS},
    joined={},
    tokenizer_classes={"qwen3": "Qwen2Tokenizer"},
    gguf={"qwen3": Gguf(False, {**LLAMA_GGUF_LAYER, "attn_q_norm": NORMS["q_norm"], "attn_k_norm": NORMS["k_norm"]})},
)

"""Phi-3 (model_type phi3): Llama's block with W_q, W_k, W_v stored as one qkv_proj and W_gate, W_up
as one gate_up_proj (split on loading), rms_norm_eps 1e-5 and an optional window on every layer.

Phi-3's long-context RoPE ("longrope", formerly "su" / "yarn") and partial rotation are refused by
name (`_decoder_fields.rope_theta`). llama.cpp's Phi-3 files carry a SentencePiece tokenizer: not read."""

from attnkit.checkpoints.families import _decoder_fields
from attnkit.checkpoints.families.decoder_family import LLAMA_LAYER, DecoderFamily
from attnkit.checkpoints.families.llama import SILU


def arguments(source, config):
    args = _decoder_fields.common_arguments(source, config, activations=SILU, epsilon=1e-5)  # Phi3Config's eps
    windows = _decoder_fields.every_layer_windows(source, config, args["n"], None)  # Phi3Config: no window
    return dict(args, attention_bias=False, output_bias=False, mlp_bias=False, sliding_windows=windows)


FAMILY = DecoderFamily(
    name="Phi-3",
    model_types=("phi3",),
    arguments=arguments,
    layer_weights={role: name for role, name in LLAMA_LAYER.items() if role not in ("q", "k", "v", "gate", "up")},
    joined={"self_attn.qkv_proj": ("q", "k", "v"), "mlp.gate_up_proj": ("gate", "up")},
    tokenizer_classes={},
    gguf={},
)

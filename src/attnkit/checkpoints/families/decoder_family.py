"""`DecoderFamily`: what attnkit knows of one decoder-only family's checkpoints (docs/decisions.md
item 101), as `families.family.Family` is for an encoder family.

A family is data: its config fields become `CausalLM` arguments (the block options among them), its
tensor names (Hugging Face and GGUF) become the model's variables, and it names the tokenizer class
transformers' AutoTokenizer builds for it. The loader (`pipelines.causal_checkpoint`) is the same for all.
"""

from typing import Callable, NamedTuple

# A block's weights by role, under "model.layers.{i}." (".weight" / ".bias" appended): Llama's names,
# which most families keep.
LLAMA_LAYER = {
    "q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
    "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj",
    "attention_norm": "input_layernorm", "feed_forward_norm": "post_attention_layernorm",
}
# llama.cpp's names of a block's tensors ("blk.{i}.<name>.weight") as Hugging Face names them.
LLAMA_GGUF_LAYER = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}


class Gguf(NamedTuple):
    """How llama.cpp stores one architecture of the family.

    Attributes:
        permuted: whether W_q and W_k are stored permuted for llama.cpp's interleaved rotary layout
            (its converter permutes them for "llama" only).
        layer_names: {GGUF block tensor name: Hugging Face name under "model.layers.{i}."}.
    """

    permuted: bool
    layer_names: dict


class DecoderFamily(NamedTuple):
    """One decoder-only family.

    Attributes:
        name: the family's name in messages and docs ("Llama", ...).
        model_types: config.json `model_type` values of the family.
        arguments: (source, config) -> CausalLM keyword arguments (sizes, RoPE, biases, windows and the
            block options activation, norm_offset, qk_norm, embedding_scale); refuses what attnkit
            does not implement, by name.
        layer_weights: {role: Hugging Face name under "model.layers.{i}."}; roles q, k, v, o, gate,
            up, down, attention_norm, feed_forward_norm, q_norm, k_norm.
        joined: {Hugging Face name: roles}: one stored tensor holding several roles' rows in order
            (Phi-3's qkv_proj, gate_up_proj), split on loading.
        tokenizer_classes: {model_type: the class AutoTokenizer builds for it whatever tokenizer_config.json
            declares} where transformers registers one ("TokenizersBackend": tokenizer.json as it is).
        gguf: {GGUF general.architecture: `Gguf`} of the architectures attnkit reads.
    """

    name: str
    model_types: tuple
    arguments: Callable
    layer_weights: dict
    joined: dict
    tokenizer_classes: dict
    gguf: dict

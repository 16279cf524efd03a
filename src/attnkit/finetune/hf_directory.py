"""A fine-tuned `CausalLM` written as a Hugging Face directory that transformers and `load_causal_lm` load.

    config.json              model_type llama (qwen2 / qwen3 / mistral where the biases, q/k norms or windows say so)
    model.safetensors        the weights, LoRA merged, under transformers' names, float32
    tokenizer.json           the tokenizer as attnkit runs it (a GGUF's rebuilt one included)
    tokenizer_config.json    PreTrainedTokenizerFast over that file, the special tokens, the chat template
    generation_config.json   the stop and padding ids and the model's generation defaults

Every file is written aside and renamed into place (`attnkit._atomic_save.replace_tree`).
"""

import json
import os

from attnkit._atomic_save import replace_tree
from attnkit.checkpoints.context import context_length
from attnkit.checkpoints.export import stale_model_files
from attnkit.finetune.lora import merged_weights

MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json")
# The model_types written here: their modules have the names PEFT's adapter uses (`lora.TARGETS`).
WRITTEN_TYPES = ("llama", "qwen2", "qwen3", "mistral")


def model_config(lm):
    """config.json for `lm.model`: the family whose options express its biases, windows and q/k norms,
    else refused: a config that left out one of the model's options would load as another model."""
    m = lm.model
    windows = set(m.sliding_windows)
    # No family written here expresses Gemma's GELU, norms scaling by 1 + weight or scaled embeddings.
    if m.activation != "silu" or m.norm_offset != 0 or m.embedding_scale is not None:
        raise ValueError(
            "attnkit writes llama, qwen2, qwen3 and mistral directories, whose blocks use SiLU, plain RMSNorms and "
            f"unscaled embeddings. Received: activation={m.activation!r}, norm_offset={m.norm_offset}, "
            f"embedding_scale={m.embedding_scale}"
        )
    config = {
        "vocab_size": m.vocab_size, "hidden_size": m.d_model, "intermediate_size": m.d_ff, "num_hidden_layers": m.n,
        "num_attention_heads": m.h, "num_key_value_heads": m.num_kv_heads, "head_dim": m.d_k,
        "rms_norm_eps": m.epsilon, "rope_theta": m.rope_theta, "tie_word_embeddings": m.tie_embeddings,
        "hidden_act": "silu", "torch_dtype": "float32",
    }
    context = base_context_length(lm)
    if context is not None:  # the base's: 8192 here made a 64-token model claim 8192 in transformers and `serve`
        config["max_position_embeddings"] = context
    if m.qk_norm:  # Qwen3's q_norm and k_norm: a llama config would load without them
        if windows != {None} or m.attention_bias != m.output_bias or m.mlp_bias:
            raise ValueError(
                "attnkit writes a model with q/k norms as qwen3, without sliding windows, with biases on all of W_q, "
                f"W_k, W_v, W_o or none, and none in the MLP. Received: attention_bias={m.attention_bias}, "
                f"output_bias={m.output_bias}, mlp_bias={m.mlp_bias}, sliding_windows={m.sliding_windows}"
            )
        config.update(model_type="qwen3", architectures=["Qwen3ForCausalLM"], attention_bias=m.attention_bias,
                      use_sliding_window=False)
    elif windows == {None} and m.attention_bias == m.output_bias:
        config.update(model_type="llama", architectures=["LlamaForCausalLM"], attention_bias=m.attention_bias, mlp_bias=m.mlp_bias)
    elif windows == {None} and m.attention_bias and not m.output_bias and not m.mlp_bias:
        config.update(model_type="qwen2", architectures=["Qwen2ForCausalLM"], use_sliding_window=False)
    elif len(windows) == 1 and not (m.attention_bias or m.output_bias or m.mlp_bias):
        config.update(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=windows.pop())
    else:
        raise ValueError(
            "attnkit writes llama, qwen2, qwen3 and mistral directories; this model's biases and sliding windows fit none of them. "
            f"Received: attention_bias={m.attention_bias}, output_bias={m.output_bias}, mlp_bias={m.mlp_bias}, "
            f"sliding_windows={m.sliding_windows}"
        )
    tokens = _token_ids(lm)
    config.update({f"{k}_token_id": v for k, v in tokens.items() if k in ("bos", "eos", "pad")})
    config["eos_token_id"] = lm.stop_ids[0] if len(lm.stop_ids) == 1 else (lm.stop_ids or None)
    config["pad_token_id"] = lm.pad_id
    return config


def base_context_length(lm):
    """The context length of the model `lm` was loaded from (`context_length`), or None where its
    file or config.json gives none: then the written directory gives none either."""
    if lm.path is None:  # a model built in code
        return None
    try:
        return context_length(lm.path)
    except (ValueError, OSError, KeyError):
        return None


def _token_ids(lm):
    ids = {}
    for key, text in lm.special_tokens.items():
        token_id = lm.tokenizer.token_to_id(text) if lm.tokenizer is not None and isinstance(text, str) else None
        if token_id is not None:
            ids[key.removesuffix("_token")] = token_id
    return ids


def tokenizer_config(lm):
    settings = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    context = base_context_length(lm)
    if context is not None:
        settings["model_max_length"] = context
    settings.update({k: v for k, v in lm.special_tokens.items() if k in ("bos_token", "eos_token", "unk_token", "pad_token")})
    if lm.chat_template:
        settings["chat_template"] = lm.chat_template
    return settings


def write_model_directory(lm, directory, weights=None):
    """Writes `lm` (a `PretrainedCausalLM`; its LoRA merged) as a Hugging Face directory into `directory`,
    all files or none; a model's files there that this one does not have (an earlier model's
    chat_template.jinja, added_tokens.json, weight shards: `stale_model_files`) go, others stay.
    `weights`: {HF name: array} to write instead of the model's own (the base model, say)."""
    replace_tree(directory, lambda staging: write_model_files(lm, staging, weights), remove=stale_model_files(directory))


def write_model_files(lm, directory, weights=None):
    """MODEL_FILES of `lm` written into `directory` as they are (a staging directory of `replace_tree`)."""
    from safetensors.numpy import save_file

    if lm.tokenizer is None:
        raise ValueError(f"The model at {lm.path} has no tokenizer; a fine-tuned directory needs one")
    config = model_config(lm)
    weights = merged_weights(lm.model) if weights is None else weights
    if lm.model.tie_embeddings:
        weights.pop("lm_head.weight", None)
    generation = {**generation_fields(lm.generation_defaults), "eos_token_id": config["eos_token_id"], "pad_token_id": lm.pad_id}
    if "bos_token_id" in config:
        generation["bos_token_id"] = config["bos_token_id"]
    _json(os.path.join(directory, "config.json"), config)
    save_file(weights, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    lm.tokenizer.save(os.path.join(directory, "tokenizer.json"))
    _json(os.path.join(directory, "tokenizer_config.json"), tokenizer_config(lm))
    _json(os.path.join(directory, "generation_config.json"), generation)


def generation_fields(defaults):
    """generation_config.json's fields of attnkit's generation defaults (temperature 0 = greedy, top_k
    None = no filter, top_p None = 1), as `read_generation_defaults` and transformers read them back.

    The defaults are not the file's fields: transformers samples only with "do_sample": true (a bare
    temperature is ignored, with a warning), and attnkit reads a file without it as greedy, so a base
    model that sampled at its temperature would come back greedy in attnkit and in transformers."""
    fields = {}
    if defaults.get("repetition_penalty", 1) != 1:
        fields["repetition_penalty"] = defaults["repetition_penalty"]
    temperature = defaults.get("temperature") or 0.0
    if temperature == 0:
        return {"do_sample": False, **fields}
    fields.update(do_sample=True, temperature=temperature, top_k=defaults.get("top_k") or 0)  # 0: no top-k, in both
    if defaults.get("top_p") is not None:
        fields["top_p"] = defaults["top_p"]
    return fields


def _json(path, data):
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2)
        f.write("\n")

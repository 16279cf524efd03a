"""A tiny random llama directory with a byte-level tokenizer and a ChatML template (SmolLM2's form),
saved by transformers at test time, and small JSON-lines data sets."""

import json

from attnkit.checkpoints.formats.gguf import bytes_to_unicode
from attnkit.dates import task as dates

# SmolLM2-135M-Instruct's template (its default system message shortened)
TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are SmolLM.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def save_tiny_llama(path, *, seed=0, layers=2, family="llama", **config_fields):
    """Writes a tiny LlamaForCausalLM (vocabulary: 256 bytes + 3 special tokens) into `path`; returns str(path).
    `family` "phi3": a Phi3ForCausalLM (fused qkv_proj and gate_up_proj) of the same sizes; `config_fields`
    override the config's."""
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {c: i for i, c in enumerate(bytes_to_unicode().values())}
    for i, token in enumerate(SPECIAL):
        vocab[token] = 256 + i
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(SPECIAL)
    tokenizer.save(str(path / "tokenizer.json"))
    with open(path / "tokenizer_config.json", "w") as f:
        json.dump({"chat_template": TEMPLATE, "eos_token": "<|im_end|>", "bos_token": "<|im_start|>",
                   "pad_token": "<|endoftext|>", "tokenizer_class": "PreTrainedTokenizerFast"}, f)
    torch.manual_seed(seed)
    fields = dict(vocab_size=259, hidden_size=32, intermediate_size=48, num_hidden_layers=layers, num_attention_heads=4,
                  num_key_value_heads=2, eos_token_id=258, bos_token_id=257, pad_token_id=256, tie_word_embeddings=True)
    config_class, model_class = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                                 "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM)}[family]
    model_class(config_class(**{**fields, **config_fields})).save_pretrained(path)
    return str(path)


def write_jsonl(path, records):
    with open(path, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
    return str(path)


def date_chats(n, seed=0):
    return [{"messages": [{"role": "user", "content": f"Normalise: {s}"}, {"role": "assistant", "content": t}]}
            for s, t in dates.generate(n, seed)]

"""A tiny random-initialised llama directory with a byte-level tokenizer (257 ids: the 256 bytes, then
"<s>", its end-of-sequence token), saved by transformers, for the language model's input and command
tests."""

import json

CHAT_TEMPLATE = "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}<s>assistant: {% endif %}"


def save_tiny_llama(path, *, eos_token_id=256, vocab_size=257, zero_norm=False, generation=None):
    """Writes the directory at `path` (a pathlib.Path); returns it as a str.

    zero_norm: the final norm's weight set to 0, so every logit is 0 and greedy decoding picks id 0.
    generation: generation_config.json's fields, when given."""
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from attnkit.checkpoints.formats.gguf import bytes_to_unicode

    path.mkdir(parents=True, exist_ok=True)
    vocab = {c: i for i, c in enumerate(bytes_to_unicode().values())}
    vocab["<s>"] = 256
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<s>"])
    tokenizer.save(str(path / "tokenizer.json"))
    with open(path / "tokenizer_config.json", "w") as f:
        json.dump({"chat_template": CHAT_TEMPLATE, "eos_token": "<s>"}, f)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, eos_token_id=eos_token_id)
    model = transformers.LlamaForCausalLM(config)
    if zero_norm:
        with torch.no_grad():
            model.model.norm.weight.zero_()
    model.save_pretrained(path)
    if generation is not None:
        with open(path / "generation_config.json", "w") as f:
            json.dump(generation, f)
    return str(path)


def byte_id(byte):
    """The token id of one byte in the tiny tokenizer."""
    from attnkit.checkpoints.formats.gguf import bytes_to_unicode

    return list(bytes_to_unicode()).index(byte)

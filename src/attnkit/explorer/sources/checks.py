"""The text every source takes, checked once: `check_text`, and `BadInput` for text a source refuses."""


class BadInput(ValueError):
    """Text a source refuses (empty, not valid Unicode): a message in the page, HTTP 400 from the server."""


def check_text(text):
    """`text` as a non-empty string; raises `BadInput` (empty, only spaces, or a lone surrogate) or TypeError."""
    if not isinstance(text, str):
        raise TypeError(f"`text` must be a string. Received: text of type {type(text).__name__}")
    try:  # JSON's "\ud800" escape gives a lone surrogate: no tokenizer takes it, no UTF-8 answer holds it
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise BadInput(
            f"The text is not valid Unicode: a lone surrogate \\u{ord(text[e.start]):04x} at offset {e.start}"
        ) from None
    if not text.strip():
        raise BadInput("The text is empty: type a sentence to see its attention.")
    return text

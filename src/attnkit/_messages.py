"""One-line error text and field escaping: the ground floor that the command, the explorer's server and
the training workers share, so that none of them imports another (docs/decisions.md item 96)."""

import re
import unicodedata

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def original(error):
    """The error a tf.function raised, rather than tensorflow's StagingError ("in user code:" and
    a traceback), which keeps the original as its context."""
    while str(error).startswith("in user code:") and (error.__cause__ or error.__context__) is not None:
        error = error.__cause__ or error.__context__
    return error


def one_line(error):
    r"""The first meaningful line of an exception's message, without terminal colour codes.

    Keras re-raises an error from inside a layer's `call` as "Exception encountered when calling
    X.call().\n\n<the original message, in bold>\n\nArguments received by X.call(): ...": the
    original message is the line after that header.
    """
    lines = [line.strip() for line in _ANSI.sub("", str(error)).splitlines()]
    lines = [line for line in lines if line and not line.startswith("Exception encountered when calling")]
    if not lines:
        return type(error).__name__
    return lines[0]


_ESCAPES = {"\\": "\\\\", "\t": "\\t", "\n": "\\n", "\r": "\\r"}
_LINE_BREAKS = "\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"  # str.splitlines also breaks on these


def field(text):
    r"""`text` as one tab-separated field on one line: backslash, tab, CR and LF written as \\, \t, \r,
    \n, the other characters line splitters break on and every other control character (NUL, ESC: a
    terminal would act on them) as \xNN or \uNNNN; other text unchanged."""
    out = []
    for c in text:
        if c in _ESCAPES:
            out.append(_ESCAPES[c])
        elif c in _LINE_BREAKS or unicodedata.category(c) == "Cc":
            out.append(f"\\x{ord(c):02x}" if ord(c) < 256 else f"\\u{ord(c):04x}")
        else:
            out.append(c)
    return "".join(out)


def terminal_text(text):
    r"""Generated text as the terminal shows it: `field`'s escapes for control characters (ESC, BEL,
    CR, backspace, NUL, ...: a terminal would act on them), but newline and tab kept, which lay out a
    reply's lines; other text, backslashes included, unchanged (docs/decisions.md item 108)."""
    return "".join(
        c if c in "\n\t" or not (c in _LINE_BREAKS or unicodedata.category(c) == "Cc")
        else (f"\\x{ord(c):02x}" if ord(c) < 256 else f"\\u{ord(c):04x}")
        for c in text
    )

"""Reading texts one per line, from a file or stdin, the same way for every command."""

import sys

from attnkit.cli.errors import CommandError


def split_lines(text):
    """Splits on "\\n" only (a trailing "\\r" is dropped from each line), not on the other characters
    `str.splitlines` treats as line breaks (\\x0b, \\x0c, \\x1c-\\x1e, \\x85, \\u2028, \\u2029), which
    may sit inside a line. A final "\\n" ends the last line rather than starting an empty one."""
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()
    return [line.removesuffix("\r") for line in lines]


def read_lines(source):
    """The lines of `source`: a file's path, or "-" for stdin (both UTF-8).

    Raises:
        CommandError: a file that cannot be read, or bytes that are not UTF-8, naming the file.
    """
    name = "stdin" if source == "-" else source
    try:
        if source == "-":
            stream = getattr(sys.stdin, "buffer", None)  # bytes: no newline translation by Python
            data = stream.read() if stream is not None else sys.stdin.read()
        else:
            with open(source, "rb") as f:
                data = f.read()
        text = data.decode("utf-8") if isinstance(data, bytes) else data
    except OSError as e:
        raise CommandError(f"cannot read --input {name}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise CommandError(
            f"cannot read --input {name}: not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start})"
        ) from None
    return split_lines(text)

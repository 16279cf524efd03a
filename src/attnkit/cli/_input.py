"""Reading texts one per line, from arguments, a file or stdin, the same way for every command.

The line-for-line rule (docs/decisions.md item 26): every command that takes texts answers each one,
in order, with exactly one result, and N texts give N results for every N, 0 included.
"""

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
        text = data.decode("utf-8-sig") if isinstance(data, bytes) else data  # a leading byte-order mark is not text
    except OSError as e:
        raise CommandError(f"cannot read --input {name}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise CommandError(
            f"cannot read --input {name}: not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start})"
        ) from None
    return split_lines(text)


def read_texts(args):
    """The texts of a command: its arguments, `--input FILE` (`-` for stdin), or stdin when neither is
    given and stdin is not a terminal (the Unix convention: `echo "3/3/21" | attnkit translate ...`).

    Raises:
        CommandError: both arguments and --input, or nothing given while stdin is a terminal.
    """
    if args.input == "":
        raise CommandError("--input must not be empty: give a file, or - for stdin")
    if args.texts and args.input is not None:
        raise CommandError("give texts as arguments or with --input, not both")
    if args.input is not None:
        return read_lines(args.input)  # one text per "\n"-separated line, blank lines included
    if args.texts:
        return list(args.texts)
    stdin = sys.stdin
    if stdin is None or stdin.isatty():
        raise CommandError("no texts: give them as arguments, one per line with --input FILE, or on stdin")
    return read_lines("-")


def note_no_texts(args):
    """Says on stderr that the input held no texts (the commands then print no results, exit 0)."""
    source = "stdin" if args.input in (None, "-") else args.input
    print(f"attnkit: note: {source} held no texts", file=sys.stderr)

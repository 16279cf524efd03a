"""What the `attnkit` command treats as a user's mistake: one line on stderr, exit status 2."""

import argparse
import os


class CommandError(Exception):
    """A user error: printed as one line, exit status 2."""


class Parser(argparse.ArgumentParser):
    """argparse that raises `CommandError` instead of printing usage and exiting."""

    def error(self, message):
        raise CommandError(message)


def positive_int(text):
    """An argparse type: a positive integer."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, not {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, not {text!r}")
    return value


def non_negative_int(text):
    """An argparse type: an integer >= 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, not {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, not {text!r}")
    return value


def seed(text):
    """An argparse type: a seed, an integer in [0, 2**32 - 1] (NumPy's and Keras's range)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer in [0, 2**32 - 1], not {text!r}") from None
    if not 0 <= value < 2**32:
        raise argparse.ArgumentTypeError(f"must be an integer in [0, 2**32 - 1], not {text!r}")
    return value


def utf8_text(text):
    """An argparse type: a text argument, refused when the command line's bytes are not UTF-8 (Python
    keeps such bytes as lone surrogates, which no tokenizer takes)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raw = os.fsencode(text)
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise argparse.ArgumentTypeError(f"is not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start})") from None
        raise argparse.ArgumentTypeError("is not UTF-8 text") from None
    return text

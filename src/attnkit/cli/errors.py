"""What the `attnkit` command treats as a user's mistake: one line on stderr, exit status 2."""

import argparse


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

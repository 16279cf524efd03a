"""Writing a command's output file: refused before any work if it could not be written, then written
aside and renamed into place, so an interrupt never leaves a half-written file or destroys the old one
(docs/decisions.md item 23)."""

import os

from attnkit._atomic_save import check_replaceable, probe_writable, remove_created, replace_files
from attnkit.cli.errors import CommandError


def check_output_file(path, force):
    """Refuses `path` before any work: an existing file without --force, something that is not a
    regular file, or a directory where no file can be written (proved by writing one)."""
    directory, name = os.path.split(path)
    directory = directory or "."
    if not name:
        raise CommandError(f"--output {path} names a directory, not a file")
    if os.path.lexists(path) and not force:
        raise CommandError(f"{path} already exists; pass --force to overwrite it")
    if not os.path.isdir(directory):
        raise CommandError(f"--output {path}: no directory {directory}")
    try:
        check_replaceable(directory, [name])
        remove_created(probe_writable(directory))  # creates nothing here: the directory exists
    except ValueError as e:
        raise CommandError(f"--output: {e}") from None
    except OSError as e:
        raise CommandError(f"--output {path} cannot be written: {e.strerror or e}") from None


def write_output_file(path, write):
    """`write(aside)` writes the file at a path beside `path`; it then replaces `path` in one rename."""
    directory, name = os.path.split(path)
    replace_files(directory or ".", {name: write})

"""What the fault tests share: the CLI's tiny training options and checks of what it printed."""

import os

TINY = ["--epochs", "1", "--train-size", "64", "--batch-size", "32", "--d-model", "16", "--heads", "2",
        "--layers", "1", "--d-ff", "32", "--quiet"]


def one_line_error(capsys):
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("attnkit: error:"), err
    return err


def contents(directory):
    """{name: bytes} of every file in `directory`, hidden ones included."""
    return {name: (directory / name).read_bytes() for name in sorted(os.listdir(directory))
            if (directory / name).is_file()}

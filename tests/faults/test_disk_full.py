"""A full disk (or any OSError that names no file) is reported naming the file being written
(docs/decisions.md item 114): `[Errno 28] No space left on device` alone said nothing of where."""

import errno
import os

import pytest
from fault_helpers import TINY, contents, one_line_error

from attnkit import cli
from attnkit.dates import translator as translation
from attnkit._atomic_save import replace_files
from backend_utils import once_per_run

pytestmark = once_per_run  # writing, checking and refusing files: the same code whatever the backend


def _full(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # as a write() on a full disk raises it


def test_a_full_disk_while_saving_names_the_file(tmp_path, monkeypatch, capsys, tiny_translator):
    monkeypatch.setattr(translation, "save_model", _full)
    out = tmp_path / "out"
    monkeypatch.setattr(translation, "train_dates", lambda *a, **k: (tiny_translator, [("3/3/21", "2021-03-03")], None))
    assert cli.main(["train", *TINY, "--output-dir", str(out)]) == 1
    assert one_line_error(capsys) == f"attnkit: error: [Errno 28] No space left on device: '{out / 'model.keras'}'"
    assert not out.exists()  # the directory the command made is gone again


def test_a_full_disk_in_a_library_save_names_the_file(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"old")

    def write(path):
        with open(path, "wb") as f:
            f.write(b"new")
        _full()

    with pytest.raises(OSError, match=rf"\[Errno 28\] No space left on device: '{tmp_path / 'a.txt'}'"):
        replace_files(str(tmp_path), {"a.txt": write})
    assert contents(tmp_path) == {"a.txt": b"old"}


def test_an_unnamed_oserror_anywhere_is_reported_with_the_commands_destination(tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    monkeypatch.setattr(translation, "train_dates", _full)  # raised before any save names its file
    assert cli.main(["train", *TINY, "--output-dir", str(out)]) == 1
    assert one_line_error(capsys) == f"attnkit: error: No space left on device (writing {out})"

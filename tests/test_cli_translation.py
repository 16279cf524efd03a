"""The `attnkit demo`, `train` and `translate` commands, with tiny sizes so they run in seconds."""

import io
import os
import re
import subprocess
import sys

import pytest

from attnkit import cli
from attnkit.dates.translator import DateTranslator

TINY = ["--epochs", "1", "--train-size", "256", "--batch-size", "64", "--d-model", "16", "--heads", "2",
        "--layers", "1", "--d-ff", "32", "--quiet"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("trained")
    assert cli.main(["train", *TINY, "--output-dir", str(directory)]) == 0
    return directory


def one_line_error(capsys):
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("attnkit: error:"), err
    assert "Traceback" not in err
    return err


def flagged(output):
    """What `translate` prints for a model output: the date, or the not-a-date marker."""
    from attnkit.dates.task import is_task_date

    return output if is_task_date(output) else f"<not a date: {output}>"


def is_date(output):
    return flagged(output) == output


def test_train_writes_a_model_that_translate_reloads(model_dir, capsys):
    assert sorted(os.listdir(model_dir)) == ["model.keras", "translator.json"]
    texts = ["March 3, 2021", "3/3/21"]
    expected = DateTranslator.load(model_dir).translate(texts)
    status = cli.main(["translate", "--model", str(model_dir), *texts])
    assert status == (0 if all(map(is_date, expected)) else 1)  # a one-epoch model: likely no dates
    lines = capsys.readouterr().out.splitlines()
    assert lines == [f"{t}\t{flagged(o)}" for t, o in zip(texts, expected)]


def test_translate_reads_a_file_and_stdin(model_dir, tmp_path, monkeypatch, capsys):
    source = tmp_path / "in.txt"
    source.write_text("March 3, 2021\n\n3/3/21\n", encoding="utf-8")
    cli.main(["translate", "--model", str(model_dir), "--input", str(source)])
    from_file = [line.split("\t") for line in capsys.readouterr().out.splitlines()]
    assert [row[0] for row in from_file] == ["March 3, 2021", "", "3/3/21"] and from_file[1][1] == "<empty>"
    monkeypatch.setattr(sys, "stdin", io.StringIO("March 3, 2021\n3/3/21\n"))
    cli.main(["translate", "--model", str(model_dir), "--input", "-", "--beam", "2"])
    assert [line.split("\t")[0] for line in capsys.readouterr().out.splitlines()] == ["March 3, 2021", "3/3/21"]


def test_train_refuses_to_overwrite_without_force(model_dir, capsys):
    before = (model_dir / "model.keras").stat().st_mtime_ns
    assert cli.main(["train", *TINY, "--output-dir", str(model_dir)]) == 2
    assert "model.keras already exists; pass --force" in one_line_error(capsys)
    assert (model_dir / "model.keras").stat().st_mtime_ns == before


def test_demo_writes_the_picture_and_the_model(tmp_path, capsys):
    out = tmp_path / "demo"
    assert cli.main(["demo", *TINY, "--output-dir", str(out), "--examples", "3"]) == 0
    printed = capsys.readouterr().out
    assert "validation exact match" in printed and "cross-attention picture" in printed
    picture = out / "cross_attention.png"
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "model.keras").is_file()
    assert cli.main(["demo", *TINY, "--output-dir", str(out)]) == 2  # no silent overwrite
    assert "already exists; pass --force" in one_line_error(capsys)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["translate", "--model", "DIR", "x", "--bogus"], "unrecognized arguments: --bogus"),
        (["translate", "--model", "/no/such/dir", "March 3, 2021"], "model directory /no/such/dir does not exist"),
        (["translate", "--model", "DIR", "--input", "/no/such/file.txt"], "cannot read --input /no/such/file.txt"),
        (["translate", "--model", "DIR", "a", "--input", "f"], "not both"),
        (["train", "--epochs", "0", "--output-dir", "x"], "must be a positive integer"),
        (["train", "--d-model", "10", "--heads", "4", "--output-dir", "x"], "must be a multiple of --heads"),
        (["train"], "required: --output-dir"),
    ],
)
def test_bad_input_is_one_line_and_a_nonzero_exit(argv, message, model_dir, capsys):
    argv = [str(model_dir) if a == "DIR" else a for a in argv]
    assert cli.main(argv) != 0
    assert message in one_line_error(capsys)


def test_an_unreadable_input_directory_and_a_model_dir_without_a_model(model_dir, tmp_path, capsys):
    assert cli.main(["translate", "--model", str(model_dir), "--input", str(tmp_path)]) != 0
    assert "cannot read --input" in one_line_error(capsys)
    assert cli.main(["translate", "--model", str(tmp_path), "March 3, 2021"]) != 0
    assert "No model.keras in model directory" in one_line_error(capsys)


def test_the_installed_command_prints_no_traceback(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "attnkit.cli", "translate", "--model", str(tmp_path / "missing"), "x"],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("attnkit: error: model directory")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["demo", "--examples", "0"], "attnkit: error: argument --examples: must be a positive integer, not '0'"),
        (["demo", "--examples", "-1"], "attnkit: error: argument --examples: must be a positive integer, not '-1'"),
        (["train", "--output-dir", ""], "attnkit: error: --output-dir must not be empty"),
        (["train", "--seed", "-1", "--output-dir", "x"], "attnkit: error: argument --seed: must be an integer in [0, 2**32 - 1], not '-1'"),
    ],
)
def test_options_are_checked_before_training(argv, message, tmp_path, monkeypatch, capsys):
    import attnkit.dates.translator

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(attnkit.dates.translator, "train_dates", lambda *a, **k: pytest.fail("trained before checking"))
    assert cli.main([*argv, *TINY]) == 2
    assert one_line_error(capsys) == message
    assert os.listdir(tmp_path) == []


def test_an_output_dir_that_cannot_be_created_is_refused_before_training(tmp_path, monkeypatch, capsys):
    import attnkit.dates.translator

    monkeypatch.setattr(attnkit.dates.translator, "train_dates", lambda *a, **k: pytest.fail("trained before checking"))
    (tmp_path / "file").write_text("")
    target = tmp_path / "file" / "model"
    assert cli.main(["train", *TINY, "--output-dir", str(target)]) == 2
    assert one_line_error(capsys) == f"attnkit: error: --output-dir {target} cannot be created: {tmp_path / 'file'} is not a directory"


def damaged_copy(model_dir, tmp_path, name, content):
    import shutil

    copy = tmp_path / "damaged"
    shutil.copytree(model_dir, copy)
    (copy / name).write_bytes(content(copy / name) if callable(content) else content)
    return copy


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("translator.json", b"{}", "missing alphabet and source_length; it should be the file `attnkit train` writes"),
        ("translator.json", b"", "not valid JSON (Expecting value: line 1 column 1 (char 0))"),
        ("translator.json", b'{"alphabet": "abc", "source_length": "32"}',
         "`source_length` must be a positive integer. Received: source_length='32'"),
        ("translator.json", b"[1]", "expected a JSON object with alphabet and source_length. Received: list"),
        ("model.keras", b"not a zip", "not a Keras model archive (truncated or corrupt?)"),
        ("model.keras", lambda path: path.read_bytes()[: path.stat().st_size // 2],
         "not a Keras model archive (truncated or corrupt?)"),
    ],
)
def test_a_damaged_model_directory_names_the_file_and_the_problem(model_dir, tmp_path, capsys, name, content, message):
    damaged = damaged_copy(model_dir, tmp_path, name, content)
    assert cli.main(["translate", "--model", str(damaged), "3/3/21"]) == 1
    assert one_line_error(capsys) == f"attnkit: error: {damaged / name}: {message}"
    with pytest.raises(ValueError, match=f"^{re.escape(f'{damaged / name}: {message}')}$"):
        DateTranslator.load(damaged)


def test_unknown_characters_are_translated_as_the_unknown_token(model_dir):
    translator = DateTranslator.load(model_dir)
    source = translator.encode_sources(["3/3/21 ✓"])
    assert source[0, 7] == translator.tokenizer.UNKNOWN  # "✓", the 8th character
    assert len(translator.translate(["3/3/21 ✓"])) == 1  # documented: a guess, not an error

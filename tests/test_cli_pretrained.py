"""The `attnkit embed`, `similarity` and `heads` commands.

The embedded model is loaded once for the module and handed to the commands in place of a fresh
load; `--model` with a bad directory goes through the real loader, and one test runs the command
in a subprocess to see exactly what a user sees.
"""

import io
import json
import os
import subprocess
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "models"))
from pretrained_fixtures import write_tiny_model  # noqa: E402
from backend_utils import once_per_run  # noqa: E402

import attnkit  # noqa: E402
from attnkit import cli  # noqa: E402
from attnkit.pipelines import encoder as pretrained  # noqa: E402


@pytest.fixture(scope="module")
def encoder():
    return attnkit.load_pretrained()


@pytest.fixture(autouse=True)
def _loaded_once(encoder, monkeypatch):
    real = pretrained.load_pretrained
    monkeypatch.setattr(
        pretrained, "load_pretrained",
        lambda path=None, dtype="float32": encoder if path is None and dtype == "float32" else real(path, dtype=dtype),
    )


def test_embed_to_npy(encoder, tmp_path, capsys):
    output = tmp_path / "out.npy"
    assert cli.main(["embed", "A cat sits.", "A dog runs.", "--output", str(output)]) == 0
    embeddings = np.load(output)
    assert embeddings.shape == (2, 384)
    np.testing.assert_allclose(embeddings, encoder.encode(["A cat sits.", "A dog runs."]), atol=1e-6)
    assert f"wrote 2 embeddings of size 384 to {output}" in capsys.readouterr().err


def test_embed_file_to_jsonl(encoder, tmp_path):
    source, output = tmp_path / "texts.txt", tmp_path / "out.jsonl"
    texts = ["first line", "Café 😀", "third line"]
    source.write_text("\n".join(texts) + "\n", encoding="utf-8")
    assert cli.main(["embed", "--input", str(source), "--output", str(output)]) == 0
    rows = [json.loads(line) for line in output.read_text(encoding="utf-8").splitlines()]
    assert [row["text"] for row in rows] == texts
    np.testing.assert_allclose(np.array([row["embedding"] for row in rows]), encoder.encode(texts), atol=1e-6)


def test_embed_from_stdin_to_stdout(encoder, monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.StringIO("one\ntwo\n"))
    assert cli.main(["embed", "--input", "-"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [row["text"] for row in rows] == ["one", "two"]
    np.testing.assert_allclose(np.array([row["embedding"] for row in rows]), encoder.encode(["one", "two"]), atol=1e-6)


def test_embed_shows_progress_for_large_inputs(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(cli.pretrained, "PROGRESS_FROM", 3)
    assert cli.main(["embed", "a", "b", "c", "--output", str(tmp_path / "out.npy")]) == 0
    assert "3/3" in capsys.readouterr().out
    assert cli.main(["embed", "a", "b", "--output", str(tmp_path / "small.npy")]) == 0
    assert "2/2" not in capsys.readouterr().out


def test_embed_warns_about_truncation_in_one_line(tmp_path, capsys):
    assert cli.main(["embed", "word " * 300, "short", "--output", str(tmp_path / "out.npy")]) == 0
    err = capsys.readouterr().err
    assert "attnkit: warning: 1 of 2 texts were longer than the model's maximum of 256 tokens" in err


def test_embed_refuses_to_overwrite_without_force(tmp_path, capsys):
    output = tmp_path / "out.npy"
    output.write_bytes(b"keep me")
    assert cli.main(["embed", "hello", "--output", str(output)]) == 2
    assert capsys.readouterr().err == f"attnkit: error: {output} already exists; pass --force to overwrite it\n"
    assert output.read_bytes() == b"keep me"
    assert cli.main(["embed", "hello", "--output", str(output), "--force"]) == 0
    assert np.load(output).shape == (1, 384)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["embed"], "no texts: give them as arguments, one per line with --input FILE, or on stdin"),
        (["embed", "a", "--input", "-"], "give texts as arguments or with --input, not both"),
        (["embed", "a", "--output", "out.csv"], "--output must end in .npy or .jsonl. Received: out.csv"),
        (["similarity"], "no texts: give them as arguments, one per line with --input FILE, or on stdin"),
        (["heads", "a b", "--layer", "6"], "--layer must be in [-6, 5] (0 = first, -1 = last) for this 6-layer model. Received: 6"),
        (["heads", "a b", "--output", "heads.jpg"], "--output must end in .png. Received: heads.jpg"),
        (["export", ""], "DIR must not be empty"),
        (["embed", "a", "--output", ""], "--output must not be empty"),
        (["embed", "--input", ""], "--input must not be empty: give a file, or - for stdin"),
        (["heads", "a b", "--output", ""], "--output must not be empty"),
        (["embed", "\udcff\udcfe abc"], "argument texts: is not UTF-8 text (byte 0xff at offset 0)"),
        (["heads", "ok \udce9"], "argument sentence: is not UTF-8 text (byte 0xe9 at offset 3)"),
    ],
)
def test_usage_errors(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "stdin", type("Terminal", (io.StringIO,), {"isatty": lambda self: True})())
    assert cli.main(argv) == 2
    assert capsys.readouterr().err == f"attnkit: error: {message}\n"


def test_missing_model_directory_is_one_line(tmp_path, capsys):
    missing = tmp_path / "no-model"
    assert cli.main(["similarity", "a", "b", "--model", str(missing)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"attnkit: error: Model directory {missing} does not exist;") and err.count("\n") == 1


@once_per_run  # what a process prints does not depend on the backend
def test_missing_model_directory_in_a_real_process(tmp_path):
    missing = tmp_path / "no-model"
    result = subprocess.run(
        [sys.executable, "-m", "attnkit.cli", "embed", "hello", "--model", str(missing)],
        capture_output=True, text=True, timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("attnkit:")]
    assert errors == [
        f"attnkit: error: Model directory {missing} does not exist; a model directory holds config.json, weights "
        "(model.safetensors, sharded safetensors or pytorch_model.bin), and tokenizer.json or vocab.txt"
    ]
    assert result.stdout == ""


def test_similarity_prints_a_table(encoder, capsys):
    texts = ["A cat sits on the mat.", "A kitten rests on a rug.", "Stock markets fell sharply."]
    assert cli.main(["similarity", *texts]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["[0]", "[1]", "[2]"]
    table = np.array([[float(v) for v in line.split()[1:]] for line in lines[1:4]])
    assert [line.split()[0] for line in lines[1:4]] == ["[0]", "[1]", "[2]"]
    embeddings = encoder.encode(texts)
    np.testing.assert_allclose(table, embeddings @ embeddings.T, atol=5e-4)  # printed to 3 decimals
    assert table[0, 1] > 0.5 > table[0, 2]
    assert lines[5:] == [f"[{i}] {t}" for i, t in enumerate(texts)]


def test_heads_writes_one_panel_per_head(tmp_path, capsys):
    import matplotlib.image

    output = tmp_path / "heads.png"
    assert cli.main(["heads", "The cat sat on the mat.", "--layer", "-1", "--output", str(output)]) == 0
    assert output.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    height, width, _ = matplotlib.image.imread(output).shape
    assert width > height > 300  # 12 panels: 3 rows of 4
    assert f"wrote 12 heads of layer 5 over 9 tokens to {output}" in capsys.readouterr().err
    assert cli.main(["heads", "Again.", "--output", str(output)]) == 2  # no overwrite without --force


def test_model_option_loads_another_directory(tmp_path, capsys):
    path = write_tiny_model(tmp_path / "tiny")
    assert cli.main(["similarity", "the cat sat", "a dog ran", "--model", path]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["[0]", "[1]"]
    assert lines[1].split()[:2] == ["[0]", "1.000"] and lines[2].split()[2] == "1.000"


def test_embed_input_splits_on_newlines_only(encoder, tmp_path, monkeypatch, capsys):
    # str.splitlines() also split on \x0b \x0c \x1c-\x1e \x85 \u2028 \u2029: 7 embeddings for 3 lines
    texts = ["page\x0cbreak and\x0bvertical tab", "sep\x1carators\x1d\x1e and next\x85line", "para\u2028graph\u2029s"]
    source = tmp_path / "texts.txt"
    source.write_bytes(("\r\n".join(texts) + "\r\n").encode("utf-8"))  # Windows line ends: "\r" dropped too
    assert cli.main(["embed", "--input", str(source)]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == len(out.splitlines()) == 3  # \x85, \u2028, \u2029 are escaped in the JSON lines
    assert [json.loads(line)["text"] for line in out.splitlines()] == texts
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(("\n".join(texts) + "\n\nlast").encode("utf-8"))))
    assert cli.main(["embed", "--input", "-"]) == 0
    assert [json.loads(line)["text"] for line in capsys.readouterr().out.splitlines()] == [*texts, "", "last"]


def test_embed_input_that_is_not_utf8_names_the_file(tmp_path, capsys):
    source = tmp_path / "latin1.txt"
    source.write_bytes("café\n".encode("latin-1"))
    assert cli.main(["embed", "--input", str(source)]) == 2
    assert capsys.readouterr().err == (
        f"attnkit: error: cannot read --input {source}: not UTF-8 text (byte 0xe9 at offset 3)\n"
    )


def test_embed_accepts_upper_case_extensions(encoder, tmp_path):
    output = tmp_path / "OUT.NPY"
    assert cli.main(["embed", "A cat sits.", "--output", str(output)]) == 0
    assert sorted(os.listdir(tmp_path)) == ["OUT.NPY"]  # np.save(path) would have written OUT.NPY.npy
    np.testing.assert_allclose(np.load(output), encoder.encode(["A cat sits."]), atol=1e-6)


def test_heads_accepts_negative_layers_and_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["heads", "a b", "--layer", "-7"]) == 2
    assert capsys.readouterr().err == (
        "attnkit: error: --layer must be in [-6, 5] (0 = first, -1 = last) for this 6-layer model. Received: -7\n"
    )


def test_batch_size_must_be_positive(capsys):
    assert cli.main(["embed", "a", "--batch-size", "0"]) == 2
    assert capsys.readouterr().err == "attnkit: error: argument --batch-size: must be a positive integer, not '0'\n"


def test_heads_prints_the_truncation_warning_once(monkeypatch, capsys, tmp_path):
    drawn = {}

    def plot(weights, x, y, *, path, **kwargs):  # the picture itself is not the point: an empty file
        drawn.update(shape=weights.shape)
        open(path, "wb").close()

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("attnkit.viz.plot_attention", plot)
    assert cli.main(["heads", "word " * 300, "--output", "long.png"]) == 0
    assert drawn["shape"] == (12, 256, 256)
    assert capsys.readouterr().err.splitlines() == [
        "attnkit: warning: 1 of 1 texts were longer than the model's maximum of 256 tokens and were truncated",
        "wrote 12 heads of layer 0 over 256 tokens to long.png",
    ]


def test_a_keras_layer_error_is_its_first_line_without_colours(encoder, monkeypatch, capsys):
    import keras

    class Failing(keras.layers.Layer):
        def call(self, x):
            raise ValueError("the real problem\nmore detail")

    try:
        Failing()(np.zeros((1, 2), "float32"))
    except ValueError as e:
        wrapped = e
    assert "Exception encountered when calling" in str(wrapped)  # as Keras re-raises it, on every backend

    def encode(*args, **kwargs):
        raise wrapped

    monkeypatch.setattr(encoder, "encode", encode)
    assert cli.main(["embed", "hello"]) == 1
    assert capsys.readouterr().err == "attnkit: error: the real problem\n"


def test_memory_error_is_one_line(tmp_path, monkeypatch, capsys):
    path = write_tiny_model(tmp_path / "tiny")
    monkeypatch.setenv("ATTNKIT_MAX_SCORES_BYTES", "100")  # the tiny model's (1, 2, 5, 5) float32 scores: 200 bytes
    assert cli.main(["heads", "the cat sat", "--model", path, "--output", str(tmp_path / "m.png")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("attnkit: error: MemoryError: Explicit attention would allocate a scores tensor of shape")
    assert err.count("\n") == 1 and "\x1b" not in err
    assert not (tmp_path / "m.png").exists()


def test_any_other_exception_is_one_line_with_its_type(monkeypatch, capsys):
    def fail(path=None, dtype="float32"):
        raise KeyError("alphabet")

    monkeypatch.setattr(pretrained, "load_pretrained", fail)
    assert cli.main(["similarity", "a", "b"]) == 1
    assert capsys.readouterr().err == "attnkit: error: KeyError: 'alphabet'\n"


@once_per_run  # what a process prints does not depend on the backend
def test_a_closed_pipe_ends_quietly(tmp_path):
    # `attnkit embed ... | head -1`: the reader goes away after one line
    path = write_tiny_model(tmp_path / "tiny")
    source = tmp_path / "texts.txt"
    source.write_text("the cat sat on the mat\n" * 3000, encoding="utf-8")  # ~600 kB of JSON lines: past a pipe's buffer
    process = subprocess.Popen(
        [sys.executable, "-m", "attnkit.cli", "embed", "--input", str(source), "--model", path],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert json.loads(process.stdout.readline())["text"] == "the cat sat on the mat"
    process.stdout.close()
    stderr = process.stderr.read().decode()
    assert process.wait(timeout=120) == 141
    assert [line for line in stderr.splitlines() if line.startswith(("attnkit", "Traceback", "Exception"))] == []


def test_export_never_replaces_a_directory_that_is_not_a_model(encoder, tmp_path, monkeypatch, capsys):
    # `export "" --force` replaced the working directory, the user's files with it.
    precious = tmp_path / "mine"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me")
    monkeypatch.chdir(precious)
    for target in (".", str(precious)):
        assert cli.main(["export", target, "--force"]) == 2
        assert "holds files but no config.json" in capsys.readouterr().err
    for target in ("", precious):  # the library refuses the same
        with pytest.raises((ValueError, FileExistsError), match="must not be empty|holds files but no config.json"):
            encoder.save_pretrained(target, overwrite=True)
    assert (precious / "notes.txt").read_text() == "keep me" and os.listdir(precious) == ["notes.txt"]


def test_a_closed_stdout_or_stdin_is_an_error_that_names_it(monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdout", None)  # started with >&-: the embeddings would go nowhere
    assert cli.main(["embed", "hello"]) == 1
    assert capsys.readouterr().err == "attnkit: error: stdout is closed: the command has nowhere to write\n"
    monkeypatch.undo()
    monkeypatch.setattr(sys, "stdin", None)  # started with <&-
    assert cli.main(["embed", "--input", "-"]) == 2
    assert "stdin is closed" in capsys.readouterr().err
    assert sys.stdin is None  # put back as it was

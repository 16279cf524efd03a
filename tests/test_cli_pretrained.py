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

import attnkit  # noqa: E402
from attnkit import cli  # noqa: E402
from attnkit.models import pretrained  # noqa: E402


@pytest.fixture(scope="module")
def encoder():
    return attnkit.load_pretrained()


@pytest.fixture(autouse=True)
def _loaded_once(encoder, monkeypatch):
    real = pretrained.load_pretrained
    monkeypatch.setattr(pretrained, "load_pretrained", lambda path=None: encoder if path is None else real(path))


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
        (["embed"], "no texts: give them as arguments, or one per line with --input FILE (- for stdin)"),
        (["embed", "a", "--input", "-"], "give texts as arguments or with --input, not both"),
        (["embed", "a", "--output", "out.csv"], "--output must end in .npy or .jsonl. Received: out.csv"),
        (["similarity", "only one"], "similarity needs at least two texts"),
        (["heads", "a b", "--layer", "6"], "--layer must be in [0, 5] for this 6-layer model. Received: 6"),
        (["heads", "a b", "--output", "heads.jpg"], "--output must end in .png. Received: heads.jpg"),
    ],
)
def test_usage_errors(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.main(argv) == 2
    assert capsys.readouterr().err == f"attnkit: error: {message}\n"


def test_missing_model_directory_is_one_line(tmp_path, capsys):
    missing = tmp_path / "no-model"
    assert cli.main(["similarity", "a", "b", "--model", str(missing)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"attnkit: error: Model directory {missing} does not exist;") and err.count("\n") == 1


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
        f"attnkit: error: Model directory {missing} does not exist; a model directory holds config.json, "
        "model.safetensors, and tokenizer.json or vocab.txt"
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

"""Empty and huge inputs, and the commands as batch tools: N texts in, N results out, in order.

The rule (docs/decisions.md items 25 and 26): an empty batch gives an empty result of the documented
shape in the library, and zero result lines (exit 0, a note on stderr) in the commands; an empty text
is refused by the date translator (the library raises, the command prints an <empty> marker line).
"""

import io
import json
import math
import os
import sys

import numpy as np
import pytest
from fault_helpers import one_line_error

from attnkit import beam_search, cli, greedy_decode, load_pretrained
from attnkit.dates.task import CharTokenizer, is_iso_date, is_task_date

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "models"))
from pretrained_fixtures import write_tiny_model  # noqa: E402


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("bert")
    write_tiny_model(directory)
    return directory


@pytest.fixture(scope="module")
def bert(bert_dir):
    return load_pretrained(str(bert_dir))


class Terminal(io.StringIO):
    def isatty(self):
        return True


def stdin(monkeypatch, text):
    monkeypatch.setattr(sys, "stdin", io.StringIO(text))


# The library: empty batches.

@pytest.mark.parametrize("use_cache", [True, False])
def test_greedy_decode_of_an_empty_batch(tiny_translator, use_cache):
    model = tiny_translator.model
    result = greedy_decode(model, np.zeros((0, 32), np.int32), use_cache=use_cache, return_attention_weights=True)
    assert result.ids.shape == (0, 0) and result.ids.dtype == np.int32
    assert result.scores.shape == (0,)
    assert result.step_logits.shape == (0, 0, model.decoder.vocab_size)
    assert [w.shape for w in result.cross_attention] == [(0, 2, 0, 32)] * model.decoder.n
    assert greedy_decode(model, np.zeros((0, 32), np.int32)).cross_attention is None


@pytest.mark.parametrize("use_cache", [True, False])
@pytest.mark.parametrize("beam_size", [1, 3])
def test_beam_search_of_an_empty_batch(tiny_translator, use_cache, beam_size):
    result = beam_search(tiny_translator.model, np.zeros((0, 7), np.int32), beam_size=beam_size, use_cache=use_cache)
    assert result.ids.shape == (0, 0) and result.scores.shape == (0,) and result.step_logits is None


def test_an_empty_batch_is_still_checked(tiny_translator):
    with pytest.raises(ValueError, match="must be a token id in"):
        greedy_decode(tiny_translator.model, np.zeros((0, 32), np.int32), end_id=1000)
    with pytest.raises(ValueError, match="`encoder_input` must be"):
        beam_search(tiny_translator.model, np.zeros((0,), np.int32))


def test_translate_of_no_texts_and_of_empty_texts(tiny_translator):
    assert tiny_translator.translate([]) == []
    outputs, scores = tiny_translator.translate([], return_scores=True)
    assert outputs == [] and scores.shape == (0,)
    assert tiny_translator.encode_sources([]).shape == (0, 32)
    for texts, index in ((["3/3/21", ""], 1), (["   "], 0), (["\t"], 0)):
        with pytest.raises(ValueError, match=rf"^Input {index} \(.*\) is empty or only whitespace"):
            tiny_translator.translate(texts)


def test_encode_of_no_texts(bert):
    assert bert.encode([]).shape == (0, bert.d_model)
    assert bert.encode([], normalize=False).dtype == np.float32


# The commands: zero texts.

@pytest.mark.parametrize("how", ["stdin", "dash", "file"])
def test_zero_input_lines_give_zero_output_lines(saved_dir, bert_dir, tmp_path, monkeypatch, capsys, how):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    source = {"stdin": [], "dash": ["--input", "-"], "file": ["--input", str(empty)]}[how]
    name = str(empty) if how == "file" else "stdin"
    for argv in (["translate", "--model", str(saved_dir)], ["embed", "--model", str(bert_dir)],
                 ["similarity", "--model", str(bert_dir)]):
        stdin(monkeypatch, "")
        assert cli.main([*argv, *source]) == 0, argv
        captured = capsys.readouterr()
        assert captured.out == ""
        assert captured.err == f"attnkit: note: {name} held no texts\n"


def test_embed_of_zero_texts_writes_an_empty_array(bert_dir, tmp_path, monkeypatch, capsys):
    stdin(monkeypatch, "")
    assert cli.main(["embed", "--model", str(bert_dir), "--output", str(tmp_path / "x.npy")]) == 0
    assert np.load(tmp_path / "x.npy").shape == (0, 8)
    assert capsys.readouterr().err.splitlines()[-1] == f"wrote 0 embeddings of size 8 to {tmp_path / 'x.npy'}"


@pytest.mark.parametrize("command", ["translate", "embed", "similarity"])
def test_no_texts_and_a_terminal_on_stdin_is_a_usage_error(saved_dir, monkeypatch, capsys, command):
    monkeypatch.setattr(sys, "stdin", Terminal())
    argv = [command, "--model", str(saved_dir)] if command == "translate" else [command]
    assert cli.main(argv) == 2
    assert one_line_error(capsys) == (
        "attnkit: error: no texts: give them as arguments, one per line with --input FILE, or on stdin"
    )


# The commands: line for line.

def parse(out):
    return [line.split("\t") for line in out.splitlines()]


def test_translate_prints_one_line_per_input_in_order(saved_dir, tiny_translator, capsys):
    texts = ["july 4, 1976", "", "2021-13-45", "   ", "x" * 40, "3/3/21 ✓", "march 5 1999"]
    status = cli.main(["translate", "--model", str(saved_dir), *texts])
    captured = capsys.readouterr()
    rows = parse(captured.out)
    assert [row[0] for row in rows] == texts
    decoded = tiny_translator.translate([texts[i] for i in (0, 6)])
    expected = {1: "<empty>", 2: "<no such date: month 13 does not exist>", 3: "<empty>",
                4: "<too long: 40 characters, the model takes at most 32>", 5: "<unknown characters: ✓>"}
    expected.update({i: o if is_task_date(o) else f"<not a date: {o}>" for i, o in zip((0, 6), decoded)})
    assert [row[1] for row in rows] == [expected[i] for i in range(len(texts))]
    flagged = [i for i in range(len(texts)) if expected[i].startswith("<")]
    assert status == 1 and flagged  # a two-step model gives no dates
    err = captured.err.strip()
    assert err.startswith(f"attnkit: error: {len(flagged)} of 7 inputs have no date (input 1 ") and "\n" not in err


def test_stdin_is_read_when_no_text_is_given(saved_dir, monkeypatch, capsys):
    for argv in ([], ["--input", "-"]):
        stdin(monkeypatch, "march 5 1999\n\n3/3/21\r\n")
        cli.main(["translate", "--model", str(saved_dir), *argv])
        rows = parse(capsys.readouterr().out)
        assert [row[0] for row in rows] == ["march 5 1999", "", "3/3/21"] and rows[1][1] == "<empty>"


def test_texts_with_tabs_and_newlines_stay_on_one_line(saved_dir, capsys):
    texts = ["3/3\t21", "3/3\n21", "a\\b", "3\u20283"]
    cli.main(["translate", "--model", str(saved_dir), *texts])
    lines = capsys.readouterr().out.split("\n")[:-1]
    assert [line.split("\t")[0] for line in lines] == ["3/3\\t21", "3/3\\n21", "a\\\\b", "3\\u20283"]


def teacher_forced_log_probability(model, source, ids):
    """log P(ids | source) by one uncached decoder pass in float64: the sum of the log-softmax of every
    token up to and including the end token."""
    from keras import ops

    ids = list(ids)
    length = ids.index(CharTokenizer.END) + 1 if CharTokenizer.END in ids else len(ids)
    prefix = np.array([[CharTokenizer.START] + ids[: length - 1]], np.int32)  # (1, L)
    encoder_output, source_mask = model.encode(source[None], training=False)
    y = model.decoder(prefix, encoder_output, np.ones(prefix.shape, bool), source_mask, training=False)
    logits = np.asarray(ops.convert_to_numpy(model.logits(y)), np.float64)[0]  # (L, V)
    log_softmax = logits - logits.max(-1, keepdims=True)
    log_softmax -= np.log(np.exp(log_softmax).sum(-1, keepdims=True))
    return float(sum(log_softmax[t, i] for t, i in enumerate(ids[:length])))


@pytest.mark.parametrize("beam", [1, 3])
def test_scores_are_the_models_sequence_probability(saved_dir, tiny_translator, capsys, beam):
    texts = ["july 4, 1976", "", "3/3/21", "the 1st of may 2001"]
    cli.main(["translate", "--model", str(saved_dir), "--scores", "--beam", str(beam), *texts])
    rows = parse(capsys.readouterr().out)
    assert [len(row) for row in rows] == [3] * 4 and rows[1][1:] == ["<empty>", "-"]
    source = tiny_translator.encode_sources([texts[i] for i in (0, 2, 3)])
    decode = greedy_decode if beam == 1 else lambda m, s, **k: beam_search(m, s, beam_size=beam, **k)
    ids = decode(tiny_translator.model, source, start_id=CharTokenizer.START, end_id=CharTokenizer.END).ids
    for row, s, i in zip((rows[0], rows[2], rows[3]), source, ids):
        expected = math.exp(teacher_forced_log_probability(tiny_translator.model, s, i))
        assert float(row[2]) == pytest.approx(expected, rel=1e-3)


def test_similarity_and_embed_answer_line_for_line(bert_dir, bert, tmp_path, capsys):
    source = tmp_path / "texts.txt"
    texts = ["a cat", "", "a\tdog", "a cat"]
    source.write_text("\n".join(texts) + "\n")
    assert cli.main(["similarity", "--model", str(bert_dir), "--input", str(source)]) == 0
    lines = capsys.readouterr().out.splitlines()
    table = np.array([[float(v) for v in line.split()[1:]] for line in lines[1:5]])
    embeddings = bert.encode(texts, normalize=True)  # similarity compares unit vectors
    np.testing.assert_allclose(table, embeddings @ embeddings.T, atol=5e-4)
    assert lines[6:] == ["[0] a cat", "[1] ", "[2] a\\tdog", "[3] a cat"]
    assert cli.main(["embed", "--model", str(bert_dir), "--input", str(source)]) == 0
    assert [json.loads(line)["text"] for line in capsys.readouterr().out.splitlines()] == texts


def test_similarity_of_one_text_is_its_own_cosine(bert_dir, capsys):
    assert cli.main(["similarity", "--model", str(bert_dir), "only one"]) == 0
    assert capsys.readouterr().out.splitlines()[1].split()[1] == "1.000"


# Huge inputs.

def test_a_huge_line_is_marked_too_long(saved_dir, tmp_path, capsys):
    source = tmp_path / "huge.txt"
    source.write_text("3" * 1_000_000 + "\n3/3/21\n")
    assert cli.main(["translate", "--model", str(saved_dir), "--input", str(source)]) == 1
    rows = parse(capsys.readouterr().out)
    assert len(rows) == 2 and rows[0][1] == "<too long: 1000000 characters, the model takes at most 32>"


def test_thousands_of_lines_give_as_many_lines_in_order(saved_dir, tmp_path, capsys):
    texts = [f"{1 + i % 12}/{1 + i % 28}/{i % 100:02d}" if i % 7 else "" for i in range(3000)]
    source = tmp_path / "many.txt"
    source.write_text("\n".join(texts) + "\n")
    cli.main(["translate", "--model", str(saved_dir), "--input", str(source)])
    rows = parse(capsys.readouterr().out)
    assert [row[0] for row in rows] == texts
    assert all((row[1] == "<empty>") == (text == "") for row, text in zip(rows, texts))


@pytest.mark.parametrize(
    "text, valid",
    [("2021-03-03", True), ("2024-02-29", True), ("2023-02-29", False), ("2021-13-45", False), ("2021-3-3", False),
     ("2021-03-03 ", False), ("20210303", False), ("２０２１-03-03", False), ("0000-01-01", False), ("", False),
     ("2021-04-31", False), ("2049-12-31", True)],
)
def test_is_iso_date(text, valid):
    assert is_iso_date(text) is valid


@pytest.mark.parametrize("text, valid", [("1950-01-01", True), ("2049-12-31", True), ("1949-12-31", False),
                                         ("2050-01-01", False), ("1021-03-03", False), ("2021-02-29", False)])
def test_a_task_date_is_a_day_the_translator_can_give(text, valid):
    """A model answering "1021-03-03" answered a calendar day outside the task's years: wrong, and marked."""
    assert is_task_date(text) is valid


def test_a_byte_order_mark_is_not_read_as_text(saved_dir, tmp_path, capsys):
    source = tmp_path / "bom.txt"
    source.write_bytes("\ufeff3/3/21\n\ufeffmarch 5 1999\n".encode("utf-8"))
    cli.main(["translate", "--model", str(saved_dir), "--input", str(source)])
    rows = parse(capsys.readouterr().out)
    assert [row[0] for row in rows] == ["3/3/21", "\ufeffmarch 5 1999"]  # only the file's leading mark goes
    assert rows[1][1] == "<unknown characters: \ufeff>"


def test_control_characters_are_written_escaped(saved_dir, capsys):
    """ESC and NUL went to the terminal as they were: an input could move the cursor or recolour it."""
    texts = ["\x1b[2J3/3/21", "3/3\x00/21", "3/3/21\x7f\x9b"]
    cli.main(["translate", "--model", str(saved_dir), *texts])
    out = capsys.readouterr().out
    assert not any(c in out for c in "\x1b\x00\x7f\x9b")
    rows = parse(out)
    assert [row[0] for row in rows] == ["\\x1b[2J3/3/21", "3/3\\x00/21", "3/3/21\\x7f\\x9b"]
    assert rows[0][1] == "<unknown characters: \\x1b[>"

"""Truncated and mismatched model directories: refused at load, naming the file and the field."""

import hashlib
import json
import re

import keras
import numpy as np
import pytest
from fault_helpers import one_line_error

from attnkit import Transformer, cli
from attnkit.dates.task import CharTokenizer
from attnkit.dates.translator import DateTranslator
from backend_utils import once_per_run

pytestmark = once_per_run  # writing, checking and refusing files: the same code whatever the backend

ALPHABET = CharTokenizer().alphabet


def edit_meta(directory, **fields):
    path = directory / "translator.json"
    meta = json.loads(path.read_text())
    meta.update(fields)
    meta = {k: v for k, v in meta.items() if v is not None}
    path.write_text(json.dumps(meta))
    return path


def refused(directory, capsys, message):
    """Both DateTranslator.load and `attnkit translate` refuse `directory` with exactly `message`."""
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        DateTranslator.load(directory)
    assert cli.main(["translate", "--model", str(directory), "3/3/21"]) == 1
    assert one_line_error(capsys) == f"attnkit: error: {message}"


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"alphabet": ALPHABET[:-1]},
         "`alphabet` has 56 characters, so 60 token ids with the 4 special ones, but the model's encoder has a "
         "vocabulary of 61"),
        ({"alphabet": ALPHABET + "Z"},
         "`alphabet` has 58 characters, so 62 token ids with the 4 special ones, but the model's encoder has a "
         "vocabulary of 61"),
        ({"source_length": 13}, "`source_length` is 13 but the model's encoder takes 32 tokens (enc_seq_length)"),
        ({"source_length": 64}, "`source_length` is 64 but the model's encoder takes 32 tokens (enc_seq_length)"),
    ],
)
def test_a_translator_json_that_does_not_match_the_model(model_copy, capsys, fields, message):
    assert len(ALPHABET) == 57
    path = edit_meta(model_copy, **fields)
    refused(model_copy, capsys, f"{path} does not match {model_copy / 'model.keras'}: {message}")


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"alphabet": "aab"}, "`alphabet` must not repeat a character. Received: 'a' more than once"),
        ({"vocab": 61}, "unknown field 'vocab'; the fields are alphabet, source_length, model_sha256"),
        ({"model_sha256": "0" * 64},
         "`model_sha256` does not match {model}: the two files are not from the same save (an interrupted copy, "
         "or one of them replaced)"),
        ({"model_sha256": "XYZ"}, "`model_sha256` must be 64 lowercase hex digits. Received: model_sha256='XYZ'"),
        ({"source_length": True}, "`source_length` must be a positive integer. Received: source_length=True"),
        ({"alphabet": None}, "missing alphabet; it should be the file `attnkit train` writes"),
    ],
)
def test_a_bad_field_names_the_file_and_the_field(model_copy, capsys, fields, message):
    path = edit_meta(model_copy, **fields)
    refused(model_copy, capsys, f"{path}: " + message.format(model=model_copy / "model.keras"))


def test_a_file_without_model_sha256_still_loads(model_copy, tiny_translator):
    edit_meta(model_copy, model_sha256=None)  # written before the field existed
    loaded = DateTranslator.load(model_copy)
    assert loaded.translate(["3/3/21"]) == tiny_translator.translate(["3/3/21"])


@pytest.mark.parametrize("fraction", [0.0, 0.1, 0.5, 0.99])
def test_a_truncated_model_keras(model_copy, capsys, fraction):
    path = model_copy / "model.keras"
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * fraction)])
    refused(model_copy, capsys, f"{path}: not a Keras model archive (truncated or corrupt?)")


def save_pair(directory, model, alphabet=ALPHABET, source_length=32):
    """A model directory holding `model` and a translator.json that matches its SHA-256."""
    directory.mkdir()
    model.save(directory / "model.keras")
    digest = hashlib.sha256((directory / "model.keras").read_bytes()).hexdigest()
    meta = {"alphabet": alphabet, "source_length": source_length, "model_sha256": digest}
    (directory / "translator.json").write_text(json.dumps(meta))
    return directory


def transformer(vocab=61, enc_length=32, dec_length=11, pad_id=0):
    model = Transformer(vocab, vocab, enc_length, dec_length, 2, 4, 4, 8, 16, 1, 0.0, pad_id=pad_id)
    model.build((1, enc_length), (1, dec_length))
    return model


@pytest.mark.parametrize(
    "model, message",
    [
        (lambda: transformer(dec_length=6),
         "the model's decoder emits at most 6 tokens (dec_seq_length); a date and its end token take 11"),
        (lambda: transformer(pad_id=5), "the model's pad_id is 5 but the tokenizer pads with 0"),
        (lambda: transformer(enc_length=20), "`source_length` is 32 but the model's encoder takes 20 tokens (enc_seq_length)"),
    ],
)
def test_a_model_that_is_not_the_translators(tmp_path, capsys, model, message):
    directory = save_pair(tmp_path / "other", model())
    refused(directory, capsys, f"{directory / 'translator.json'} does not match {directory / 'model.keras'}: {message}")


def test_a_model_keras_that_is_not_a_transformer(tmp_path, capsys):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    directory = save_pair(tmp_path / "other", model)
    refused(directory, capsys, f"{directory / 'model.keras'}: holds a Sequential, not an attnkit Transformer")


def test_the_constructor_checks_the_same_fields():
    with pytest.raises(ValueError, match=r"^`source_length` is 13 but the model's encoder takes 32 tokens"):
        DateTranslator(transformer(), CharTokenizer(), 13)
    with pytest.raises(ValueError, match=r"^`alphabet` has 3 characters, so 7 token ids"):
        DateTranslator(transformer(), CharTokenizer("abc"), 32)
    with pytest.raises(TypeError, match="`model` must be an attnkit Transformer. Received: model of type Sequential"):
        DateTranslator(keras.Sequential([keras.layers.Dense(2)]), CharTokenizer(), 32)


def test_a_matching_model_from_elsewhere_loads_and_decodes_in_range(tmp_path):
    """The checks refuse only mismatches: a fresh Transformer of the right sizes loads, and every id it
    can emit decodes (the IndexError of a too-short alphabet cannot happen)."""
    directory = save_pair(tmp_path / "fresh", transformer())
    translator = DateTranslator.load(directory)
    ids = np.arange(translator.model.decoder.vocab_size)
    ids = ids[ids != CharTokenizer.END]
    assert len(translator.tokenizer.decode(ids)) == len(ids) - 2  # all but padding and start give a character

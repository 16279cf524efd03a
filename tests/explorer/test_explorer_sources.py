"""The sources: the weights in the contract equal the models' own weights, to the stated rounding."""

import json
import os

import numpy as np
import pytest

from attnkit.explorer import BadInput, open_model
from attnkit.explorer.contract import to_json, weights_array
from attnkit.models.decoding import greedy_decode

SENTENCE = "The cat sat on the mat."


def parsed(data):
    """The contract as the page reads it: through JSON text."""
    return json.loads(to_json(data))


def assert_within_rounding(kind, expected, data):
    """The contract's rounding bound, plus float32's: `expected` comes from a second float32 run of the
    model (another call, another batch shape), whose weights can differ from the page's by ~1e-7."""
    got = weights_array(kind)
    assert got.shape == np.shape(expected)
    assert np.abs(got - np.asarray(expected, np.float64)).max() <= data["max_error"] + 1e-6


def test_minilm_weights_equal_pretrained_encoder_attentions(minilm_source):
    data = parsed(minilm_source.attention(SENTENCE))
    encoder = minilm_source.encoder
    assert data["model"] == "all-MiniLM-L6-v2" and data["source"] == "pretrained-encoder"
    (kind,) = data["attention"]
    assert kind["query_tokens"] == kind["key_tokens"] == data["tokens"] == encoder.tokens(SENTENCE)
    assert (kind["layers"], kind["heads"]) == (6, 12)
    assert_within_rounding(kind, np.stack(encoder.attentions(SENTENCE)), data)
    assert data["notes"] == []


def test_a_model_directory_and_its_truncation_note(tiny_source, tiny_bert_dir):
    assert tiny_source.name == os.path.basename(tiny_bert_dir) and tiny_source.max_tokens == 16
    text = "the cat sat on the big mat . " * 3  # 24 words + [CLS] [SEP]
    data = parsed(tiny_source.attention(text))
    (kind,) = data["attention"]
    assert len(kind["query_tokens"]) == 16
    assert data["notes"] == [
        f"The text is 26 tokens long ([CLS] and [SEP] included); {tiny_source.name} reads at most 16, so it was "
        "truncated to its first 16 tokens."
    ]
    assert_within_rounding(kind, np.stack(tiny_source.encoder.attentions(text)), data)
    short = parsed(tiny_source.attention("the cat sat"))
    assert short["notes"] == [] and len(short["attention"][0]["query_tokens"]) == 5


@pytest.mark.parametrize("text", ["", "   ", "\n\t"])
def test_empty_text_is_refused_with_a_message(tiny_source, translator_source, text):
    for source in (tiny_source, translator_source):
        with pytest.raises(BadInput, match="The text is empty"):
            source.attention(text)


def test_translator_weights_equal_the_translators_own(translator_source):
    text = "March 3, 2021"
    data = parsed(translator_source.attention(text))
    translator = translator_source.translator
    model, tok = translator.model, translator.tokenizer
    assert data["source"] == "date-translator"
    assert data["output"] == translator.translate([text])[0]
    encoder_self, decoder_self, cross = data["attention"]
    names = ["encoder self-attention", "decoder self-attention", "cross-attention"]
    assert [k["name"] for k in data["attention"]] == names
    S = len(text)
    assert encoder_self["query_tokens"] == encoder_self["key_tokens"] == cross["key_tokens"] == list(text)
    assert data["tokens"] == list(text)

    # Cross-attention: the cached decoding's own weights, step by step (`translate(return_attention_weights=True)`).
    _, (decoded,) = translator.translate([text], return_attention_weights=True)
    labels = tok.display_tokens(decoded.ids[0])
    T_out = len(labels)
    assert data["steps"] == {"labels": labels, "query_rows": list(range(1, T_out + 1))}
    assert decoder_self["query_tokens"] == ["<s>"] + labels[:-1]
    expected_cross = np.stack([w[0] for w in decoded.cross_attention])[:, :, :T_out, :S]  # (n, h, T_out, S)
    assert_within_rounding(cross, expected_cross, data)
    # Nothing was cut off with the padding: each row of the kept keys still sums to 1.
    np.testing.assert_allclose(weights_array(cross).sum(-1), 1, atol=S * data["max_error"] + 1e-6)

    # Decoder self-attention: row t is what the decoder computed at step t, from the t + 1 tokens it had then.
    source = translator.encode_sources([text])
    encoder_output, source_mask = model.encode(source, training=False)
    prefix = np.array([[tok.START] + list(decoded.ids[0, : T_out - 1])], dtype=np.int32)
    for t in range(T_out):
        step = prefix[:, : t + 1]
        _, self_weights, _ = model.decoder(
            step, encoder_output, np.ones(step.shape, bool), source_mask, training=False, return_attention_weights=True
        )
        got = weights_array(decoder_self)[:, :, t, : t + 1]  # (n, h, t + 1)
        expected = np.stack([np.asarray(w)[0, :, -1] for w in _to_numpy(self_weights)])
        assert np.abs(got - expected).max() <= data["max_error"] + 1e-12
    assert np.all(np.triu(weights_array(decoder_self), k=1) == 0)  # nothing from the future

    # Encoder self-attention over the characters (padding cut off).
    _, encoder_weights = model.encoder(source, source_mask, training=False, return_attention_weights=True)
    expected_encoder = np.stack([w[0] for w in _to_numpy(encoder_weights)])[:, :, :S, :S]
    assert_within_rounding(encoder_self, expected_encoder, data)


def _to_numpy(tensors):
    from keras import ops

    return [np.asarray(ops.convert_to_numpy(t.detach() if hasattr(t, "detach") else t)) for t in tensors]


def test_translator_truncates_long_text_with_a_note(translator_source):
    limit = translator_source.max_tokens
    text = "the 3rd of march 2021, " * 3 + "日本"  # characters it never saw, past what it reads: no note
    data = parsed(translator_source.attention(text))
    assert data["text"] == text
    assert data["attention"][0]["query_tokens"] == list(text[:limit])
    assert data["notes"][0] == (
        f"The text is {len(text)} characters long; {translator_source.name} reads at most {limit}, so it was "
        f"truncated to {text[:limit]!r}."
    )
    assert not any("refuses" in note for note in data["notes"])
    assert data["output"] == translator_source.translator.translate([text[:limit]])[0]


def test_translator_refuses_text_whose_read_part_is_blank(translator_source):
    limit = translator_source.max_tokens
    with pytest.raises(BadInput) as error:
        translator_source.attention(" " * (limit + 8) + "3/3/21")
    assert str(error.value) == (
        f"The text's first {limit} characters, all that {translator_source.name} reads, are blank: put the date "
        f"within its first {limit} characters."
    )


@pytest.mark.parametrize(
    "text, marker",
    [
        ("日本", "<unknown characters: 日本>"),
        ("2021-13-45", "<no such date: month 13 does not exist>"),
    ],
)
def test_translator_notes_what_translate_would_mark(translator_source, text, marker):
    data = parsed(translator_source.attention(text))
    refused = [note for note in data["notes"] if note.startswith("attnkit translate refuses")]
    assert refused == [f"attnkit translate refuses this text: {marker}. The output is the model's guess regardless."]


def test_translator_notes_an_output_that_is_not_a_date(translator_source):
    from attnkit.dates.task import is_iso_date

    data = parsed(translator_source.attention("march 3, 2021"))
    assert not is_iso_date(data["output"])  # the tiny model, trained for seconds, writes no date
    assert data["notes"] == [f"attnkit translate marks this output <not a date: {data['output']}>."]


def test_open_model_refuses_what_it_cannot_read(tmp_path):
    with pytest.raises(FileNotFoundError, match="model directory /no/such/dir does not exist"):
        open_model("/no/such/dir")
    with pytest.raises(FileNotFoundError, match="holds neither a date translator .* nor a BERT-architecture model"):
        open_model(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json: not valid JSON"):
        open_model(tmp_path)
    broken = tmp_path / "translator"
    broken.mkdir()
    (broken / "translator.json").write_text('{"alphabet": "abc", "source_length": 8}')
    with pytest.raises(FileNotFoundError, match="No model.keras in model directory"):
        open_model(broken)

"""`load_pretrained`: parity with sentence-transformers and transformers on the real all-MiniLM-L6-v2,
a tiny random BERT read through vocab.txt, and one clear error per kind of bad directory.

The reference libraries are torch-based and run beside whichever Keras backend is under test.
"""

import os
import re
import shutil

import keras
import numpy as np
import pytest
from pretrained_fixtures import MODEL_PATH, TINY_VOCAB, copy_small_files, write_tiny_model

import attnkit
from attnkit.models import BertEncoder

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

LONG = " ".join(f"word{i} is followed by another" for i in range(80))  # ~480 tokens: truncated at 256
SENTENCES = [
    "",
    "a",
    "Hello, world!",
    "The cat sat on the mat.",
    "A man is playing a guitar.",
    "A woman is slicing an onion in the kitchen.",
    "The quick brown fox jumps over the lazy dog.",
    "I love this movie so much 😍🎬",
    "Café, naïve, façade, jalapeño, smörgåsbord.",
    "東京は日本の首都です。",
    "Москва — столица России.",
    "الطقس جميل اليوم",
    "Ελληνικά γράμματα: α β γ δ",
    "🚀🚀🚀",
    "   leading and trailing spaces   ",
    "UPPER CASE AND lower case MiXeD",
    "Numbers: 3.14159, 42, 1e-9, -7",
    "https://example.com/path?query=1&other=2",
    "email@example.com wrote: \"quotes\" and 'apostrophes'",
    "Tabs\tand\nnewlines\nin the text",
    "Supercalifragilisticexpialidocious antidisestablishmentarianism",
    "The stock market fell sharply on Monday after the announcement.",
    "Transformers use self-attention to relate positions in a sequence.",
    "def f(x): return x ** 2  # Python code",
    "SELECT * FROM users WHERE id = 7;",
    "He said: well... maybe?!",
    "¿Dónde está la biblioteca?",
    "Wo ist der Bahnhof? Ich habe mich verlaufen.",
    "C'est la vie, mon ami.",
    "The patient was given 5 mg of the drug twice daily.",
    "Photosynthesis converts light energy into chemical energy.",
    "A dog runs through the park chasing a red ball.",
    "Two dogs are playing in the snow.",
    "The weather today is sunny with a light breeze.",
    "I can't believe it's not butter!",
    "Once upon a time, in a land far away, there lived a king.",
    "♥ ★ ☺ ✓ ∞ ≠ ≤ ≥",
    "x" * 300,  # one word past WordPiece's 100 characters: a single [UNK]
    "word " * 40,
    "The " + "very " * 60 + "long sentence.",
    " ".join(["Attention is all you need."] * 50),
    LONG,
    LONG + " and even more words at the end",
    "Ünïcödé everywhere 🤖 with emoji 👍🏽 and skin tones",
    "Short.",
    "Is this the real life? Is this just fantasy?",
    "A bird in the hand is worth two in the bush.",
    "Machine learning models can be biased by their training data.",
    "The Eiffel Tower is in Paris, France.",
    "The mitochondria is the powerhouse of the cell.",
    "Please remember to bring your umbrella tomorrow.",
    "Coffee or tea? Tea, please, with milk.",
]
N_TRUNCATED = 3  # the 50 "Attention is all you need.", LONG and LONG + ...: over 256 tokens


@pytest.fixture(scope="module")
def encoder():
    return attnkit.load_pretrained()


@pytest.fixture(scope="module")
def reference_bert():
    from transformers import AutoTokenizer, BertModel

    model = BertModel.from_pretrained(MODEL_PATH, attn_implementation="eager").eval()
    return model, AutoTokenizer.from_pretrained(MODEL_PATH)


def bert_outputs(model, tokenizer, texts, max_length=256):
    batch = tokenizer(texts, padding=True, truncation=True, max_length=max_length, return_tensors="pt")
    with torch.no_grad():
        outputs = model(**batch, output_attentions=True)
    return outputs, batch["attention_mask"].numpy().astype(bool)


def test_default_model_is_all_minilm(encoder):
    assert (encoder.n, encoder.h, encoder.d_model, encoder.max_length, encoder.pooling) == (6, 12, 384, 256, "mean")
    assert isinstance(encoder.model, BertEncoder) and isinstance(encoder.model, keras.Model)
    assert encoder.model.epsilon == 1e-12 and encoder.model.activation == "gelu"
    assert encoder.tokens("The cat sat.") == ["[CLS]", "the", "cat", "sat", ".", "[SEP]"]


def test_embeddings_match_sentence_transformers(encoder):
    from sentence_transformers import SentenceTransformer

    reference = SentenceTransformer(MODEL_PATH, device="cpu").encode(SENTENCES, batch_size=8, convert_to_numpy=True)
    with pytest.warns(UserWarning, match=rf"^{N_TRUNCATED} of {len(SENTENCES)} texts were longer than .* 256 tokens"):
        embeddings = encoder.encode(SENTENCES, batch_size=8)  # batches of similar lengths pad little
    assert embeddings.shape == (len(SENTENCES), 384) and embeddings.dtype == np.float32
    max_diff = np.abs(embeddings - reference).max()
    cosines = (embeddings * reference).sum(axis=1) / (
        np.linalg.norm(embeddings, axis=1) * np.linalg.norm(reference, axis=1)
    )
    print(f"\nembeddings vs sentence-transformers: max abs diff {max_diff:.2e}, min cosine {cosines.min():.8f}")
    assert max_diff <= 1e-4
    assert cosines.min() >= 0.99999
    np.testing.assert_allclose(np.linalg.norm(embeddings, axis=1), 1.0, atol=1e-5)


def test_encode_is_independent_of_batching_and_order(encoder):
    texts = SENTENCES[:12]
    together = encoder.encode(texts, batch_size=64)
    np.testing.assert_allclose(encoder.encode(texts, batch_size=5), together, atol=1e-5)
    np.testing.assert_allclose(encoder.encode(texts[::-1])[::-1], together, atol=1e-5)
    np.testing.assert_allclose(encoder.encode(texts[3]), together[3], atol=1e-5)  # one string: (d_model,)
    assert encoder.encode([]).shape == (0, 384)


def test_hidden_states_match_transformers(encoder, reference_bert):
    texts = ["The cat sat on the mat.", "", "Café 😀 naïve 東京", "A much longer sentence, with commas; and more words."]
    outputs, real = bert_outputs(*reference_bert, texts)
    hidden = encoder.hidden_states(texts)  # (B, T, d_model)
    assert hidden.shape == tuple(outputs.last_hidden_state.shape)
    max_diff = np.abs(hidden - outputs.last_hidden_state.numpy())[real].max()
    print(f"\nhidden states vs transformers.BertModel: max abs diff {max_diff:.2e}")
    assert max_diff <= 1e-4
    single = encoder.hidden_states(texts[0])  # (T, d_model), no padding
    np.testing.assert_allclose(single, hidden[0, : len(single)], atol=1e-4)


def test_attentions_match_transformers(encoder, reference_bert):
    texts = ["The cat sat on the mat.", "Two dogs are playing in the snow, far away from home."]
    outputs, real = bert_outputs(*reference_bert, texts)
    weights = encoder.attentions(texts)
    assert len(weights) == 6
    max_diff = 0.0
    for ours, theirs in zip(weights, outputs.attentions):
        assert ours.shape == tuple(theirs.shape)  # (B, h, T, T)
        theirs = theirs.numpy()
        for b in range(len(texts)):
            keep = real[b]
            max_diff = max(max_diff, np.abs(ours[b][:, keep][:, :, keep] - theirs[b][:, keep][:, :, keep]).max())
            np.testing.assert_array_equal(ours[b][:, :, ~keep], 0.0)  # padding is never attended to
    print(f"\nattention weights vs transformers.BertModel (eager): max abs diff {max_diff:.2e}")
    assert max_diff <= 1e-4
    single = encoder.attentions(texts[0])
    T = len(encoder.tokens(texts[0]))
    assert len(single) == 6 and single[0].shape == (12, T, T)
    np.testing.assert_allclose(single[0].sum(axis=-1), 1.0, atol=1e-5)


def test_texts_must_be_strings(encoder):
    with pytest.raises(TypeError, match=r"`texts` must be a list of strings. Received: list with items of type \['int'\]"):
        encoder.encode([1, 2])
    with pytest.raises(ValueError, match="`batch_size` must be a positive integer. Received: batch_size=0"):
        encoder.encode(["a"], batch_size=0)


def test_tiny_model_from_vocab_txt_matches_transformers(tmp_path):
    path = write_tiny_model(tmp_path / "tiny")
    tiny = attnkit.load_pretrained(path)
    assert (tiny.n, tiny.h, tiny.d_model, tiny.max_length) == (2, 2, 8, 16)  # no sentence_bert_config.json
    assert tiny.model.activation == "relu" and tiny.model.epsilon == 1e-5
    texts = ["the cat sat on the mat .", "a big dog ran", "cats"]
    assert tiny.tokens("cats") == ["[CLS]", "cat", "##s", "[SEP]"]
    token_ids, padding_mask, _ = tiny.tokenize(texts)
    reference = transformers.BertModel.from_pretrained(path, attn_implementation="eager").eval()
    with torch.no_grad():
        outputs = reference(torch.tensor(token_ids, dtype=torch.long), attention_mask=torch.tensor(padding_mask))
    np.testing.assert_allclose(
        tiny.hidden_states(texts)[padding_mask], outputs.last_hidden_state.numpy()[padding_mask], atol=1e-5
    )
    with pytest.warns(UserWarning, match=r"^1 of 2 texts were longer than the model's maximum of 16 tokens"):
        assert tiny.encode(["the cat " * 10, "a dog"]).shape == (2, 8)
    assert len(TINY_VOCAB) == tiny.model.vocab_size


def test_bert_encoder_config_round_trip(tmp_path):
    model = BertEncoder(50, 12, h=2, d_k=4, d_v=4, d_model=8, d_ff=16, n=2, rate=0.0, epsilon=1e-7)
    ids = np.array([[2, 5, 7, 3, 0, 0]], dtype="int32")
    expected = keras.ops.convert_to_numpy(model(ids))
    path = str(tmp_path / "bert.keras")
    model.save(path)
    restored = keras.saving.load_model(path)
    assert restored.get_config() == model.get_config()
    np.testing.assert_allclose(keras.ops.convert_to_numpy(restored(ids)), expected, atol=1e-6)


# Bad directories: each error names the file and the problem.


def test_missing_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match=rf"Model directory {re.escape(str(tmp_path))}/absent does not exist; .*config.json"):
        attnkit.load_pretrained(tmp_path / "absent")


def test_missing_weights_file(tmp_path):
    path = copy_small_files(tmp_path / "model")
    with pytest.raises(FileNotFoundError, match=rf"{re.escape(path)}: no model.safetensors, model.safetensors.index.json, pytorch_model.bin or"):
        attnkit.load_pretrained(path)


def test_config_of_another_architecture(tmp_path):
    path = copy_small_files(tmp_path / "model")
    with open(os.path.join(path, "config.json"), "w") as f:
        f.write('{"model_type": "gpt2", "n_layer": 12}')
    with pytest.raises(ValueError, match=rf"{re.escape(path)}/config.json: model_type 'gpt2' is not supported; .*'bert'"):
        attnkit.load_pretrained(path)


def test_weight_of_the_wrong_shape(tmp_path):
    path = write_tiny_model(tmp_path / "tiny", wrong_shape="encoder.layer.1.attention.self.key.weight")
    with pytest.raises(
        ValueError,
        match=rf"{re.escape(path)}/model.safetensors: tensors with shapes other than .*config.json implies: "
        r"'encoder.layer.1.attention.self.key.weight \(9, 8\), expected \(8, 8\)'",
    ):
        attnkit.load_pretrained(path)


def test_truncated_weights_file(tmp_path):
    path = write_tiny_model(tmp_path / "tiny")
    file = os.path.join(path, "model.safetensors")
    os.truncate(file, os.path.getsize(file) // 2)
    with pytest.raises(ValueError, match=rf"{re.escape(file)}: cannot read the safetensors file, truncated or corrupt\?"):
        attnkit.load_pretrained(path)


def test_missing_tokenizer(tmp_path):
    path = write_tiny_model(tmp_path / "tiny")
    os.remove(os.path.join(path, "vocab.txt"))
    with pytest.raises(FileNotFoundError, match=rf"{re.escape(path)}: neither tokenizer.json nor vocab.txt found"):
        attnkit.load_pretrained(path)


def test_missing_weight(tmp_path):
    from safetensors.numpy import load_file, save_file

    path = write_tiny_model(tmp_path / "tiny")
    file = os.path.join(path, "model.safetensors")
    weights = load_file(file)
    del weights["encoder.layer.0.output.dense.bias"]
    save_file(weights, file)
    with pytest.raises(ValueError, match=rf"{re.escape(file)}: 1 tensors that .*config.json implies are missing: 'encoder.layer.0.output.dense.bias \(8,\)'"):
        attnkit.load_pretrained(path)


def test_path_that_is_a_file(tmp_path):
    file = tmp_path / "config.json"
    shutil.copy(os.path.join(MODEL_PATH, "config.json"), file)
    with pytest.raises(FileNotFoundError, match=rf"Model directory {re.escape(str(file))} is not a directory"):
        attnkit.load_pretrained(file)


def test_texts_may_be_any_iterable_and_other_types_are_named(tmp_path):
    tiny = attnkit.load_pretrained(write_tiny_model(tmp_path / "tiny"))
    texts = ["the cat sat", "a dog ran"]
    expected = tiny.encode(texts)
    np.testing.assert_array_equal(tiny.encode(t for t in texts), expected)  # a generator was read as empty
    np.testing.assert_array_equal(tiny.encode(tuple(texts)), expected)
    from_generator = tiny.attentions(t for t in texts)
    assert len(from_generator) == 2 and from_generator[0].shape == (2, 2, 5, 5)
    np.testing.assert_array_equal(from_generator[1], tiny.attentions(texts)[1])
    with pytest.raises(TypeError, match=r"^`texts` must be a string or a list of strings. Received: texts of type int$"):
        tiny.encode(5)
    with pytest.raises(TypeError, match=r"^`texts` must be a string or a list of strings. Received: texts of type NoneType$"):
        tiny.attentions(None)
    with pytest.raises(TypeError, match=r"^`text` must be a string. Received: text of type int$"):
        tiny.tokens(3)
    with pytest.raises(
        TypeError, match=r"^`path` must be a model directory \(str or os.PathLike\) or None. Received: path of type int$"
    ):
        attnkit.load_pretrained(5)


def test_encode_does_not_make_numpy_warn_about_copy(tmp_path):
    import warnings

    tiny = attnkit.load_pretrained(write_tiny_model(tmp_path / "tiny"))
    with warnings.catch_warnings():
        # torch tensors through keras.ops.convert_to_numpy warned once per batch under NumPy 2
        warnings.filterwarnings("error", message=".*__array__ implementation doesn't accept a copy keyword")
        assert tiny.encode(["the cat", "a dog ran", "big"], batch_size=1).shape == (3, 8)


def test_a_model_loaded_under_mixed_bfloat16_encodes_close_to_float32(tmp_path):
    """Its outputs are bfloat16 on torch, which NumPy has no dtype for: encode returns float32."""
    path = write_tiny_model(tmp_path / "tiny")
    texts = ["the cat sat on the mat .", "a big dog ran", "cats"]
    full = attnkit.load_pretrained(path).encode(texts)
    keras.config.set_dtype_policy("mixed_bfloat16")
    try:
        half = attnkit.load_pretrained(path)
    finally:
        keras.config.set_dtype_policy("float32")
    embeddings = half.encode(texts)
    assert embeddings.dtype == np.float32 and embeddings.shape == full.shape
    # bfloat16 keeps 8 bits of mantissa: about 2^-8 relative per operation, a few percent after 2 layers.
    np.testing.assert_allclose(embeddings, full, rtol=0, atol=0.05)
    assert half.hidden_states(texts).dtype == np.float32


def test_tokenizer_with_more_ids_than_the_vocab_size_is_refused(tmp_path):
    path = write_tiny_model(tmp_path / "tiny")
    with open(os.path.join(path, "vocab.txt"), "a") as f:
        f.write("mouse\nhouse\n")  # ids 16 and 17; config.json says vocab_size 16
    message = (
        rf"^{re.escape(path)}/vocab.txt: the tokenizer has ids up to 17 \(18 tokens\), but {re.escape(path)}/config.json "
        r"has vocab_size=16: the tokenizer does not belong to these weights$"
    )
    with pytest.raises(ValueError, match=message):
        attnkit.load_pretrained(path)


def test_original_bert_layer_norm_names_are_accepted(tmp_path):
    from safetensors.numpy import load_file, save_file

    path = write_tiny_model(tmp_path / "tiny")
    expected = attnkit.load_pretrained(path).hidden_states("the cat sat")
    file = os.path.join(path, "model.safetensors")
    renamed = {
        name.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): value
        for name, value in load_file(file).items()
    }
    assert "bert.embeddings.LayerNorm.gamma" not in renamed and "embeddings.LayerNorm.gamma" in renamed
    save_file({"bert." + name: value for name, value in renamed.items()}, file)
    np.testing.assert_array_equal(attnkit.load_pretrained(path).hidden_states("the cat sat"), expected)


def test_layer_norm_stored_under_both_names_is_refused(tmp_path):
    from safetensors.numpy import load_file, save_file

    path = write_tiny_model(tmp_path / "tiny")
    file = os.path.join(path, "model.safetensors")
    weights = load_file(file)
    weights["embeddings.LayerNorm.gamma"] = weights["embeddings.LayerNorm.weight"]
    save_file(weights, file)
    with pytest.raises(
        ValueError,
        match=rf"^{re.escape(file)}: the tensor 'embeddings.LayerNorm.weight' is stored twice",
    ):
        attnkit.load_pretrained(path)


@pytest.mark.parametrize(
    "key, value, expected",
    [
        ("hidden_dropout_prob", "abc", "`hidden_dropout_prob` must be a number. Received: hidden_dropout_prob='abc'"),
        ("hidden_dropout_prob", 1.0, r"`hidden_dropout_prob` must be in \[0, 1\). Received: hidden_dropout_prob=1.0"),
        ("layer_norm_eps", None, "`layer_norm_eps` must be a number. Received: layer_norm_eps=None"),
        ("layer_norm_eps", 0, "`layer_norm_eps` must be a positive number. Received: layer_norm_eps=0.0"),
        ("pad_token_id", "x", r"`pad_token_id` must be null or an integer in \[-vocab_size, vocab_size\) = \[-16, 16\). Received: pad_token_id='x'"),
        ("pad_token_id", 16, r"`pad_token_id` must be null or an integer in \[-vocab_size, vocab_size\) = \[-16, 16\). Received: pad_token_id=16"),
        ("type_vocab_size", 2.5, "`type_vocab_size` must be a positive integer. Received: type_vocab_size=2.5"),
        ("type_vocab_size", 0, "`type_vocab_size` must be a positive integer. Received: type_vocab_size=0"),
    ],
)
def test_invalid_optional_config_fields_name_config_json_and_the_key(tmp_path, key, value, expected):
    import json

    path = write_tiny_model(tmp_path / "tiny")
    file = os.path.join(path, "config.json")
    with open(file) as f:
        config = json.load(f)
    config[key] = value
    with open(file, "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match=rf"^{re.escape(file)}: {expected}$"):
        attnkit.load_pretrained(path)


def test_null_pad_token_id_pads_with_zero(tmp_path):
    import json

    path = write_tiny_model(tmp_path / "tiny")
    file = os.path.join(path, "config.json")
    with open(file) as f:
        config = json.load(f)
    config["pad_token_id"] = None
    with open(file, "w") as f:
        json.dump(config, f)
    assert attnkit.load_pretrained(path).model.pad_id == 0


ACCENT_VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "cafe", "café", "Cafe", "Café", "naive", "naïve",
                "東", "京", "東京"]


@pytest.mark.parametrize(
    "settings, expected",
    [
        ({}, ["cafe", "naive", "東", "京", "cafe"]),
        ({"strip_accents": False}, ["café", "naïve", "東", "京", "cafe"]),  # was stripped: the setting was ignored
        ({"strip_accents": True, "do_lower_case": False}, ["Cafe", "naive", "東", "京", "Cafe"]),
        ({"do_lower_case": False}, ["Café", "naïve", "東", "京", "Cafe"]),
        ({"tokenize_chinese_chars": False}, ["cafe", "naive", "東京", "cafe"]),
    ],
)
def test_vocab_txt_tokenizer_follows_tokenizer_config(tmp_path, settings, expected):
    import json

    from attnkit.checkpoints.tokenizers.hf import read_tokenizer

    with open(tmp_path / "vocab.txt", "w", encoding="utf-8") as f:
        f.write("\n".join(ACCENT_VOCAB) + "\n")
    with open(tmp_path / "tokenizer_config.json", "w") as f:
        json.dump(settings, f)
    text = "Café naïve 東京 Cafe"
    tokens = read_tokenizer(str(tmp_path)).encode(text).tokens
    assert tokens == ["[CLS]", *expected, "[SEP]"]
    reference = transformers.BertTokenizer(
        str(tmp_path / "vocab.txt"), do_lower_case=settings.get("do_lower_case", True),
        strip_accents=settings.get("strip_accents"), tokenize_chinese_chars=settings.get("tokenize_chinese_chars", True),
    )
    assert tokens[1:-1] == reference.tokenize(text)


def test_invalid_tokenizer_config_setting(tmp_path):
    from attnkit.checkpoints.tokenizers.hf import read_tokenizer

    (tmp_path / "vocab.txt").write_text("\n".join(ACCENT_VOCAB) + "\n", encoding="utf-8")
    (tmp_path / "tokenizer_config.json").write_text('{"strip_accents": "yes"}')
    with pytest.raises(
        ValueError, match=r"tokenizer_config.json: `strip_accents` must be null, true or false. Received: strip_accents='yes'$"
    ):
        read_tokenizer(str(tmp_path))

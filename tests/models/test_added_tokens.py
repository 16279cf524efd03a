"""Added and special tokens as transformers 5 adds them on loading (`attnkit.checkpoints.tokenizers.added_tokens`):
tokenizer_config.json's added_tokens_decoder over tokenizer.json's added_tokens, the special tokens
and extra_special_tokens / additional_special_tokens, added_tokens.json, split_special_tokens.
Random texts (hypothesis) over tokenizers built here, compared with AutoTokenizer's ids."""

import json
import shutil

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import attnkit
from attnkit.checkpoints.tokenizers.hf import read_tokenizer

transformers = pytest.importorskip("transformers")

WORDS = ["the", "cat", "sat", "on", "mat", "hello", "world", "café", "cafe", "naive", "naïve", "東", "京", "##s",
         "##ing", "a", "b", "x", "##a", "##b", "##x", "run", "##ning", ",", ".", "!", "[", "]", "<", ">", "|", "😍",
         "tok", "##tok", "foo", "##foo", "bar", "##bar", "new", "##new", "for", "##mat", "[unused0]"]
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS
# pieces the random texts are made of: words, the added tokens' texts in other cases, specials spelled out
PIECES = WORDS[:13] + ["foobar", "FooBar", "XyZ", "xyz", "newtok", "NEWTOK", "<tool>", "<TOOL>", "[MASK]", "[CLS]",
                       "[SEP]", "[UNK]", "[unused0]", "Ünïcödé", "中国", "🙂", "\u200b", "\x00", "\t", "\n", "  ", " ",
                       "format", "matte", "é", "e\u0301"]
TEXTS = st.lists(st.sampled_from(PIECES) | st.text(max_size=3), max_size=12).map("".join)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A BertTokenizer directory as transformers 5 saves it: normal, unnormalized and special added tokens."""
    from transformers import AddedToken

    path = tmp_path_factory.mktemp("added") / "base"
    tokenizer = transformers.BertTokenizerFast(vocab={w: i for i, w in enumerate(VOCAB)})
    tokenizer.add_tokens([AddedToken("foobar"), AddedToken("XyZ", normalized=False), "newtok"])
    tokenizer.add_special_tokens({"additional_special_tokens": [AddedToken("<tool>", lstrip=True)]})
    tokenizer.save_pretrained(path)
    return path


def _edit(file, change):
    data = json.loads(file.read_text())
    change(data)
    file.write_text(json.dumps(data))


def _decoder(path):
    """tokenizer.json's added tokens as transformers 4 wrote them into tokenizer_config.json."""
    tokens = json.loads((path / "tokenizer.json").read_text())["added_tokens"]
    return {str(t["id"]): {k: v for k, v in t.items() if k != "id"} for t in tokens}


def _vocab_txt_only(path):
    vocab = json.loads((path / "tokenizer.json").read_text())["model"]["vocab"]
    (path / "vocab.txt").write_text("\n".join(sorted(vocab, key=vocab.get)) + "\n")
    (path / "tokenizer.json").unlink()


def _no_file_tokens(path):
    _edit(path / "tokenizer.json", lambda d: d.__setitem__("added_tokens", []))


def _flags_changed(data):
    data["added_tokens_decoder"] = decoder = _decoder_of(data)
    flags = {"foobar": dict(single_word=True, lstrip=True), "XyZ": dict(normalized=True),  # a lowercased text matches it
             "<tool>": dict(lstrip=False, rstrip=True)}
    for token in decoder.values():
        token.update(flags.get(token["content"], {}))


def _decoder_of(data):
    return {key: dict(value) for key, value in data["__decoder"].items()}


# (name, change of the directory, change of tokenizer_config.json); every one of these gave other ids before
VARIANTS = {
    # transformers 4's files: added_tokens_decoder in tokenizer_config.json, which transformers 5 reads instead
    "added_tokens_decoder only": (_no_file_tokens, lambda d: d.__setitem__("added_tokens_decoder", _decoder_of(d))),
    "added_tokens_decoder flags": (None, _flags_changed),
    # an in-vocabulary word added: it is matched inside other words ("format")
    "decoder adds a vocabulary word": (None, lambda d: d.__setitem__("added_tokens_decoder", {
        **_decoder_of(d), str(VOCAB.index("mat")): {"content": "mat", "lstrip": False, "rstrip": False, "normalized": True,
                                 "single_word": False, "special": False}})),
    "special tokens missing from the file": (
        lambda p: _edit(p / "tokenizer.json", lambda d: d.__setitem__("added_tokens", d["added_tokens"][5:])), None),
    "additional_special_tokens": (None, lambda d: (d.pop("extra_special_tokens"),
                                                   d.__setitem__("additional_special_tokens", ["<tool>", "tok"]))),
    "a model-specific special token": (None, lambda d: d.__setitem__("image_token", "mat")),
    "split_special_tokens": (None, lambda d: d.__setitem__("split_special_tokens", True)),
    "vocab.txt with added_tokens_decoder": (_vocab_txt_only, lambda d: d.__setitem__("added_tokens_decoder", _decoder_of(d))),
    "vocab.txt with added_tokens.json": (
        lambda p: (_vocab_txt_only(p), (p / "added_tokens.json").write_text(json.dumps({"foobar": len(VOCAB), "XyZ": len(VOCAB) + 1}))), None),
    "vocab.txt alone, mask_token another word": (_vocab_txt_only, lambda d: d.__setitem__("mask_token", "[unused0]")),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request, base, tmp_path_factory):
    """(attnkit's tokenizer, AutoTokenizer) of one edited copy of `base`."""
    change_directory, change_config = VARIANTS[request.param]
    path = tmp_path_factory.mktemp("variant") / "model"
    shutil.copytree(base, path)
    decoder = _decoder(path)
    if change_directory:
        change_directory(path)
    if change_config:
        def change(data):
            data["__decoder"] = decoder
            change_config(data)
            data.pop("__decoder")
        _edit(path / "tokenizer_config.json", change)
    return read_tokenizer(str(path)), transformers.AutoTokenizer.from_pretrained(str(path))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=TEXTS, pair=st.none() | TEXTS.filter(bool))  # transformers reads a pair "" as no pair
def test_ids_offsets_and_decoding_match_transformers(variant, text, pair):
    ours, reference = variant
    expected = reference(text, pair, return_offsets_mapping=True)
    encoding = ours.encode(text, pair)
    assert encoding.ids == expected["input_ids"]
    assert encoding.type_ids == expected["token_type_ids"]
    assert [tuple(o) for o in encoding.offsets] == [tuple(o) for o in expected["offset_mapping"]]
    for skip in (True, False):
        assert ours.decode(encoding.ids, skip_special_tokens=skip) == reference.decode(
            expected["input_ids"], skip_special_tokens=skip, clean_up_tokenization_spaces=False)


def test_the_encoder_tokenizes_tokenizer_config_tokens_as_transformers(checkpoints, tmp_path):
    # the session's BERT checkpoint, transformers 4 style: a vocabulary word added in added_tokens_decoder
    path = shutil.copytree(checkpoints.base("bert"), tmp_path / "model")

    def change(data):
        data["added_tokens_decoder"] = {"4937": {"content": "cat", "lstrip": False, "rstrip": False, "normalized": True,
                                                 "single_word": False, "special": False}}
        data["extra_special_tokens"] = ["dog"]

    _edit(path / "tokenizer_config.json", change)
    texts = ["concatenate the dogma", "Cat DOG catdog", "[MASK] x [CLS]"]
    reference = transformers.AutoTokenizer.from_pretrained(str(path))
    token_ids, mask, _ = attnkit.load_pretrained(path).tokenize(texts)
    assert [ids[m].tolist() for ids, m in zip(token_ids, mask)] == [reference(text)["input_ids"] for text in texts]


@pytest.mark.parametrize("change, match", [
    (lambda d: d.__setitem__("added_tokens_decoder", []), r"`added_tokens_decoder` must be an object of \{id: token\}"),
    (lambda d: d.__setitem__("added_tokens_decoder", {"x": {"content": "a"}}), r"`added_tokens_decoder` keys must be token ids"),
    (lambda d: d.__setitem__("added_tokens_decoder", {"5": {"content": "a", "lstrip": "yes"}}),
     r"`added_tokens_decoder\[5\]\.lstrip` must be true or false"),
    (lambda d: d.__setitem__("added_tokens_decoder", {"5": {"content": "a", "colour": "red"}}),
     r"`added_tokens_decoder\[5\]` must be an AddedToken object"),
    (lambda d: d.__setitem__("extra_special_tokens", "<tool>"), r"`extra_special_tokens` must be a list of tokens"),
    (lambda d: d.__setitem__("extra_special_tokens", [3]), r"`extra_special_tokens\[0\]` must be a token string"),
    (lambda d: d.__setitem__("split_special_tokens", "no"), r"`split_special_tokens` must be true or false"),
])
def test_malformed_added_tokens_are_refused_by_field(base, tmp_path, change, match):
    path = shutil.copytree(base, tmp_path / "model")
    _edit(path / "tokenizer_config.json", change)
    with pytest.raises(ValueError, match=r"tokenizer_config\.json: " + match):
        read_tokenizer(str(path))


BPE_CORPUS = ["the cat sat on the mat", "hello world", "café naïve 東京 😍", "def f(x): return x+1"] * 3
CAUSAL_PIECES = ["hello", " world", "cat", "mat", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<tool>", "<extra>",
                 "catalogue", " Cat", "\n", "  ", "\t", "é", "東京", "😍", "\x00", "\u200b"]
CAUSAL_TEXTS = st.lists(st.sampled_from(CAUSAL_PIECES) | st.text(max_size=3), max_size=12).map("".join)


@pytest.fixture(scope="module")
def causal(tmp_path_factory):
    """(attnkit's causal tokenizer, AutoTokenizer) of a byte-level BPE directory (run as it is) whose
    tokenizer_config.json adds tokens the tokenizer.json does not have (transformers 4 style)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from attnkit.pipelines.causal_checkpoint import read_hf_tokenizer

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(BPE_CORPUS, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    path = tmp_path_factory.mktemp("causal") / "model"
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>").save_pretrained(path)

    def change(data):
        flags = dict(lstrip=False, rstrip=False, single_word=False)
        data["added_tokens_decoder"] = {
            "0": {"content": "<|endoftext|>", "normalized": False, "special": True, **flags},
            "400": {"content": "<tool>", "normalized": False, "special": True, **flags},  # gets the next free id
            "401": {"content": "cat", "normalized": True, "special": False, **flags},  # matched inside "catalogue"
        }
        data["extra_special_tokens"] = ["<extra>", "<|im_start|>"]
        data["tokenizer_class"] = "PreTrainedTokenizerFast"

    _edit(path / "tokenizer_config.json", change)
    return read_hf_tokenizer(str(path), {})[0], transformers.AutoTokenizer.from_pretrained(str(path))


@settings(max_examples=80, deadline=None)
@given(text=CAUSAL_TEXTS)
def test_a_causal_tokenizer_adds_tokenizer_config_tokens_as_transformers(causal, text):
    ours, reference = causal
    expected = reference(text, return_offsets_mapping=True)
    encoding = ours.encode(text)
    assert encoding.ids == expected["input_ids"]
    assert [tuple(o) for o in encoding.offsets] == [tuple(o) for o in expected["offset_mapping"]]
    for skip in (True, False):
        assert ours.decode(encoding.ids, skip_special_tokens=skip) == reference.decode(
            expected["input_ids"], skip_special_tokens=skip)

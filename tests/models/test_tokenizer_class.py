"""tokenizer.json rebuilt as transformers' tokenizer class rebuilds it from tokenizer_config.json
(`attnkit.checkpoints.tokenizers.tokenizer_class`): token ids identical to AutoTokenizer's (and sentence-transformers'
embeddings) when tokenizer.json's own pipeline disagrees with tokenizer_config.json or the class's
defaults; a class not replicated is refused. Checkpoints are copies of the session's random ones,
with the JSON edited."""

import json
import shutil

import numpy as np
import pytest

import attnkit

pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TEXTS = ["Hello World, THE Cat", "Café naïve ÜBER", "東京 is 中国", "  two  spaces here ", "a"]


def _copy(source, target):
    shutil.copytree(source, target)
    return target


def _edit(file, change):
    with open(file) as f:
        data = json.load(f)
    change(data)
    with open(file, "w") as f:
        json.dump(data, f)


def _set(**values):
    """A change that sets keys, or removes those given None."""
    def change(data):
        for key, value in values.items():
            data.pop(key, None) if value is None else data.__setitem__(key, value)
    return change


def _bert_normalizer(**values):
    return lambda data: data["normalizer"].update(values)


def _ids(encoder, texts):
    token_ids, mask, _ = encoder.tokenize(texts)
    return [ids[m].tolist() for ids, m in zip(token_ids, mask)]


def _assert_as_transformers(path, texts=TEXTS):
    reference = transformers.AutoTokenizer.from_pretrained(str(path))
    assert _ids(attnkit.load_pretrained(path), texts) == [reference(text)["input_ids"] for text in texts]


@pytest.mark.parametrize("family", ["bert", "distilbert", "electra"])
def test_a_cased_tokenizer_json_lowercases_without_do_lower_case(checkpoints, tmp_path, family):
    # BertTokenizer's default do_lower_case=True wins over tokenizer.json's lowercase=false; electra and
    # distilbert without tokenizer_class get BertTokenizer from their model_type
    path = _copy(checkpoints.base(family), tmp_path / "model")
    _edit(path / "tokenizer.json", _bert_normalizer(lowercase=False, strip_accents=False))
    _edit(path / "tokenizer_config.json", _set(do_lower_case=None, tokenizer_class=None if family != "bert" else "BertTokenizer"))
    _assert_as_transformers(path)


def test_do_lower_case_false_over_a_lowercasing_tokenizer_json_as_sentence_transformers(checkpoints, tmp_path):
    # sentence-transformers' Transformer(path, do_lower_case=True), saved: tokenizer.json gets a Lowercase
    # normalizer, tokenizer_config.json keeps do_lower_case false, and loading it back does not lowercase
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules.transformer import Transformer
    from sentence_transformers.sentence_transformer.modules.pooling import Pooling

    base = _copy(checkpoints.base("bert"), tmp_path / "base")
    _edit(base / "tokenizer.json", _bert_normalizer(lowercase=False, strip_accents=False))
    _edit(base / "tokenizer_config.json", _set(do_lower_case=False))
    transformer = Transformer(str(base), do_lower_case=True)
    path = tmp_path / "model"
    SentenceTransformer(modules=[transformer, Pooling(24)], device="cpu").save(str(path))
    assert "Lowercase" in (path / "tokenizer.json").read_text()
    reference = SentenceTransformer(str(path), device="cpu")
    encoder = attnkit.load_pretrained(path)
    batch = reference.tokenize(TEXTS)
    expected = [ids[m == 1].tolist() for ids, m in zip(batch["input_ids"].numpy(), batch["attention_mask"].numpy())]
    assert _ids(encoder, TEXTS) == expected
    np.testing.assert_allclose(encoder.encode(TEXTS), reference.encode(TEXTS), atol=1e-5)


@pytest.mark.parametrize("json_normalizer, config", [
    (dict(strip_accents=False), dict(do_lower_case=False, strip_accents=True)),  # strips, uncased
    (dict(strip_accents=True), dict(strip_accents=False)),  # lowercases, keeps accents
    (dict(handle_chinese_chars=True), dict(tokenize_chinese_chars=False)),  # 東京 one word
    (dict(clean_text=False), {}),  # BertTokenizer always cleans
])
def test_bert_normalizer_follows_tokenizer_config(checkpoints, tmp_path, json_normalizer, config):
    path = _copy(checkpoints.base("bert"), tmp_path / "model")
    _edit(path / "tokenizer.json", _bert_normalizer(**json_normalizer))
    _edit(path / "tokenizer_config.json", _set(**config))
    _assert_as_transformers(path, TEXTS + ["tab\there \x00 zero"])


def test_bert_pipeline_and_wordpiece_settings_are_the_classes(checkpoints, tmp_path):
    # BertTokenizer keeps tokenizer.json's vocabulary only: its normalizer Sequence, pre-tokenizer,
    # post-processor and WordPiece max_input_chars_per_word are rebuilt
    path = _copy(checkpoints.base("bert"), tmp_path / "model")

    def change(data):
        data["normalizer"] = {"type": "Sequence", "normalizers": [{"type": "NFKC"}, data["normalizer"]]}
        data["pre_tokenizer"] = {"type": "WhitespaceSplit"}
        data["post_processor"] = None
        data["model"]["max_input_chars_per_word"] = 5

    _edit(path / "tokenizer.json", change)
    _assert_as_transformers(path, TEXTS + ["ｈｅｌｌｏ wonderful"])


def test_cls_and_sep_tokens_come_from_tokenizer_config(checkpoints, tmp_path):
    path = _copy(checkpoints.base("bert"), tmp_path / "model")
    _edit(path / "tokenizer_config.json", _set(cls_token="[unused0]", sep_token="[unused1]"))
    _assert_as_transformers(path)
    shutil.copy(path / "tokenizer.json", tmp_path / "tokenizer.json")
    (path / "tokenizer.json").unlink()  # vocab.txt alone: BertTokenizer's template too
    (path / "vocab.txt").write_text("\n".join(
        token for token, _ in sorted(json.loads((tmp_path / "tokenizer.json").read_text())["model"]["vocab"].items(),
                                     key=lambda item: item[1])) + "\n")
    _assert_as_transformers(path)


@pytest.mark.parametrize("add_prefix_space", [True, False])
def test_roberta_add_prefix_space_and_no_normalizer(checkpoints, tmp_path, add_prefix_space):
    path = _copy(checkpoints.base("roberta"), tmp_path / "model")

    def change(data):
        data["pre_tokenizer"]["add_prefix_space"] = not add_prefix_space
        data["normalizer"] = {"type": "Lowercase"}  # RobertaTokenizer has none

    _edit(path / "tokenizer.json", change)
    _edit(path / "tokenizer_config.json", _set(tokenizer_class="RobertaTokenizer", add_prefix_space=add_prefix_space))
    _assert_as_transformers(path)


def _unigram_tokenizer_json(file):
    """A small Unigram tokenizer.json shaped like xlm-roberta-base's (unknown token at id 3)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.Unigram())
    tokenizer.normalizer = normalizers.Sequence([normalizers.Lowercase(), normalizers.Replace("  ", " ")])
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    corpus = ["the cat sat on the mat", "a dog ran in the park", "hello world", "café naïve 東京"] * 5
    trainer = trainers.UnigramTrainer(vocab_size=120, special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"],
                                      unk_token="<unk>", show_progress=False)
    tokenizer.train_from_iterator(corpus, trainer)
    tokenizer.save(str(file))


@pytest.mark.parametrize("add_prefix_space", [None, False])
def test_xlm_roberta_rebuilds_the_unigram_pipeline(checkpoints, tmp_path, add_prefix_space):
    path = _copy(checkpoints.base("xlm-roberta"), tmp_path / "model")
    _unigram_tokenizer_json(path / "tokenizer.json")
    _edit(path / "tokenizer_config.json", _set(tokenizer_class="XLMRobertaTokenizer", add_prefix_space=add_prefix_space))
    _assert_as_transformers(path, TEXTS + ["Hello World"])


def test_a_class_not_replicated_is_refused(checkpoints, tmp_path):
    path = _copy(checkpoints.base("bert"), tmp_path / "model")
    _edit(path / "tokenizer_config.json", _set(tokenizer_class="MPNetTokenizer"))
    with pytest.raises(ValueError, match=r"tokenizer_config\.json: tokenizer_class 'MPNetTokenizer': transformers "
                                         r"rebuilds tokenizer\.json with that class's own settings"):
        attnkit.load_pretrained(path)


def test_a_special_token_outside_the_vocabulary_is_refused(checkpoints, tmp_path):
    path = _copy(checkpoints.base("bert"), tmp_path / "model")
    _edit(path / "tokenizer_config.json", _set(cls_token="<cls>"))
    with pytest.raises(ValueError, match=r"tokenizer_config\.json: `cls_token` '<cls>' is not in the vocabulary of .*tokenizer\.json"):
        attnkit.load_pretrained(path)


def test_a_tokenizer_json_model_of_another_kind_is_refused(checkpoints, tmp_path):
    path = _copy(checkpoints.base("roberta"), tmp_path / "model")
    _edit(path / "tokenizer_config.json", _set(tokenizer_class="BertTokenizer"))
    with pytest.raises(ValueError, match=r"tokenizer\.json: `model\.type` is 'BPE', but the tokenizer class builds a WordPiece model"):
        attnkit.load_pretrained(path)

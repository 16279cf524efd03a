"""sentence-transformers' prompts and config overrides, read from a model directory as it reads them:
config_sentence_transformers.json's `prompts` and `default_prompt_name` (with Pooling's
include_prompt), and sentence_bert_config.json's `config_kwargs` (formerly `config_args`). Parity
with sentence-transformers on random checkpoints saved at test time; bad values refused by name.
"""

import json
import os
import shutil
import warnings

import numpy as np
import pytest
from checkpoint_fixtures import TEXTS, max_difference

import attnkit

pytest.importorskip("torch")
pytest.importorskip("sentence_transformers")

PROMPTS = {"query": "query: the cat ", "passage": "passage: ", "none": ""}


def _copy(source, tmp_path, name="model"):
    directory = tmp_path / name
    shutil.copytree(source, directory)
    return str(directory)


def _edit(file, **fields):
    with open(file) as f:
        data = json.load(f) if os.path.getsize(file) else {}
    data.update(fields)
    with open(file, "w") as f:
        json.dump(data, f)


def _encode(encoder, texts, **options):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # truncation: tested elsewhere
        return encoder.encode(texts, batch_size=4, **options)


def _close(ours, theirs):
    assert ours.shape == theirs.shape
    assert max_difference(ours, theirs) <= 2e-6 * max(1.0, float(np.abs(theirs).max()))


@pytest.mark.parametrize("mode", ["mean", "cls", "weightedmean", "lasttoken", "max"])
@pytest.mark.parametrize("include_prompt", [True, False])
def test_prompts_match_sentence_transformers(checkpoints, tmp_path, mode, include_prompt):
    from sentence_transformers import SentenceTransformer

    directory = _copy(checkpoints.sentence("bert", mode), tmp_path)
    _edit(os.path.join(directory, "config_sentence_transformers.json"), prompts=PROMPTS, default_prompt_name="query")
    _edit(os.path.join(directory, "1_Pooling", "config.json"), include_prompt=include_prompt)
    theirs = SentenceTransformer(directory, device="cpu")
    ours = attnkit.load_pretrained(directory)
    texts = TEXTS[:3] + [TEXTS[4]]
    default = _encode(ours, texts)
    _close(default, theirs.encode(texts, batch_size=4))  # the default prompt, unasked
    _close(_encode(ours, texts, prompt_name="passage"), theirs.encode(texts, batch_size=4, prompt_name="passage"))
    _close(_encode(ours, texts, prompt="search: "), theirs.encode(texts, batch_size=4, prompt="search: "))
    plain = _encode(ours, texts, prompt="")
    _close(plain, theirs.encode(texts, batch_size=4, prompt=""))
    assert max_difference(default, plain) > 1e-3  # the prompt changes the embeddings: the test can tell


@pytest.mark.parametrize("mode", ["mean", "cls", "max"])
def test_a_prompt_longer_than_max_seq_length_is_counted_truncated(checkpoints, tmp_path, mode):
    """sentence-transformers measures the prompt truncated at max_seq_length, so its [SEP] stays pooled;
    attnkit counted it whole and pooled nothing: zeros (mean), [CLS] (cls), NaN (max then Normalize)."""
    from sentence_transformers import SentenceTransformer

    directory = _copy(checkpoints.sentence("bert", mode), tmp_path)
    _edit(os.path.join(directory, "1_Pooling", "config.json"), include_prompt=False)
    _edit(os.path.join(directory, "sentence_bert_config.json"), max_seq_length=6)
    prompt = "query: the cat sat on the mat and the dog "  # longer than 6 tokens
    ours = _encode(attnkit.load_pretrained(directory), TEXTS[:2], prompt=prompt)
    assert np.isfinite(ours).all() and np.abs(ours).max() > 0
    _close(ours, SentenceTransformer(directory, device="cpu").encode(TEXTS[:2], batch_size=4, prompt=prompt))


def test_a_default_prompt_is_added_to_the_texts(checkpoints, tmp_path):
    directory = _copy(checkpoints.sentence("bert", "mean"), tmp_path)
    encoder = attnkit.load_pretrained(directory)
    asked = _encode(encoder, ["a dog"], prompt="query: the cat ")
    _edit(os.path.join(directory, "config_sentence_transformers.json"), prompts=PROMPTS, default_prompt_name="query")
    np.testing.assert_array_equal(_encode(attnkit.load_pretrained(directory), ["a dog"]), asked)


def test_bad_prompts_are_refused_by_name(checkpoints, tmp_path):
    directory = _copy(checkpoints.sentence("bert", "mean"), tmp_path)
    config = os.path.join(directory, "config_sentence_transformers.json")
    _edit(config, prompts=PROMPTS, default_prompt_name="query")
    encoder = attnkit.load_pretrained(directory)
    with pytest.raises(ValueError, match=r"`prompt_name` must be one of the directory's prompts \['none', 'passage', 'query'\]"):
        encoder.encode(["a"], prompt_name="document")
    with pytest.raises(ValueError, match="not both"):
        encoder.encode(["a"], prompt="x", prompt_name="query")
    with pytest.raises(TypeError, match="`prompt` must be a string or None"):
        encoder.encode(["a"], prompt=3)
    _edit(config, default_prompt_name="document")
    with pytest.raises(ValueError, match="default_prompt_name 'document' is not one of the prompts"):
        attnkit.load_pretrained(directory)
    _edit(config, prompts=["query: "], default_prompt_name=None)
    with pytest.raises(ValueError, match="`prompts` must map prompt names to prompt texts"):
        attnkit.load_pretrained(directory)
    _edit(config, prompts=PROMPTS)
    _edit(os.path.join(directory, "1_Pooling", "config.json"), include_prompt="no")
    with pytest.raises(ValueError, match="`include_prompt` must be true or false"):
        attnkit.load_pretrained(directory)


@pytest.mark.parametrize("key, fields", [("config_kwargs", {"layer_norm_eps": 0.5}), ("config_args", {"hidden_act": "relu"})])
def test_config_overrides_match_sentence_transformers(checkpoints, tmp_path, key, fields):
    from sentence_transformers import SentenceTransformer

    directory = _copy(checkpoints.sentence("bert", "mean"), tmp_path)
    plain = _encode(attnkit.load_pretrained(directory), TEXTS)
    _edit(os.path.join(directory, "sentence_bert_config.json"), **{key: fields})
    ours = _encode(attnkit.load_pretrained(directory), TEXTS)
    _close(ours, SentenceTransformer(directory, device="cpu").encode(TEXTS, batch_size=4))
    assert max_difference(ours, plain) > 1e-3  # the override changes the numbers: the test can tell


def test_bad_config_overrides_are_refused_by_name(checkpoints, tmp_path):
    directory = _copy(checkpoints.sentence("bert", "mean"), tmp_path)
    file = os.path.join(directory, "sentence_bert_config.json")
    _edit(file, config_kwargs=["layer_norm_eps"])
    with pytest.raises(ValueError, match="`config_kwargs` must be an object of config fields"):
        attnkit.load_pretrained(directory)
    _edit(file, config_kwargs={"layer_norm_eps": 0.5}, config_args={"layer_norm_eps": 0.1})
    with pytest.raises(ValueError, match="`config_kwargs` and its older name `config_args` differ"):
        attnkit.load_pretrained(directory)
    _edit(file, config_kwargs={"hidden_act": "swishy"}, config_args=None)
    with pytest.raises(ValueError, match="config_kwargs"):  # the field's own error names where it came from
        attnkit.load_pretrained(directory)


def test_save_pretrained_keeps_the_prompts_and_the_overrides(checkpoints, tmp_path):
    from sentence_transformers import SentenceTransformer

    directory = _copy(checkpoints.sentence("bert", "mean"), tmp_path)
    _edit(os.path.join(directory, "config_sentence_transformers.json"), prompts=PROMPTS, default_prompt_name="query")
    _edit(os.path.join(directory, "1_Pooling", "config.json"), include_prompt=False)
    _edit(os.path.join(directory, "sentence_bert_config.json"), config_kwargs={"layer_norm_eps": 0.5})
    encoder = attnkit.load_pretrained(directory)
    saved = str(tmp_path / "saved")
    encoder.save_pretrained(saved)
    again = _encode(attnkit.load_pretrained(saved), TEXTS)
    np.testing.assert_array_equal(again, _encode(encoder, TEXTS))
    _close(again, SentenceTransformer(saved, device="cpu").encode(TEXTS, batch_size=4))


@pytest.mark.parametrize("key, value", [
    ("processing_kwargs", {"text": {"max_length": 5}}),
    ("processing_kwargs", {"text": {"add_special_tokens": False}}),
    ("tokenizer_args", {"truncation_side": "left"}),
    ("processor_kwargs", {"do_lower_case": False, "model_max_length": 8}),
])
def test_tokenizer_settings_attnkit_does_not_apply_are_refused_by_name(checkpoints, tmp_path, key, value):
    """sentence-transformers applies these to its tokenizer (embeddings 0.9-1.9 apart when ignored)."""
    directory = _copy(checkpoints.sentence("bert", "mean"), tmp_path)
    _edit(os.path.join(directory, "sentence_bert_config.json"), **{key: value})
    with pytest.raises(ValueError, match=rf"sentence_bert_config.json: `{key}` sets \[.*\], which attnkit does not apply"):
        attnkit.load_pretrained(directory)


def test_model_max_length_in_tokenizer_args_is_applied_and_loading_options_pass(checkpoints, tmp_path):
    from sentence_transformers import SentenceTransformer

    directory = _copy(checkpoints.sentence("bert", "mean"), tmp_path)
    settings = {"model_max_length": 5, "trust_remote_code": False, "revision": "main", "use_fast": True}
    _edit(os.path.join(directory, "sentence_bert_config.json"), tokenizer_args=settings)
    ours = attnkit.load_pretrained(directory)
    assert ours.max_length == 5
    _close(_encode(ours, TEXTS), SentenceTransformer(directory, device="cpu").encode(TEXTS, batch_size=4))

"""What `load_pretrained` refuses (by name), the strict matching of config and weights, the maximum
length's precedence against sentence-transformers', and export back to transformers and
sentence-transformers (atomic), on random checkpoints saved at test time."""

import builtins
import json
import os
import re
import shutil
import warnings

import numpy as np
import pytest
from checkpoint_fixtures import FAMILIES, TEXTS, copy_checkpoint, edit_json, max_difference, reference_hidden

import attnkit
from attnkit import cli
from attnkit.checkpoints import export

pytest.importorskip("torch")
pytest.importorskip("transformers")


def _quiet_hidden(encoder, texts):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return encoder.hidden_states(texts)


@pytest.mark.parametrize("layers, message", [
    (1, r"16 stored tensors are not part of the BERT encoder .*config.json describes \(n=1, d_model=24\): "
        r"'encoder.layer.1.attention.output.LayerNorm.bias', "),
    (3, r"16 tensors that .*config.json implies are missing: 'encoder.layer.2.attention.self.query.weight \(24, 24\)'"),
])
def test_config_and_weights_that_disagree_on_the_layers_are_refused(checkpoints, tmp_path, layers, message):
    path = copy_checkpoint(checkpoints.base("bert"), tmp_path / "model")
    edit_json(path / "config.json", num_hidden_layers=layers)
    with pytest.raises(ValueError, match=message):
        attnkit.load_pretrained(path)


def test_an_unknown_stored_tensor_is_refused_by_name(checkpoints, tmp_path):
    from safetensors.numpy import load_file, save_file

    path = copy_checkpoint(checkpoints.base("distilbert"), tmp_path / "model")
    weights = load_file(path / "model.safetensors")
    weights["transformer.layer.0.attention.rotary.weight"] = np.zeros(3, np.float32)
    save_file(weights, path / "model.safetensors")
    with pytest.raises(ValueError, match=r"1 stored tensors are not part of the DistilBERT encoder .*'transformer.layer.0.attention.rotary.weight'"):
        attnkit.load_pretrained(path)


def test_half_a_pooler_is_refused_by_name(checkpoints, tmp_path):
    from safetensors.numpy import load_file, save_file

    path = copy_checkpoint(checkpoints.base("bert"), tmp_path / "model")
    weights = load_file(path / "model.safetensors")
    del weights["pooler.dense.bias"]
    save_file(weights, path / "model.safetensors")
    with pytest.raises(ValueError, match=r"the pooler is incomplete: .*pooler\.dense\.weight.* stored without .*pooler\.dense\.bias"):
        attnkit.load_pretrained(path)


@pytest.mark.parametrize("head, family", [("BertForMaskedLM", "bert"), ("RobertaForMaskedLM", "roberta"),
                                          ("ElectraForPreTraining", "electra"), ("DistilBertForMaskedLM", "distilbert")])
def test_task_checkpoints_load_their_encoder(checkpoints, tmp_path, head, family):
    import transformers

    config = transformers.AutoConfig.from_pretrained(checkpoints.base(family))
    model = getattr(transformers, head)(config)
    model.save_pretrained(tmp_path / "task")
    for name in os.listdir(checkpoints.base(family)):
        if name.startswith("tokenizer"):
            shutil.copy(os.path.join(checkpoints.base(family), name), tmp_path / "task")
    reference, _ = reference_hidden(str(tmp_path / "task"), TEXTS[:3])
    with pytest.warns(UserWarning, match=r"tensors of task heads \(.+\) are not loaded: attnkit runs the base"):
        encoder = attnkit.load_pretrained(tmp_path / "task")
    for text, expected in zip(TEXTS[:3], reference):
        assert max_difference(encoder.hidden_states(text), expected) <= 1e-5


@pytest.mark.parametrize("family, changes, message", [
    ("bert", {"position_embedding_type": "relative_key"}, r"position_embedding_type 'relative_key' is not supported"),
    ("bert", {"model_type": "albert"}, r"model_type 'albert' is not supported; .*'bert', 'distilbert', 'roberta', 'xlm-roberta', 'electra'"),
    ("roberta", {"hidden_act": "quick_gelu"}, r"`hidden_act` 'quick_gelu' is not supported; attnkit computes \["),
    ("distilbert", {"activation": "tanh"}, r"`activation` 'tanh' is not supported"),
    ("electra", {"is_decoder": True}, r"`is_decoder`=True \(a causal self-attention\) is not supported"),
    ("bert", {"add_cross_attention": True}, r"`add_cross_attention`=True \(cross-attention layers\) is not supported"),
    ("electra", {"embedding_size": 0}, r"`embedding_size` must be a positive integer. Received: embedding_size=0"),
    ("bert", {"model_type": None, "architectures": ["GPT2Model"]}, r"no `model_type`, and neither `architectures` nor"),
])
def test_what_attnkit_lacks_is_refused_by_name(checkpoints, tmp_path, family, changes, message):
    path = copy_checkpoint(checkpoints.base(family), tmp_path / "model")
    edit_json(path / "config.json", **changes)
    with pytest.raises(ValueError, match=message):
        attnkit.load_pretrained(path)


@pytest.mark.parametrize("family, changes", [
    ("bert", {"model_type": None, "architectures": None}),  # Google's original BERT config
    ("roberta", {"model_type": None}),  # architectures: ["RobertaModel"]
    ("distilbert", {"model_type": None}),
])
def test_configs_without_model_type(checkpoints, tmp_path, family, changes):
    original = attnkit.load_pretrained(checkpoints.base(family))
    path = copy_checkpoint(checkpoints.base(family), tmp_path / "model")
    edit_json(path / "config.json", **changes)
    encoder = attnkit.load_pretrained(path)
    assert encoder.family is original.family
    np.testing.assert_array_equal(_quiet_hidden(encoder, TEXTS), _quiet_hidden(original, TEXTS))


def test_pytorch_weights_without_torch_are_refused_clearly(checkpoints, monkeypatch):
    real_import = builtins.__import__

    def no_torch(name, *args, **kwargs):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("No module named 'torch'")
        return real_import(name, *args, **kwargs)

    from attnkit.checkpoints.formats.weights import read_state_dict

    path = checkpoints.base("bert", "bin")
    monkeypatch.setattr(builtins, "__import__", no_torch)  # only the reading: the torch backend needs torch
    with pytest.raises(ImportError, match=r"pytorch_model.bin: reading this weights file needs torch \(pip install torch\)"):
        read_state_dict(path)


def test_a_missing_shard_is_named(checkpoints, tmp_path):
    path = copy_checkpoint(checkpoints.base("electra", "sharded"), tmp_path / "model")
    with open(path / "model.safetensors.index.json") as f:
        shard = sorted(set(json.load(f)["weight_map"].values()))[-1]
    os.remove(path / shard)
    with pytest.raises(FileNotFoundError, match=rf"model.safetensors.index.json: shard '{shard}' not found"):
        attnkit.load_pretrained(path)


@pytest.mark.parametrize("module_type", ["sentence_transformers.models.LayerNorm", "my_package.CustomPooling"])
def test_an_unknown_module_is_refused_by_name(checkpoints, tmp_path, module_type):
    path = copy_checkpoint(checkpoints.sentence("bert", "mean", normalize=True), tmp_path / "model")
    with open(path / "modules.json") as f:
        modules = json.load(f)
    modules[-1]["type"] = module_type
    with open(path / "modules.json", "w") as f:
        json.dump(modules, f)
    with pytest.raises(ValueError, match=rf"module '2' has type '{re.escape(module_type)}', which attnkit does not run"):
        attnkit.load_pretrained(path)


def test_an_unknown_dense_activation_is_refused_by_name(checkpoints, tmp_path):
    path = copy_checkpoint(checkpoints.sentence("bert", "mean", dense="Tanh"), tmp_path / "model")
    edit_json(path / "2_Dense" / "config.json", activation_function="torch.nn.modules.activation.Softplus")
    with pytest.raises(ValueError, match=r"activation_function 'torch.nn.modules.activation.Softplus' is not supported"):
        attnkit.load_pretrained(path)


def _limits(path):
    from sentence_transformers import SentenceTransformer

    return attnkit.load_pretrained(path).max_length, SentenceTransformer(str(path), device="cpu").max_seq_length


@pytest.mark.parametrize("sentence_config, tokenizer_limit, expected", [
    ({"max_seq_length": 12}, 16, 12),  # sentence_bert_config.json first
    ({"max_seq_length": 12, "tokenizer_args": {"model_max_length": 8}}, 16, 8),  # tokenizer_args before it
    ({}, 16, 16),  # then tokenizer_config.json's model_max_length
    ({}, 512, 40),  # ... capped at max_position_embeddings
])
def test_maximum_length_follows_sentence_transformers(checkpoints, tmp_path, sentence_config, tokenizer_limit, expected):
    path = copy_checkpoint(checkpoints.sentence("bert", "mean"), tmp_path / "model")
    with open(path / "sentence_bert_config.json", "w") as f:
        json.dump(sentence_config, f)
    edit_json(path / "tokenizer_config.json", model_max_length=tokenizer_limit)
    assert _limits(path) == (expected, expected)


def test_without_modules_json_sentence_bert_config_is_not_read(checkpoints, tmp_path):
    path = copy_checkpoint(checkpoints.base("bert"), tmp_path / "model")
    with open(path / "sentence_bert_config.json", "w") as f:
        json.dump({"max_seq_length": 10}, f)
    assert _limits(path) == (40, 40)
    encoder = attnkit.load_pretrained(path)
    assert (encoder.pooling, encoder.pipeline.normalize) == ("mean", False)  # sentence-transformers' default


def test_a_maximum_length_past_the_positions_refuses_long_texts(checkpoints, tmp_path):
    path = copy_checkpoint(checkpoints.sentence("roberta", "cls"), tmp_path / "model")
    with open(path / "sentence_bert_config.json", "w") as f:
        json.dump({"max_seq_length": 100}, f)
    encoder = attnkit.load_pretrained(path)
    assert encoder.encode("the cat sat").shape == (24,)
    with pytest.raises(ValueError, match=r"has \d+ tokens after truncation at max_length=100, but the encoder has positions for 40"), \
            pytest.warns(UserWarning, match="1 of 1 texts were longer than the model's maximum of 100 tokens"):
        encoder.encode(TEXTS[3])


def test_do_lower_case_lowercases_as_sentence_transformers_does(checkpoints, tmp_path):
    from sentence_transformers import SentenceTransformer

    path = copy_checkpoint(checkpoints.sentence("roberta", "mean"), tmp_path / "model")  # a cased BPE tokenizer
    edit_json(path / "sentence_bert_config.json", do_lower_case=True)
    texts = ["THE CAT Sat", "Hello World"]
    reference = SentenceTransformer(str(path), device="cpu").tokenize(texts)
    token_ids, mask, _ = attnkit.load_pretrained(path).tokenize(texts)
    np.testing.assert_array_equal(token_ids[mask], reference["input_ids"].numpy()[reference["attention_mask"].numpy() == 1])
    assert not np.array_equal(token_ids, attnkit.load_pretrained(checkpoints.sentence("roberta", "mean")).tokenize(texts)[0])


def test_normalize_must_be_a_boolean_or_none(checkpoints):
    encoder = attnkit.load_pretrained(checkpoints.sentence("bert", "mean"))
    with pytest.raises(TypeError, match=r"`normalize` must be None, True or False. Received: normalize='yes'"):
        encoder.encode(["a"], normalize="yes")


@pytest.mark.parametrize("family", FAMILIES)
def test_export_loads_back_in_transformers_and_sentence_transformers(checkpoints, tmp_path, family):
    from sentence_transformers import SentenceTransformer

    source = checkpoints.sentence(family, ("cls", "mean"), dense="Tanh", normalize=True) if family == "electra" else \
        checkpoints.sentence(family, "max", max_seq_length=12)
    encoder = attnkit.load_pretrained(source)
    encoder.model.token_position_embedding.token_embedding.embeddings.assign(
        np.asarray(encoder.model.token_position_embedding.token_embedding.embeddings) * 1.5
    )  # as a fine-tuned model's: the export must carry the new weights
    out = encoder.save_pretrained(tmp_path / "exported")
    reference, _ = reference_hidden(out, TEXTS)
    hidden = _quiet_hidden(encoder, TEXTS)
    assert max(max_difference(h[: len(r)], r) for h, r in zip(hidden, reference)) <= 1e-5
    embeddings = SentenceTransformer(out, device="cpu").encode(TEXTS)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        assert max_difference(encoder.encode(TEXTS), embeddings) <= 1e-5
        scale = max(1.0, float(np.abs(embeddings).max()))
        assert max_difference(attnkit.load_pretrained(out).encode(TEXTS), embeddings) <= 1e-6 * scale


def test_export_never_destroys_a_directory(checkpoints, tmp_path, monkeypatch):
    encoder = attnkit.load_pretrained(checkpoints.sentence("bert", "mean"))
    target = tmp_path / "model"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match=r"already exists; pass overwrite=True"):
        encoder.save_pretrained(target)
    with pytest.raises(FileExistsError, match=r"holds files but no config.json: it is not a model directory"):
        encoder.save_pretrained(target, overwrite=True)  # not a model directory: not replaced, even so
    assert os.listdir(target) == ["keep.txt"]
    (target / "config.json").write_text("{}")  # an old model directory: overwrite replaces its model files

    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(export, "_write_modules", interrupted)
    with pytest.raises(KeyboardInterrupt):
        encoder.save_pretrained(target, overwrite=True)
    assert sorted(os.listdir(tmp_path)) == ["model"] and (target / "keep.txt").read_text() == "mine"
    assert (target / "config.json").read_text() == "{}"
    monkeypatch.undo()
    encoder.save_pretrained(target, overwrite=True)
    assert sorted(os.listdir(tmp_path)) == ["model"] and (target / "keep.txt").read_text() == "mine"  # item 111
    assert (target / "modules.json").exists()


def test_cli_export_and_embed_normalize(checkpoints, tmp_path, capsys):
    source = checkpoints.sentence("distilbert", "mean")  # no Normalize module
    out = tmp_path / "exported"
    assert cli.main(["export", str(out), "--model", source]) == 0
    assert "wrote the DistilBERT model" in capsys.readouterr().err
    assert cli.main(["export", str(out), "--model", source]) == 2
    assert "already exists; pass --force" in capsys.readouterr().err
    norms = {}
    for flag in ([], ["--normalize"], ["--no-normalize"]):
        assert cli.main(["embed", "the cat sat", "--model", str(out), *flag]) == 0
        norms[tuple(flag)] = np.linalg.norm(json.loads(capsys.readouterr().out)["embedding"])
    assert norms[()] == pytest.approx(norms[("--no-normalize",)]) and norms[()] > 1.5
    assert norms[("--normalize",)] == pytest.approx(1, abs=1e-6)


def test_export_of_a_half_precision_checkpoint_says_its_float32_weights(checkpoints, tmp_path):
    """attnkit widens float16 weights to float32 and writes those; the export kept config.json's
    "dtype": "float16", so transformers loaded it back in float16 (its dtype="auto" follows the config)."""
    import torch
    import transformers

    path = copy_checkpoint(checkpoints.base("bert"), tmp_path / "model")
    model = transformers.AutoModel.from_pretrained(path, dtype=torch.float16)
    model.save_pretrained(path)  # float16 weights, config.json "dtype": "float16"
    with open(os.path.join(path, "config.json")) as f:
        source = json.load(f)
    assert {source[key] for key in ("dtype", "torch_dtype") if key in source} == {"float16"}
    encoder = attnkit.load_pretrained(path)
    exported = encoder.save_pretrained(str(tmp_path / "export"))
    with open(os.path.join(exported, "config.json")) as f:
        config = json.load(f)
    assert {config[key] for key in ("dtype", "torch_dtype") if key in config} == {"float32"}
    reloaded = transformers.AutoModel.from_pretrained(exported, dtype="auto")
    assert reloaded.dtype == torch.float32
    tokens = transformers.AutoTokenizer.from_pretrained(exported)(TEXTS[:2], padding=True, return_tensors="pt")
    with torch.no_grad():
        theirs = reloaded(**tokens).last_hidden_state.numpy()
    ours = _quiet_hidden(encoder, TEXTS[:2])
    mask = tokens["attention_mask"].numpy().astype(bool)
    assert max_difference(ours[mask], theirs[mask]) < 1e-5

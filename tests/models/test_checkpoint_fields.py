"""Settings of a model directory that sentence-transformers or transformers read and attnkit did not:
each is now refused by name where attnkit would compute something else (docs/decisions.md item 85).
Random checkpoints saved at test time."""

import json

import pytest
from checkpoint_fixtures import copy_checkpoint, edit_json

import attnkit

pytest.importorskip("torch")
pytest.importorskip("transformers")


@pytest.mark.parametrize("changes", [{"module_input_name": "token_embeddings"}, {"module_output_name": "normalized"}])
def test_a_normalize_module_of_another_feature_is_refused(checkpoints, tmp_path, changes):
    # sentence-transformers then leaves the sentence embedding unnormalised (norms about 5.4 here);
    # attnkit normalised it, 2.99 apart.
    path = copy_checkpoint(checkpoints.sentence("bert", "mean", normalize=True), tmp_path / "model")
    (key, value), = changes.items()
    edit_json(path / "2_Normalize" / "config.json", **changes)
    with pytest.raises(ValueError, match=rf"2_Normalize/config.json: `{key}` '{value}' is not supported"):
        attnkit.load_pretrained(path)


@pytest.mark.parametrize("key, value", [
    ("transformer_task", "sequence-classification"),  # a classification head's logits
    ("modality_config", {"text": {"method": "forward", "method_output_name": "pooler_output"}}),
    ("module_output_name", "features"),  # Pooling finds no token_embeddings
])
def test_a_transformer_module_giving_pooling_another_output_is_refused(checkpoints, tmp_path, key, value):
    path = copy_checkpoint(checkpoints.sentence("bert", "mean"), tmp_path / "model")
    edit_json(path / "sentence_bert_config.json", **{key: value})
    with pytest.raises(ValueError, match=rf"sentence_bert_config.json: `{key}` .* is not supported; attnkit's "
                                         r"Transformer module gives Pooling the encoder's last hidden states"):
        attnkit.load_pretrained(path)


def test_the_transformer_modules_default_outputs_load(checkpoints, tmp_path):
    # What sentence-transformers 6 writes: the defaults spelled out.
    path = copy_checkpoint(checkpoints.sentence("bert", "mean"), tmp_path / "model")
    edit_json(path / "sentence_bert_config.json", transformer_task="feature-extraction", module_output_name="token_embeddings",
               modality_config={"text": {"method": "forward", "method_output_name": "last_hidden_state"}})
    assert attnkit.load_pretrained(path).encode("a cat").shape == (24,)


@pytest.mark.parametrize("value", [1, "false"])
def test_the_older_pooling_flags_must_be_booleans(checkpoints, tmp_path, value):
    # sentence-transformers takes any truthy flag as set ("false" too): 1 pooled [CLS] there and the
    # mean here, 0.55 apart.
    path = copy_checkpoint(checkpoints.sentence("bert", "mean"), tmp_path / "model")
    with open(path / "1_Pooling" / "config.json", "w") as f:
        json.dump({"word_embedding_dimension": 24, "pooling_mode_cls_token": value, "pooling_mode_mean_tokens": False}, f)
    with pytest.raises(ValueError, match=rf"`pooling_mode_cls_token` must be true or false. Received: pooling_mode_cls_token={value!r}"):
        attnkit.load_pretrained(path)


def test_do_lower_case_must_be_a_boolean(checkpoints, tmp_path):
    # sentence-transformers lowercases on "true" (truthy); attnkit did not (`is True`).
    path = copy_checkpoint(checkpoints.sentence("bert", "mean"), tmp_path / "model")
    edit_json(path / "sentence_bert_config.json", do_lower_case="true")
    with pytest.raises(ValueError, match=r"sentence_bert_config.json: `do_lower_case` must be true or false"):
        attnkit.load_pretrained(path)


@pytest.mark.parametrize("file, changes, message", [
    ("config.json", {"hidden_act": ["gelu"]}, r"config.json: `hidden_act` \['gelu'\] is not supported"),
    ("2_Dense/config.json", {"activation_function": ["torch.nn.modules.activation.Tanh"]},
     r"2_Dense/config.json: activation_function \['torch.nn.modules.activation.Tanh'\] is not supported"),
])
def test_a_name_that_is_not_a_string_is_refused_by_field(checkpoints, tmp_path, file, changes, message):
    path = copy_checkpoint(checkpoints.sentence("bert", "mean", dense="Tanh"), tmp_path / "model")
    edit_json(path / file, **changes)
    with pytest.raises(ValueError, match=message):  # was TypeError: unhashable type: 'list'
        attnkit.load_pretrained(path)


@pytest.mark.parametrize("loader", ["load_pretrained", "load_causal_lm"])
def test_a_config_json_that_is_not_an_object_is_refused_by_file(checkpoints, tmp_path, loader):
    path = copy_checkpoint(checkpoints.base("bert"), tmp_path / "model")
    (path / "config.json").write_text("[1]")
    with pytest.raises(ValueError, match=r"config.json: expected a JSON object. Received: list"):  # was AttributeError
        getattr(attnkit, loader)(path)


@pytest.mark.parametrize("name", ["torch.nn.ReLU", "torch.nn.Tanh"])
def test_a_dense_activation_by_torch_public_name_loads_as_sentence_transformers_reads_it(checkpoints, tmp_path, name):
    # sentence-transformers imports the path: torch.nn.ReLU is torch.nn.modules.activation.ReLU.
    from sentence_transformers import SentenceTransformer

    path = copy_checkpoint(checkpoints.sentence("bert", "mean", dense="ReLU" if "ReLU" in name else "Tanh"), tmp_path / "model")
    edit_json(path / "2_Dense" / "config.json", activation_function=name)
    reference = SentenceTransformer(str(path), device="cpu").encode(["a cat", "the dog sat"])
    ours = attnkit.load_pretrained(path).encode(["a cat", "the dog sat"])
    assert abs(ours - reference).max() <= 1e-5

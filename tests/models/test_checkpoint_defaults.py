"""config.json fields as transformers' config classes read them (docs/decisions.md item 94): an absent
field takes the class's default, DistilBERT's standard names set its own fields, a negative
pad_token_id loads as transformers loads it. Parity with transformers and sentence-transformers on
random checkpoints saved at test time."""

import warnings

import numpy as np
import pytest
from checkpoint_fixtures import TEXTS, copy_checkpoint, edit_json, max_difference, reference_hidden

import attnkit
from attnkit.checkpoints.families import defaults

pytest.importorskip("torch")
pytest.importorskip("transformers")


def _edited(checkpoints, tmp_path, family, **changes):
    path = copy_checkpoint(checkpoints.base(family), tmp_path / "model")
    edit_json(path / "config.json", **changes)  # None removes the field
    return path


def _assert_hidden_states_match_transformers(path):
    reference, _ = reference_hidden(str(path), TEXTS[:3])
    encoder = attnkit.load_pretrained(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        hidden = encoder.hidden_states(TEXTS[:3])  # (B, T, d_model)
        _, mask, _ = encoder.tokenize(TEXTS[:3])
    assert max(max_difference(h[m], r) for h, m, r in zip(hidden, mask, reference)) <= 1e-5
    return encoder


@pytest.mark.parametrize("model_type", sorted(defaults.CONFIG_DEFAULTS))
def test_the_defaults_are_transformers_config_classes(model_type):
    import transformers

    reference = transformers.AutoConfig.for_model(model_type)
    assert defaults.CONFIG_DEFAULTS[model_type] == {key: getattr(reference, key) for key in defaults.CONFIG_DEFAULTS[model_type]}
    assert defaults.ALIASES.get(model_type, {}) == type(reference).attribute_map


@pytest.mark.parametrize("family, field", [
    ("bert", "num_attention_heads"),  # 12 heads of width 2 over hidden_size 24
    ("bert", "vocab_size"),  # 30522, the checkpoint's
    ("roberta", "num_attention_heads"),
    ("xlm-roberta", "num_attention_heads"),
    ("electra", "vocab_size"),
    ("distilbert", "n_heads"),
])
def test_an_absent_field_takes_transformers_default(checkpoints, tmp_path, family, field):
    # Was refused: "`num_attention_heads` must be a positive integer. Received: num_attention_heads=None".
    encoder = _assert_hidden_states_match_transformers(_edited(checkpoints, tmp_path, family, **{field: None}))
    if field.endswith("heads"):
        assert encoder.h == 12


@pytest.mark.parametrize("family, field, message", [
    # transformers builds the default size and initialises what the weights lack randomly, with a warning.
    ("electra", "embedding_size", r"shapes other than .*: 'embeddings.word_embeddings.weight \(30522, 16\), expected \(30522, 128\)'"),
    ("bert", "num_hidden_layers", r"160 tensors that .* implies are missing: 'encoder.layer.2.attention.self.query.weight"),
    ("roberta", "type_vocab_size", r"'embeddings.token_type_embeddings.weight \(1, 24\), expected \(2, 24\)'"),
])
def test_an_absent_size_the_weights_disagree_with_is_refused_by_shape(checkpoints, tmp_path, family, field, message):
    with pytest.raises(ValueError, match=message):
        attnkit.load_pretrained(_edited(checkpoints, tmp_path, family, **{field: None}))


@pytest.mark.parametrize("family, pad", [("bert", -1), ("distilbert", -1), ("electra", -30522), ("roberta", -1),
                                         ("xlm-roberta", -1)])
def test_a_negative_pad_token_id_loads_as_transformers_does(checkpoints, tmp_path, family, pad):
    # transformers warns and loads it (torch's Embedding counts a negative padding_idx from the end);
    # RoBERTa's positions then count from -1 + 1 = 0. attnkit refused it.
    from sentence_transformers import SentenceTransformer

    path = _edited(checkpoints, tmp_path, family, pad_token_id=pad)
    encoder = _assert_hidden_states_match_transformers(path)
    assert encoder.model.pad_id is None
    assert encoder.max_length == 40
    reference = SentenceTransformer(str(path), device="cpu").encode(TEXTS[:3], batch_size=3)  # mean pooling, padded
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        embeddings = encoder.encode(TEXTS[:3], batch_size=3)
    assert max_difference(embeddings, reference) <= 2e-6 * max(1.0, float(np.abs(reference).max()))


@pytest.mark.parametrize("family, pad", [("bert", -30523), ("distilbert", 30522)])
def test_a_pad_token_id_outside_the_embedding_is_refused_by_name(checkpoints, tmp_path, family, pad):
    # torch: "Padding_idx must be within num_embeddings".
    with pytest.raises(ValueError, match=rf"`pad_token_id` must be null or an integer in \[-vocab_size, vocab_size\) = "
                                         rf"\[-30522, 30522\). Received: pad_token_id={pad}"):
        attnkit.load_pretrained(_edited(checkpoints, tmp_path, family, pad_token_id=pad))


@pytest.mark.parametrize("pad", [-2, 41])
def test_a_roberta_pad_token_id_without_positions_after_it_is_refused_by_name(checkpoints, tmp_path, pad):
    # transformers looks up position -1, or 42 of 42, and fails in the forward pass.
    with pytest.raises(ValueError, match=r"RoBERTa counts positions from pad_token_id \+ 1, so `pad_token_id` must be "
                                         rf"null, -1 or in \[0, max_position_embeddings - 1\) = \[0, 41\). Received: pad_token_id={pad}"):
        attnkit.load_pretrained(_edited(checkpoints, tmp_path, "roberta", pad_token_id=pad))


def test_distilbert_standard_names_win_over_its_own(checkpoints, tmp_path):
    # DistilBertConfig's attribute_map: num_attention_heads sets n_heads. attnkit read n_heads=2 where
    # transformers ran 3 heads.
    encoder = _assert_hidden_states_match_transformers(_edited(checkpoints, tmp_path, "distilbert", num_attention_heads=3))
    assert encoder.h == 3


def test_distilbert_num_hidden_layers_sets_its_layers(checkpoints, tmp_path):
    # transformers runs 1 layer (and reports the stored layer 1 as unexpected); attnkit ran 2.
    with pytest.raises(ValueError, match=r"16 stored tensors are not part of the DistilBERT encoder .*\(n=1, d_model=24\)"):
        attnkit.load_pretrained(_edited(checkpoints, tmp_path, "distilbert", num_hidden_layers=1))

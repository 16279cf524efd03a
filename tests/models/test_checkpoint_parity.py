"""Parity of every encoder family, weight format and sentence-transformers pipeline with the reference
libraries, on random checkpoints they save at test time: hidden states <= 1e-5, sentence embeddings
<= 1e-6, token ids identical, texts past the maximum length included.

Weight formats, the encoder and the pooling pipeline are independent code paths: every family runs
against transformers once; every family x format is checked to load the very same tensors; every
pooling mode runs once, on families in turn, with and without Dense and Normalize, in both Pooling
config formats.
"""

import warnings

import keras
import numpy as np
import pytest
from checkpoint_fixtures import FAMILIES, FORMATS, POOLING_MODES, TEXTS, max_difference, reference_hidden

import attnkit

pytest.importorskip("torch")
pytest.importorskip("transformers")

DENSE = (None, "Tanh", "ReLU", "Identity", "GELU", "SiLU", "Sigmoid")
PIPELINES = [
    dict(family=FAMILIES[i % len(FAMILIES)], mode=mode, dense=DENSE[i], normalize=i % 2 == 0,
         legacy_pooling=i % 3 == 1, max_seq_length=12 if i % 3 == 0 else None)
    for i, mode in enumerate(POOLING_MODES)
]


def _quietly(function, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the truncation warning: tested elsewhere
        return function(*args, **kwargs)


@pytest.mark.parametrize("fmt", FORMATS[1:])
@pytest.mark.parametrize("family", FAMILIES)
def test_every_weight_format_loads_the_same_tensors(checkpoints, family, fmt):
    expected = attnkit.load_pretrained(checkpoints.base(family))
    encoder = attnkit.load_pretrained(checkpoints.base(family, fmt))
    assert len(encoder.model.weights) == len(expected.model.weights)
    for ours, theirs in zip(encoder.model.weights, expected.model.weights):
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(ours), keras.ops.convert_to_numpy(theirs), err_msg=ours.path)
    assert encoder.unused_weights.keys() == expected.unused_weights.keys()


@pytest.mark.parametrize("family", FAMILIES)
def test_hidden_states_and_tokens_match_transformers(checkpoints, family):
    reference, reference_ids = reference_hidden(checkpoints.base(family), TEXTS)
    encoder = attnkit.load_pretrained(checkpoints.base(family))
    token_ids, mask, _ = _quietly(encoder.tokenize, TEXTS)
    assert [list(ids[m]) for ids, m in zip(token_ids, mask)] == reference_ids
    assert max(len(ids) for ids in reference_ids) == encoder.max_length == 40  # the long texts were cut
    hidden = _quietly(encoder.hidden_states, TEXTS)  # (B, T, d_model)
    assert max(max_difference(h[m], r) for h, m, r in zip(hidden, mask, reference)) <= 1e-5
    assert max_difference(encoder.hidden_states(TEXTS[1]), reference[1]) <= 1e-5  # alone: no padding


@pytest.mark.parametrize("case", PIPELINES, ids=lambda c: f"{c['family']}-{c['mode']}-{c['dense']}-n{int(c['normalize'])}")
def test_sentence_embeddings_match_sentence_transformers(checkpoints, case):
    from sentence_transformers import SentenceTransformer

    directory = checkpoints.sentence(**case)
    reference_model = SentenceTransformer(directory, device="cpu")
    reference = reference_model.encode(TEXTS, batch_size=4)
    encoder = attnkit.load_pretrained(directory)
    assert encoder.max_length == reference_model.max_seq_length
    assert encoder.pooling == case["mode"]
    embeddings = _quietly(encoder.encode, TEXTS, batch_size=4)
    assert embeddings.shape == reference.shape == (len(TEXTS), encoder.dimension)
    # Measured at most 8e-7 relative, except last-token pooling on jax (1.2e-6): one token's float32
    # hidden state through a Dense, with no average to smooth the rounding.
    assert max_difference(embeddings, reference) <= 2e-6 * max(1.0, float(np.abs(reference).max()))
    norms = np.linalg.norm(_quietly(encoder.encode, TEXTS, normalize=False), axis=1)
    if case["normalize"]:
        np.testing.assert_allclose(np.linalg.norm(embeddings, axis=1), 1, atol=1e-6)
        assert not np.allclose(norms, 1)  # the override turns the module off
    else:
        np.testing.assert_allclose(np.linalg.norm(embeddings, axis=1), norms, rtol=1e-6)
        np.testing.assert_allclose(np.linalg.norm(_quietly(encoder.encode, TEXTS, normalize=True), axis=1), 1, atol=1e-6)

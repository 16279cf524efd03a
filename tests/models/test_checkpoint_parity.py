"""Parity of every encoder family, weight format and sentence-transformers pipeline with the reference
libraries, on random checkpoints they save at test time: hidden states <= 1e-5, sentence embeddings
<= 1e-6, token ids identical, texts past the maximum length included.

Weight formats and pooling pipelines are independent code paths (the weights are read, then the same
encoder runs), so formats are crossed with families and pipelines with (family, mode) pairs that
give every family several modes and every mode two families.
"""

import warnings

import numpy as np
import pytest
from checkpoint_fixtures import FAMILIES, FORMATS, POOLING_MODES, TEXTS, max_difference, reference_hidden

import attnkit

pytest.importorskip("torch")
pytest.importorskip("transformers")

DENSE = (None, "Tanh", "ReLU", "Identity", "GELU", "SiLU", "Sigmoid")
PIPELINES = [
    dict(family=FAMILIES[(i + k) % len(FAMILIES)], mode=mode, dense=DENSE[(i + k) % len(DENSE)],
         normalize=(i + k) % 2 == 0, legacy_pooling=k == 2, max_seq_length=12 if (i + k) % 3 == 0 else None)
    for i, mode in enumerate(POOLING_MODES) for k in (0, 2)
]


def _quietly(function, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the truncation warning: tested elsewhere
        return function(*args, **kwargs)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("family", FAMILIES)
def test_hidden_states_and_tokens_match_transformers(checkpoints, family, fmt):
    reference, reference_ids = reference_hidden(checkpoints.base(family), TEXTS)
    encoder = attnkit.load_pretrained(checkpoints.base(family, fmt))
    token_ids, mask, _ = _quietly(encoder.tokenize, TEXTS)
    assert [list(ids[m]) for ids, m in zip(token_ids, mask)] == reference_ids
    assert max(len(ids) for ids in reference_ids) == encoder.max_length == 40  # the long texts were cut
    hidden = _quietly(encoder.hidden_states, TEXTS)  # (B, T, d_model)
    assert max(max_difference(h[m], r) for h, m, r in zip(hidden, mask, reference)) <= 1e-5
    for text, expected in zip(TEXTS[:3], reference):  # one at a time: no padding
        assert max_difference(encoder.hidden_states(text), expected) <= 1e-5


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
    assert max_difference(embeddings, reference) <= 1e-6 * max(1.0, float(np.abs(reference).max()))
    norms = np.linalg.norm(_quietly(encoder.encode, TEXTS, normalize=False), axis=1)
    if case["normalize"]:
        np.testing.assert_allclose(np.linalg.norm(embeddings, axis=1), 1, atol=1e-6)
        assert not np.allclose(norms, 1)  # the override turns the module off
    else:
        np.testing.assert_allclose(np.linalg.norm(embeddings, axis=1), norms, rtol=1e-6)
        np.testing.assert_allclose(np.linalg.norm(_quietly(encoder.encode, TEXTS, normalize=True), axis=1), 1, atol=1e-6)

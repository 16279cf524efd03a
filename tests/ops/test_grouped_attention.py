"""Grouped-query / multi-query attention against a float64 NumPy reference."""

import numpy as np
import pytest
from backend_utils import to_numpy
from reference import attention as np_attention

from attnkit.ops.grouped_attention import grouped_query_attention


def reference_gqa(q, k, v, keep=None):
    groups = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, groups, axis=1), np.repeat(v, groups, axis=1)
    return np_attention(q, k, v, keep)


@pytest.mark.parametrize("h,h_kv", [(6, 3), (4, 1), (4, 4)])
def test_gqa_matches_reference(rng, h, h_kv):
    q = rng.standard_normal((2, h, 5, 8))
    k, v = rng.standard_normal((2, h_kv, 7, 8)), rng.standard_normal((2, h_kv, 7, 8))
    keep = rng.random((2, 1, 5, 7)) > 0.3
    keep[..., 0] = True
    out = to_numpy(grouped_query_attention(*(a.astype("float32") for a in (q, k, v)), keep))
    expected = reference_gqa(q, k, v, keep)[0]
    np.testing.assert_allclose(out, expected, atol=2e-5)
    out, weights = grouped_query_attention(*(a.astype("float32") for a in (q, k, v)), keep, return_attention_weights=True)
    np.testing.assert_allclose(to_numpy(out), expected, atol=2e-5)
    np.testing.assert_allclose(to_numpy(weights), reference_gqa(q, k, v, keep)[1], atol=2e-5)


def test_gqa_causal(rng):
    q, k, v = rng.standard_normal((1, 4, 6, 8)), rng.standard_normal((1, 2, 6, 8)), rng.standard_normal((1, 2, 6, 8))
    keep = np.tril(np.ones((6, 6), bool))
    out = to_numpy(grouped_query_attention(*(a.astype("float32") for a in (q, k, v)), causal=True))
    np.testing.assert_allclose(out, reference_gqa(q, k, v, keep)[0], atol=2e-5)


def test_gqa_refuses_indivisible_heads(rng):
    q, kv = rng.standard_normal((1, 4, 3, 8)), rng.standard_normal((1, 3, 3, 8))
    with pytest.raises(ValueError, match="dividing the queries' h"):
        grouped_query_attention(q, kv, kv)

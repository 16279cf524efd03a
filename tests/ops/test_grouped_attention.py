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


@pytest.mark.parametrize("where", ["query", "last key"])
@pytest.mark.parametrize("causal", [False, True])
def test_a_nan_reaches_exactly_the_rows_that_read_it(rng, where, causal):
    """No silent zeros (docs/decisions.md item 21): torch's fused kernel returned 0 for a NaN query row
    and for a causal row whose only NaN key it read, also with shared key/value heads."""
    q = rng.standard_normal((2, 4, 5, 8))
    k, v = rng.standard_normal((2, 2, 5, 8)), rng.standard_normal((2, 2, 5, 8))
    if where == "query":
        q[1, 3, 2, 5] = np.nan  # one row of query head 3 (key/value head 1)
    else:
        k[0, 0, 4, 0] = np.nan  # the last key of key/value head 0: every row of query heads 0 and 1 reads it,
        # or, causally, only their last row
    keep = np.tril(np.ones((5, 5), bool)) if causal else np.ones((5, 5), bool)
    nan_keys = np.repeat(np.isnan(k).any(-1), 2, axis=1)  # (B, h, T_k)
    nan_rows = np.isnan(q).any(-1) | (keep & nan_keys[:, :, None, :]).any(-1)  # (B, h, T_q): rows reading a NaN
    assert nan_rows.any() and not nan_rows.all()
    out = to_numpy(grouped_query_attention(*(a.astype("float32") for a in (q, k, v)), causal=causal))
    np.testing.assert_array_equal(np.isnan(out).all(-1), nan_rows)
    np.testing.assert_array_equal(np.isnan(out).any(-1), nan_rows)
    expected = reference_gqa(np.nan_to_num(q), np.nan_to_num(k), v, keep)[0]  # the other rows read no NaN
    np.testing.assert_allclose(out[~nan_rows], expected[~nan_rows], atol=2e-5)


def test_gqa_refuses_indivisible_heads(rng):
    q, kv = rng.standard_normal((1, 4, 3, 8)), rng.standard_normal((1, 3, 3, 8))
    with pytest.raises(ValueError, match="dividing the queries' h"):
        grouped_query_attention(q, kv, kv)

"""`KVCache` and `keep_mask`: which slots a cached step writes, attends to, and may see.

The models' cached decoding is compared with uncached decoding elsewhere (tests/models); these
tests pin the cache's own contract against NumPy references.
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attnkit.layers.kv_cache import KVCache, keep_mask
from backend_utils import BACKEND, to_numpy


def reference_keep(valid, query_slots, window):
    """(B, 1, T, S) NumPy reference, one loop per entry: slot j visible to query slot i when valid, j <= i, j > i - window."""
    B, S = valid.shape
    keep = np.zeros((B, 1, len(query_slots), S), bool)
    for b in range(B):
        for t, i in enumerate(query_slots):
            for j in range(S):
                keep[b, 0, t, j] = valid[b, j] and j <= i and (window is None or j > i - window)
    return keep


@settings(max_examples=60, deadline=None)
@given(
    valid=st.lists(st.lists(st.booleans(), min_size=6, max_size=6), min_size=1, max_size=3),
    T=st.integers(1, 6),
    window=st.one_of(st.none(), st.integers(1, 8)),
)
def test_keep_mask_is_the_reference_or_none_with_the_causal_flag(valid, T, window):
    valid = np.array(valid)  # (B, S=6)
    S = valid.shape[1]
    query_slots = np.arange(S - T, S)  # the last T slots: a step's new tokens
    keep, causal = keep_mask(valid, query_slots, window)
    want = reference_keep(valid, query_slots, window)
    if keep is None:
        # No mask stands for the plain bottom-right causal one: every key real and no window cutting.
        assert valid.all() and (window is None or window >= S) and causal == (T > 1)
        rows = np.arange(S - T, S)[:, None] >= np.arange(S)[None, :]  # (T, S)
        np.testing.assert_array_equal(want, np.broadcast_to(rows, want.shape))
    else:
        assert causal is False
        np.testing.assert_array_equal(to_numpy(keep), want)


def test_update_writes_its_slots_and_returns_what_a_step_attends_to():
    cache = KVCache(n=2, batch=2, num_kv_heads=1, max_length=5, d_k=3, d_v=2)
    rng = np.random.default_rng(0)
    written_k, written_v = np.zeros((2, 1, 5, 3), "float32"), np.zeros((2, 1, 5, 2), "float32")
    for T in (2, 1, 2):
        start = cache.length
        cache.advance(np.ones((2, T), bool))
        k, v = rng.standard_normal((2, 1, T, 3)).astype("float32"), rng.standard_normal((2, 1, T, 2)).astype("float32")
        written_k[:, :, start:start + T], written_v[:, :, start:start + T] = k, v
        got_k, got_v = cache.update(1, k, v, start)
        S = start + T if BACKEND == "torch" else 5  # jax and tensorflow attend to every slot (fixed shapes)
        assert cache.attended == S
        np.testing.assert_array_equal(to_numpy(got_k), written_k[:, :, :S])
        np.testing.assert_array_equal(to_numpy(got_v), written_v[:, :, :S])
    np.testing.assert_array_equal(to_numpy(cache.keys[0]), 0)  # the other layer's buffer is untouched
    with pytest.raises(ValueError, match="holds 5 tokens; 5 are used and 1 more"):
        cache.advance(np.ones((2, 1), bool))
    with pytest.raises(ValueError, match=r"batch of 2 sequences.*Received: shape \(3, 1\)"):
        cache.advance(np.ones((3, 1), bool))


def test_reorder_keeps_the_rows_asked_for_in_that_order():
    cache = KVCache(n=1, batch=3, num_kv_heads=2, max_length=4, d_k=2)
    cache.advance(np.array([[True, True], [False, True], [True, True]]))
    k = np.arange(3 * 2 * 2 * 2, dtype="float32").reshape(3, 2, 2, 2)
    cache.update(0, k, -k, 0)
    cache.reorder([2, 2, 1, 0])
    np.testing.assert_array_equal(to_numpy(cache.keys[0])[:, :, :2], k[[2, 2, 1, 0]])
    np.testing.assert_array_equal(to_numpy(cache.values[0])[:, :, :2], -k[[2, 2, 1, 0]])
    np.testing.assert_array_equal(cache.seen, [2, 2, 1, 2])
    np.testing.assert_array_equal(cache.valid[:, :2], [[True, True], [True, True], [False, True], [True, True]])

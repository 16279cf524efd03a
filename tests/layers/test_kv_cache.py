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


def _filled(batch, slots, seed):
    """A 2-layer cache whose every slot holds distinct numbers, `valid` random, and NumPy copies of its buffers."""
    rng = np.random.default_rng(seed)
    cache = KVCache(n=2, batch=batch, num_kv_heads=2, max_length=slots, d_k=3)
    keys = [rng.standard_normal((batch, 2, slots, 3)).astype("float32") for _ in range(2)]
    values = [rng.standard_normal((batch, 2, slots, 3)).astype("float32") for _ in range(2)]
    cache.keys = [keras_tensor(k) for k in keys]
    cache.values = [keras_tensor(v) for v in values]
    cache.length = slots - 1
    cache.valid[:, : slots - 1] = rng.random((batch, slots - 1)) < 0.6
    cache.seen = cache.valid.sum(axis=1)
    return cache, keys, values


def keras_tensor(x):
    from keras import ops

    return ops.convert_to_tensor(x)


def test_place_copies_a_row_s_filled_slots_and_invalidates_the_rest():
    cache, keys, values = _filled(3, 8, seed=0)
    source, s_keys, _ = _filled(2, 5, seed=1)  # length 4
    cache.place(2, source, 1, at=3)
    for layer in range(2):
        want = keys[layer].copy()
        want[2, :, 3:7] = s_keys[layer][1, :, :4]
        np.testing.assert_array_equal(to_numpy(cache.keys[layer]), want)
        np.testing.assert_array_equal(to_numpy(cache.values[layer])[:2], values[layer][:2])
    assert not cache.valid[2, :3].any() and not cache.valid[2, 7:].any()
    np.testing.assert_array_equal(cache.valid[2, 3:7], source.valid[1, :4])
    assert cache.seen[2] == source.seen[1]
    with pytest.raises(ValueError, match="outside the cache"):
        cache.place(0, source, 0, at=5)


@settings(max_examples=15, deadline=None)
@given(count=st.integers(1, 3), seed=st.integers(0, 1000))
def test_compact_keeps_each_row_s_valid_slots_in_order_at_the_end(count, seed):
    cache, keys, values = _filled(3, 9, seed)
    valid = cache.valid.copy()
    length = cache.compact(count)
    held = valid[:count, :8].sum(axis=1)
    assert length == held.max()
    for r in range(count):
        slots = np.flatnonzero(valid[r, :8])
        new = np.arange(length - len(slots), length)
        assert cache.valid[r, :length].tolist() == [i >= length - len(slots) for i in range(length)]
        for layer in range(2):
            np.testing.assert_array_equal(to_numpy(cache.keys[layer])[r, :, new], keys[layer][r, :, slots])
            np.testing.assert_array_equal(to_numpy(cache.values[layer])[r, :, new], values[layer][r, :, slots])
    assert not cache.valid[count:].any() and not cache.valid[:, length:].any() and cache.length == length


def test_rows_views_and_merge_rows_write_back_a_step_of_some_rows():
    cache, keys, _ = _filled(3, 8, seed=2)
    view = cache.rows(1, 3)
    start = view.length
    view.advance(np.ones((2, 1), bool))
    new = np.full((2, 2, 1, 3), 7.0, "float32")
    for layer in range(2):
        view.update(layer, keras_tensor(new), keras_tensor(new), start)
    cache.merge_rows(view, 1)
    assert cache.length == start + 1 and cache.valid[1:, start].all() and not cache.valid[0, start]
    for layer in range(2):
        got = to_numpy(cache.keys[layer])
        np.testing.assert_array_equal(got[1:, :, start], new[:, :, 0])
        np.testing.assert_array_equal(got[0], keys[layer][0])


def test_grow_adds_empty_slots_and_keeps_the_rest():
    cache, keys, _ = _filled(2, 4, seed=3)
    valid = cache.valid.copy()
    cache.grow(10)
    assert cache.max_length == 10 and cache.valid.shape == (2, 10) and not cache.valid[:, 4:].any()
    np.testing.assert_array_equal(cache.valid[:, :4], valid)
    np.testing.assert_array_equal(to_numpy(cache.keys[1])[:, :, :4], keys[1])
    with pytest.raises(ValueError, match="cannot grow"):
        cache.grow(5)

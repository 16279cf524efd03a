"""Property-based tests of the attention ops (issue 17): shapes, masks, dtypes and paths drawn by
hypothesis, each property checked on the current backend against a float64 NumPy reference or an
invariant. Fixed example budgets, derandomized: the same examples on every run, so CI stays fast and
reproducible. Failing examples found while building the suite are kept as `@example`s."""

import numpy as np
from hypothesis import example, given, settings
from hypothesis import strategies as st

import attnkit
import reference
from backend_utils import to_numpy

FAST = settings(max_examples=25, deadline=None, derandomize=True, database=None)


@st.composite
def problems(draw, causal=None):
    """(q, k, v, keep (B, T_k) or None, causal): small shapes, B == T_q and length-1 cases included."""
    B = draw(st.integers(1, 3))
    t_q = draw(st.integers(1, 4))
    t_k = draw(st.integers(1, 4))
    d = draw(st.integers(1, 4))
    seed = draw(st.integers(0, 2**16))
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal((B, 2, t, d)).astype("float32") for t in (t_q, t_k, t_k))
    keep = rng.random((B, t_k)) < 0.7 if draw(st.booleans()) else None
    causal = draw(st.booleans()) if causal is None else causal
    return q, k, v, keep, causal


def _full_keep(keep, causal, shape):
    """The reference's keep-mask for scores of `shape` (B, h, T_q, T_k)."""
    full = np.ones(shape, bool)
    if keep is not None:
        full &= keep[:, None, None, :]
    if causal:
        full &= reference.causal_keep(shape[-2], shape[-1])
    return full


def _mask_arg(keep):
    return None if keep is None else keep[:, None, :]  # (B, 1, T_k): padding, never ambiguous


@FAST
@given(problems())
@example((np.ones((3, 2, 3, 2), "float32"), np.ones((3, 2, 1, 2), "float32"), np.ones((3, 2, 1, 2), "float32"), np.array([[False]] * 3), False))
def test_fused_and_explicit_equal_the_float64_reference(problem):
    q, k, v, keep, causal = problem
    expected, weights = reference.attention(q, k, v, _full_keep(keep, causal, (*q.shape[:-1], k.shape[-2])))
    fused = to_numpy(attnkit.fused_attention(q, k, v, _mask_arg(keep), causal=causal))
    explicit, explicit_weights = attnkit.scaled_dot_product_attention(q, k, v, _mask_arg(keep), causal=causal)
    np.testing.assert_allclose(fused, expected, atol=2e-5)
    np.testing.assert_allclose(to_numpy(explicit), expected, atol=2e-5)
    np.testing.assert_allclose(to_numpy(explicit_weights), weights, atol=2e-6)


@FAST
@given(problems(causal=False), st.integers(1, 3), st.integers(0, 2**16))
def test_padding_keys_never_change_the_output(problem, extra, seed):
    q, k, v, keep, _ = problem
    rng = np.random.default_rng(seed)
    B, h, _, d = k.shape
    junk_k, junk_v = (rng.standard_normal((B, h, extra, d)).astype("float32") * 100 for _ in range(2))
    keep = np.ones((B, k.shape[-2]), bool) if keep is None else keep
    padded_keep = np.concatenate([keep, np.zeros((B, extra), bool)], axis=1)
    base = to_numpy(attnkit.fused_attention(q, k, v, keep[:, None, :]))
    for fn in (attnkit.fused_attention, lambda *a: attnkit.scaled_dot_product_attention(*a)[0]):
        padded = fn(q, np.concatenate([k, junk_k], 2), np.concatenate([v, junk_v], 2), padded_keep[:, None, :])
        np.testing.assert_allclose(to_numpy(padded), base, atol=2e-5)


@FAST
@given(problems(causal=True), st.integers(0, 2**16))
def test_causal_attention_never_reads_the_future(problem, seed):
    q, k, v, _, _ = problem
    t = min(q.shape[-2], k.shape[-2])
    q, k, v = q[..., :t, :], k[..., :t, :], v[..., :t, :]  # square: position i sees keys <= i
    cut = np.random.default_rng(seed).integers(0, t)
    changed_k, changed_v = k.copy(), v.copy()
    changed_k[..., cut + 1:, :] += 7.0
    changed_v[..., cut + 1:, :] -= 3.0
    for fn in (attnkit.fused_attention, lambda *a, **o: attnkit.scaled_dot_product_attention(*a, **o)[0]):
        before = to_numpy(fn(q, k, v, causal=True))[..., : cut + 1, :]
        after = to_numpy(fn(q, changed_k, changed_v, causal=True))[..., : cut + 1, :]
        np.testing.assert_allclose(after, before, atol=1e-6)


@FAST
@given(problems(causal=False), st.randoms(use_true_random=False))
def test_permuting_keys_with_their_values_changes_nothing_and_queries_permute_the_output(problem, random):
    q, k, v, keep, _ = problem
    keys = list(range(k.shape[-2]))
    queries = list(range(q.shape[-2]))
    random.shuffle(keys)
    random.shuffle(queries)
    mask = _mask_arg(keep)
    base = to_numpy(attnkit.fused_attention(q, k, v, mask))
    permuted_mask = None if keep is None else keep[:, keys][:, None, :]
    out = to_numpy(attnkit.fused_attention(q[..., queries, :], k[..., keys, :], v[..., keys, :], permuted_mask))
    np.testing.assert_allclose(out, base[..., queries, :], atol=2e-5)


@FAST
@given(st.integers(1, 4), st.integers(1, 5), st.integers(0, 2**16))
def test_mask_converters_round_trip(B, T, seed):
    rng = np.random.default_rng(seed)
    keep = rng.random((B, T)) < 0.5
    np.testing.assert_array_equal(to_numpy(attnkit.from_hide_mask(~keep)), keep)
    np.testing.assert_array_equal(to_numpy(attnkit.from_hide_mask((~keep).astype("float32"))), keep)
    np.testing.assert_array_equal(to_numpy(attnkit.from_key_padding_mask(~keep)), keep)
    ids = np.where(keep, rng.integers(1, 9, (B, T)), 0)
    np.testing.assert_array_equal(to_numpy(attnkit.padding_mask(ids)), keep)
    combined = to_numpy(attnkit.combine_masks(keep[:, None, :], attnkit.causal_mask(T)))
    np.testing.assert_array_equal(combined, keep[:, None, :] & reference.causal_keep(T, T))


@FAST
@given(problems(), st.integers(0, 2**16))
def test_a_nan_query_reaches_its_row_on_every_path(problem, seed):
    q, k, v, keep, causal = problem
    rng = np.random.default_rng(seed)
    b, head, i = (rng.integers(0, n) for n in q.shape[:3])
    q = q.copy()
    q[b, head, i, rng.integers(0, q.shape[-1])] = np.nan
    sees = _full_keep(keep, causal, (*q.shape[:-1], k.shape[-2]))[b, head, i].any()
    for out in (
        attnkit.fused_attention(q, k, v, _mask_arg(keep), causal=causal),
        attnkit.scaled_dot_product_attention(q, k, v, _mask_arg(keep), causal=causal)[0],
    ):
        row = to_numpy(out)[b, head, i]
        if sees:
            assert np.isnan(row).all(), "a NaN query gave a number"
        else:
            np.testing.assert_array_equal(row, 0)  # a row with nothing to attend to stays zeros

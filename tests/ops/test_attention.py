"""`scaled_dot_product_attention` and `fused_attention` against the float64 reference in `reference.py`.

Legend: B batch, h heads, T_q/T_k query/key lengths, d_k/d_v widths. Masks: True = may attend.
The fused path against the explicit one (gradients, half precision) is in `test_fused.py`.
"""

import numpy as np
import pytest
from keras import ops

import reference
from attnkit.ops import fused_attention, scaled_dot_product_attention
from backend_utils import to_numpy

ATOL = 1e-5  # float32 against float64, weights and outputs
B, H, T_Q, T_K = 2, 3, 7, 5


def qkv(rng, lead, t_q, t_k, d_k=4, d_v=6):
    """Random float32 queries (*lead, T_q, d_k), keys (*lead, T_k, d_k), values (*lead, T_k, d_v)."""
    return (
        rng.normal(size=(*lead, t_q, d_k)).astype("float32"),
        rng.normal(size=(*lead, t_k, d_k)).astype("float32"),
        rng.normal(size=(*lead, t_k, d_v)).astype("float32"),
    )


def check_both_paths(q, k, v, keep=None, **kwargs):
    """Both functions within ATOL of the reference with the full keep-mask `keep`; returns (out, weights)."""
    ref_out, ref_weights = reference.attention(q, k, v, keep, scale=kwargs.get("scale"))
    out, weights = scaled_dot_product_attention(q, k, v, **kwargs)
    np.testing.assert_allclose(to_numpy(weights), ref_weights, rtol=0, atol=ATOL)
    np.testing.assert_allclose(to_numpy(out), ref_out, rtol=0, atol=ATOL)
    np.testing.assert_allclose(to_numpy(fused_attention(q, k, v, **kwargs)), ref_out, rtol=0, atol=ATOL)
    return to_numpy(out), to_numpy(weights)


@pytest.mark.parametrize("lead", [(2,), (2, 3), (2, 2, 3)], ids=["1-lead", "2-lead", "3-lead"])
@pytest.mark.parametrize("t_q, t_k", [(7, 7), (7, 5), (5, 7)])
def test_matches_reference_without_mask(rng, lead, t_q, t_k):
    out, weights = check_both_paths(*qkv(rng, lead, t_q, t_k))
    assert out.shape == (*lead, t_q, 6) and weights.shape == (*lead, t_q, t_k)


@pytest.mark.parametrize("lead", [(2,), (2, 3), (2, 2, 3)], ids=["1-lead", "2-lead", "3-lead"])
def test_matches_reference_with_padding_and_causal(rng, lead):
    q, k, v = qkv(rng, lead, 7, 9)
    pad = np.ones((lead[0], 9), bool)
    pad[0, 6:] = False  # (B, T_k)
    keep = pad.reshape(lead[0], *([1] * len(lead)), 9) & reference.causal_keep(7, 9)
    check_both_paths(q, k, v, keep, mask=pad, causal=True)


@pytest.mark.parametrize(
    "t_q, t_k, causal",
    [(267, 267, False), (267, 267, True), (267, 7, True), (7, 267, True)],
    ids=["267-square", "267-square-causal", "267x7-causal", "7x267-causal"],
)
def test_odd_long_lengths(rng, t_q, t_k, causal):
    # d_k == d_v and rank 4: the shape every fused kernel (torch SDPA, jax) accepts.
    q, k, v = qkv(rng, (1, 2), t_q, t_k, d_k=8, d_v=8)
    keep = reference.causal_keep(t_q, t_k) if causal else None
    check_both_paths(q, k, v, keep, causal=causal)


def _random_keep(rng, shape):
    keep = rng.random(shape) < 0.7
    keep[..., 0] = True  # every row keeps a key: fully masked rows are tested on their own
    return keep


# (mask shape, how the mask broadcasts against scores (B, h, T_q, T_k) in NumPy)
MASK_SHAPES = {
    "T_k": ((T_K,), lambda m: m),
    "B,T_k": ((B, T_K), lambda m: m[:, None, None, :]),
    "T_q,T_k": ((T_Q, T_K), lambda m: m),
    "B,T_q,T_k": ((B, T_Q, T_K), lambda m: m[:, None]),
    "B,h,T_q,T_k": ((B, H, T_Q, T_K), lambda m: m),
    "1,T_k": ((1, T_K), lambda m: m),
    "B,1,T_k": ((B, 1, T_K), lambda m: m[:, None]),
    "1,T_q,T_k": ((1, T_Q, T_K), lambda m: m[:, None]),
    "B,1,1,T_k": ((B, 1, 1, T_K), lambda m: m),
    "1,h,T_q,T_k": ((1, H, T_Q, T_K), lambda m: m),
    "1,1,1,T_k": ((1, 1, 1, T_K), lambda m: m),
}


@pytest.mark.parametrize(
    "name, mask_dtype",
    [(name, "bool") for name in MASK_SHAPES] + [(name, "int32") for name in ("B,T_k", "T_q,T_k", "B,h,T_q,T_k")],
)
def test_every_mask_shape_matches_reference(rng, name, mask_dtype):
    shape, to_scores = MASK_SHAPES[name]
    q, k, v = qkv(rng, (B, H), T_Q, T_K, d_k=8, d_v=8)
    keep = _random_keep(rng, shape)
    # Integer masks: any nonzero value attends, not only 1.
    mask = keep if mask_dtype == "bool" else np.where(keep, rng.integers(1, 5, shape), 0).astype(mask_dtype)
    _, weights = check_both_paths(q, k, v, to_scores(keep), mask=mask)
    assert (weights[~np.broadcast_to(to_scores(keep), weights.shape)] == 0).all()


@pytest.mark.parametrize("name", ["B,T_k", "B,h,T_q,T_k"])
@pytest.mark.parametrize("t_q", [T_Q, T_K, 3], ids=["tall", "square", "wide"])
def test_mask_plus_causal_matches_reference(rng, name, t_q):
    shape, to_scores = MASK_SHAPES[name]
    shape = tuple(t_q if d == T_Q else d for d in shape)
    q, k, v = qkv(rng, (B, H), t_q, T_K, d_k=8, d_v=8)
    keep = _random_keep(rng, shape)
    check_both_paths(q, k, v, to_scores(keep) & reference.causal_keep(t_q, T_K), mask=keep, causal=True)


@pytest.mark.parametrize("t_q, t_k", [(6, 6), (4, 9), (9, 4)], ids=["square", "wide", "tall"])
def test_causal_is_bottom_right_aligned(rng, t_q, t_k):
    q, k, v = qkv(rng, (B, H), t_q, t_k)
    out, weights = check_both_paths(q, k, v, reference.causal_keep(t_q, t_k), causal=True)
    for i in range(t_q):
        # Query i sees keys 0 .. T_k - T_q + i and nothing after.
        last = t_k - t_q + i
        assert (weights[..., i, last + 1 :] == 0).all()
        if last >= 0:
            assert (weights[..., i, : last + 1] > 0).all()
    if t_q > t_k:
        # The first T_q - T_k queries have no key at or before them: exact zeros.
        empty = t_q - t_k
        assert (out[..., :empty, :] == 0).all() and (weights[..., :empty, :] == 0).all()
        assert (out[..., empty:, :] != 0).any()


def test_causal_square_is_lower_triangular(rng):
    q, k, v = qkv(rng, (B,), 5, 5)
    _, weights = scaled_dot_product_attention(q, k, v, causal=True)
    np.testing.assert_array_equal(to_numpy(weights)[0] > 0, np.tril(np.ones((5, 5), bool)))


@pytest.mark.parametrize("scale", [0.3, 2.0])
def test_custom_scale(rng, scale):
    q, k, v = qkv(rng, (B, H), T_Q, T_K, d_k=8, d_v=8)
    out, _ = check_both_paths(q, k, v, None, scale=scale)
    default, _ = reference.attention(q, k, v)
    assert np.abs(out - default).max() > 1e-2  # the scale was really used


def test_default_scale_is_inverse_sqrt_d_k(rng):
    q, k, v = qkv(rng, (B,), T_Q, T_K, d_k=16)
    explicit = scaled_dot_product_attention(q, k, v, scale=0.25)[0]
    np.testing.assert_array_equal(to_numpy(scaled_dot_product_attention(q, k, v)[0]), to_numpy(explicit))


# A padding pattern given in every shape that can express it (scores (B, h, T_q, T_k)).
_PAD = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], bool)  # (B, T_k)
_ROWS = np.tril(np.ones((T_Q, T_K), bool), 1)  # (T_q, T_k)
SAME_MASK = {
    "padding": [
        _PAD,
        _PAD[:, None, :],
        _PAD[:, None, None, :],
        np.broadcast_to(_PAD[:, None, :], (B, T_Q, T_K)),
        np.broadcast_to(_PAD[:, None, None, :], (B, H, T_Q, T_K)),
        _PAD.astype("int64"),
    ],
    "per-query": [
        _ROWS,
        _ROWS[None],
        _ROWS[None, None],
        np.broadcast_to(_ROWS, (B, T_Q, T_K)),
        np.broadcast_to(_ROWS, (B, H, T_Q, T_K)),
        _ROWS.astype("uint8"),
    ],
    "keys-only": [_PAD[0], _PAD[:1], _PAD[:1, None], _PAD[:1, None, None], np.broadcast_to(_PAD[0], (T_Q, T_K))],
}


@pytest.mark.parametrize("pattern", list(SAME_MASK))
def test_every_shape_of_one_mask_gives_identical_outputs(rng, pattern):
    q, k, v = qkv(rng, (B, H), T_Q, T_K, d_k=8, d_v=8)
    results = [
        (to_numpy(out), to_numpy(weights), to_numpy(fused_attention(q, k, v, mask=mask)))
        for mask in SAME_MASK[pattern]
        for out, weights in [scaled_dot_product_attention(q, k, v, mask=mask)]
    ]
    for out, weights, fused in results[1:]:
        np.testing.assert_array_equal(out, results[0][0])
        np.testing.assert_array_equal(weights, results[0][1])
        # Exactly equal on CPU; on a GPU torch picks its kernel by the mask's layout (3.6e-7 seen on an H100).
        np.testing.assert_allclose(fused, results[0][2], rtol=1e-6, atol=1e-6)
    assert (results[0][1] == 0).any()  # the mask did hide something


def _identity_values(batch, t_k):
    return np.broadcast_to(np.eye(t_k, dtype="float32"), (batch, t_k, t_k)).copy()  # (B, T_k, d_v = T_k)


def test_dropout_scales_kept_weights_and_returns_pre_dropout_weights(rng):
    # With identity values the output *is* the dropped weights.
    q, k, _ = qkv(rng, (4,), 16, 16)
    v = _identity_values(4, 16)
    rate = 0.5
    dropped, weights = scaled_dot_product_attention(q, k, v, dropout=rate, training=True, seed=7)
    dropped, weights = to_numpy(dropped), to_numpy(weights)
    np.testing.assert_allclose(weights, reference.attention(q, k, v)[1], rtol=0, atol=ATOL)
    zeroed = dropped == 0
    assert 0.3 < zeroed.mean() < 0.7
    np.testing.assert_allclose(dropped[~zeroed], weights[~zeroed] / (1 - rate), rtol=1e-6)
    fused = to_numpy(fused_attention(q, k, v, dropout=rate, training=True, seed=7))
    assert np.abs(fused - weights).max() > 0.01
    assert 0.3 < (fused == 0).mean() < 0.7


@pytest.mark.parametrize("function", ["explicit", "fused"])
def test_dropout_inactive_when_not_training(rng, function):
    q, k, v = qkv(rng, (B, H), T_Q, T_K, d_k=8, d_v=8)

    def run(**kwargs):
        if function == "explicit":
            return to_numpy(scaled_dot_product_attention(q, k, v, **kwargs)[0])
        return to_numpy(fused_attention(q, k, v, **kwargs))

    plain = run()
    np.testing.assert_array_equal(run(dropout=0.5, training=False), plain)
    np.testing.assert_array_equal(run(dropout=0.0, training=True), plain)
    assert np.abs(run(dropout=0.5, training=True, seed=3) - plain).max() > 1e-3


def test_accepts_backend_tensors(rng):
    q, k, v = qkv(rng, (B,), T_Q, T_K)
    out, _ = scaled_dot_product_attention(*(ops.convert_to_tensor(x) for x in (q, k, v)))
    np.testing.assert_allclose(to_numpy(out), reference.attention(q, k, v)[0], rtol=0, atol=ATOL)


FUNCTIONS = {
    "explicit": lambda *a, **kw: scaled_dot_product_attention(*a, **kw)[0],
    "fused": fused_attention,
}


def _zeros(*shape):
    return np.zeros(shape, "float32")


BAD_SHAPES = {
    "rank-2 queries": ((5, 4), (2, 5, 4), (2, 5, 4), r"`queries` must have rank >= 3.*Received: queries.shape=\(5, 4\)"),
    "rank-2 values": ((2, 5, 4), (2, 5, 4), (5, 4), r"`values` must have rank >= 3.*values.shape=\(5, 4\)"),
    "ranks differ": ((2, 5, 4), (2, 1, 5, 4), (2, 1, 5, 4), r"same rank.*queries=\(2, 5, 4\)"),
    "batch differs": ((2, 5, 4), (3, 5, 4), (3, 5, 4), r"same batch dimensions.*queries=\(2, 5, 4\), keys=\(3, 5, 4\)"),
    "heads differ": ((2, 3, 5, 4), (2, 2, 5, 4), (2, 2, 5, 4), r"same batch dimensions"),
    "keys/values lengths": ((2, 5, 4), (2, 6, 4), (2, 7, 4), r"same length T_k.*keys=\(2, 6, 4\), values=\(2, 7, 4\)"),
    "q/k widths": ((2, 5, 4), (2, 6, 3), (2, 6, 4), r"same width d_k.*queries=\(2, 5, 4\), keys=\(2, 6, 3\)"),
}


@pytest.mark.parametrize("function", list(FUNCTIONS))
@pytest.mark.parametrize("case", list(BAD_SHAPES))
def test_bad_shapes_raise(function, case):
    q, k, v, message = BAD_SHAPES[case]
    with pytest.raises(ValueError, match=message):
        FUNCTIONS[function](_zeros(*q), _zeros(*k), _zeros(*v))


BAD_MASKS = {
    "wrong T_k": ((2, 3, 4), r"`mask` of shape \(2, 3, 4\) does not broadcast .* shape \(2, 5, 6\)"),
    "wrong T_q": ((2, 4, 6), r"`mask` of shape \(2, 4, 6\) does not broadcast .* shape \(2, 5, 6\)"),
    "wrong B": ((3, 5, 6), r"`mask` of shape \(3, 5, 6\) does not broadcast .* shape \(2, 5, 6\)"),
    "2-D neither B nor T_q": ((4, 6), r"`mask` of shape \(4, 6\) does not broadcast .* shape \(2, 5, 6\)"),
    "rank above scores": ((2, 1, 5, 6), r"`mask` of shape \(2, 1, 5, 6\) does not broadcast .* shape \(2, 5, 6\)"),
    "scalar": ((), r"`mask` of shape \(\) does not broadcast"),
}


@pytest.mark.parametrize("function", list(FUNCTIONS))
@pytest.mark.parametrize("case", list(BAD_MASKS))
def test_mask_that_does_not_broadcast_names_both_shapes(function, case):
    shape, message = BAD_MASKS[case]
    with pytest.raises(ValueError, match=message):
        FUNCTIONS[function](_zeros(2, 5, 4), _zeros(2, 6, 4), _zeros(2, 6, 4), mask=np.ones(shape, bool))


@pytest.mark.parametrize("function", list(FUNCTIONS))
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_float_mask_is_refused_with_the_convention(function, dtype):
    mask = np.ones((2, 6), dtype)
    with pytest.raises(TypeError, match=r"boolean or integer mask, not float.*True .*= may attend.*padding_mask"):
        FUNCTIONS[function](_zeros(2, 5, 4), _zeros(2, 6, 4), _zeros(2, 6, 4), mask=mask)


@pytest.mark.parametrize("function", list(FUNCTIONS))
def test_two_dimensional_mask_is_ambiguous_when_batch_equals_query_length(function):
    with pytest.raises(ValueError, match=r"`mask` of shape \(5, 6\) is ambiguous.*both 5.*mask\[:, None, :\]"):
        FUNCTIONS[function](_zeros(5, 5, 4), _zeros(5, 6, 4), _zeros(5, 6, 4), mask=np.ones((5, 6), bool))


@pytest.mark.parametrize("function", list(FUNCTIONS))
@pytest.mark.parametrize("scale", [float("nan"), float("inf"), -1.0, 0.0, 0])
def test_bad_scale_raises(function, scale):
    with pytest.raises(ValueError, match=rf"`scale` must be a finite positive number. Received: scale={scale!r}"):
        FUNCTIONS[function](_zeros(2, 5, 4), _zeros(2, 6, 4), _zeros(2, 6, 4), scale=scale)


@pytest.mark.parametrize("function", list(FUNCTIONS))
@pytest.mark.parametrize("dropout", [1.0, -0.1, 1.5])
def test_dropout_outside_unit_interval_raises(function, dropout):
    with pytest.raises(ValueError, match=rf"`dropout` must be a float in \[0, 1\). Received: dropout={dropout!r}"):
        FUNCTIONS[function](_zeros(2, 5, 4), _zeros(2, 6, 4), _zeros(2, 6, 4), dropout=dropout)


@pytest.mark.parametrize("tiled", [False, True])
def test_float64_inputs_are_computed_in_float64(rng, tiled, monkeypatch, default_scores_budget):
    """float64 in, float64 out, to float64's rounding, on both paths, masked and causal; the tiled
    path (forced by a tiny budget where the backend has no kernel) too."""
    import keras

    if keras.backend.backend() == "jax":
        pytest.skip("jax holds float64 only under jax_enable_x64")
    from attnkit.ops import set_max_scores_bytes

    q, k, v = (rng.standard_normal((B, H, t, 8)) for t in (T_Q, T_K, T_K))  # float64
    keep = rng.random((B, 1, T_Q, T_K)) < 0.7
    if tiled:
        set_max_scores_bytes(64)
    for causal in (False, True):
        want = reference.attention(q, k, v, keep=keep & reference.causal_keep(T_Q, T_K) if causal else keep)[0]
        outputs = [fused_attention(*map(ops.convert_to_tensor, (q, k, v)), keep, causal=causal)]
        if not tiled:
            outputs.append(scaled_dot_product_attention(*map(ops.convert_to_tensor, (q, k, v)), keep, causal=causal)[0])
        for out in outputs:
            assert keras.backend.standardize_dtype(out.dtype) == "float64"
            np.testing.assert_allclose(to_numpy(out), want, rtol=0, atol=1e-13)


def test_one_key_gets_weight_one_without_a_warning(rng):
    """A single key (the first step of uncached decoding) has weight 1, or 0 where masked, and Keras's
    warning about a softmax over an axis of size 1 does not fire."""
    import warnings

    q, k, v = qkv(rng, (B, H), T_Q, 1)
    keep = np.array([True, False])[:, None, None, None]  # the second example's only key is hidden
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, weights = scaled_dot_product_attention(q, k, v, keep)
    np.testing.assert_array_equal(to_numpy(weights)[:, :, :, 0], np.broadcast_to([[[1.0]], [[0.0]]], (B, H, T_Q)))
    np.testing.assert_allclose(to_numpy(out), reference.attention(q, k, v, keep=keep)[0], rtol=0, atol=1e-6)

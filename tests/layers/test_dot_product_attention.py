"""Tests for `attnkit.DotProductAttention`: exact values against the float64 reference (the seed-000 call
with a positional d_k, every mask shape, causal), every backend, Keras citizenship, dropout, the fused
path and the errors."""

import keras
import numpy as np
import pytest
from keras import ops

import attnkit
import reference
from attnkit._validation import ArgumentTypeError
from backend_utils import once_per_run, to_numpy, value_and_grads
from layer_harness import check_config_round_trip
from layer_checks import assert_same_on_every_backend, numpy_outputs

B, H, T_q, T_k, D_K, D_V = 2, 3, 5, 7, 4, 6  # all different, so no 2-D mask is ambiguous


def inputs(rng, t_q=T_q, t_k=T_k, d_k=D_K, d_v=D_V, lead=(B, H)):
    return (
        rng.standard_normal((*lead, t_q, d_k)).astype("float32"),
        rng.standard_normal((*lead, t_k, d_k)).astype("float32"),
        rng.standard_normal((*lead, t_k, d_v)).astype("float32"),
    )


def assert_close(actual, desired, atol=1e-5):
    np.testing.assert_allclose(to_numpy(actual), desired, rtol=0, atol=atol)


# --- against the float64 reference ------------------------------------------------------------------


def test_seed_call_with_positional_d_k_matches_reference(rng):
    # seed 000: attention(queries, keys, values, d_k) with d_k passed positionally
    q, k, v = inputs(rng)
    layer = attnkit.DotProductAttention()
    want, want_w = reference.attention(q, k, v, scale=1 / np.sqrt(D_K))
    out = layer(q, k, v, D_K)
    assert tuple(out.shape) == (B, H, T_q, D_V)
    assert_close(out, want)
    out, w = layer(q, k, v, D_K, return_attention_weights=True)
    assert_close(out, want)
    assert_close(w, want_w)


def test_d_k_sets_the_scale(rng):
    q, k, v = inputs(rng)
    layer = attnkit.DotProductAttention()
    want, want_w = reference.attention(q, k, v, scale=1 / np.sqrt(16))
    assert_close(layer(q, k, v, d_k=16), want)
    assert_close(layer(q, k, v, d_k=16, return_attention_weights=True)[1], want_w)
    # default: the queries' width
    assert_close(layer(q, k, v), reference.attention(q, k, v)[0])


def test_three_dimensional_inputs_and_odd_long_keys_match_reference(rng):
    q, k, v = inputs(rng, t_q=7, t_k=267, d_k=3, d_v=5, lead=(2,))
    layer = attnkit.DotProductAttention()
    want, want_w = reference.attention(q, k, v)
    assert_close(layer(q, k, v), want)
    out, w = layer(q, k, v, return_attention_weights=True)
    assert tuple(w.shape) == (2, 7, 267)
    assert_close(out, want)
    assert_close(w, want_w)


def mask_cases(rng):
    """(mask as given, the same mask as a keep-mask broadcastable to (B, h, T_q, T_k))."""
    t_k = rng.random(T_k) < 0.6
    b_k = rng.random((B, T_k)) < 0.6
    q_k = rng.random((T_q, T_k)) < 0.6
    bqk = rng.random((B, T_q, T_k)) < 0.6
    bhqk = rng.random((B, H, T_q, T_k)) < 0.6
    bqk[1, 4] = False  # rows with nothing to attend to
    bhqk[0, 2, 1] = False
    return {
        "T_k": (t_k, t_k),
        "B,T_k": (b_k, b_k[:, None, None, :]),
        "T_q,T_k": (q_k, q_k),
        "B,T_q,T_k": (bqk, bqk[:, None]),  # the same for every head, as in Keras
        "B,h,T_q,T_k": (bhqk, bhqk),
        "B,h,T_q,T_k int": (bhqk.astype("int64") * 3, bhqk),  # nonzero = attend
    }


@pytest.mark.parametrize("case", ["T_k", "B,T_k", "T_q,T_k", "B,T_q,T_k", "B,h,T_q,T_k", "B,h,T_q,T_k int"])
@pytest.mark.parametrize("return_weights", [False, True], ids=["fused", "explicit"])
def test_every_mask_shape_matches_reference(rng, case, return_weights):
    q, k, v = inputs(rng)
    mask, keep = mask_cases(rng)[case]
    want, want_w = reference.attention(q, k, v, keep)
    out = attnkit.DotProductAttention()(q, k, v, mask=mask, return_attention_weights=return_weights)
    if return_weights:
        out, w = out
        assert_close(w, want_w)
    assert_close(out, want)


def test_seed_call_with_positional_mask(rng):
    q, k, v = inputs(rng)
    mask, keep = mask_cases(rng)["B,T_q,T_k"]
    assert_close(attnkit.DotProductAttention()(q, k, v, D_K, mask), reference.attention(q, k, v, keep)[0])


@pytest.mark.parametrize("t_q,t_k", [(T_q, T_q), (T_q, T_k), (T_k, T_q)])
@pytest.mark.parametrize("return_weights", [False, True], ids=["fused", "explicit"])
def test_causal_is_bottom_right_aligned(rng, t_q, t_k, return_weights):
    q, k, v = inputs(rng, t_q=t_q, t_k=t_k)
    padding = rng.random((B, t_k)) < 0.8
    for mask, keep in ((None, reference.causal_keep(t_q, t_k)),
                       (padding, padding[:, None, None, :] & reference.causal_keep(t_q, t_k))):
        want, want_w = reference.attention(q, k, v, keep)
        out = attnkit.DotProductAttention()(q, k, v, mask=mask, causal=True, return_attention_weights=return_weights)
        if return_weights:
            out, w = out
            assert_close(w, want_w)
        assert_close(out, want)


# --- every backend ----------------------------------------------------------------------------------


def test_keras_masks_on_the_keys_are_key_padding(rng):
    """Embeddings with `mask_zero=True` as queries, keys and values: padded keys get no weight, alone or
    combined with an explicit causal mask, eagerly and in a functional model."""
    ids = np.array([[3, 4, 5, 0, 0, 0], [1, 2, 0, 0, 0, 0]], "int32")
    embedding = keras.layers.Embedding(9, 4, mask_zero=True)
    x = embedding(ids)
    e = to_numpy(x).astype("float64")
    padding = (ids != 0)[:, None, :]  # (B, 1, T_k)
    look_ahead = np.tril(np.ones((6, 6), bool))
    layer = attnkit.DotProductAttention()
    assert_close(layer(x, x, x), reference.attention(e, e, e, keep=padding)[0])
    assert_close(layer(x, x, x, mask=look_ahead), reference.attention(e, e, e, keep=padding & look_ahead)[0])
    tokens = keras.Input((6,), dtype="int32")
    embedded = embedding(tokens)
    model = keras.Model(tokens, attnkit.DotProductAttention()(embedded, embedded, embedded))
    assert_close(model(ids), reference.attention(e, e, e, keep=padding)[0])


@once_per_run  # compares the three backends, from whichever pass runs it
def test_same_inputs_give_same_outputs_on_every_backend():
    assert_same_on_every_backend("DotProductAttention")


# --- Keras citizenship ------------------------------------------------------------------------------


def test_config_round_trip(rng):
    layer = attnkit.DotProductAttention(dropout=0.3, seed=11, name="dpa")
    config = layer.get_config()
    assert config["dropout"] == 0.3 and config["seed"] == 11 and config["name"] == "dpa"
    check_config_round_trip(layer, inputs(rng))


def test_keras_file_round_trip_in_functional_model(rng, tmp_path):
    q_in, k_in, v_in = keras.Input((H, None, D_K)), keras.Input((H, None, D_K)), keras.Input((H, None, D_V))
    layer = attnkit.DotProductAttention(dropout=0.2)
    out, w = layer(q_in, k_in, v_in, causal=True, return_attention_weights=True)
    assert tuple(out.shape) == (None, H, None, D_V) and len(w.shape) == 4
    model = keras.Model([q_in, k_in, v_in], [out, w])
    q, k, v = inputs(rng)
    before = numpy_outputs(model([q, k, v]))
    path = tmp_path / "dpa.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    restored = [x for x in loaded.layers if isinstance(x, attnkit.DotProductAttention)]
    assert len(restored) == 1 and restored[0].dropout == 0.2
    after = numpy_outputs(loaded([q, k, v]))
    np.testing.assert_allclose(before[0], reference.attention(q, k, v, reference.causal_keep(T_q, T_k))[0], atol=1e-5)
    for a, b in zip(before, after):
        np.testing.assert_array_equal(a, b)


def test_compute_output_shape_matches_call(rng):
    q, k, v = inputs(rng)
    layer = attnkit.DotProductAttention()
    assert layer.compute_output_shape(q.shape, k.shape, v.shape) == tuple(layer(q, k, v).shape) == (B, H, T_q, D_V)
    symbolic = layer(keras.KerasTensor((None, 2, 3, 4)), keras.KerasTensor((None, 2, 9, 4)), keras.KerasTensor((None, 2, 9, 8)))
    assert tuple(symbolic.shape) == (None, 2, 3, 8)


def test_mixed_bfloat16(rng):
    q, k, v = inputs(rng)
    mask, keep = mask_cases(rng)["B,T_q,T_k"]
    want = reference.attention(q, k, v, keep)[0]
    keras.config.set_dtype_policy("mixed_bfloat16")
    layer = attnkit.DotProductAttention()
    assert layer.compute_dtype == "bfloat16"
    for return_weights in (False, True):
        out = layer(q, k, v, mask=mask, return_attention_weights=return_weights)
        out = out[0] if return_weights else out
        assert keras.backend.standardize_dtype(out.dtype) == "bfloat16"
        got = to_numpy(ops.cast(out, "float32"))
        assert np.all(np.isfinite(got))
        # bfloat16 has a relative step of 2**-8; q, k and v round once each, the scores and weights
        # once more: 8 steps of the output's scale bound it, a wrong computation is off by O(1).
        np.testing.assert_allclose(got, want, rtol=0, atol=8 * 2**-8 * np.abs(want).max())


# --- dropout and the fused path ---------------------------------------------------------------------


def test_dropout_only_when_training(rng):
    q, k, v = inputs(rng)
    layer = attnkit.DotProductAttention(dropout=0.5, seed=5)
    want = reference.attention(q, k, v)[0]
    assert_close(layer(q, k, v), want)
    assert_close(layer(q, k, v, training=False), want)
    trained = to_numpy(layer(q, k, v, training=True))
    assert np.abs(trained - want).max() > 1e-3
    # inverted dropout: each surviving weight is scaled by 1 / (1 - rate), so the values' span is kept
    _, w = layer(q, k, v, training=True, return_attention_weights=True)
    np.testing.assert_allclose(to_numpy(ops.sum(w, -1)), 1.0, atol=1e-5)


def test_fused_and_explicit_paths_equal_with_gradients_and_empty_rows(rng):
    q, k, v = inputs(rng)
    mask = rng.random((B, H, T_q, T_k)) < 0.6
    mask[0, 1, 2] = False  # a query with nothing to attend to
    layer = attnkit.DotProductAttention()
    fused_out, fused_grads = value_and_grads(lambda q, k, v: layer(q, k, v, mask=mask), q, k, v)
    explicit_out, explicit_grads = value_and_grads(
        lambda q, k, v: layer(q, k, v, mask=mask, return_attention_weights=True)[0], q, k, v
    )
    np.testing.assert_allclose(fused_out, explicit_out, rtol=0, atol=1e-5)
    np.testing.assert_allclose(fused_out, reference.attention(q, k, v, mask)[0], rtol=0, atol=1e-5)
    assert np.all(fused_out[0, 1, 2] == 0)
    for f, e in zip(fused_grads, explicit_grads):
        assert np.all(np.isfinite(f)) and np.all(np.isfinite(e))
        np.testing.assert_allclose(f, e, rtol=0, atol=1e-5)
    assert np.all(fused_grads[0][0, 1, 2] == 0)  # the empty row's query gets no gradient


# --- errors -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dropout", [-0.5, 1.0])
def test_dropout_outside_unit_interval_raises(dropout):
    with pytest.raises(ValueError, match=r"`dropout` must be a float in \[0, 1\)\. Received: dropout="):
        attnkit.DotProductAttention(dropout=dropout)


def test_bad_d_k_raises(rng):
    q, k, v = inputs(rng)
    layer = attnkit.DotProductAttention()
    for d_k in (0, -2):
        with pytest.raises(ValueError, match=rf"`d_k` must be a positive integer\. Received: d_k={d_k}"):
            layer(q, k, v, d_k)
    for d_k in (1.5, "8"):
        with pytest.raises(ArgumentTypeError, match=r"`d_k` must be a positive integer\. Received: d_k="):
            layer(q, k, v, d_k=d_k)


def test_bad_inputs_raise(rng):
    q, k, v = inputs(rng)
    layer = attnkit.DotProductAttention()
    with pytest.raises(ValueError, match=r"`queries` must have rank >= 3.*Received: queries.shape=\(5, 4\)"):
        layer(q[0, 0], k, v)
    with pytest.raises(ValueError, match=r"same batch dimensions.*queries=\(2, 3, 5, 4\), keys=\(1, 3, 7, 4\)"):
        layer(q, k[:1], v)
    with pytest.raises(ValueError, match=r"same length T_k.*keys=\(2, 3, 7, 4\), values=\(2, 3, 6, 6\)"):
        layer(q, k, v[:, :, :6])
    with pytest.raises(ValueError, match=r"same width d_k.*queries=\(2, 3, 5, 4\), keys=\(2, 3, 7, 3\)"):
        layer(q, k[..., :3], v)


@pytest.mark.parametrize("shape", [(T_k + 1,), (B + 1, T_k), (T_q + 1, T_k), (B, H + 1, T_q, T_k)])
@pytest.mark.parametrize("return_weights", [False, True])
def test_mask_that_does_not_broadcast_raises(rng, shape, return_weights):
    q, k, v = inputs(rng)
    with pytest.raises(ValueError, match=r"`mask` of shape .* does not broadcast to the attention scores of shape \(2, 3, 5, 7\)"):
        attnkit.DotProductAttention()(q, k, v, mask=np.ones(shape, bool), return_attention_weights=return_weights)


def test_float_mask_raises_and_explains_the_convention(rng):
    q, k, v = inputs(rng)
    with pytest.raises(attnkit.MaskDtypeError, match=r"not float32.*True \(or a nonzero integer\) = may attend"):
        attnkit.DotProductAttention()(q, k, v, mask=np.ones((B, T_k), "float32"))

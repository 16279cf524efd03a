"""Tests for `attnkit.AdditiveAttention` (Bahdanau; seed 003): exact values against the float64 reference
for a single query step and for query sequences, masks, every backend, Keras citizenship and the errors."""

import keras
import numpy as np
import pytest
from keras import ops

import attnkit
import reference
from attnkit._validation import ArgumentTypeError
from attnkit.layers._keras_mask import keras_mask_of
from backend_utils import once_per_run, to_numpy, value_and_grads
from layer_harness import check_config_round_trip
from layer_checks import assert_same_on_every_backend, numpy_outputs, set_additive_weights

B, T_q, T_k, D_Q, D_K, D_V, UNITS = 2, 5, 7, 6, 9, 4, 8  # the widths differ on purpose


def make_layer(rng, units=UNITS, d_q=D_Q, d_k=D_K):
    layer = attnkit.AdditiveAttention(units)
    return layer, set_additive_weights(layer, rng, d_q, d_k)


def inputs(rng, t_q=T_q, t_k=T_k, batch=B):
    query_shape = (batch, D_Q) if t_q is None else (batch, t_q, D_Q)
    return (
        rng.standard_normal(query_shape).astype("float32"),
        rng.standard_normal((batch, t_k, D_K)).astype("float32"),
        rng.standard_normal((batch, t_k, D_V)).astype("float32"),
    )


def expected(weights, query, key, value, keep=None):
    return reference.additive_attention(query, key, value, weights["W_q"], weights["W_k"], weights["v"], keep)


def assert_close(actual, desired, atol=1e-5):
    np.testing.assert_allclose(to_numpy(actual), desired, rtol=0, atol=atol)


# --- against the float64 reference ------------------------------------------------------------------


def test_single_query_step_gives_context_and_weights_of_seed_003(rng):
    layer, weights = make_layer(rng)
    query, key, value = inputs(rng, t_q=None)
    context, w = layer(query, key, value)
    assert tuple(context.shape) == (B, D_V)
    assert tuple(w.shape) == (B, 1, T_k)
    want_context, want_w = expected(weights, query[:, None], key, value)
    assert_close(context, want_context[:, 0])
    assert_close(w, want_w)
    np.testing.assert_allclose(to_numpy(ops.sum(w, -1)), 1.0, atol=1e-6)


def test_query_sequence_matches_reference(rng):
    layer, weights = make_layer(rng)
    query, key, value = inputs(rng)
    context, w = layer(query, key, value)
    assert tuple(context.shape) == (B, T_q, D_V) and tuple(w.shape) == (B, T_q, T_k)
    want_context, want_w = expected(weights, query, key, value)
    assert_close(context, want_context)
    assert_close(w, want_w)


def test_odd_long_keys_match_reference(rng):
    layer, weights = make_layer(rng, units=3)
    query, key, value = inputs(rng, t_q=3, t_k=267, batch=1)
    context, w = layer(query, key, value)
    want_context, want_w = expected(weights, query, key, value)
    assert_close(context, want_context)
    assert_close(w, want_w)


def mask_cases(rng):
    """(mask as given, the same mask as a keep-mask broadcastable to (B, T_q, T_k))."""
    t_k = rng.random(T_k) < 0.6
    b_k = rng.random((B, T_k)) < 0.6
    q_k = rng.random((T_q, T_k)) < 0.6
    bqk = rng.random((B, T_q, T_k)) < 0.6
    bqk[1, 2] = False  # a query with nothing to attend to
    return {
        "T_k": (t_k, t_k),
        "B,T_k": (b_k, b_k[:, None, :]),
        "T_q,T_k": (q_k, q_k),
        "B,T_q,T_k": (bqk, bqk),
        "B,1,T_k int": (b_k[:, None, :].astype("int32"), b_k[:, None, :]),
    }


@pytest.mark.parametrize("case", ["T_k", "B,T_k", "T_q,T_k", "B,T_q,T_k", "B,1,T_k int"])
def test_every_mask_shape_matches_reference(rng, case):
    layer, weights = make_layer(rng)
    query, key, value = inputs(rng)
    mask, keep = mask_cases(rng)[case]
    want_context, want_w = expected(weights, query, key, value, keep)
    context, w = layer(query, key, value, mask=mask)
    assert_close(context, want_context)
    assert_close(w, want_w)
    if case == "B,T_q,T_k":
        assert np.all(to_numpy(w)[1, 2] == 0) and np.all(to_numpy(context)[1, 2] == 0)


def test_single_query_step_with_padding_mask(rng):
    layer, weights = make_layer(rng)
    query, key, value = inputs(rng, t_q=None)
    padding = np.ones((B, T_k), bool)
    padding[0, 4:] = False
    want_context, want_w = expected(weights, query[:, None], key, value, padding[:, None, :])
    context, w = layer(query, key, value, padding)  # seed 003 passes the mask positionally
    assert_close(context, want_context[:, 0])
    assert_close(w, want_w)
    assert np.all(to_numpy(w)[0, 0, 4:] == 0)


def test_gradients_are_finite_with_an_empty_row(rng):
    layer, _ = make_layer(rng)
    query, key, value = inputs(rng)
    mask = np.ones((B, T_q, T_k), bool)
    mask[0, 3] = False
    out, grads = value_and_grads(lambda q, k, v: layer(q, k, v, mask=mask)[0], query, key, value)
    assert np.all(out[0, 3] == 0)
    assert all(np.all(np.isfinite(g)) for g in grads)
    assert np.all(grads[0][0, 3] == 0)  # the empty row's query gets no gradient
    assert np.abs(grads[0][0, 2]).max() > 0


# --- every backend ----------------------------------------------------------------------------------


@once_per_run  # compares the three backends, from whichever pass runs it
def test_same_weights_give_same_outputs_on_every_backend():
    assert_same_on_every_backend("AdditiveAttention")


# --- Keras citizenship ------------------------------------------------------------------------------


def test_config_round_trip_gives_identical_outputs(rng):
    layer = attnkit.AdditiveAttention(UNITS, kernel_initializer="he_normal", name="bahdanau")
    query, key, value = inputs(rng)
    layer(query, key, value)
    config = layer.get_config()
    assert config["units"] == UNITS and config["name"] == "bahdanau"
    check_config_round_trip(layer, (query, key, value))


def test_keras_file_round_trip_in_functional_model(rng, tmp_path):
    q_in, k_in, v_in = keras.Input((D_Q,)), keras.Input((None, D_K)), keras.Input((None, D_V))
    context, w = attnkit.AdditiveAttention(UNITS)(q_in, k_in, v_in)
    assert tuple(context.shape) == (None, D_V) and tuple(w.shape) == (None, 1, None)
    model = keras.Model([q_in, k_in, v_in], [context, w])
    query, key, value = inputs(rng, t_q=None)
    before = numpy_outputs(model([query, key, value]))
    path = tmp_path / "additive.keras"
    model.save(path)
    after = numpy_outputs(keras.models.load_model(path)([query, key, value]))
    for a, b in zip(before, after):
        np.testing.assert_array_equal(a, b)


def test_compute_output_shape_matches_call(rng):
    layer, _ = make_layer(rng)
    for t_q in (None, T_q):
        query, key, value = inputs(rng, t_q=t_q)
        context, w = layer(query, key, value)
        shapes = layer.compute_output_shape(query.shape, key.shape, value.shape)
        assert shapes == (tuple(context.shape), tuple(w.shape))
    assert layer.compute_output_shape((None, 3, D_Q), (None, 11, D_K), (None, 11, D_V)) == ((None, 3, D_V), (None, 3, 11))


def test_keras_mask_on_keys_is_padding(rng):
    ids = np.array([[3, 4, 5, 0, 0, 0, 0], [1, 2, 3, 4, 5, 6, 7]], "int32")
    embedding = keras.layers.Embedding(9, D_K, mask_zero=True)
    layer, _ = make_layer(rng)
    query, _, value = inputs(rng, t_q=None)
    key = embedding(ids)
    assert keras_mask_of(key) is not None
    plain = ops.convert_to_tensor(to_numpy(key))
    with_keras_mask = numpy_outputs(layer(query, key, value))
    explicit = numpy_outputs(layer(query, plain, value, mask=attnkit.padding_mask(ids)))
    for a, b in zip(with_keras_mask, explicit):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
    assert np.all(with_keras_mask[1][0, 0, 3:] == 0)


def test_mixed_bfloat16(rng):
    layer32, _ = make_layer(rng)
    query, key, value = inputs(rng)
    want = numpy_outputs(layer32(query, key, value))
    keras.config.set_dtype_policy("mixed_bfloat16")
    layer16 = attnkit.AdditiveAttention(UNITS)
    layer16.build(query.shape, key.shape, value.shape)
    layer16.set_weights(layer32.get_weights())
    context, w = layer16(query, key, value)
    for out, ref in zip((context, w), want):
        assert keras.backend.standardize_dtype(out.dtype) == "bfloat16"
        got = to_numpy(ops.cast(out, "float32"))
        assert np.all(np.isfinite(got))
        # bfloat16's relative step is 2**-8; inputs, W_q, W_k, tanh, v and the final matmul each
        # round once: 10 steps of the output's scale bound it, a wrong computation is off by O(1).
        np.testing.assert_allclose(got, ref, rtol=0, atol=10 * 2**-8 * np.abs(ref).max())


# --- errors -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("units", [0, -2])
def test_non_positive_units_raise(units):
    with pytest.raises(ValueError, match=rf"`units` must be a positive integer\. Received: units={units}"):
        attnkit.AdditiveAttention(units)


@pytest.mark.parametrize("units", [1.5, "8", True])
def test_non_integer_units_raise_argument_type_error(units):
    with pytest.raises(ArgumentTypeError, match=r"`units` must be a positive integer\. Received: units="):
        attnkit.AdditiveAttention(units)


def test_bad_inputs_raise(rng):
    layer, _ = make_layer(rng)
    query, key, value = inputs(rng)
    with pytest.raises(ValueError, match=r"`key` must have rank 3.*Received: key.shape=\(2, 9\)"):
        layer(query, key[:, 0], value)
    with pytest.raises(ValueError, match=r"`query` must have rank 3 \(rank 2 for a single query step\)"):
        layer(query[..., None], key, value)
    with pytest.raises(ValueError, match=r"same batch size.*query=\(2, 5, 6\), key=\(1, 7, 9\)"):
        layer(query, key[:1], value)
    with pytest.raises(ValueError, match=r"same length T_k.*key=\(2, 7, 9\), value=\(2, 6, 4\)"):
        layer(query, key, value[:, :6])


@pytest.mark.parametrize("shape", [(T_k + 1,), (B + 1, T_k), (B, T_q + 1, T_k), (1, B, T_q, T_k)])
def test_mask_that_does_not_broadcast_raises(rng, shape):
    layer, _ = make_layer(rng)
    query, key, value = inputs(rng)
    with pytest.raises(ValueError, match=r"`mask` of shape .* does not broadcast to the attention scores of shape \(2, 5, 7\)"):
        layer(query, key, value, mask=np.ones(shape, bool))


def test_float_mask_raises_and_explains_the_convention(rng):
    layer, _ = make_layer(rng)
    query, key, value = inputs(rng, t_q=None)
    with pytest.raises(attnkit.MaskDtypeError, match=r"True \(or a nonzero integer\) = may attend.*from_hide_mask"):
        layer(query, key, value, mask=np.zeros((B, T_k), "float32"))

"""Issue 17, library classes 1-5: every reproducer refused with one clear error, or computed exactly."""

import keras
import numpy as np
import pytest

import attnkit
from backend_utils import BACKEND, to_numpy


def _functional_encoder():
    i = keras.Input((5,))
    return keras.Model(i, attnkit.Encoder(20, 5, 2, 4, 4, 8, 16, 1, 0.0)(i))


def _compiled_error():
    """What a failed in-graph check raises: ValueError eagerly, the backend's runtime error when compiled."""
    if BACKEND == "jax":
        import jax

        return (ValueError, jax.errors.JaxRuntimeError)
    if BACKEND == "tensorflow":
        import tensorflow as tf

        return (ValueError, tf.errors.InvalidArgumentError)
    return ValueError


# --- class 1: compiled paths check token ids -----------------------------------------------------------


BAD_IDS = {
    "fractional": (np.random.default_rng(0).random((4, 5)), "floats are accepted only when they are whole numbers"),
    "too-large": (np.array([[1, 2, 25, 0, 0]], np.int32), r"token ids in \[0, vocab_size=20\)"),
    "negative": (np.array([[1, -2, 3, 0, 0]], np.int32), r"token ids in \[0, vocab_size=20\)"),
}


@pytest.mark.parametrize(
    "how, bad", [("predict", "fractional"), ("predict", "too-large"), ("predict", "negative"), ("evaluate", "fractional"),
                 ("fit", "too-large")],
)
def test_bad_token_ids_fail_inside_compiled_keras_loops(how, bad):
    ids, message = BAD_IDS[bad]
    model = _functional_encoder()
    model.compile(loss="mse")
    with pytest.raises(_compiled_error(), match=message):
        if how == "predict":
            model.predict(ids, verbose=0)
        else:
            getattr(model, how)(ids, np.zeros((len(ids), 5, 8), "float32"), verbose=0)


def test_valid_token_ids_pass_the_compiled_checks():
    model = _functional_encoder()
    ids = np.array([[1, 2, 19, 0, 0], [3, 4, 5, 6, 7]], np.int32)
    expected = to_numpy(model(ids))
    np.testing.assert_allclose(model.predict(ids, verbose=0), expected, atol=1e-6)
    np.testing.assert_allclose(model.predict(ids.astype("float32"), verbose=0), expected, atol=1e-6)


@pytest.mark.skipif(BACKEND != "jax", reason="jax.jit")
def test_bad_token_ids_fail_under_jax_jit():
    import jax

    encoder = attnkit.Encoder(20, 5, 2, 4, 4, 8, 16, 1, 0.0)
    encoder(np.ones((1, 5), np.int32))
    call = jax.jit(lambda ids: encoder(ids))
    assert np.isfinite(to_numpy(call(np.array([[1, 2, 3, 0, 0]], np.int32)))).all()
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"token ids in \[0, vocab_size=20\)"):
        to_numpy(call(np.array([[1, 2, 25, 0, 0]], np.int32)))


@pytest.mark.skipif(BACKEND != "tensorflow", reason="tf.function")
def test_tensorflow_checks_in_tf_function_and_refuses_xla():
    import tensorflow as tf

    encoder = attnkit.Encoder(20, 5, 2, 4, 4, 8, 16, 1, 0.0)
    encoder(np.ones((1, 5), np.int32))
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"token ids in \[0, vocab_size=20\)"):
        tf.function(lambda ids: encoder(ids))(tf.constant([[1, 2, 25, 0, 0]]))
    with pytest.raises(ValueError, match="cannot be checked inside an XLA-compiled tensorflow function"):
        tf.function(lambda ids: encoder(ids), jit_compile=True)(tf.constant([[1, 2, 3, 0, 0]]))
    assert not encoder.pos_encoding.supports_jit  # Keras's jit_compile="auto" then stays off XLA
    # A length known only when the graph runs: checked then, not the backend's Slice error
    dynamic = tf.function(lambda ids: encoder(ids), input_signature=[tf.TensorSpec((None, None), tf.int32)])
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"`input_sentence` must be at most sequence_length=5 tokens long"):
        dynamic(tf.constant([[1, 2, 3, 4, 5, 6]]))
    assert dynamic(tf.constant([[1, 2, 3]])).shape == (1, 3, 8)


# --- class 2: dtypes ---------------------------------------------------------------------------------------

Q = np.random.default_rng(1).random((2, 3, 4)).astype("float32")


@pytest.mark.parametrize("dtype", ["int32", "bool", "str"])
@pytest.mark.parametrize("fn", [attnkit.scaled_dot_product_attention, attnkit.fused_attention])
def test_non_floating_queries_keys_values_are_refused(fn, dtype):
    bad = np.ones((2, 3, 4)).astype(dtype) if dtype != "str" else np.full((2, 3, 4), "a")
    expected = "string" if dtype == "str" else dtype
    for position, name in enumerate(("queries", "keys", "values")):
        args = [Q, Q, Q]
        args[position] = bad
        with pytest.raises(TypeError, match=rf"`{name}` must be a floating-point tensor. Received: {name} with dtype={expected}"):
            fn(*args)


@pytest.mark.parametrize("flag", ["causal", "training"])
@pytest.mark.parametrize("value", ["yes", 2, 0.5])
def test_non_bool_flags_are_refused(flag, value):
    for fn in (attnkit.scaled_dot_product_attention, attnkit.fused_attention):
        with pytest.raises(TypeError, match=rf"`{flag}` must be a bool. Received: {flag}="):
            fn(Q, Q, Q, **{flag: value})
    np.testing.assert_array_equal(
        to_numpy(attnkit.fused_attention(Q, Q, Q, causal=np.True_)), to_numpy(attnkit.fused_attention(Q, Q, Q, causal=True))
    )


def test_string_masks_and_ids_are_refused_on_every_path():
    strings = np.full((2, 3), "a")
    with pytest.raises(TypeError, match="`mask` must be a boolean or integer mask, not string"):
        attnkit.scaled_dot_product_attention(Q, Q, Q, strings)
    with pytest.raises(TypeError, match="`mask` must be a boolean or integer mask, not string"):
        attnkit.MultiHeadAttention(2, 2, 2, 4)(Q, mask=strings)
    with pytest.raises(TypeError, match="`input_sentence` must hold integer token ids. Received: input_sentence with dtype=string"):
        attnkit.Encoder(20, 5, 2, 4, 4, 8, 16, 1, 0.0)(np.full((1, 5), "a"))
    transformer = attnkit.Transformer(9, 9, 4, 4, 2, 4, 4, 8, 16, 1, 0.0)
    with pytest.raises(TypeError, match="`encoder_input` must hold integer token ids. Received: encoder_input with dtype=string"):
        transformer((np.full((1, 4), "a"), np.ones((1, 4), np.int32)))
    with pytest.raises(TypeError, match="`decoder_input` must hold integer token ids"):
        transformer(np.ones((1, 4), np.int32), np.full((1, 4), "a"))
    with pytest.raises(TypeError, match="`mask` must be a boolean, integer or 0/1 float mask"):
        attnkit.from_hide_mask(strings)


def test_layers_refuse_non_floating_inputs_and_non_bool_flags():
    x = np.ones((2, 3, 8), np.int32)
    layers = [
        (attnkit.MultiHeadAttention(2, 4, 4, 8), "queries"),
        (attnkit.EncoderLayer(2, 4, 4, 8, 16, 0.0), "x"),
        (attnkit.FeedForward(16, 8), "x"),
        (attnkit.SinusoidalPositionEncoding(5, 8), "inputs"),
    ]
    for layer, name in layers:
        with pytest.raises(TypeError, match=rf"`{name}` must be a floating-point tensor. Received: {name} with dtype=int32"):
            layer(x)
    with pytest.raises(TypeError, match=r"`query` must be a floating-point tensor"):
        attnkit.AdditiveAttention(4)(x, Q, Q)
    with pytest.raises(TypeError, match=r"`return_attention_weights` must be a bool"):
        attnkit.MultiHeadAttention(2, 4, 4, 8)(x.astype("float32"), return_attention_weights="yes")
    with pytest.raises(TypeError, match=r"`causal` must be a bool"):
        attnkit.DotProductAttention()(Q, Q, Q, causal="yes")


def test_layers_take_numpy_bools_and_integers_as_their_python_values():
    """Keras turns NumPy scalars into tensors before `call`, which then refused the bools and sizes
    the functions take (`causal=np.True_`, the seeds' `d_k`)."""
    x = Q.astype("float32")
    mha, attention = attnkit.MultiHeadAttention(2, 4, 4, 8), attnkit.DotProductAttention()
    np.testing.assert_array_equal(to_numpy(mha(x, causal=np.True_)), to_numpy(mha(x, causal=True)))
    np.testing.assert_array_equal(
        to_numpy(attention(x, x, x, np.int64(4), causal=np.True_, return_attention_weights=np.False_)),
        to_numpy(attention(x, x, x, 4, causal=True)),
    )
    np.testing.assert_array_equal(to_numpy(attention(x, x, x, d_k=np.int32(4))[0]), to_numpy(attention(x, x, x, 4)[0]))
    with pytest.raises(TypeError, match=r"`d_k` must be a positive integer. Received: d_k=np.float64\(4.0\)"):
        attention(x, x, x, np.float64(4))
    with pytest.raises(ValueError, match=r"`d_k` must be a positive integer. Received: d_k=np.int64\(0\)"):
        attention(x, x, x, np.int64(0))


# --- class 3: one mask rule ---------------------------------------------------------------------------------


def test_decoder_refuses_a_look_ahead_mask_it_could_read_as_padding():
    decoder = attnkit.Decoder(11, 4, 2, 4, 4, 8, 16, 1, 0.0)
    ids = np.random.default_rng(2).integers(1, 11, (4, 4))
    memory = np.random.default_rng(3).random((4, 6, 8)).astype("float32")
    with pytest.raises(ValueError, match=r"`lookahead_mask` of shape \(4, 4\) is ambiguous"):
        decoder(ids, memory, attnkit.causal_mask(4))
    # Unambiguous spellings give the causal self-attention the layer applies anyway.
    expected = to_numpy(decoder(ids, memory))
    np.testing.assert_allclose(to_numpy(decoder(ids, memory, to_numpy(attnkit.causal_mask(4))[None])), expected, atol=1e-6)
    np.testing.assert_allclose(to_numpy(decoder(ids, memory, np.ones((4, 1, 4), bool))), expected, atol=1e-6)


@pytest.mark.skipif(BACKEND != "tensorflow", reason="tf.function traced for unknown batch and length")
def test_an_ambiguous_mask_is_refused_when_a_graph_of_unknown_shapes_runs():
    """Traced with B and T unknown, a (T, T) look-ahead mask was read as (B, T_k) padding when B == T:
    every query saw the first key only. The eager check refuses it as ambiguous; the graph now asserts."""
    import tensorflow as tf

    x = np.random.default_rng(0).normal(size=(3, 3, 8)).astype("float32")
    look_ahead = np.tril(np.ones((3, 3), bool))
    layer = attnkit.MultiHeadAttention(2, 4, 4, 8)
    with pytest.raises(ValueError, match="is ambiguous"):
        layer(x, mask=look_ahead)
    weights = tf.function(
        lambda x, m: layer(x, mask=m, return_attention_weights=True)[1],
        input_signature=[tf.TensorSpec((None, None, 8)), tf.TensorSpec((None, None), tf.bool)],
    )
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"`mask` of shape \(None, T_k\), read as a \(B, T_k\) padding mask"):
        weights(x, look_ahead)
    padding = np.array([[True, True, False], [True, True, True]])  # B = 2 != T = 3: padding, as eagerly
    np.testing.assert_allclose(to_numpy(weights(x[:2], padding)), to_numpy(layer(x[:2], mask=padding, return_attention_weights=True)[1]), atol=1e-6)
    attention = tf.function(lambda q, m: attnkit.fused_attention(q, q, q, m), input_signature=[tf.TensorSpec((None, 2, None, 4)), tf.TensorSpec((None, None), tf.bool)])
    with pytest.raises(tf.errors.InvalidArgumentError, match="could be a \\(T_q, T_k\\) mask"):
        attention(np.ones((3, 2, 3, 4), "float32"), look_ahead)


@pytest.mark.parametrize("B, T", [(3, 3), (1, 4), (3, 1), (1, 1)], ids=["B==T", "B==1", "T==1", "B==T==1"])
def test_every_layer_mask_argument_follows_one_rule(B, T):
    rng = np.random.default_rng(B * 10 + T)
    x = rng.random((B, T, 8)).astype("float32")
    padding = np.ones((B, T), bool)
    padding[0, -1] = T == 1  # one padded key unless that would leave nothing
    ambiguous = B == T and B > 1
    calls = {
        "mask": lambda m: attnkit.MultiHeadAttention(2, 4, 4, 8)(x, mask=m),
        "padding_mask": lambda m: attnkit.EncoderLayer(2, 4, 4, 8, 16, 0.0)(x, m),
        "lookahead_mask": lambda m: attnkit.DecoderLayer(2, 4, 4, 8, 16, 0.0)(x, x, m),
    }
    for name, call in calls.items():
        keras.utils.set_random_seed(0)
        if ambiguous:
            with pytest.raises(ValueError, match=rf"`{name}` of shape \({B}, {T}\) is ambiguous"):
                call(padding)
        else:
            two_d = to_numpy(call(padding))
            keras.utils.set_random_seed(0)
            np.testing.assert_allclose(two_d, to_numpy(call(padding[:, None, :])), atol=1e-6)
        keras.utils.set_random_seed(0)
        call(padding[:, None, :])  # (B, 1, T) is padding on every layer, whatever B and T
    with pytest.raises(ValueError, match=r"is ambiguous") if ambiguous else _nothing():
        attnkit.scaled_dot_product_attention(x, x, x, padding)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# --- class 4: policies reach every sub-layer ---------------------------------------------------------------


@pytest.mark.parametrize("policy", ["float32", "mixed_float16", "mixed_bfloat16"])
def test_transformer_policy_reaches_every_sublayer(policy):
    model = attnkit.Transformer(13, 13, 5, 6, 2, 4, 4, 8, 16, 1, 0.0, dtype=policy)
    model((np.ones((1, 5), np.int32), np.ones((1, 6), np.int32)))
    names = {layer.dtype_policy.name for layer in model._flatten_layers()}
    assert names == {policy}


# --- class 5: NaN and Inf reach the output ------------------------------------------------------------------


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_query_row_reaches_the_output_on_every_path(bad):
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal((1, 2, 3, 4)).astype("float32") for _ in range(3))
    q[0, 0, 1, 0] = bad
    keep = np.array([True, True, False])
    for out in (
        attnkit.fused_attention(q, k, v),
        attnkit.fused_attention(q, k, v, keep),
        attnkit.fused_attention(q, k, v, causal=True),
        attnkit.scaled_dot_product_attention(q, k, v, keep)[0],
    ):
        out = to_numpy(out)
        assert np.isnan(out[0, 0, 1]).all()
        assert np.isfinite(out[0, 1]).all() and np.isfinite(out[0, 0, [0, 2]]).all()


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_one_key_does_not_hide_a_non_finite_score(bad):
    rng = np.random.default_rng(5)
    q = rng.standard_normal((2, 3, 4)).astype("float32")
    k = rng.standard_normal((2, 1, 4)).astype("float32")
    k[0, 0, 0] = bad
    for out in (attnkit.fused_attention(q, k, k), attnkit.scaled_dot_product_attention(q, k, k)[0]):
        out = to_numpy(out)
        assert np.isnan(out[0]).all() and np.isfinite(out[1]).all()
    context, weights = attnkit.AdditiveAttention(4)(q, k, k)
    if np.isnan(bad):
        assert np.isnan(to_numpy(weights)[0]).all()
    # tanh saturates: an infinite key gives a finite score, weight 1, and its infinite value the output.
    assert not np.isfinite(to_numpy(context)[0, :, 0]).any() and np.isfinite(to_numpy(context)[1]).all()
    # A row whose one (non-finite) key is masked is still zeros.
    values = np.ones((2, 1, 4), "float32")
    hidden = np.zeros((2, 1, 1), bool)
    for fn in (attnkit.fused_attention, lambda *a: attnkit.scaled_dot_product_attention(*a)[0]):
        np.testing.assert_array_equal(to_numpy(fn(q, k, values, hidden)), 0)


def test_scores_finite_in_float32_give_finite_outputs_and_overflowing_scores_give_nan():
    # d_k = 1, scale 1: the score of x with itself is x^2; float32's largest is 3.4028e38.
    v = np.array([[[1.0], [2.0]]], np.float32)
    for x, finite in ((1.8e19, True), (1.9e19, False)):
        q = k = np.array([[[x], [0.0]]], np.float32)
        for out in (attnkit.fused_attention(q, k, v, scale=1.0), attnkit.scaled_dot_product_attention(q, k, v, scale=1.0)[0]):
            out = to_numpy(out)
            if finite:
                np.testing.assert_allclose(out[0, 0], [1.0])
            else:
                assert np.isnan(out[0, 0]).all()

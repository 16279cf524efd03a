"""`call_sublayer` gives what `layer(...)` gives, skips Keras's `__call__` only when that changes nothing,
and the composite layers built on it keep their precision when their public methods are called
directly, outside any `__call__`."""

import keras
import numpy as np
import pytest
from keras import ops
from keras.src.backend.common.variables import AutocastScope, get_autocast_scope  # no public names in Keras 3

import attnkit
from attnkit.layers._sublayer import call_layer_norm, call_sublayer
from backend_utils import to_numpy

B, T, D = 2, 5, 8


class CountingLinear(attnkit.Linear):
    """A Linear that counts the calls that go through Keras's `__call__`."""

    keras_calls = 0

    def __call__(self, *args, **kwargs):
        CountingLinear.keras_calls += 1
        return super().__call__(*args, **kwargs)


@pytest.fixture
def counting():
    CountingLinear.keras_calls = 0
    layer = CountingLinear(4, activation="relu")
    layer.build((None, None, D))
    return layer


def test_built_float32_layer_on_a_tensor_skips_keras_call(rng, counting):
    x = ops.convert_to_tensor(rng.standard_normal((B, T, D)).astype("float32"))
    got = call_sublayer(counting, x)
    assert CountingLinear.keras_calls == 0
    np.testing.assert_array_equal(to_numpy(got), to_numpy(counting(x)))


@pytest.mark.parametrize(
    "case", ["numpy input", "float16 tensor", "unbuilt", "mixed policy", "quantized"]
)
def test_falls_back_to_keras_call_and_gives_the_same_result(rng, case):
    x = rng.standard_normal((B, T, D)).astype("float32")
    dtype = "mixed_bfloat16" if case == "mixed policy" else None
    CountingLinear.keras_calls = 0
    layer = CountingLinear(4, dtype=dtype)
    if case != "unbuilt":
        layer.build((None, None, D))
    if case == "quantized":
        layer.quantize("int8")
    if case == "float16 tensor":
        x = ops.convert_to_tensor(x.astype("float16"))
    elif case != "numpy input":
        x = ops.convert_to_tensor(x)
    got = call_sublayer(layer, x)
    assert CountingLinear.keras_calls == 1
    assert layer.built
    assert keras.backend.standardize_dtype(got.dtype) == layer.compute_dtype
    np.testing.assert_array_equal(to_numpy(ops.cast(got, "float32")), to_numpy(ops.cast(layer(x), "float32")))


def test_dropout_and_layer_norm_equal_their_keras_calls(rng):
    x = ops.convert_to_tensor(rng.standard_normal((B, T, D)).astype("float32"))
    norm = keras.layers.LayerNormalization(epsilon=1e-6)
    norm.build((None, None, D))
    np.testing.assert_array_equal(to_numpy(call_sublayer(norm, x)), to_numpy(norm(x)))
    dropout = keras.layers.Dropout(0.5)
    np.testing.assert_array_equal(to_numpy(call_sublayer(dropout, x, training=False)), to_numpy(x))
    dropped = to_numpy(call_sublayer(dropout, x, training=True))
    kept = dropped != 0
    assert 0 < kept.mean() < 1
    np.testing.assert_allclose(dropped[kept], 2 * to_numpy(x)[kept], rtol=1e-6)


def test_encode_called_directly_keeps_mixed_precision(rng, monkeypatch):
    """`Encoder.encode` is a public method: called outside `__call__`, its layers must still compute in
    bfloat16 under mixed_bfloat16, exactly as when the encoder is called on token ids. It converts its
    input and opens the autocast scope as `__call__` would, so its layers skip their own `__call__`s,
    on float32 embeddings and NumPy ones too."""
    keras.config.set_dtype_policy("mixed_bfloat16")
    try:
        encoder = attnkit.Encoder(20, T, 2, 4, 4, D, 16, 2, 0.0)
        ids = rng.integers(1, 20, size=(B, T))
        through_call = encoder(ids)
    finally:
        keras.config.set_dtype_policy("float32")
    embeddings = encoder.pos_encoding(ids)
    direct = encoder.encode(embeddings, training=False)
    assert keras.backend.standardize_dtype(direct.dtype) == "bfloat16"
    np.testing.assert_array_equal(to_numpy(ops.cast(direct, "float32")), to_numpy(ops.cast(through_call, "float32")))
    layer_calls = []
    layer_type = type(encoder.encoder_layers[0])
    original = layer_type.__call__
    monkeypatch.setattr(layer_type, "__call__", lambda self, *a, **k: layer_calls.append(self) or original(self, *a, **k))
    wide = to_numpy(ops.cast(embeddings, "float32"))
    padding = ops.convert_to_tensor((ids != 0)[:, None, :])  # `embeddings`' Keras mask: a GPU picks its kernel by it
    for given in (ops.convert_to_tensor(wide), wide):  # float32 tensor, NumPy: converted as `__call__` would
        again = encoder.encode(given, padding, training=False)
        assert keras.backend.standardize_dtype(again.dtype) == "bfloat16"
        np.testing.assert_array_equal(to_numpy(ops.cast(again, "float32")), to_numpy(ops.cast(direct, "float32")))
    assert not layer_calls
    assert get_autocast_scope() is None  # the scope closed with the call
    integers = ops.convert_to_tensor(rng.integers(-3, 4, (B, T, D)).astype("int32"))
    with pytest.raises(TypeError, match="must be a floating-point tensor"):  # the layers' own check, as before
        encoder.encode(integers)
    assert get_autocast_scope() is None


@pytest.mark.parametrize("policy, scope", [("float32", "bfloat16"), ("mixed_bfloat16", "float16"), ("float32", None)])
def test_a_sublayer_inside_another_layers_autocast_scope_computes_as_its_keras_call(rng, policy, scope):
    """Keras's `__call__` runs a layer in an autocast scope of its own compute dtype inside another
    layer's scope (a float32 layer inside a mixed_bfloat16 parent reads float32 kernels): called
    directly, a sublayer must read its kernels the same way, not cast to the parent's dtype."""
    layer = attnkit.Linear(4, dtype=policy)
    layer.build((None, None, D))
    x = ops.cast(ops.convert_to_tensor(rng.standard_normal((B, T, D))), layer.compute_dtype)
    with AutocastScope(scope):
        got, want = call_sublayer(layer, x), layer(x)
    assert keras.backend.standardize_dtype(got.dtype) == layer.compute_dtype
    np.testing.assert_array_equal(to_numpy(ops.cast(got, "float32")), to_numpy(ops.cast(want, "float32")))


@pytest.mark.parametrize("policy, scope", [("float32", "bfloat16"), ("mixed_bfloat16", "float16")])
def test_encode_inside_another_layers_autocast_scope_computes_in_its_own_precision(rng, policy, scope):
    """A user's mixed-precision layer calling `encoder.encode` in its own `call`: the encoder computes
    as it does alone and as `encoder(...)` would there (a float32 encoder in float32: 0.009 apart in
    bfloat16 before this was fixed)."""
    keras.config.set_dtype_policy(policy)
    try:
        encoder = attnkit.Encoder(20, T, 2, 4, 4, D, 16, 2, 0.0)
        encoder.build((B, T))
    finally:
        keras.config.set_dtype_policy("float32")
    x = ops.convert_to_tensor(rng.standard_normal((B, T, D)).astype("float32"))
    alone = encoder.encode(x, training=False)
    with AutocastScope(scope):
        inside = encoder.encode(x, training=False)
        assert get_autocast_scope().dtype == scope  # the caller's scope is back after the call
    assert keras.backend.standardize_dtype(inside.dtype) == encoder.compute_dtype
    np.testing.assert_array_equal(to_numpy(ops.cast(inside, "float32")), to_numpy(ops.cast(alone, "float32")))


def test_attend_projected_called_directly_casts_numpy_queries(rng):
    """`MultiHeadAttention.attend_projected` (used by cached decoding) with float64 NumPy queries."""
    mha = attnkit.MultiHeadAttention(2, 4, 4, D)
    x = rng.standard_normal((B, T, D))
    mha.build((None, None, D))
    k, v = mha.project_keys_values(x.astype("float32"), x.astype("float32"))
    got = mha.attend_projected(x, k, v)
    assert keras.backend.standardize_dtype(got.dtype) == "float32"
    np.testing.assert_allclose(to_numpy(got), to_numpy(mha(x.astype("float32"))), atol=1e-5)


@pytest.mark.parametrize(
    "options, policy",
    [
        (dict(), "float32"),
        (dict(center=False), "float32"),
        (dict(scale=False, epsilon=1e-3), "float32"),
        (dict(axis=[1, 2]), "float32"),  # not the last axis alone: Keras's own call
        (dict(), "mixed_bfloat16"),  # float32 statistics of bfloat16 inputs: Keras's own call
    ],
)
def test_call_layer_norm_equals_the_keras_layer(rng, options, policy):
    norm = keras.layers.LayerNormalization(dtype=policy, **options)
    norm.build((B, T, D))
    # Non-trivial scale and offset, so that dropping either would show.
    for weight in norm.weights:
        weight.assign(rng.standard_normal(weight.shape))
    x = ops.cast(ops.convert_to_tensor(3.0 + 2.0 * rng.standard_normal((B, T, D))), norm.compute_dtype)
    got = call_layer_norm(norm, x)
    assert keras.backend.standardize_dtype(got.dtype) == norm.compute_dtype
    np.testing.assert_array_equal(to_numpy(got), to_numpy(norm(x)))


SCOPES = [("float32", "bfloat16"), ("mixed_bfloat16", "float16")]


def _as_float32(x):
    return to_numpy(ops.cast(x, "float32"))


@pytest.mark.parametrize("policy, scope", SCOPES)
def test_attention_steps_called_directly_inside_another_scope_compute_as_outside(rng, policy, scope):
    """`project_queries`, `project_keys_values` and `attend_projected`, the steps cached decoding calls,
    read their kernels in their own precision inside a caller's other autocast scope (before: cast to
    the caller's dtype, 4-5e-3 apart in float32 on torch and jax)."""
    attention = attnkit.MultiHeadAttention(4, 4, 4, 16, dtype=policy)
    x = ops.convert_to_tensor(rng.standard_normal((B, T, 16)).astype("float32"))
    attention(x)

    def steps():
        k, v = attention.project_keys_values(x, x)
        q = attention.project_queries(x)
        return k, v, q, attention.attend_projected(x, k, v, projected_queries=q)

    alone = steps()
    with AutocastScope(scope):
        inside = steps()
    for got, want in zip(inside, alone):
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(_as_float32(got), _as_float32(want))
    np.testing.assert_array_equal(_as_float32(alone[-1]), _as_float32(attention(x)))


@pytest.mark.parametrize("policy, scope", SCOPES)
def test_decoding_inside_another_scope_gives_the_logits_it_gives_outside(policy, scope):
    """Greedy decoding, cached and not, and the tied output projection (`Transformer.logits`), called
    from inside a caller's other autocast scope: the same logits as outside it."""
    keras.utils.set_random_seed(0)
    model = attnkit.Transformer(12, 12, 6, 6, h=2, d_k=4, d_v=4, d_model=8, d_ff=16, n=2, rate=0.0,
                                tie_weights=True, dtype=policy)
    source = np.array([[3, 4, 5, 6, 0, 0], [7, 8, 9, 3, 4, 5]], "int32")
    target = np.array([[1, 3, 4], [1, 5, 6]], "int32")
    model(source, target)
    y = model.decoder(target, model.encode(source)[0])
    alone = [attnkit.greedy_decode(model, source, max_length=5, end_id=11, use_cache=c).step_logits for c in (True, False)]
    alone.append(_as_float32(model.logits(y)))
    with AutocastScope(scope):
        inside = [attnkit.greedy_decode(model, source, max_length=5, end_id=11, use_cache=c).step_logits for c in (True, False)]
        inside.append(_as_float32(model.logits(y)))
    for got, want in zip(inside, alone):
        np.testing.assert_array_equal(got, want)


def test_the_steps_of_an_unbuilt_attention_or_model_are_refused_with_a_clear_error():
    attention = attnkit.MultiHeadAttention(4, 4, 4, 16)
    y = np.zeros((B, T, 16), "float32")
    for name, step in [("project_keys_values", lambda: attention.project_keys_values(y, y)),
                       ("project_queries", lambda: attention.project_queries(y)),
                       ("attend_projected", lambda: attention.attend_projected(y, y, y))]:
        with pytest.raises(ValueError, match=f"`MultiHeadAttention.{name}` needs a built layer"):
            step()
    model = attnkit.Transformer(12, 12, 6, 6, h=2, d_k=4, d_v=4, d_model=8, d_ff=16, n=1, rate=0.0, tie_weights=True)
    with pytest.raises(ValueError, match="`Transformer.logits` needs a built model"):
        model.logits(np.zeros((1, 3, 8), "float32"))


def test_encode_converts_nested_lists_as_arrays(rng):
    encoder = attnkit.Encoder(20, T, 2, 4, 4, D, 16, 1, 0.0)
    encoder.build((B, T))
    x = rng.standard_normal((B, T, D))
    np.testing.assert_array_equal(to_numpy(encoder.encode(x.tolist())), to_numpy(encoder.encode(x.astype("float32"))))

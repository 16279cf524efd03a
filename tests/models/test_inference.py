"""`inference_function`: the model's own numbers without dropout, weights assigned later are used, and
nothing is recorded for gradients on torch."""

import keras
import numpy as np
import pytest

import attnkit
from attnkit.models._inference import inference_function
from backend_utils import BACKEND, to_numpy

B, T, D = 3, 6, 8


@pytest.fixture
def encoder(rng):
    model = attnkit.Encoder(30, T, 2, 4, 4, D, 16, 2, 0.5)  # dropout 0.5: any training-mode run shows
    model.build((None, T))
    return model


def token_ids(rng):
    ids = rng.integers(1, 30, size=(B, T)).astype("int32")
    ids[0, 4:] = 0  # padding
    return keras.ops.convert_to_tensor(ids)


def test_equals_the_model_in_inference_mode(rng, encoder):
    ids = token_ids(rng)
    run = inference_function(encoder)
    want = to_numpy(encoder(ids, training=False))
    np.testing.assert_allclose(to_numpy(run(ids)), want, atol=1e-6)
    np.testing.assert_allclose(to_numpy(run(ids)), want, atol=1e-6)  # deterministic: no dropout


def test_fixed_keyword_arguments_are_passed(rng, encoder):
    ids = token_ids(rng)
    hidden, weights = inference_function(encoder, return_attention_weights=True)(ids)
    want_hidden, want_weights = encoder(ids, training=False, return_attention_weights=True)
    np.testing.assert_allclose(to_numpy(hidden), to_numpy(want_hidden), atol=1e-6)
    assert len(weights) == 2
    for got, want in zip(weights, want_weights):
        np.testing.assert_allclose(to_numpy(got), to_numpy(want), atol=1e-6)


def test_uses_weights_assigned_after_it_was_made(rng, encoder):
    ids = token_ids(rng)
    run = inference_function(encoder)
    before = to_numpy(run(ids))
    encoder.set_weights([rng.standard_normal(w.shape).astype("float32") for w in encoder.get_weights()])
    after = to_numpy(run(ids))
    assert np.abs(after - before).max() > 1e-2
    np.testing.assert_allclose(after, to_numpy(encoder(ids, training=False)), atol=1e-5)


@pytest.mark.skipif(BACKEND != "torch", reason="autograd graphs are a torch notion")
def test_records_no_autograd_graph_on_torch(rng, encoder):
    out = inference_function(encoder)(token_ids(rng))
    assert not out.requires_grad and out.grad_fn is None


@pytest.fixture
def mixed_encoder(rng):
    """The encoder under `mixed_bfloat16`, its float32 weights random (none of them bfloat16 values)."""
    keras.config.set_dtype_policy("mixed_bfloat16")
    try:
        model = attnkit.Encoder(30, T, 2, 4, 4, D, 16, 2, 0.5)
        model.build((None, T))
    finally:
        keras.config.set_dtype_policy("float32")
    model.set_weights([rng.standard_normal(w.shape).astype("float32") for w in model.get_weights()])
    return model


def compiled_reference(model, ids):
    """The model's compiled inference on its float32 variables, as passed before item 67."""
    import jax

    run = jax.jit(lambda tr, nt, x: model.stateless_call(tr, nt, x, training=False)[0])
    return to_numpy(run([v.value for v in model.trainable_variables], [v.value for v in model.non_trainable_variables], ids))


@pytest.mark.skipif(BACKEND != "jax", reason="jax passes the variables as arguments, cast where only cast copies are read")
def test_mixed_bfloat16_passes_cast_variables_and_keeps_the_numbers(rng, mixed_encoder):
    """Kernels and biases are passed as bfloat16 copies; LayerNorm's gamma and beta and the embedding
    tables, read in float32, are not: the outputs are the same bits (docs/decisions.md item 67), and
    weights assigned later are used."""
    from attnkit.models import _inference

    ids = token_ids(rng)
    run = inference_function(mixed_encoder)
    np.testing.assert_array_equal(to_numpy(run(ids)), compiled_reference(mixed_encoder, ids))
    values = [v.value for v in [*mixed_encoder.trainable_variables, *mixed_encoder.non_trainable_variables]]
    n = len(mixed_encoder.trainable_variables)
    call = lambda tr, nt, x: mixed_encoder.stateless_call(tr, nt, x, training=False)[0]  # noqa: E731
    dtypes = _inference._narrowed_dtypes(call, n, values, (ids,))
    paths = [v.path for v in [*mixed_encoder.trainable_variables, *mixed_encoder.non_trainable_variables]]
    narrowed = {p for p, dtype in zip(paths, dtypes) if dtype is not None}
    assert narrowed and all(p.endswith(("kernel", "bias")) for p in narrowed), narrowed
    assert not any(p.endswith(("gamma", "beta", "embeddings")) for p in narrowed)
    mixed_encoder.set_weights([rng.standard_normal(w.shape).astype("float32") for w in mixed_encoder.get_weights()])
    np.testing.assert_array_equal(to_numpy(run(ids)), compiled_reference(mixed_encoder, ids))


def test_nested_inputs_are_passed_as_they_are(rng):
    """A model of a dict of inputs runs as it does eagerly (on jax, the signature of the kept casts
    is read from the inputs' leaves)."""
    a, b = keras.Input((4,), name="a"), keras.Input((4,), name="b")
    model = keras.Model({"a": a, "b": b}, keras.layers.Dense(3)(keras.layers.Add()([a, b])))
    x = {"a": rng.standard_normal((2, 4)).astype("float32"), "b": rng.standard_normal((2, 4)).astype("float32")}
    np.testing.assert_allclose(to_numpy(inference_function(model)(x)), to_numpy(model(x)), atol=1e-6)


class CastToInputDtype(keras.layers.Layer):
    """x @ w with w cast to x's dtype: one variable that calls of two dtypes read in two half dtypes."""

    def build(self, shape):
        self.w = self.add_weight(shape=(shape[-1], 4), initializer="random_normal")

    def call(self, x, training=None):
        return keras.ops.matmul(x, keras.ops.cast(self.w, x.dtype))


@pytest.mark.skipif(BACKEND != "jax", reason="jax passes the variables as arguments, cast where only cast copies are read")
def test_a_kept_cast_is_made_again_for_another_half_dtype(rng):
    """The same unchanged variable read as bfloat16, then as float16: the float16 call gets float16(w),
    not float16 of the kept bfloat16(w)."""
    import jax

    layer = CastToInputDtype()
    layer.build((None, 3))
    layer.set_weights([1.2345 * rng.standard_normal((3, 4)).astype("float32")])
    run = inference_function(layer)
    for dtype in ("bfloat16", "float16", "bfloat16"):
        x = jax.numpy.eye(3, dtype=dtype)
        want = compiled_reference(layer, x)
        np.testing.assert_array_equal(to_numpy(run(x)), want)

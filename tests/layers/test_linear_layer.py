"""`attnkit.Linear` is a `keras.layers.Dense`: the same outputs with the same weights for every
activation, with LoRA and int8 quantization, and the same saving; only its arithmetic differs."""

import warnings

import keras
import numpy as np
import pytest

import attnkit
from attnkit import Linear
from backend_utils import to_numpy
from encoder_checks import config_round_trip, keras_file_round_trip, mixed_bfloat16_close

B, T, D_IN, D_OUT = 3, 5, 6, 11


def pair(rng, **kwargs):
    """A Linear and a Dense with the same random weights (biases nonzero)."""
    ours, theirs = Linear(D_OUT, **kwargs), keras.layers.Dense(D_OUT, **kwargs)
    for layer in (ours, theirs):
        layer.build((None, None, D_IN))
    weights = [rng.standard_normal(w.shape).astype("float32") for w in theirs.get_weights()]
    ours.set_weights(weights)
    theirs.set_weights(weights)
    return ours, theirs


@pytest.mark.parametrize("activation", [None, "relu", "gelu", "tanh", "softplus"])
@pytest.mark.parametrize("use_bias", [True, False])
def test_equals_dense(rng, activation, use_bias):
    ours, theirs = pair(rng, activation=activation, use_bias=use_bias)
    x = rng.standard_normal((B, T, D_IN)).astype("float32") * 2
    np.testing.assert_allclose(to_numpy(ours(x)), to_numpy(theirs(x)), atol=1e-5)


def test_relu_output_is_exact(rng):
    ours, _ = pair(rng, activation="relu")
    x = rng.standard_normal((B, T, D_IN)).astype("float32")
    kernel, bias = (w.astype(np.float64) for w in ours.get_weights())
    np.testing.assert_allclose(to_numpy(ours(x)), np.maximum(x @ kernel + bias, 0), atol=1e-5)


def test_lora_equals_dense_lora(rng):
    ours, theirs = pair(rng)
    for layer in (ours, theirs):
        layer.enable_lora(2)
    lora = [rng.standard_normal(w.shape).astype("float32") for w in (theirs.lora_kernel_a, theirs.lora_kernel_b)]
    for layer in (ours, theirs):
        layer.lora_kernel_a.assign(lora[0])
        layer.lora_kernel_b.assign(lora[1])
    x = rng.standard_normal((B, T, D_IN)).astype("float32")
    got, want = to_numpy(ours(x)), to_numpy(theirs(x))
    kernel, bias = (to_numpy(w) for w in (ours._kernel, ours.bias))
    without_lora = x @ kernel + bias
    assert np.abs(want - without_lora).max() > 1e-2  # the LoRA update changes the output
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_int8_quantization_equals_dense(rng):
    ours, theirs = pair(rng, activation="relu")
    for layer in (ours, theirs):
        layer.quantize("int8")
    x = rng.standard_normal((B, T, D_IN)).astype("float32")
    np.testing.assert_allclose(to_numpy(ours(x)), to_numpy(theirs(x)), atol=1e-6)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantizing_drops_the_float_kernel_without_a_collection_per_layer(rng, monkeypatch, mode):
    """Keras's deletion of a variable runs gc.collect() (0.1-1 s in a large process, once per
    quantized layer); a kernel in host memory is untracked and deleted without it, and is gone from
    the layer's weights (and torch's parameters) all the same."""
    import gc

    ours, theirs = pair(rng, activation="relu")
    float_kernel = ours._kernel
    collections = []
    monkeypatch.setattr(gc, "collect", lambda *a: collections.append(a) or 0)
    ours.quantize(mode)
    monkeypatch.undo()
    assert collections == []
    assert all(w is not float_kernel for w in ours.weights)
    assert len(ours.weights) == len({id(w) for w in ours.weights})
    if keras.backend.backend() == "torch":
        assert all(p is not float_kernel.value for p in ours.parameters())
    theirs.quantize(mode)
    assert sorted(w.name for w in ours.weights) == sorted(w.name for w in theirs.weights)  # Dense's variables
    x = rng.standard_normal((B, T, D_IN)).astype("float32")
    np.testing.assert_allclose(to_numpy(ours(x)), to_numpy(theirs(x)), atol=1e-6)


def test_config_and_keras_file_round_trip(rng, tmp_path):
    ours, _ = pair(rng, activation="gelu")
    x = rng.standard_normal((B, T, D_IN)).astype("float32")
    config_round_trip(ours, x)
    inputs = keras.Input((T, D_IN))
    model = keras.Model(inputs, Linear(D_OUT, activation="relu")(inputs))
    keras_file_round_trip(model, x, str(tmp_path / "linear.keras"))


def test_mixed_bfloat16(rng):
    x = rng.standard_normal((B, T, D_IN)).astype("float32")

    def make():
        layer = Linear(D_OUT, activation="relu")
        layer.build((None, None, D_IN))
        return layer

    mixed_bfloat16_close(make, (x,), atol=0.1)


def test_bfloat16_variables_follow_every_assignment(rng):
    # A bfloat16 layer's kernel may be kept in another layout between calls (torch's CPU GEMM): after
    # each assignment the outputs must be exactly those of a fresh layer holding the new weights.
    x = rng.standard_normal((B, T, D_IN)).astype("float32")

    def fresh(weights):
        layer = Linear(D_OUT, dtype="bfloat16")
        layer.build((None, None, D_IN))
        layer.set_weights(weights)
        return to_numpy(layer(x)).astype("float32")

    layer = Linear(D_OUT, dtype="bfloat16")
    layer.build((None, None, D_IN))
    layer.trainable = False  # as a loaded language model is: no autograd graph to keep
    for _ in range(3):
        weights = [rng.standard_normal(w.shape).astype("float32") for w in layer.get_weights()]
        layer.set_weights(weights)
        for _ in range(2):  # the second call reads the kept layout, if any
            np.testing.assert_array_equal(to_numpy(layer(x)).astype("float32"), fresh(weights))
    layer.kernel.assign(layer.kernel * 2)
    doubled = [np.asarray(to_numpy(w), "float32") for w in layer.get_weights()]
    np.testing.assert_array_equal(to_numpy(layer(x)).astype("float32"), fresh(doubled))


def test_a_model_of_attnkit_layers_quantizes_to_int8(rng):
    """`Model.quantize` reaches every projection; MultiHeadAttention then leaves its fused QKV matmul
    for the quantized layers' own calls."""
    inputs = keras.Input((T, 16))
    outputs = attnkit.EncoderLayer(2, 8, 8, 16, 32, 0.0)(inputs)
    model = keras.Model(inputs, outputs)
    x = rng.standard_normal((B, T, 16)).astype("float32")
    want = model.predict(x, verbose=0)
    model.quantize("int8")
    projections = [layer for layer in model._flatten_layers() if isinstance(layer, Linear)]
    assert len(projections) == 6 and all(layer.quantization_mode == "int8" for layer in projections)
    got = model.predict(x, verbose=0)
    assert 0 < np.abs(got - want).max() < 0.1  # int8 weights: close, not equal


@pytest.mark.parametrize("xla_flags", ["", "--xla_gpu_enable_triton_gemm=false"])
def test_int8_quantization_warns_where_xla_triton_gemm_runs_on_a_gpu(monkeypatch, xla_flags):
    """jaxlib 0.11.2's Triton GEMM got int8 products wrong on an H100 (docs/decisions.md, item 14):
    quantizing on a jax GPU without the flag that turns it off warns; nothing else does."""
    if keras.backend.backend() == "jax":
        import jax

        monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setenv("XLA_FLAGS", xla_flags)
    layer = Linear(4)
    layer.build((None, 8))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        layer.quantize("int8")
    warned = any("xla_gpu_enable_triton_gemm=false" in str(w.message) for w in caught)
    assert warned == (keras.backend.backend() == "jax" and not xla_flags)
    assert layer.quantization_mode == "int8"


def test_lora_keeps_a_float64_layer_in_float64_and_a_bfloat16_one_in_bfloat16(rng):
    """Keras keeps LoRA's A and B in float32 under any policy: the update and the sum are taken in the
    wider dtype (PEFT's order) and rounded to the layer's, never cut to float32 or left there."""
    x = rng.normal(size=(3, D_IN))
    cases = [("bfloat16", 3e-2)] + ([("float64", 1e-12)] if keras.backend.backend() != "jax" else [])  # jax: no x64
    for dtype, tolerance in cases:
        layer = Linear(D_OUT, dtype=dtype)
        layer.build((None, D_IN))
        layer.enable_lora(2, lora_alpha=3.0)
        layer.lora_kernel_b.assign(rng.normal(size=layer.lora_kernel_b.shape).astype("float32"))
        y = layer(keras.ops.convert_to_tensor(x, dtype))
        assert keras.backend.standardize_dtype(y.dtype) == dtype
        f64 = lambda t: keras.ops.convert_to_numpy(keras.ops.cast(t, "float64"))
        want = f64(keras.ops.cast(x, dtype)) @ f64(layer._kernel) + f64(layer.bias) + 1.5 * (
            f64(keras.ops.cast(x, dtype)) @ f64(layer.lora_kernel_a) @ f64(layer.lora_kernel_b))
        np.testing.assert_allclose(f64(y), want, rtol=tolerance, atol=tolerance)

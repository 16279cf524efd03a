"""`attnkit.ops.linear`: exact values and gradients against float64 NumPy, every activation, NumPy and
variable operands, half precision, and the error for an unknown activation.

Legend: N rows, d_in input width, d_out output width.
"""

import math

import keras
import numpy as np
import pytest
from keras import ops

from attnkit.ops import linear
from backend_utils import to_numpy, value_and_grads

N, D_IN, D_OUT = 9, 7, 13  # odd sizes, not powers of two


def erf_gelu(x):
    return 0.5 * x * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))


REFERENCE = {None: lambda y: y, "relu": lambda y: np.maximum(y, 0), "gelu": erf_gelu}


def operands(rng, batch_shape=(N,)):
    x = rng.standard_normal((*batch_shape, D_IN)).astype("float32")
    kernel = (rng.standard_normal((D_IN, D_OUT)) / np.sqrt(D_IN)).astype("float32")
    bias = rng.standard_normal(D_OUT).astype("float32")
    return x, kernel, bias


@pytest.mark.parametrize("activation", [None, "relu", "gelu"])
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("batch_shape", [(N,), (2, 5)])
def test_equals_float64_reference(rng, activation, with_bias, batch_shape):
    x, kernel, bias = operands(rng, batch_shape)
    bias = bias if with_bias else None
    got = linear(ops.convert_to_tensor(x), ops.convert_to_tensor(kernel),
                 None if bias is None else ops.convert_to_tensor(bias), activation=activation)
    y = x.astype(np.float64) @ kernel.astype(np.float64) + (0 if bias is None else bias.astype(np.float64))
    assert tuple(got.shape) == (*batch_shape, D_OUT)
    np.testing.assert_allclose(to_numpy(got), REFERENCE[activation](y), atol=1e-5)


@pytest.mark.parametrize("activation", [None, "relu", "gelu"])
def test_gradients_equal_float64_reference(rng, activation):
    """d sum(linear) / d (x, kernel, bias): checks, among others, that the in-place ReLU keeps them exact."""
    x, kernel, bias = operands(rng)
    y = x.astype(np.float64) @ kernel.astype(np.float64) + bias
    if activation is None:
        d_y = np.ones_like(y)
    elif activation == "relu":
        d_y = (y > 0).astype(np.float64)
    else:
        d_y = 0.5 * (1 + np.vectorize(math.erf)(y / math.sqrt(2))) + y * np.exp(-(y**2) / 2) / math.sqrt(2 * math.pi)
    out, (d_x, d_kernel, d_bias) = value_and_grads(lambda a, k, b: linear(a, k, b, activation=activation), x, kernel, bias)
    np.testing.assert_allclose(out, REFERENCE[activation](y), atol=1e-5)
    np.testing.assert_allclose(d_x, d_y @ kernel.T.astype(np.float64), atol=1e-5)
    np.testing.assert_allclose(d_kernel, x.T.astype(np.float64) @ d_y, atol=1e-4)
    np.testing.assert_allclose(d_bias, d_y.sum(axis=0), atol=1e-4)


def test_accepts_numpy_arrays_and_keras_variables(rng):
    x, kernel, bias = operands(rng)
    want = np.maximum(x.astype(np.float64) @ kernel + bias, 0)
    np.testing.assert_allclose(to_numpy(linear(x, kernel, bias, activation="relu")), want, atol=1e-5)
    variable = keras.Variable(kernel)
    np.testing.assert_allclose(to_numpy(linear(ops.convert_to_tensor(x), variable, bias, activation="relu")), want, atol=1e-5)


def test_leaves_its_inputs_unchanged(rng):
    x, kernel, bias = operands(rng)
    tensors = [ops.convert_to_tensor(a) for a in (x, kernel, bias)]
    linear(*tensors, activation="relu")
    for tensor, array in zip(tensors, (x, kernel, bias)):
        np.testing.assert_array_equal(to_numpy(tensor), array)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_stays_half_and_close(rng, dtype):
    x, kernel, bias = operands(rng)
    got = linear(*(ops.cast(a, dtype) for a in (x, kernel, bias)), activation="relu")
    assert keras.backend.standardize_dtype(got.dtype) == dtype
    want = np.maximum(x.astype(np.float64) @ kernel + bias, 0)
    # bfloat16 keeps 8 significant bits: each input is off by up to 2^-8 relatively, sums of 7 terms.
    np.testing.assert_allclose(to_numpy(ops.cast(got, "float32")), want, atol=0.1 if dtype == "bfloat16" else 0.02)


def test_unknown_activation_is_a_clear_error(rng):
    x, kernel, bias = operands(rng)
    with pytest.raises(ValueError, match=r"`activation` must be one of \(None, 'relu', 'gelu'\). Received: activation='tanh'"):
        linear(x, kernel, bias, activation="tanh")


def compiled(fn):
    """`fn` as each backend compiles it for inference: a `tf.function` (where tensorflow's grappler
    rewrites the graph), `jax.jit`; torch runs it eagerly."""
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        return tf.function(fn)
    if keras.backend.backend() == "jax":
        import jax

        return jax.jit(fn)
    return fn


def rounded(array, dtype):
    """`array` rounded to `dtype` and back to float64: the operands a `dtype` product really multiplies."""
    return to_numpy(ops.cast(ops.cast(array, dtype), "float32")).astype(np.float64)


@pytest.mark.parametrize("activation", [None, "relu", "gelu"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("batch_shape", [(), (N,), (2, 5), (2, 1, 3)])
def test_compiled_equals_float64_reference(rng, activation, dtype, batch_shape):
    """Compiled, the products, the bias and the activation may fuse into one kernel (tensorflow's
    remapper, XLA): the values stay those of the float64 formula on the operands as rounded to
    `dtype`, to `dtype`'s own rounding of the result."""
    x, kernel, bias = operands(rng, batch_shape)
    got = compiled(lambda a, k, b: linear(a, k, b, activation=activation))(
        *(ops.cast(a, dtype) for a in (x, kernel, bias)))
    assert tuple(got.shape) == (*batch_shape, D_OUT)
    assert keras.backend.standardize_dtype(got.dtype) == dtype
    product, b = rounded(x, dtype) @ rounded(kernel, dtype), rounded(bias, dtype)
    want = REFERENCE[activation](product + b)
    got = to_numpy(ops.cast(got, "float32"))
    if dtype == "float32":
        np.testing.assert_allclose(got, want, atol=1e-5)  # sums of 7 products
    else:
        # A unit of bfloat16's 8 significant bits per rounding: of the product, of the sum with the
        # bias and of the activation's steps where they are not fused (Keras's own order, in bfloat16),
        # once where they are (half a unit each when exact; the activation's steps round more).
        bound = 2**-8 * (np.abs(product) + np.abs(product + b) + np.abs(want)) + 1e-6
        assert np.all(np.abs(got - want) <= bound), np.max(np.abs(got - want) / bound)


def test_compiled_bfloat16_gelu_over_its_whole_range():
    """GELU of bfloat16 products from -10 to 10, through the negative tail where its values are
    tiny. torch and jax apply the erf form, 0.5 y (1 + erf(y / sqrt 2)), to the float32 sum and
    round once: within one bfloat16 rounding of the float64 value, plus 1e-6 absolute, the erf
    form's loss of relative precision in the tail (docs/decisions.md item 66). tensorflow's
    rounds to bfloat16 between its steps, and 1 + erf(y / sqrt 2) cancels to 0 below y = -2.9:
    an absolute error up to 3e-3, a unit of bfloat16 at |y| (item 63)."""
    y = np.linspace(-10, 10, 4001)  # the products, exact: bfloat16 values times an identity kernel
    x = rounded(y.reshape(-1, 1).astype("float32"), "bfloat16")  # (4001, 1)
    got = compiled(lambda a, k: linear(a, k, activation="gelu"))(
        ops.cast(x, "bfloat16"), ops.cast(np.ones((1, 1)), "bfloat16"))
    want = erf_gelu(x)
    got = to_numpy(ops.cast(got, "float32")).astype(np.float64)
    bound = 2**-8 * (np.abs(want) + (np.abs(x) if keras.backend.backend() == "tensorflow" else 0)) + 1e-6
    assert np.all(np.abs(got - want) <= bound), np.max(np.abs(got - want) / bound)
    assert np.all(got[x < -5.5] <= 0) and got[-1, 0] == 10.0  # sign kept; the top is the identity


@pytest.mark.skipif(keras.backend.backend() != "tensorflow", reason="a tf.function traced for unknown batch axes")
def test_unknown_batch_axes_keep_their_static_shape(rng):
    import tensorflow as tf

    x, kernel, bias = operands(rng, (2, 3))
    shapes = []

    @tf.function(input_signature=[tf.TensorSpec([None, None, D_IN], tf.float32)])
    def run(a):
        y = linear(a, kernel, bias, activation="gelu")
        shapes.append(y.shape.as_list())
        return y

    got = run(tf.constant(x))
    assert shapes == [[None, None, D_OUT]]
    y = x.astype(np.float64) @ kernel + bias
    np.testing.assert_allclose(to_numpy(got), erf_gelu(y), atol=1e-5)


@pytest.mark.parametrize("activation", [None, "relu"])
def test_compiled_bfloat16_rounds_once(activation):
    """x @ kernel = 1 + 2^-8 - 2^-12 and bias 2^-11: their sum, 1 + 2^-8 + 2^-12, is nearest to the
    bfloat16 1 + 2^-7. Rounding the product first gives 1 (it is below the halfway point 1 + 2^-8),
    and 1 + 2^-11 rounds to 1 again: a unit of the last place lost. Compiled, every backend adds the
    bias (and applies ReLU) to the float32 accumulator and rounds once. (GELU: torch applies it to
    the rounded sum.)"""
    x = np.ones((1, 2), "float32")
    kernel = np.array([[1.0], [2**-8 - 2**-12]], "float32")
    bias = np.array([2**-11], "float32")
    got = compiled(lambda a, k, b: linear(a, k, b, activation=activation))(
        *(ops.cast(a, "bfloat16") for a in (x, kernel, bias)))
    y = 1 + 2**-8 + 2**-12
    want = REFERENCE[activation](np.array([[y]]))
    np.testing.assert_array_equal(to_numpy(ops.cast(got, "float32")), rounded(want, "bfloat16"))


@pytest.mark.parametrize("batch_shape", [(N,), (7, 2)])
def test_mismatched_widths_are_an_error_compiled_too(rng, batch_shape):
    """x (7, 2, 6) against a (7, 13) kernel: its 84 values would reshape into 12 rows of 7, each
    mixing two examples; every backend refuses, compiled or not."""
    x = rng.standard_normal((*batch_shape, D_IN - 1)).astype("float32")
    _, kernel, bias = operands(rng)
    for fn in (linear, compiled(linear)):
        with pytest.raises(ValueError, match=r"`x`'s last axis must have the length of `kernel`'s first \(d_in\)\. "
                                             r"Received: x of shape \(.*6\), kernel of shape \(7, 13\)"):
            fn(ops.convert_to_tensor(x), ops.convert_to_tensor(kernel), ops.convert_to_tensor(bias))


@pytest.mark.parametrize("bias_dtype", ["float32", "bfloat16"])
def test_result_dtype_is_keras_promotion(rng, bias_dtype):
    """bfloat16 x and kernel with a float32 bias give float32, as keras.ops' promotion does, on every
    backend (the fused paths take one dtype only)."""
    x, kernel, bias = operands(rng, (2, 3))
    x, kernel, bias = ops.cast(x, "bfloat16"), ops.cast(kernel, "bfloat16"), ops.cast(bias, bias_dtype)
    want = keras.backend.standardize_dtype(ops.add(ops.matmul(x, kernel), bias).dtype)
    for fn in (linear, compiled(linear)):
        assert keras.backend.standardize_dtype(fn(x, kernel, bias).dtype) == want


def test_broadcast_bias_and_batched_kernel_as_keras_ops(rng):
    """Outside the (d_in, d_out) / (d_out,) contract the values are still keras.ops': a (5, d_out)
    bias broadcast over rows, a (2, d_in, d_out) kernel multiplied per batch entry."""
    x = rng.standard_normal((2, 5, D_IN)).astype("float32")
    kernel = rng.standard_normal((D_IN, D_OUT)).astype("float32")
    bias = rng.standard_normal((5, D_OUT)).astype("float32")
    batched = rng.standard_normal((2, D_IN, D_OUT)).astype("float32")
    for fn in (linear, compiled(linear)):
        got = fn(ops.convert_to_tensor(x), ops.convert_to_tensor(kernel), ops.convert_to_tensor(bias))
        np.testing.assert_allclose(to_numpy(got), x.astype(np.float64) @ kernel + bias, atol=1e-5)
        got = fn(ops.convert_to_tensor(x), ops.convert_to_tensor(batched), None)
        np.testing.assert_allclose(to_numpy(got), x.astype(np.float64) @ batched, atol=1e-5)

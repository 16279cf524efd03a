"""jax's and tensorflow's packed products in block_gemv's C kernel (`jax_block_gemv`, an XLA custom
call; `tf_block_gemv`, a tensorflow op; docs/decisions.md item 162): the products of torch's
`block_gemv` bit for bit, within float32's bound of a float64 product of `gguf.quants.dequantize`,
inside a compiled program (`jax.jit`, `tf.function`) and eagerly; the dequantized product where the
kernel declines; the dequantized product's gradient; the GEMM beyond MAX_ROWS rows."""

import numpy as np
import pytest
from backend_utils import BACKEND

if BACKEND not in ("jax", "tensorflow"):
    pytest.skip("torch runs block_gemv itself (test_block_gemv.py)", allow_module_level=True)
gguf = pytest.importorskip("gguf")

import keras  # noqa: E402
from hypothesis import given, settings, strategies as st  # noqa: E402

from packed_blocks import K, N, layout, packed  # noqa: E402

from attnkit.kernels.quantized import PACKED_TYPES, block_gemv, block_linear, dequantize  # noqa: E402
from attnkit.kernels.quantized.block_matmul import round_q8  # noqa: E402

if BACKEND == "jax":
    import jax
    import jax.numpy as jnp

    from attnkit.kernels.quantized import jax_block_gemv as custom

    def tensor(array):
        return jnp.asarray(array)

    def compiled(function):
        return jax.jit(function)

    def runs_the_kernel(function, *args):
        return "attnkit_block_gemv" in function.lower(*args).as_text()

    def gradients(loss, *args):
        """d loss / d args, compiled."""
        return jax.jit(jax.grad(loss, argnums=tuple(range(len(args)))))(*args)

else:
    import tensorflow as tf

    from attnkit.kernels.quantized import tf_block_gemv as custom

    def tensor(array):
        return tf.constant(array)

    def compiled(function):
        return tf.function(function, autograph=False)

    def runs_the_kernel(function, *args):
        graph = function.get_concrete_function(*args).graph.as_graph_def()
        nodes = [*graph.node, *(node for f in graph.library.function for node in f.node_def)]
        return any(node.op == "AttnkitBlockGemv" for node in nodes)

    def gradients(loss, *args):
        """d loss / d args, compiled."""

        def run(*args):
            with tf.GradientTape() as tape:
                tape.watch(args)
                value = loss(*args)
            return tape.gradient(value, args)

        return tf.function(run, autograph=False)(*args)


pytestmark = pytest.mark.skipif(not custom.available(), reason="no C / C++ compiler to build the kernel")


def arrays(weights):
    offset = None if weights.offset is None else tensor(weights.offset)
    return tensor(weights.values), tensor(weights.scale), offset


def jitted(weights, activations=None):
    return compiled(lambda x, v, s, o: block_linear(x, v, s, o, **layout(weights), activations=activations))


def assert_float32_product(y, x, reference):
    expected = x.astype(np.float64) @ reference.T
    bound = 1e-5 * (np.abs(x) @ np.abs(reference).T) + 1e-6  # float32 accumulation
    assert np.all(np.abs(y - expected) <= bound), np.max(np.abs(y - expected) / bound)


@pytest.mark.parametrize("type_name", PACKED_TYPES)
@pytest.mark.parametrize("rows", [1, 3, 32])
def test_the_jitted_product_is_the_custom_call_within_float32s_bound(type_name, rows):
    weights, reference = packed(type_name, seed=rows)
    x = np.random.default_rng(rows).standard_normal((rows, K)).astype(np.float32)
    product = jitted(weights)
    assert runs_the_kernel(product, tensor(x), *arrays(weights))
    y = np.asarray(product(tensor(x), *arrays(weights)))
    assert y.shape == (rows, N) and y.dtype == np.float32
    assert_float32_product(y, x, reference)


@pytest.mark.parametrize("type_name", PACKED_TYPES)
@pytest.mark.parametrize("activations", [None, "q8"])
def test_products_equal_torchs_kernel_bit_for_bit(type_name, activations):
    """One C kernel for both backends: a model decodes the same numbers on jax as on torch."""
    torch = pytest.importorskip("torch")
    from packed_blocks import tensors

    weights, _ = packed(type_name, seed=5)
    if activations == "q8" and not block_gemv.q8_takes(weights.bits, weights.group, K):
        pytest.skip(f"{type_name} has no q8 product")
    x = np.random.default_rng(6).standard_normal((2, 3, K)).astype(np.float32)  # leading axes flattened
    y = np.asarray(jitted(weights, activations)(tensor(x), *arrays(weights)))
    expected = block_gemv.block_gemv(torch.from_numpy(x.reshape(6, K)), *tensors(weights), **layout(weights), activations=activations)
    np.testing.assert_array_equal(y, expected.numpy().reshape(2, 3, N))


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1"])
def test_q8_activations_multiply_the_rounded_rows(type_name):
    weights, reference = packed(type_name, seed=9)
    x = np.random.default_rng(10).standard_normal((4, K)).astype(np.float32)
    y = np.asarray(jitted(weights, "q8")(tensor(x), *arrays(weights)))
    rounded = np.asarray(round_q8(tensor(x)))
    assert not np.array_equal(rounded, x)
    assert_float32_product(y, rounded, reference)


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0"])
def test_an_infinity_in_x_takes_the_dequantized_product_inside_the_program(type_name):
    """The kernel's factored sums would give 0 * inf = NaN where a weight's integer is 0 but its value
    is not: the compiled program's other branch multiplies the dequantized W instead."""
    weights, reference = packed(type_name, seed=11)
    x = np.random.default_rng(12).standard_normal((2, K)).astype(np.float32)
    x[0, 5] = np.inf
    y = np.asarray(jitted(weights)(tensor(x), *arrays(weights)))
    with np.errstate(invalid="ignore"):
        expected = x.astype(np.float64) @ reference.T
    np.testing.assert_array_equal(np.isnan(y), np.isnan(expected))
    np.testing.assert_array_equal(np.isinf(y), np.isinf(expected))
    assert np.isinf(y[0]).sum() > 0
    assert_float32_product(y[1:], x[1:], reference)


@pytest.mark.parametrize("type_name", ["Q4_1", "Q6_K"])
def test_the_gradient_is_the_dequantized_products(type_name):
    """LoRA over packed weights trains alike under either path: d/dx, d/dscale and d/doffset are those
    of x dequantize(W)^T, exactly."""
    weights, _ = packed(type_name, seed=13)
    values, scale, offset = arrays(weights)
    x = tensor(np.random.default_rng(14).standard_normal((3, K)).astype(np.float32))
    c = tensor(np.random.default_rng(15).standard_normal((3, N)).astype(np.float32))
    ops = keras.ops

    def kernel_loss(x, scale, offset=None):
        return ops.sum(block_linear(x, values, scale, offset, **layout(weights)) * c)

    def dequantized_loss(x, scale, offset=None):
        return ops.sum(ops.matmul(x, ops.transpose(dequantize(values, scale, offset, **layout(weights)))) * c)

    args = (x, scale) if offset is None else (x, scale, offset)
    got = gradients(kernel_loss, *args)
    expected = gradients(dequantized_loss, *args)
    for g, e in zip(got, expected):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(e))


def test_beyond_max_rows_and_for_bfloat16_x_the_product_is_the_gemm():
    weights, reference = packed("Q4_1", seed=17)
    x = np.random.default_rng(18).standard_normal((block_gemv.MAX_ROWS + 1, K)).astype(np.float32)
    product = jitted(weights)
    assert not runs_the_kernel(product, tensor(x), *arrays(weights))
    assert_float32_product(np.asarray(product(tensor(x), *arrays(weights))), x, reference)
    half = keras.ops.cast(tensor(x[:2]), "bfloat16")
    assert not runs_the_kernel(product, half, *arrays(weights))


@settings(max_examples=15, deadline=None)
@given(rows=st.integers(1, 12), type_name=st.sampled_from(PACKED_TYPES), scale=st.floats(1e-3, 1e3))
def test_rows_are_independent_of_the_batch_eagerly_as_under_jit(rows, type_name, scale):
    """Each row of y is its row of x times W^T whatever the other rows, eagerly and compiled."""
    weights, _ = packed(type_name, seed=rows)
    x = (np.random.default_rng(rows).standard_normal((rows, K)) * scale).astype(np.float32)
    together = np.asarray(block_linear(tensor(x), *arrays(weights), **layout(weights)))
    alone = np.asarray(jitted(weights)(tensor(x[-1:]), *arrays(weights)))
    np.testing.assert_array_equal(together[-1:], alone)


def test_an_eager_product_reuses_its_program():
    """Eagerly, every call of a layer runs the product: it must not be traced and compiled anew."""
    weights, reference = packed("Q4_1", seed=19)
    x = np.random.default_rng(20).standard_normal((2, K)).astype(np.float32)
    block_linear(tensor(x), *arrays(weights), **layout(weights))
    if BACKEND == "jax":
        before = custom._compiled._cache_size()
    for _ in range(3):
        y = np.asarray(block_linear(tensor(x), *arrays(weights), **layout(weights)))
        assert_float32_product(y, x, reference)
    if BACKEND == "jax":
        assert custom._compiled._cache_size() == before


@pytest.mark.skipif(BACKEND != "tensorflow", reason="tensorflow's jit_compile")
def test_a_program_xla_compiles_keeps_the_dequantized_product():
    """XLA has no kernel for the tensorflow op: under jit_compile the product is the dequantized one."""
    weights, reference = packed("Q4_1", seed=21)
    x = np.random.default_rng(22).standard_normal((3, K)).astype(np.float32)
    product = tf.function(lambda x, v, s, o: block_linear(x, v, s, o, **layout(weights)), jit_compile=True)
    assert_float32_product(product(tensor(x), *arrays(weights)).numpy(), x, reference)

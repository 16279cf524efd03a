"""bfloat16 products on every backend: the projections, the lm head's tied product and the attention
scores, against float64 NumPy. On jax they are asked of XLA as float32 products and rounded once
(docs/decisions.md item 62): the same numbers within one bfloat16 rounding, eagerly and under jit,
and the attention scores stay float32.

Legend: N rows, d_in input width, d_out output width.
"""

import keras
import numpy as np
import pytest
from keras import ops

from attnkit import kernels as _fused
from attnkit.kernels import tensor_checks
from attnkit.ops import linear, scaled_dot_product_attention
from backend_utils import BACKEND, to_numpy

HALF_ULP = 2.0**-8  # bfloat16 keeps 8 significant bits: one rounding is within 2^-8 relative


def _bf16(values):
    return ops.cast(ops.convert_to_tensor(np.asarray(values, "float32")), "bfloat16")


def _float64(x):
    return to_numpy(ops.cast(x, "float32")).astype(np.float64)


def _jitted(fn):
    """fn as the backend compiles it: jax.jit on jax, as it is elsewhere."""
    if BACKEND == "jax":
        import jax

        return jax.jit(fn)
    return fn


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("activation", [None, "relu"])
def test_bfloat16_linear_is_the_float64_product_rounded_once(rng, compiled, activation):
    x, kernel = _bf16(rng.standard_normal((40, 24))), _bf16(rng.standard_normal((24, 16)) / 4)
    bias = _bf16(rng.standard_normal(16))
    fn = lambda x, k, b: linear(x, k, b, activation=activation)  # noqa: E731
    y = (_jitted(fn) if compiled else fn)(x, kernel, bias)
    assert keras.backend.standardize_dtype(y.dtype) == "bfloat16"
    product = _float64(x) @ _float64(kernel)
    # The product rounded once, then the bias added and rounded again (Dense's order).
    expected = product + _float64(bias)
    if activation == "relu":
        expected = np.maximum(expected, 0)
    np.testing.assert_allclose(_float64(y), expected, rtol=2 * HALF_ULP, atol=2 * HALF_ULP * np.abs(product).max())


@pytest.mark.parametrize("compiled", [False, True])
def test_bfloat16_matmul_and_einsum_round_once_or_keep_float32_products(rng, compiled):
    a, b = _bf16(rng.standard_normal((3, 5, 32))), _bf16(rng.standard_normal((3, 32, 7)))
    exact = _float64(a) @ _float64(b)  # bfloat16 factors: their products are exact in float32
    rounded = (_jitted(_fused.matmul) if compiled else _fused.matmul)(a, b)
    summed = (_jitted(lambda a, b: _fused.einsum("bik,bkj->bij", a, b)) if compiled else
              (lambda a, b: _fused.einsum("bik,bkj->bij", a, b)))(a, b)
    for y in (rounded, summed):
        assert keras.backend.standardize_dtype(y.dtype) == "bfloat16"
        np.testing.assert_allclose(_float64(y), exact, rtol=HALF_ULP, atol=1e-6)
    if BACKEND == "jax":
        wide = (_jitted(lambda a, b: _fused.matmul(a, b, float32_products=True)) if compiled else
                (lambda a, b: _fused.matmul(a, b, float32_products=True)))(a, b)
        assert keras.backend.standardize_dtype(wide.dtype) == "float32"
        np.testing.assert_allclose(to_numpy(wide), exact, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("compiled", [False, True])
def test_bfloat16_attention_scores_are_float32(compiled):
    """Scores 200.5 and 200 are 1.0 apart in bfloat16: rounded, the two keys would weigh the same."""
    q = _bf16(np.ones((1, 1, 2), "float32"))
    k = _bf16([[[100.0, 100.5], [100.0, 100.0]]])
    v = _bf16([[[1.0], [0.0]]])
    fn = lambda q, k, v: scaled_dot_product_attention(q, k, v, scale=1.0)  # noqa: E731
    out, weights = (_jitted(fn) if compiled else fn)(q, k, v)
    np.testing.assert_allclose(_float64(weights)[0, 0], [1 / (1 + np.exp(-0.5)), 1 / (1 + np.exp(0.5))], rtol=HALF_ULP)
    np.testing.assert_allclose(_float64(out)[0, 0, 0], 1 / (1 + np.exp(-0.5)), rtol=2 * HALF_ULP)


@pytest.mark.skipif(BACKEND != "jax", reason="the float32 products are what jax is asked for")
def test_jax_is_asked_for_float32_products_of_bfloat16_factors(rng):
    """XLA's CPU dot is 2-3x faster asked for float32 products than for bfloat16 ones."""
    import jax

    x, kernel = _bf16(rng.standard_normal((8, 4))), _bf16(rng.standard_normal((4, 6)))
    program = str(jax.make_jaxpr(lambda x, k: linear(x, k))(x, kernel))
    assert "dot_general" in program and "preferred_element_type=float32" in program


ONE_ROW_PRODUCTS = [
    # (operation, shape of a, shape of b): one row of `a` per product (on jax padded to two, item 65).
    ("matmul", (1, 24), (24, 16)),
    ("matmul", (1, 1, 24), (24, 16)),
    ("matmul", (3, 2, 1, 24), (3, 2, 24, 9)),  # a decoding step's scores: one query per head
    ("matmul", (4, 1, 24), (24, 16)),  # four rows: not padded
    ("btc,chd->bthd", (1, 1, 24), (24, 2, 8)),
    ("bhtd,hde->bte", (1, 2, 1, 12), (2, 12, 16)),
    ("...d,vd->...v", (1, 1, 24), (40, 24)),
    ("...d,vd->...v", (1, 24), (40, 24)),
    ("...d,vd->...v", (2, 1, 24), (40, 24)),
]


def _product_and_float64(operation, a, b, compiled):
    """(`_fused.matmul(a, b)` or `_fused.einsum(operation, a, b)`, jitted when `compiled`; the same
    product of `a` and `b` in float64 NumPy)."""
    if operation == "matmul":
        fn, exact = _fused.matmul, np.matmul(_float64(a), _float64(b))
    else:
        fn, exact = (lambda a, b: _fused.einsum(operation, a, b)), np.einsum(operation, _float64(a), _float64(b))
    return (_jitted(fn) if compiled else fn)(a, b), exact


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("operation, a_shape, b_shape", ONE_ROW_PRODUCTS)
def test_bfloat16_one_row_products_are_the_float64_product_rounded_once(rng, compiled, operation, a_shape, b_shape):
    y, exact = _product_and_float64(operation, _bf16(rng.standard_normal(a_shape)),
                                    _bf16(rng.standard_normal(b_shape)), compiled)
    assert tuple(y.shape) == exact.shape
    assert keras.backend.standardize_dtype(y.dtype) == "bfloat16"
    np.testing.assert_allclose(_float64(y), exact, rtol=HALF_ULP, atol=1e-6)


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("operation, a_shape, b_shape", [
    ("matmul", (1, 1, 8), (8,)),  # a vector b: the output has no row axis to cut
    ("matmul", (1, 8), (8,)),
    ("...ij,jk->...ki", (1, 8), (8, 4)),  # an ellipsis of no axes: operand 0's first axis is not the output's
    ("...d,vd->...v", (1,), (5, 1)),
    # a shared letter broadcast from 1 (tensorflow's einsum does not broadcast)
    *(pytest.param(*case, marks=pytest.mark.skipif(BACKEND == "tensorflow", reason="tf.einsum refuses it"))
      for case in [("bij,bjk->bik", (1, 1, 8), (3, 8, 4)), ("bi,bj->bij", (1, 1), (3, 2))]),
])
def test_bfloat16_products_keep_numpy_shapes_and_values(rng, compiled, operation, a_shape, b_shape):
    """Shapes around the one-row padding (item 65) that must come out as NumPy's."""
    y, exact = _product_and_float64(operation, _bf16(rng.standard_normal(a_shape)),
                                    _bf16(rng.standard_normal(b_shape)), compiled)
    assert tuple(y.shape) == exact.shape
    np.testing.assert_allclose(_float64(y), exact, rtol=HALF_ULP, atol=1e-6)


@pytest.mark.skipif(BACKEND != "tensorflow", reason="tensorflow's own bfloat16 MatMul, where the CPU lacks oneDNN's kernels")
@pytest.mark.parametrize("compiled", [False, True])
def test_tensorflow_without_bfloat16_kernels_rounds_once(rng, monkeypatch, compiled):
    """As on an AVX2 CPU (docs/decisions.md item 69): the products run in float32 on the exact casts
    and are rounded once, for matmul, einsum and the fused linear alike, eagerly and compiled."""
    monkeypatch.setattr(tensor_checks, "cpu_has_bfloat16_kernels", lambda: False)
    a, b = _bf16(rng.standard_normal((3, 5, 32))), _bf16(rng.standard_normal((3, 32, 7)))
    assert tensor_checks.tensorflow_bfloat16_as_float32(a, b)
    exact = _float64(a) @ _float64(b)
    fns = [_fused.matmul, lambda a, b: _fused.einsum("bik,bkj->bij", a, b),
           lambda a, b: linear(a, b[0], None)]
    wants = [exact, exact, _float64(a) @ _float64(b)[0]]
    for fn, want in zip(fns, wants):
        y = (_jitted(fn) if compiled else fn)(a, b)
        assert keras.backend.standardize_dtype(y.dtype) == "bfloat16"
        np.testing.assert_allclose(_float64(y), want, rtol=HALF_ULP, atol=1e-6)

"""Mixed dtypes and zero widths are refused by attnkit itself on every attention entry, before any kernel
runs; zero lengths are exact (docs/decisions.md item 114)."""

import keras
import numpy as np
import pytest

import attnkit
from attnkit.ops import fused_attention, scaled_dot_product_attention
from attnkit.ops.grouped_attention import grouped_query_attention

RNG = np.random.default_rng(44)

OPS = {
    "explicit": lambda q, k, v: scaled_dot_product_attention(q, k, v)[0],
    "explicit causal masked": lambda q, k, v: scaled_dot_product_attention(
        q, k, v, np.ones(k.shape[-2], bool), causal=True)[0],
    "fused": lambda q, k, v: fused_attention(q, k, v),
    "fused causal": lambda q, k, v: fused_attention(q, k, v, causal=True),
    "fused masked": lambda q, k, v: fused_attention(q, k, v, np.ones(k.shape[-2], bool)),
    "grouped": lambda q, k, v: grouped_query_attention(q, k[:, :1], v[:, :1]),
    "grouped with weights": lambda q, k, v: grouped_query_attention(q, k[:, :1], v[:, :1], return_attention_weights=True)[0],
    "DotProductAttention": lambda q, k, v: attnkit.DotProductAttention(autocast=False)(q, k, v),
}


def _array(shape, dtype):
    return RNG.normal(size=shape).astype(dtype)


@pytest.mark.parametrize("entry", list(OPS))
@pytest.mark.parametrize(
    "dtypes", [("float32", "float16", "float16"), ("float64", "float32", "float32"), ("float32", "float32", "float64"),
               ("bfloat16", "float32", "bfloat16")],
)
def test_mixed_dtypes_are_refused_naming_them(entry, dtypes):
    q, k, v = (_array((2, 2, 3, 4), d) if d != "bfloat16" else keras.ops.cast(_array((2, 2, 3, 4), "float32"), d)
               for d in dtypes)
    seen = {keras.backend.standardize_dtype(keras.ops.convert_to_tensor(x).dtype) for x in (q, k, v)}
    if entry == "DotProductAttention" and len(seen) == 1:
        # jax without x64 has no float64: the layer's __call__ converts float64 arrays to float32 before
        # `call` sees them, so the inputs arrive as one dtype and are computed exactly in it.
        assert keras.backend.backend() == "jax"
        return
    with pytest.raises(TypeError, match=(
        rf"`queries`, `keys` and `values` must have the same floating-point dtype .*Received: "
        rf"queries.dtype={dtypes[0]}, keys.dtype={dtypes[1]}, values.dtype={dtypes[2]}"
    )):
        OPS[entry](q, k, v)


@pytest.mark.parametrize("entry", list(OPS))
@pytest.mark.parametrize("zero", ["queries and keys", "values"])
def test_a_zero_width_is_refused_naming_the_argument(entry, zero):
    d_k, d_v = (0, 4) if zero != "values" else (4, 0)
    q, k, v = _array((2, 2, 3, d_k), "float32"), _array((2, 2, 3, d_k), "float32"), _array((2, 2, 3, d_v), "float32")
    name = "queries" if zero != "values" else "values"
    with pytest.raises(ValueError, match=rf"`{name}` must have a positive width d_{'v' if d_v == 0 else 'k'} "
                                         rf"\(its last dimension\). Received: {name}.shape=\("):
        OPS[entry](q, k, v)


@pytest.mark.parametrize("layer", ["MultiHeadAttention", "AdditiveAttention"])
@pytest.mark.parametrize("zero", [0, 1, 2])
def test_projecting_layers_refuse_an_input_of_no_features(layer, zero):
    inputs = [_array((2, 3, 4), "float32") for _ in range(3)]
    inputs[zero] = _array((2, 3, 0), "float32")
    if layer == "MultiHeadAttention":
        names, instance = ("queries", "keys", "values"), attnkit.MultiHeadAttention(h=2, d_k=4, d_v=4, d_model=8)
    else:
        names, instance = ("query", "key", "value"), attnkit.AdditiveAttention(4)
    with pytest.raises(ValueError, match=rf"`{names[zero]}` must have at least one feature. Received: "
                                         rf"{names[zero]}.shape=\(2, 3, 0\)"):
        instance(*inputs)
    assert instance(*[_array((2, 3, 4), "float32") for _ in range(3)]) is not None  # not built for width 0


@pytest.mark.parametrize("entry", list(OPS))
def test_zero_lengths_are_exact(entry):
    q, k, v = _array((2, 2, 0, 4), "float32"), _array((2, 2, 3, 4), "float32"), _array((2, 2, 3, 5), "float32")
    out = keras.ops.convert_to_numpy(OPS[entry](q, k, v))
    assert out.shape == (2, 2, 0, 5)
    # No key at all: every query row has nothing to attend to, so it is zero (README, "The mask convention").
    q, k, v = _array((2, 2, 3, 4), "float32"), _array((2, 2, 0, 4), "float32"), _array((2, 2, 0, 5), "float32")
    out = keras.ops.convert_to_numpy(OPS[entry](q, k, v))
    assert out.shape == (2, 2, 3, 5) and np.array_equal(out, np.zeros_like(out))


def test_layers_cast_mixed_inputs_to_their_dtype_policy():
    """Keras's autocast: a layer computes in its own dtype, so mixed inputs are exact there (item 114)."""
    q, k, v = _array((2, 3, 4), "float32"), _array((2, 3, 4), "float16"), _array((2, 3, 4), "float16")
    layer = attnkit.DotProductAttention(dtype="float32")
    out = keras.ops.convert_to_numpy(layer(q, k, v))
    same = keras.ops.convert_to_numpy(layer(q, k.astype("float32"), v.astype("float32")))
    assert out.dtype == np.float32 and np.array_equal(out, same)

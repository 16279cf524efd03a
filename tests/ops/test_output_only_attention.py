"""The explicit path's output-only form (docs/decisions.md item 74): the scores as one contraction
of Q and K's last axes (`_fused.times_keys`) and masked weights zeroed by multiplying with the mask,
which `fused_attention` uses where it has no kernel. Its output must be the exact path's bit for bit,
NaN and infinities included, and the scores Q K^T's.

Legend: B batch, h heads, T_q / T_k lengths, d width.
"""

import numpy as np
import pytest
from keras import ops

from attnkit import kernels as _fused
from attnkit.ops import attention
from backend_utils import BACKEND, to_numpy


def _both(q, k, v, mask, causal=False):
    """(output-only output, exact output) of the explicit path."""
    args = (ops.convert_to_tensor(q), ops.convert_to_tensor(k), ops.convert_to_tensor(v), mask, causal, 0.5, 0.0, False, None)
    return to_numpy(attention._explicit(*args, output_only=True)[0]), to_numpy(attention._explicit(*args)[0])


def _hostile(rng, B=2, h=2, T_q=4, T_k=5, d=3):
    q, k, v = (rng.standard_normal((B, h, T, d)).astype("float32") for T in (T_q, T_k, T_k))
    q[0, 0, 1, 0] = np.nan  # a NaN query: its row is NaN
    k[0, 1, 2, :] = np.inf  # an infinite key: inf - inf in the softmax
    k[1, 0, 0, :] = -np.inf  # a key scoring -inf: the masked keys' fill is then the row's largest score
    q[1, 0, :, :] = 1.0
    v[1, 1, 4, 0] = np.nan  # a NaN value under a masked key
    keep = rng.random((B, 1, T_q, T_k)) < 0.6
    keep[0, 0, 3, :] = False  # a row with no key
    keep[1, 0, 2, :] = [True, False, False, False, False]  # its only key scores -inf
    keep[1, 0, :, 4] = False
    return q, k, v, keep


@pytest.mark.parametrize("causal", [False, True])
def test_the_output_only_form_gives_the_exact_paths_output_bit_for_bit(rng, causal):
    q, k, v, keep = _hostile(rng)
    fast, exact = _both(q, k, v, keep, causal)
    assert np.isnan(exact).any() and np.isfinite(exact).any()  # the hostile rows are there
    np.testing.assert_array_equal(fast, exact)  # NaN where NaN, the same bits elsewhere
    assert (exact[0, :, 3] == 0).all()  # the row with no key stays zeros


def test_the_output_only_form_in_bfloat16_and_without_a_mask(rng):
    q, k, v, keep = _hostile(rng)
    half = [ops.cast(ops.convert_to_tensor(a), "bfloat16") for a in (q, k, v)]
    for mask in (keep, None):
        fast, exact = _both(*half, mask)
        np.testing.assert_array_equal(np.asarray(fast, np.float32), np.asarray(exact, np.float32))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shape", [((2, 3, 5, 8), (2, 3, 7, 8)), ((2, 3, 1, 8), (2, 3, 7, 8)), ((5, 8), (7, 8)),
                                   ((1, 8), (7, 8)), ((2, 3, 5, 8), (3, 7, 8))])
def test_the_scores_product_is_q_times_k_transposed(rng, dtype, shape):
    """Batched, one query row (padded on jax), unbatched, keys broadcast over the batch."""
    q, k = (rng.standard_normal(s).astype("float32") for s in shape)
    q_t, k_t = (ops.cast(ops.convert_to_tensor(a), dtype) for a in (q, k))
    got = _fused.times_keys(q_t, k_t)
    exact = to_numpy(ops.cast(q_t, "float32")).astype(np.float64) @ np.swapaxes(to_numpy(ops.cast(k_t, "float32")), -1, -2)
    assert tuple(got.shape) == exact.shape
    rtol = 2**-8 if dtype == "bfloat16" else 1e-6  # one rounding of the float32 sum to the dtype
    np.testing.assert_allclose(to_numpy(ops.cast(got, "float32")), exact, rtol=rtol, atol=rtol * np.abs(exact).max())
    wide = _fused.times_keys(q_t, k_t, float32_products=True)
    if dtype == "bfloat16" and BACKEND == "jax":  # float32 products there; elsewhere the caller casts
        np.testing.assert_allclose(to_numpy(ops.cast(wide, "float32")), exact, rtol=1e-6, atol=1e-5)


def _gradients(fn, q, k, v, mask):
    """d sum(fn(q, k, v, mask)) / d(q, k, v), as float32 NumPy arrays, on the backend's autodiff."""
    if BACKEND == "jax":
        import jax
        import jax.numpy as jnp

        grads = jax.grad(lambda *a: jnp.sum(fn(*a, mask).astype(jnp.float32)), argnums=(0, 1, 2))(q, k, v)
    elif BACKEND == "tensorflow":
        import tensorflow as tf

        q, k, v = (tf.convert_to_tensor(a) for a in (q, k, v))
        with tf.GradientTape() as tape:
            tape.watch([q, k, v])
            total = tf.reduce_sum(tf.cast(fn(q, k, v, mask), tf.float32))
        grads = tape.gradient(total, [q, k, v])
    else:
        import torch

        q, k, v = (a.detach().clone().requires_grad_(True) for a in (q, k, v))  # on the tensors' device
        fn(q, k, v, mask).float().sum().backward()
        grads = (q.grad, k.grad, v.grad)
    return [np.asarray(to_numpy(ops.cast(g, "float32"))) for g in grads]


@pytest.mark.parametrize("dtype, big", [("float16", 6e4), ("float32", 3e38)])
def test_the_output_only_forms_gradients_are_the_exact_paths(rng, dtype, big):
    """A padded key's value, large but finite, overflows the upstream gradient at that masked weight:
    the select's gradient zeroes it, a plain multiplication would give inf * 0 = NaN."""
    q, k = (rng.standard_normal((2, 2, 3, 4)).astype(dtype) for _ in range(2))
    v = rng.standard_normal((2, 2, 3, 4)).astype("float32")
    v[..., 2, :] = big  # the padded key's value
    v = v.astype(dtype)
    mask = np.array([[True, True, False], [True, False, False]])  # (B, T_k): key 2 is padding everywhere
    q_t, k_t, v_t = (ops.convert_to_tensor(a) for a in (q, k, v))
    fast = lambda q, k, v, m: attention._explicit(q, k, v, m, False, 0.5, 0.0, False, None, output_only=True)[0]  # noqa: E731
    exact = lambda q, k, v, m: attention._explicit(q, k, v, m, False, 0.5, 0.0, False, None)[0]  # noqa: E731
    got, want = _gradients(fast, q_t, k_t, v_t, mask[:, None, None, :]), _gradients(exact, q_t, k_t, v_t, mask[:, None, None, :])
    assert all(np.isfinite(g).all() for g in want)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)

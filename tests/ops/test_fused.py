"""The fused path equals the explicit path, forward and gradients, in float32 and half precision.

Includes rows with nothing to attend to (docs/decisions.md founding decision F5: output 0, weights 0, finite gradients)
and half-precision inputs of large magnitude (decision 6: no NaN or Inf for finite inputs).
Legend: B batch, h heads, T_q/T_k lengths, d_k/d_v widths. Masks: True = may attend.
"""

import numpy as np
import pytest
from keras import ops

import reference
from attnkit.kernels import jax_attention, torch_attention
from attnkit.kernels import tiled as _tiled
from attnkit.ops import broadcast_mask, fused_attention, scaled_dot_product_attention
from backend_utils import BACKEND, to_numpy, value_and_grads

ATOL = 1e-5


def reference_grads(q, k, v, keep=None, scale=None, rounding=lambda x: x):
    """Output and d sum(output) / d (q, k, v) of the reference attention, by hand, in float64.

    `rounding` is applied after every step, to emulate a computation in a lower precision.
    """
    q, k, v = (rounding(np.asarray(x, np.float64)) for x in (q, k, v))
    scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else scale
    weights = rounding(reference.softmax_rows(rounding(q @ np.swapaxes(k, -1, -2) * scale), keep))
    out = rounding(weights @ v)
    d_weights = rounding(np.broadcast_to(v.sum(-1)[..., None, :], weights.shape))  # d sum(W V) / dW
    d_scores = rounding(weights * (d_weights - (weights * d_weights).sum(-1, keepdims=True)))
    d_q = rounding(d_scores @ k * scale)
    d_k = rounding(np.swapaxes(d_scores, -1, -2) @ q * scale)
    d_v = rounding(np.swapaxes(weights, -1, -2).sum(-1, keepdims=True) * np.ones_like(v))
    return out, [d_q, d_k, d_v]


def round_to_bfloat16(x):
    """Rounds float64 values to the nearest bfloat16 (ties to even), returned as float64."""
    bits = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.astype(np.uint32).view(np.float32).astype(np.float64)


def grads_of(function, inputs, **kwargs):
    """`value_and_grads` of `function(q, k, v, **kwargs)`."""

    def call(q, k, v):
        return function(q, k, v, **kwargs)

    if BACKEND == "jax":
        import jax

        # Compiled, as in Keras's fit and predict (float16 jax kernels fail to compile on CPU), and one
        # compilation per test instead of one per op and shape in eager mode (seconds each).
        call = jax.jit(call)
    return value_and_grads(call, *inputs)


def explicit(q, k, v, **kwargs):
    return scaled_dot_product_attention(q, k, v, **kwargs)[0]


def fused(q, k, v, **kwargs):
    return fused_attention(q, k, v, **kwargs)


def tiled(q, k, v, mask=None, causal=False, tile=(1, 3, 2)):
    """The tiled path `fused_attention` takes for long sequences on tensorflow and jax's CPU backend,
    here on every backend, one example at a time in tiles of 3 queries by 2 keys (which divide
    neither 7 nor 5)."""
    scores_shape = (*q.shape[:-1], k.shape[-2])
    keep = None if mask is None else broadcast_mask(mask, scores_shape)
    return _tiled.tiled_attention(q, k, v, keep, causal, 1.0 / np.sqrt(q.shape[-1]), tile)


def with_empty_rows(rng, t_q, t_k, shape):
    """A random keep-mask of `shape` (…, T_q, T_k) with query rows 1 and T_q - 1 fully masked."""
    keep = rng.random(shape) < 0.6
    keep[..., 0] = True
    keep[..., 1, :] = False
    keep[..., t_q - 1, :] = False
    return keep


# (lead dims, T_q, T_k, d_k, d_v, causal, masked): rank 4 with d_k == d_v reaches the jax kernel,
# the others torch's only; `masked` adds fully masked rows, causal T_q > T_k has empty rows of its
# own. Few distinct shapes, as jax compiles once per shape.
CASES = {
    "4d-square": ((2, 3), 7, 7, 8, 8, False, False),
    "4d-square-empty-rows": ((2, 3), 7, 7, 8, 8, False, True),
    "4d-causal-square": ((2, 3), 7, 7, 8, 8, True, False),
    "4d-causal-square-empty-rows": ((2, 3), 7, 7, 8, 8, True, True),
    "4d-causal-tall": ((2, 3), 7, 5, 8, 8, True, False),
    "4d-causal-wide-empty-rows": ((2, 3), 5, 7, 8, 8, True, True),
    "3d-dk!=dv-empty-rows": ((2,), 7, 5, 4, 6, False, True),
    "5d-dk!=dv-causal-tall-empty-rows": ((2, 2, 3), 7, 5, 4, 6, True, True),
}


def _inputs(rng, lead, t_q, t_k, d_k, d_v):
    return (
        rng.normal(size=(*lead, t_q, d_k)).astype("float32"),
        rng.normal(size=(*lead, t_k, d_k)).astype("float32"),
        rng.normal(size=(*lead, t_k, d_v)).astype("float32"),
    )


@pytest.mark.parametrize("case", list(CASES))
def test_fused_equals_explicit_forward_and_gradients_float32(rng, case):
    lead, t_q, t_k, d_k, d_v, causal, masked = CASES[case]
    q, k, v = _inputs(rng, lead, t_q, t_k, d_k, d_v)
    mask = with_empty_rows(rng, t_q, t_k, (lead[0], t_q, t_k)) if masked else None  # (B, T_q, T_k)
    keep = np.ones((t_q, t_k), bool) if mask is None else mask.reshape(lead[0], *[1] * (len(lead) - 1), t_q, t_k)
    if causal:
        keep = keep & reference.causal_keep(t_q, t_k)
    ref_out, ref_grads = reference_grads(q, k, v, keep)
    outs = {}
    for name, function in [("explicit", explicit), ("fused", fused), ("tiled", tiled)]:
        out, grads = grads_of(function, (q, k, v), mask=mask, causal=causal)
        np.testing.assert_allclose(out, ref_out, rtol=0, atol=ATOL, err_msg=name)
        for grad, ref_grad in zip(grads, ref_grads):
            np.testing.assert_allclose(grad, ref_grad, rtol=0, atol=ATOL, err_msg=name)
        outs[name] = out, grads
    for name in ("fused", "tiled"):
        np.testing.assert_allclose(outs[name][0], outs["explicit"][0], rtol=0, atol=ATOL, err_msg=name)
        for grad, explicit_grad in zip(outs[name][1], outs["explicit"][1]):
            np.testing.assert_allclose(grad, explicit_grad, rtol=0, atol=ATOL, err_msg=name)
    empty = ~np.broadcast_to(keep, (*lead, t_q, t_k)).any(-1)  # (*lead, T_q)
    assert empty.any() == (masked or (causal and t_q > t_k))
    for out, (d_q, d_k, d_v) in outs.values():
        # Rows with nothing to attend to: exactly zero output and no gradient into their query.
        assert (out[empty] == 0).all() and (d_q[empty] == 0).all()
        assert all(np.isfinite(g).all() for g in (d_q, d_k, d_v))


@pytest.mark.skipif(BACKEND == "tensorflow", reason="tensorflow has no attention kernel")
@pytest.mark.parametrize("case", ["4d-square-empty-rows", "4d-causal-square", "4d-causal-wide-empty-rows"])
def test_accelerator_kernel_equals_the_reference(rng, case):
    """The kernels attnkit calls on accelerators only, called here directly on the CPU, with attnkit's
    empty-row handling around them: jax.nn.dot_product_attention (on CPU the explicit path is
    faster), and torch's SDPA with a keep-mask off the CPU (whose empty rows need repairing)."""
    lead, t_q, t_k, d_k, d_v, causal, masked = CASES[case]
    q, k, v = _inputs(rng, lead, t_q, t_k, d_k, d_v)
    keep = with_empty_rows(rng, t_q, t_k, (lead[0], 1, t_q, t_k)) if masked else np.ones((1, 1, t_q, t_k), bool)
    full_keep = keep & reference.causal_keep(t_q, t_k) if causal else keep
    ref_out, ref_grads = reference_grads(q, k, v, full_keep)
    scale = 1.0 / np.sqrt(d_k)

    def kernel(q, k, v):
        if BACKEND == "torch":
            return torch_attention._accelerator_attention(q, k, v, ops.convert_to_tensor(full_keep), scale)
        square_causal = causal and t_q == t_k and not masked  # the kernel's own flag, as fused_attention passes it
        kernel_keep = None if square_causal else full_keep
        return jax_attention.attention(q, k, v, None if kernel_keep is None else ops.convert_to_tensor(kernel_keep),
                           square_causal, scale)

    out, grads = grads_of(kernel, (q, k, v))
    np.testing.assert_allclose(out, ref_out, rtol=0, atol=ATOL)
    for grad, ref_grad in zip(grads, ref_grads):
        np.testing.assert_allclose(grad, ref_grad, rtol=0, atol=ATOL)
    empty = ~np.broadcast_to(full_keep, (*lead, t_q, t_k)).any(-1)  # (*lead, T_q)
    assert empty.any() == masked and (out[empty] == 0).all()


def test_empty_rows_have_zero_weights(rng):
    q, k, v = _inputs(rng, (2, 3), 7, 5, 8, 8)
    mask = with_empty_rows(rng, 7, 5, (2, 7, 5))
    _, weights = scaled_dot_product_attention(q, k, v, mask=mask)
    weights = to_numpy(weights)
    assert (weights[:, :, [1, 6]] == 0).all()
    np.testing.assert_allclose(weights[:, :, [0, 2, 3, 4, 5]].sum(-1), 1.0, rtol=0, atol=ATOL)


@pytest.mark.parametrize("case", ["4d-causal-tall", "3d-dk!=dv-empty-rows"])
def test_fused_equals_explicit_bfloat16(rng, case):
    lead, t_q, t_k, d_k, d_v, causal, _ = CASES[case]
    q, k, v = (round_to_bfloat16(x).astype("float32") for x in _inputs(rng, lead, t_q, t_k, d_k, d_v))
    mask = with_empty_rows(rng, t_q, t_k, (lead[0], 1, t_q, t_k)[-len(lead) - 2 :])
    keep = mask & reference.causal_keep(t_q, t_k) if causal else mask
    # The tolerance is the gap between the float64 reference and the same formula rounded to
    # bfloat16 after every step, with a fudge factor for a different order of operations.
    ref_out, ref_grads = reference_grads(q, k, v, keep)
    low_out, low_grads = reference_grads(q, k, v, keep, rounding=round_to_bfloat16)
    out_tol = 3 * np.abs(low_out - ref_out).max()
    grad_tols = [3 * np.abs(low - ref).max() for low, ref in zip(low_grads, ref_grads)]
    assert 1e-3 < out_tol < 0.1 and all(1e-3 < tol < 0.2 for tol in grad_tols)  # bfloat16, not float32
    inputs = [ops.cast(x, "bfloat16") for x in (q, k, v)]
    results = {}
    for name, function in [("explicit", explicit), ("fused", fused), ("tiled", tiled)]:
        out, grads = grads_of(function, inputs, mask=mask, causal=causal)
        out, grads = out.astype(np.float64), [g.astype(np.float64) for g in grads]
        np.testing.assert_allclose(out, ref_out, rtol=0, atol=out_tol, err_msg=name)
        for grad, ref_grad, tol in zip(grads, ref_grads, grad_tols):
            np.testing.assert_allclose(grad, ref_grad, rtol=0, atol=tol, err_msg=name)
        results[name] = out, grads
    for name in ("fused", "tiled"):
        np.testing.assert_allclose(results[name][0], results["explicit"][0], rtol=0, atol=out_tol, err_msg=name)
        for grad, explicit_grad, tol in zip(results[name][1], results["explicit"][1], grad_tols):
            np.testing.assert_allclose(grad, explicit_grad, rtol=0, atol=tol, err_msg=name)
    empty = ~np.broadcast_to(keep, (*lead, t_q, t_k)).any(-1)
    for out, _ in results.values():
        assert (out[empty] == 0).all()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("function", ["explicit", "fused", "tiled"])
def test_half_precision_stays_finite_with_large_inputs_and_empty_rows(function, dtype):
    # Scores of 100 * 100 * 64 / 8 = 80000 overflow float16 (max 65504) unless computed in float32.
    d_k = 64
    q = np.full((2, 2, 5, d_k), 100.0, "float32")
    q[0, 0, 1] = -100.0
    v = np.arange(2 * 2 * 5 * d_k, dtype="float32").reshape(2, 2, 5, d_k) % 7 - 3.0
    mask = np.ones((2, 5, 5), bool)
    mask[:, 2, :] = False  # (B, T_q, T_k): query 2 sees nothing
    mask[1, :, 3:] = False
    function = {"explicit": explicit, "fused": fused, "tiled": tiled}[function]
    inputs = [ops.cast(x, dtype) for x in (q, q, v)]
    out, grads = grads_of(function, inputs, mask=mask)
    out = out.astype(np.float64)
    assert np.isfinite(out).all() and all(np.isfinite(g.astype(np.float64)).all() for g in grads)
    assert (out[:, :, 2] == 0).all()
    # Scores are +-80000: each query splits its weight evenly over the keys of the largest score.
    expected = np.zeros((2, 2, 5, d_k))
    expected[0, 1] = v[0, 1].mean(0)
    expected[1] = v[1, :, :3].mean(1, keepdims=True)
    expected[0, 0] = v[0, 0, [0, 2, 3, 4]].mean(0)
    expected[0, 0, 1] = v[0, 0, 1]  # the one query of -100 matches only the key of -100
    expected[:, :, 2] = 0
    np.testing.assert_allclose(out, expected, rtol=0, atol=0.05)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_weights_are_finite_and_sum_to_one(rng, dtype):
    q, k, v = (x * 30 for x in _inputs(rng, (2, 3), 7, 7, 8, 8))
    mask = with_empty_rows(rng, 7, 7, (2, 7, 7))
    out, weights = scaled_dot_product_attention(*(ops.cast(x, dtype) for x in (q, k, v)), mask=mask, causal=True)
    out, weights = to_numpy(ops.cast(out, "float32")), to_numpy(ops.cast(weights, "float32"))
    assert np.isfinite(out).all() and np.isfinite(weights).all()
    sums = weights.sum(-1)  # (B, h, T_q)
    empty = ~(mask[:, None] & reference.causal_keep(7, 7)).any(-1)
    assert (sums[np.broadcast_to(empty, sums.shape)] == 0).all()
    np.testing.assert_allclose(sums[~np.broadcast_to(empty, sums.shape)], 1.0, atol=0.02)


def test_finite_values_whose_sum_overflows_give_the_reference(rng):
    """torch's finiteness check sums each input in float32 (docs/decisions.md item 21): values near
    float32's largest make that sum infinite although every value is finite, and the explicit path
    then runs; it must give the same numbers as the reference."""
    q, k = rng.standard_normal((1, 2, 4, 8)), rng.standard_normal((1, 2, 6, 8))
    v = np.full((1, 2, 6, 8), 3e37) * np.sign(rng.standard_normal((1, 2, 6, 8)))
    v[..., 0, :] = 3e37  # the sum over v overflows float32 (3e38 is its largest)
    assert np.isinf(np.float32(v).sum(dtype=np.float32))
    out = to_numpy(fused_attention(*(x.astype("float32") for x in (q, k, v))))
    expected = reference.attention(q, k, v)[0]
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-4 * 3e37)

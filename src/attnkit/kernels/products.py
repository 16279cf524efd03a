"""Matrix products per backend: float64 kept on torch, bfloat16 with float32 products on jax and
where tensorflow has no bfloat16 kernels, the scores' product, the mask product (items 62, 65, 69, 74)."""

import functools
import math

import keras
from keras import ops

from attnkit.kernels import tensor_checks


def matmul(a, b, float32_products=False):
    """a @ b by keras.ops.matmul, except for float64 torch tensors: Keras multiplies those in float32
    (its type promotion), which would cost float64 inputs their precision; and for bfloat16 jax
    arrays, whose product XLA computes 2-3x faster when asked for float32 (`tensor_checks.jax_bfloat16`).

    Args:
        a: (..., m, k). b: (..., k, n).
        float32_products: for bfloat16 jax arrays, return the float32 product instead of rounding it
            to bfloat16 (the attention scores). Elsewhere ignored: the caller casts.
    """
    a, b = tensor_checks.value_of(a), tensor_checks.value_of(b)
    if tensor_checks.is_torch_tensor(a) and tensor_checks.is_torch_tensor(b):
        import torch

        if a.dtype == b.dtype == torch.float64:
            return torch.matmul(a, b)
    if tensor_checks.jax_bfloat16(a, b):
        import jax.numpy as jnp

        one_row = a.ndim >= 2 and b.ndim >= 2 and a.shape[-2] == 1 and (b.ndim >= 3 or math.prod(a.shape[:-1]) == 1)
        if one_row:  # (..., 1, k) -> (..., 2, k): see `tensor_checks.jax_bfloat16`
            a = jnp.concatenate([a, jnp.zeros_like(a)], axis=-2)
        y = jnp.matmul(a, b, preferred_element_type=jnp.float32)  # (..., m, n)
        if one_row:
            y = y[..., :1, :]
        return y if float32_products else y.astype(jnp.bfloat16)
    if tensor_checks.tensorflow_bfloat16_as_float32(a, b):
        return ops.cast(ops.matmul(ops.cast(a, "float32"), ops.cast(b, "float32")), "bfloat16")
    return ops.matmul(a, b)


def times_keys(queries, keys, float32_products=False):
    """queries keys^T, (..., T_q, T_k), for queries (..., T_q, d) and keys (..., T_k, d): the attention
    scores' product, `matmul(queries, swapaxes(keys))` but on jax one dot contracting both last axes.

    Given K^T, XLA's CPU fusion moved the transpose into the dot, which then ran as a loop instead of
    its GEMM: MiniLM's (64, 12, 80, 32) bfloat16 attention took 24 ms a layer, against 6 ms
    (docs/decisions.md item 74). bfloat16 jax arrays are multiplied as `matmul` multiplies them
    (float32 products, one row padded); `float32_products` as there.
    """
    queries, keys = tensor_checks.value_of(queries), tensor_checks.value_of(keys)
    if keras.backend.backend() != "jax" or queries.ndim < 2 or keys.ndim < 2:
        return matmul(queries, ops.swapaxes(keys, -1, -2), float32_products)
    import jax.numpy as jnp

    half = tensor_checks.jax_bfloat16(queries, keys)
    one_row = half and queries.shape[-2] == 1
    if one_row:  # (..., 1, d) -> (..., 2, d): see `tensor_checks.jax_bfloat16`
        queries = jnp.concatenate([queries, jnp.zeros_like(queries)], axis=-2)
    y = jnp.einsum("...qd,...kd->...qk", queries, keys, preferred_element_type=jnp.float32 if half else None)
    if one_row:
        y = y[..., :1, :]
    return y.astype(jnp.bfloat16) if half and not float32_products else y


def times_mask(weights, keep):
    """`where(keep, weights, 0)`, for attention weights that only the product with the values reads.

    On jax and tensorflow the forward is `weights * keep`, which XLA's CPU fusion ran 2-4x faster
    than the select (docs/decisions.md item 74), with the select's gradient, `where(keep, g, 0)`:
    multiplied, an overflowed upstream gradient at a masked key (a large value under padding) gave
    inf * 0 = NaN where the select gives 0. On torch: the select.

    Args:
        weights: (..., T_q, T_k) floating. keep: boolean, broadcastable to `weights`.
    """
    backend = keras.backend.backend()
    if backend == "jax":
        return _jax_times_mask()(weights, keep)
    if backend == "tensorflow":
        return _tensorflow_times_mask(tensor_checks.value_of(weights), tensor_checks.value_of(keep))
    return ops.where(keep, weights, ops.zeros((), weights.dtype))


@functools.cache
def _jax_times_mask():
    import jax
    import jax.numpy as jnp

    @jax.custom_vjp
    def times_mask(weights, keep):
        return weights * keep.astype(weights.dtype)

    def forward(weights, keep):
        return times_mask(weights, keep), keep

    def backward(keep, upstream):
        return jnp.where(keep, upstream, jnp.zeros((), upstream.dtype)), None  # the mask: no gradient

    times_mask.defvjp(forward, backward)
    return times_mask


def _tensorflow_times_mask(weights, keep):
    import tensorflow as tf

    @tf.custom_gradient
    def times_mask(weights):
        def backward(upstream):
            return tf.where(keep, upstream, tf.zeros((), upstream.dtype))

        return weights * tf.cast(keep, weights.dtype), backward

    return times_mask(weights)


def einsum(subscripts, *operands):
    """keras.ops.einsum, with bfloat16 jax arrays multiplied as `matmul` multiplies them."""
    operands = tuple(tensor_checks.value_of(x) for x in operands)
    if tensor_checks.jax_bfloat16(*operands):
        import jax.numpy as jnp

        one_row = _einsum_one_row(subscripts, operands)
        if one_row:  # operand 0's leading axis 1 -> 2: see `tensor_checks.jax_bfloat16`
            operands = (jnp.concatenate([operands[0], jnp.zeros_like(operands[0])], axis=0), *operands[1:])
        y = jnp.einsum(subscripts, *operands, preferred_element_type=jnp.float32)
        return (y[:1] if one_row else y).astype(jnp.bfloat16)
    if tensor_checks.tensorflow_bfloat16_as_float32(*operands):
        return ops.cast(ops.einsum(subscripts, *(ops.cast(x, "float32") for x in operands)), "bfloat16")
    return ops.einsum(subscripts, *operands)


def _einsum_one_row(subscripts, operands):
    """Whether a two-operand einsum multiplies one row of its first operand: the axes of operand 0
    absent from operand 1 (its rows, as a GEMM sees them) hold one element, and operand 0's first
    axis (its letter or an ellipsis) is the output's first, so padding that axis pads the output's.
    `subscripts` as attnkit writes them: "btc,chd->bthd", "...d,vd->...v"; operand 1 without an ellipsis."""
    inputs, _, output = subscripts.replace(" ", "").partition("->")
    parts = inputs.split(",")
    if len(parts) != 2 or "..." in parts[1] or not output:
        return False
    first, second = parts
    a = operands[0]
    if "..." in first:
        covered = a.ndim - (len(first) - 3)  # axes the ellipsis stands for
        if not (first.startswith("...") and output.startswith("...") and covered >= 1):
            return False
        first = "#" * covered + first[3:]  # one stand-in letter per ellipsis axis
    elif output[0] != first[0] or first[0] in second:  # a letter shared with operand 1 may broadcast
        return False
    if len(first) != a.ndim or a.ndim == 0 or a.shape[0] != 1:
        return False
    return math.prod(n for letter, n in zip(first, a.shape) if letter not in second) == 1

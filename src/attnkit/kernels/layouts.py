"""Projection layouts: heads split and merged, projections into and out of the heads, joined and split
kernels (docs/decisions.md item 13).

Legend: B batch, T length, h heads, d per-head width."""

import keras
from keras import ops
from keras.src.backend.common.variables import get_autocast_scope

from attnkit.kernels import kept, products, tensor_checks


def fuses_projections():
    """Whether projections of one input run as one matmul against their kernels side by side
    ([W_q | W_k | W_v]): on torch, where it is as fast or faster. XLA (jax, tensorflow) runs the
    three dots faster than the concatenated one plus the concatenation (docs/decisions.md item 13)."""
    return keras.backend.backend() == "torch"


def projects_into_heads():
    """Whether projections go into and out of the heads with einsums against the kernels viewed as
    (d_in, h, d) and (h, d, d_model), instead of a matmul and a reshape-transpose of its result: on
    jax, where XLA then picks layouts that need fewer transposes; not on tensorflow, whose einsum
    transposes (docs/decisions.md item 13)."""
    return keras.backend.backend() == "jax"


def project_into_heads(x, kernel, bias, h, d):
    """(B, T, d_in) @ kernel (d_in, h * d) + bias (h * d,) -> (B, h, T, d)."""
    y = products.einsum("btc,chd->bthd", x, ops.reshape(kernel, (-1, h, d)))  # (B, T, h, d)
    if bias is not None:
        y = y + ops.reshape(bias, (h, d))
    return ops.transpose(y, (0, 2, 1, 3))


def project_from_heads(heads, kernel, bias):
    """Heads (B, h, T, d) side by side, @ kernel (h * d, d_model) + bias (d_model,) -> (B, T, d_model)."""
    h, d = heads.shape[1], heads.shape[3]
    y = products.einsum("bhtd,hde->bte", heads, ops.reshape(kernel, (h, d, -1)))
    return y if bias is None else y + bias


def split_heads(x, h, d):
    """(B, T, h * d) -> (B, h, T, d): the heads of a projection, as a view where the backend has views.

    On torch tensors `view` and `transpose` directly: keras.ops.reshape flattens its arguments to
    look for symbolic tensors, a cost many times that of torch.reshape, and keras.ops.shape and
    transpose add as much again (docs/performance.md, "Measurements behind the code").
    """
    if tensor_checks.is_torch_tensor(x):
        B, T = x.shape[0], x.shape[1]
        return x.reshape(B, T, h, d).transpose(1, 2)
    B, T = ops.shape(x)[0], ops.shape(x)[1]
    return ops.transpose(ops.reshape(x, (B, T, h, d)), (0, 2, 1, 3))


def merge_heads(x):
    """(B, h, T, d) -> (B, T, h * d): the heads side by side, as the output projection reads them."""
    if tensor_checks.is_torch_tensor(x):
        B, h, T, d = x.shape
        return x.transpose(1, 2).reshape(B, T, h * d)
    B, T = ops.shape(x)[0], ops.shape(x)[2]
    return ops.reshape(ops.transpose(x, (0, 2, 1, 3)), (B, T, x.shape[1] * x.shape[3]))


def concat_last(tensors, dtype):
    """The tensors or Keras variables `tensors` (..., n_i), cast to `dtype`, joined along the last axis;
    on torch, for variables, kept between calls (`kept.kept_value`)."""
    return _concat(tensors, dtype, -1)


def concat_rows(tensors):
    """The tensors or Keras variables `tensors` (n_i, ...) joined along the first axis in their own
    dtype (packed weights' rows: `MultiHeadAttention`'s int8 [W_q; W_k; W_v]); kept as `concat_last`."""
    return _concat(tensors, None, 0)


def _concat(tensors, dtype, axis):
    if keras.backend.backend() == "torch":
        import torch

        def join():
            values = [tensor_checks.value_of(t) for t in tensors]
            if not all(isinstance(v, torch.Tensor) for v in values):
                return None
            return torch.cat([v if dtype is None else v.to(getattr(torch, dtype)) for v in values], dim=axis)

        if all(isinstance(t, keras.Variable) for t in tensors):
            scope = get_autocast_scope()
            joined = kept.kept_value(tensors, ("joined", dtype, axis, scope and scope.dtype), join)
        else:
            joined = join()
        if joined is not None:
            return joined
    return ops.concatenate([t if dtype is None else ops.cast(t, dtype) for t in tensors], axis=axis)


def split_last(x, sizes):
    """`x` (..., sum(sizes)) split along its last axis into parts (..., size), in order.

    On torch `torch.split`: views, and a backward that concatenates the parts' gradients. Slicing
    would be views too, but each slice's backward fills a zero tensor as wide as `x` and the parts
    are added up; keras.ops.split dispatches slowly on torch (docs/performance.md, "Measurements
    behind the code"). Under XLA (jax, tensorflow), slices, which it fuses.
    """
    if tensor_checks.is_torch_tensor(x):
        import torch

        return list(torch.split(x, list(sizes), dim=-1))
    parts, start = [], 0
    for size in sizes:
        parts.append(x[..., start : start + size])
        start += size
    return parts

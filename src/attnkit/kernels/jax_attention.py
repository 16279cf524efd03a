"""jax's attention kernel, `jax.nn.dot_product_attention` (docs/decisions.md item 12).

Legend: B batch, h heads, T_q/T_k lengths, d_k/d_v widths."""

import keras
from keras import ops

from attnkit.kernels import tensor_checks


def takes(queries, values):
    import jax

    # jax's kernel takes exactly (B, T, h, d), one width for keys and values, and float32 or half;
    # on CPU its float16 version does not compile under jit ("precision 'F16_F16_F32' is not supported").
    dtypes = ("float32", "bfloat16") if jax.default_backend() == "cpu" else ("float32", "float16", "bfloat16")
    return (
        len(queries.shape) == 4
        and queries.shape[-1] == values.shape[-1]
        and keras.backend.standardize_dtype(queries.dtype) in dtypes
    )


def attention(queries, keys, values, keep, causal, scale):
    import jax

    if not takes(queries, values):
        return None
    has_key = None
    if keep is not None:
        keep, has_key = tensor_checks.open_empty_rows(keep)  # jax fills masked scores with a large negative number
    # jax wants (B, T, h, d); attnkit's layout is (B, h, T, d).
    out = jax.nn.dot_product_attention(
        ops.swapaxes(queries, 1, 2), ops.swapaxes(keys, 1, 2), ops.swapaxes(values, 1, 2),
        mask=keep, scale=scale, is_causal=causal,
    )
    out = ops.swapaxes(out, 1, 2)  # (B, h, T_q, d_v)
    if has_key is not None:
        out = ops.where(has_key, out, ops.zeros((), out.dtype))
    return out

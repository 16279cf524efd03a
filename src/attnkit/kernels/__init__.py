"""The backend kernels, behind one dispatch table (docs/decisions.md items 12, 13, 21 and 97).

`ops`, `layers` and `models` call only the names below. Each returns its result, or None where no
kernel of this backend takes the inputs: the caller then runs its own `keras.ops` path, which gives
the same numbers. Which kernel takes which inputs:

| name | torch | jax | tensorflow | module |
|---|---|---|---|---|
| `attention(q, k, v, keep, causal, scale, grouped=False)` | bfloat16 CPU: two batched GEMMs; else SDPA (`enable_gqa` when `grouped`); None for non-finite inputs, and off the CPU with a mask when `grouped` | `jax.nn.dot_product_attention` off the CPU, (B, h, T, d), float32 / half; not `grouped` | None (tiled or explicit path) | torch_attention, jax_attention |
| `memory_efficient()`, `has_kernel(q, v)` | True | off the CPU, for inputs `attention` takes | False | here |
| `if_finite(tensors, output, fallback)`, `all_finite(*tensors)` | `all_finite`: one sum per tensor | `if_finite`: a `lax.cond` when traced | - | tensor_checks |
| `matmul`, `einsum`, `times_keys`, `times_mask` | float64 kept float64 | bfloat16 with float32 products (one row padded) | bfloat16 as float32 products without oneDNN's bfloat16 kernels | products |
| `linear(x, kernel, bias, activation)` | `torch_linear`: oneDNN's linear (prepacked, fused bias and activation) or one GEMM | None (XLA fuses) | `tensorflow_linear`: grappler's fused matmul | linear, onednn |
| `lora_linear(x, kernel, bias, a, b, scale)` | one autograd Function: the scale and both sums inside the GEMMs | None | None | lora |
| `token_cross_entropy(targets, logits)` | one autograd Function: a log-sum-exp per row, softmax - one-hot in one pass | None | None | cross_entropy |
| `learned_rows(keep)`, `spread_rows(rows, values, n)` | the kept rows' indices (a shape known at run time), and values put back at them | None | None | cross_entropy |
| `times_transposed(x, weight)` | one `F.linear` (oneDNN where it takes it) | einsum | einsum | linear |
| `gelu_erf(y)` | GELU's erf form, any backend | | | linear |
| `layer_norm`, `tensorflow_layer_norm`, `rms_norm` | torch's functional norms, half precision in float32 row chunks | None | one XLA-compiled norm inside a `tf.function` | norms |
| `rotate(x, cos, sin)` | one fused multiply-add | None | None | rotary |
| `split_heads`, `merge_heads`, `split_last`, `concat_last`, `concat_rows`, `project_into_heads`, `project_from_heads`, `fuses_projections()`, `projects_into_heads()` | views; joined kernels kept between calls | einsum projections into the heads | `keras.ops` | layouts |
| `is_torch_tensor`, `value_of`, `jax_bfloat16` | tensor checks | | | tensor_checks |

Values kept between inference calls on torch (a mixed-precision cast, [W_q | W_k | W_v], a prepacked
kernel) are made in kept.py; the tiled attention with its own gradient is tiled.py, the scores'
dtypes numerics.py.

Legend: B batch, h heads, T_q/T_k lengths, d_k/d_v widths.
"""

import keras

from attnkit.kernels import jax_attention, torch_attention
from attnkit.kernels.layouts import (
    concat_last,
    concat_rows,
    fuses_projections,
    merge_heads,
    project_from_heads,
    project_into_heads,
    projects_into_heads,
    split_heads,
    split_last,
)
from attnkit.kernels.linear import gelu_erf, linear, tensorflow_linear, times_transposed, torch_linear
from attnkit.kernels.cross_entropy import learned_rows, spread_rows, token_cross_entropy
from attnkit.kernels.lora import lora_linear
from attnkit.kernels.norms import layer_norm, rms_norm, tensorflow_layer_norm
from attnkit.kernels.products import einsum, matmul, times_keys, times_mask
from attnkit.kernels.rotary import rotate
from attnkit.kernels.tensor_checks import all_finite, if_finite, is_torch_tensor, jax_bfloat16, value_of

__all__ = [
    "all_finite", "attention", "concat_last", "concat_rows", "einsum", "fuses_projections", "gelu_erf", "has_kernel", "if_finite",
    "is_torch_tensor", "jax_bfloat16", "layer_norm", "learned_rows", "linear", "lora_linear", "matmul", "memory_efficient", "merge_heads",
    "project_from_heads", "project_into_heads", "projects_into_heads", "rms_norm", "rotate", "split_heads", "spread_rows",
    "split_last", "tensorflow_layer_norm", "tensorflow_linear", "times_keys", "times_mask", "times_transposed", "token_cross_entropy",
    "torch_linear", "value_of",
]


def memory_efficient():
    """Whether the backend has a kernel that never materializes the (..., T_q, T_k) scores: torch's
    SDPA (flash on CPU) and jax's accelerator kernels; not jax's CPU implementation (XLA's), and
    tensorflow has none."""
    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        return jax.default_backend() != "cpu"
    return backend == "torch"


def has_kernel(queries, values):
    """Whether `attention` runs a memory-efficient kernel for these inputs, (..., T_q, d_k) and
    (..., T_k, d_v), instead of returning None."""
    if keras.backend.backend() == "jax":
        return memory_efficient() and jax_attention.takes(queries, values)
    return memory_efficient()


def attention(queries, keys, values, keep, causal, scale, grouped=False):
    """Fused softmax(scale * Q K^T, masked) V.

    Args:
        queries, keys, values: (..., T_q, d_k), (..., T_k, d_k), (..., T_k, d_v); with `grouped`
            (torch only) keys and values of h_kv heads dividing the queries' h, (..., h_kv, T_k, d).
        keep: None or a boolean keep-mask already broadcastable to (..., T_q, T_k).
        causal: True only when T_q == T_k and `keep` is None (then the kernels' top-left alignment
            agrees with attnkit's bottom-right one).
        scale: float.

    Returns:
        (..., T_q, d_v), or None when no fused kernel applies.
    """
    backend = keras.backend.backend()
    if backend == "torch":
        return torch_attention.attention(queries, keys, values, keep, causal, scale, grouped)
    if backend == "jax" and memory_efficient() and not grouped:
        # On CPU jax's kernel is XLA's own matmul-softmax-matmul, which materializes the scores like
        # the explicit path and measured slower than it (docs/performance.md, "Measurements behind the code").
        return jax_attention.attention(queries, keys, values, keep, causal, scale)
    return None

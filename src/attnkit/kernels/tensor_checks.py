"""Tensor helpers the kernels share: which backend's tensor a value is, a variable's value, bfloat16
checks per backend, finiteness, a keep-mask's empty rows, autograd and layout checks."""

import functools

import keras
from keras import ops


def is_torch_tensor(x):
    """Whether the backend is torch and `x` one of its tensors (not a NumPy array or a KerasTensor)."""
    if keras.backend.backend() != "torch":
        return False
    import torch

    return isinstance(x, torch.Tensor)


def value_of(v):
    """A Keras variable's value (cast to the compute dtype inside a mixed-precision layer's call), or
    `v` itself."""
    return v.value if isinstance(v, keras.Variable) else v


def jax_bfloat16(*operands):
    """Whether the backend is jax and the operands jax arrays (or traced ones) of bfloat16.

    XLA's CPU dot of bfloat16 factors runs at ~310 GFLOP/s when its result is bfloat16 and at
    ~900 when asked for float32 products (`preferred_element_type`; a 2048^3 product on an
    AVX512-BF16 EPYC), which a cast then rounds once to bfloat16: the same float32 accumulation
    rounded once, by a faster kernel whose order of additions may differ in the last bit
    (docs/decisions.md item 62). With one row, that dot takes a slow path: (1, 576) x (576, 49152)
    took 29 ms, against 2.7 ms for the same row padded with a row of zeros, which `products.matmul` and
    `products.einsum` add and cut off again (item 65).
    """
    if keras.backend.backend() != "jax":
        return False
    import jax
    import jax.numpy as jnp

    return all(isinstance(x, jax.Array) and x.dtype == jnp.bfloat16 for x in operands)


def tensorflow_bfloat16_as_float32(*operands):
    """Whether tensorflow multiplies these bfloat16 tensors as float32 products of their exact casts:
    on a CPU without oneDNN's bfloat16 kernels (`cpu_has_bfloat16_kernels`), where tensorflow's own
    bfloat16 MatMul rounds partial sums (errors of twice the once-rounded product's on an AVX2
    EPYC, docs/decisions.md item 69)."""
    if keras.backend.backend() != "tensorflow":
        return False
    import tensorflow as tf

    if not all(isinstance(x, (tf.Tensor, tf.Variable)) and x.dtype == tf.bfloat16 for x in operands):
        return False
    return not cpu_has_bfloat16_kernels()


@functools.cache
def cpu_has_bfloat16_kernels():
    """Whether this CPU runs oneDNN's bfloat16 kernels (AVX-512 core, AMX or AVX-NE-CONVERT), from
    /proc/cpuinfo's flags; True where they cannot be read (tensorflow's own kernels then run)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.partition(":")[2].split() for line in f if line.startswith("flags")), None)
    except OSError:
        return True
    if flags is None:
        return True
    return bool({"avx512bw", "amx_bf16", "avx_ne_convert"} & set(flags))


def all_finite(*tensors):
    """Whether the sum of all elements of these torch tensors is finite (True for shapes only traced on
    "meta").

    A NaN or an infinity anywhere makes the sum NaN or infinite, so a finite sum proves every element
    finite, in one pass over each tensor (`isfinite(t).all()` took four: 5% of a 6-layer encoder's
    time). The converse can fail: finite elements whose sum overflows float32's range (magnitudes near
    1e34) read as non-finite, and the caller then takes the explicit path, which computes the same numbers.
    """
    import torch

    if any(t.device.type == "meta" for t in tensors):
        return True
    # float32 and bfloat16 (float32's range) are summed in their own dtype, float16 (max 65504) in float32.
    sums = (t.detach().sum(dtype=torch.float32 if t.dtype == torch.float16 else None) for t in tensors)
    return bool(torch.isfinite(sum(s.float() for s in sums)))


def if_finite(tensors, output, fallback):
    """`output` when every element of the jax arrays `tensors` is finite, else `fallback()`: a
    `lax.cond` when traced (only the branch taken runs), a Python choice otherwise. Finite as in
    `all_finite`: the float32 sum of each array."""
    import jax
    import jax.numpy as jnp

    finite = jnp.isfinite(sum(jnp.sum(t, dtype=jnp.float32) for t in tensors))
    if not isinstance(finite, jax.core.Tracer):
        return output if bool(finite) else fallback()
    return jax.lax.cond(finite, lambda: output, lambda: fallback().astype(output.dtype))


def open_empty_rows(keep):
    """(keep with its empty rows opened to every key, has_key (..., T_q|1, 1)).

    Kernels that fill masked scores with a large negative number make a row with no key left uniform
    rather than empty: letting such rows see everything keeps the kernel finite, and the caller then
    zeroes their output, which also zeroes their gradients.
    """
    has_key = ops.any(keep, axis=-1, keepdims=True)
    return ops.logical_or(keep, ops.logical_not(has_key)), has_key


def plain_cpu_tensor(x):
    """Whether x is a contiguous torch.Tensor on the CPU, neither a subclass nor wrapped by a
    `torch.func` transform (vmap, grad): one whose memory a loop may write chunk by chunk."""
    import torch

    if type(x) is not torch.Tensor or x.device.type != "cpu" or not x.is_contiguous():
        return False
    return not torch._C._functorch.is_functorch_wrapped_tensor(x)


def records_graph(*tensors):
    """Whether autograd records an operation on these torch tensors (None entries ignored)."""
    import torch

    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)

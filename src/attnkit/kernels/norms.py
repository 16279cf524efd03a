"""Layer and RMS normalization kernels: torch's functional norms, half precision in float32 row chunks,
tensorflow's norm as one XLA function (docs/decisions.md items 73 and 75)."""

import functools

import keras

from attnkit.kernels import kept, tensor_checks


def layer_norm(x, gamma, beta, epsilon):
    """Layer normalization of `x` over its last axis on torch tensors, in `x`'s dtype, or None (then
    Keras's layer runs). On tensorflow: `tensorflow_layer_norm`.

    It is the `torch.nn.functional.layer_norm` call keras.ops.layer_normalization itself makes on
    torch, without its dispatch (12 calls in a 6-layer encoder). Half precision is normalized in
    float32 with float32 gamma and beta and cast back, as Keras's layer does under a mixed policy.

    Args:
        x: (..., d). gamma, beta: (d,) Keras variables or tensors, or None. epsilon: float.
    """
    if keras.backend.backend() == "tensorflow":
        return tensorflow_layer_norm(x, gamma, beta, epsilon)
    if not tensor_checks.is_torch_tensor(x):
        return None
    import torch
    import torch.nn.functional as F

    gamma, beta = tensor_checks.value_of(gamma), tensor_checks.value_of(beta)
    wide = torch.float32 if x.dtype in (torch.bfloat16, torch.float16) else x.dtype  # of gamma and beta
    if not all(p is None or (isinstance(p, torch.Tensor) and p.dtype == wide) for p in (gamma, beta)):
        return None
    if x.dtype in (torch.float32, torch.float64):  # Keras's layer computes float64 in float32 on torch
        return F.layer_norm(x, x.shape[-1:], gamma, beta, epsilon)
    if x.dtype in (torch.bfloat16, torch.float16):
        return in_float32_row_chunks(x, lambda rows: F.layer_norm(rows, x.shape[-1:], gamma, beta, epsilon), gamma, beta)
    return None


# A half-precision norm on the CPU widens this many bytes of float32 rows at a time (`in_float32_row_chunks`).
NORM_CHUNK_BYTES = 1024**2


def in_float32_row_chunks(x, norm, *parameters):
    """`norm(x.float()).to(x.dtype)` for a half-precision torch tensor x (..., d) and a row-wise `norm`
    of float32 (rows, d) tensors, the same numbers, computed NORM_CHUNK_BYTES of float32 rows at a time
    on the CPU where no autograd graph is recorded.

    Whole, the float32 copy of a (16, 128, 512) input and the norm's float32 output are 4 MiB each,
    written and read back from memory: a bfloat16 LayerNorm took 2.5 ms cold from the cache, 0.26 ms
    in chunks of 1 MiB (0.5 and 2 MiB were slower), and the bfloat16 encoder row 4.9 ms less
    (docs/decisions.md item 75). torch's mixed-dtype kernel (bfloat16 x, float32 gamma and beta), as
    fast, is not used: it computes x * rstd - mean * rstd, so a constant row of 3000 with epsilon
    1e-6 normalizes to 0.066 instead of 0, and its backward sums beta's gradient imprecisely.

    The whole input is widened at once elsewhere: under autograd (a chunked copy would record a node
    per chunk), off the CPU, inside `torch.func` transforms (their batched tensors cannot be written
    into a plain buffer), and for inputs that are not contiguous (torch's RMSNorm of a strided
    float32 input depends on its layout, so the rows' copies would change the numbers).

    Args:
        x: (..., d) bfloat16 or float16. norm: (rows, d) float32 -> (rows, d) float32, row by row.
        parameters: the norm's torch tensors or None, for the autograd check.
    """
    import torch

    d = x.shape[-1]
    step = max(1, NORM_CHUNK_BYTES // (4 * d)) if d else 0  # rows per chunk
    if not tensor_checks.plain_cpu_tensor(x) or tensor_checks.records_graph(x, *parameters) or x.numel() <= step * d:
        return norm(x.float()).to(x.dtype)
    rows = x.view(-1, d)  # (rows, d)
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    for start in range(0, rows.shape[0], step):
        out[start : start + step] = norm(rows[start : start + step].float())  # rounded as .to(x.dtype)
    return out.view(x.shape)


def tensorflow_layer_norm(x, gamma, beta, epsilon):
    """Layer normalization of a tensorflow tensor over its last axis inside a `tf.function`, as one
    XLA-compiled function, or None (eagerly, or other operands: Keras's layer then runs).

    Keras's formula on tensorflow (`keras.ops.layer_normalization`: moments, rsqrt, x * inv + res in
    float32, then cast back) is eleven graph ops, each a pass over (..., d) in float32, which grappler
    does not fuse; compiled as one XLA function it is one pass for the moments and one for the output.
    The bfloat16 encoder row's 12 norms took 10.5 ms less (148.2 -> 137.7 ms), MiniLM's bfloat16
    embeddings 33 ms less (docs/decisions.md item 73). XLA sums the moments in another order than
    tensorflow's reductions: float32 results differ from Keras's by float32 rounding, and 29 of 1M
    bfloat16 ones by one bfloat16 ulp (the float32 result rounded the other way). Keras's layer runs
    where compiling would cost more than it saves or go wrong: eagerly, in a graph traced for shapes
    not fully known (XLA would compile for every new shape as it runs: 60 ms each), and under a
    `tf.distribute` strategy (there the one cached function lost the gradients of all norms but the
    first, with no error).

    Args:
        x: (..., d) float32, bfloat16 or float16. gamma, beta: (d,) float32 variables or tensors.
        epsilon: float.
    """
    import tensorflow as tf

    if not isinstance(x, tf.Tensor) or tf.executing_eagerly() or gamma is None or beta is None:
        return None
    if not x.shape.is_fully_defined():
        return None  # a graph for every shape (`reduce_retracing`): XLA would compile each new one as it runs
    if tf.distribute.has_strategy():
        return None  # under MirroredStrategy the shared compiled function lost the norms' gradients (item 73)
    gamma, beta = kept.variable_value(gamma), kept.variable_value(beta)
    if not (x.dtype in (tf.float32, tf.bfloat16, tf.float16) and gamma.dtype == beta.dtype == tf.float32):
        return None
    # Their values, read here: the one cached function given the variables themselves kept the first
    # model's, and a later model's training raised "referencing variables which have been deleted".
    gamma, beta = tf.convert_to_tensor(gamma), tf.convert_to_tensor(beta)
    return _xla_layer_norm()(x, gamma, beta, float(epsilon))


@functools.cache
def _xla_layer_norm():
    """Keras's layer-norm formula on tensorflow as a `tf.function(jit_compile=True)`: x (..., d) in
    any floating dtype, gamma and beta (d,) float32; computed in float32, returned in x's dtype."""
    import tensorflow as tf

    def norm(x, gamma, beta, epsilon):
        wide = tf.cast(x, tf.float32)  # (..., d)
        mean, variance = tf.nn.moments(wide, axes=[-1], keepdims=True)  # (..., 1) each
        inv = tf.math.rsqrt(variance + epsilon) * gamma  # (..., d)
        return tf.cast(wide * inv + (-mean * inv + beta), x.dtype)

    return tf.function(norm, jit_compile=True)


def rms_norm(x, gamma, epsilon):
    """RMS normalization of `x` over its last axis on torch float tensors, or None (then the layer's
    `keras.ops` path runs).

    One `torch.nn.functional.rms_norm` call instead of six dispatched operations (61 norms in a
    SmolLM2 decoding step). Half precision is normalized in float32 and scaled in its own dtype, as
    the layer's `keras.ops` path does.

    Args:
        x: (..., d). gamma: (d,) Keras variable or tensor. epsilon: float.
    """
    if not tensor_checks.is_torch_tensor(x):
        return None
    import torch
    import torch.nn.functional as F

    gamma = tensor_checks.value_of(gamma)
    if not isinstance(gamma, torch.Tensor) or gamma.dtype != x.dtype:
        return None
    if x.dtype in (torch.float32, torch.float64):  # keras.ops.mean computes float64 in float32 on torch
        return F.rms_norm(x, x.shape[-1:], gamma, epsilon)
    if x.dtype in (torch.bfloat16, torch.float16):
        return gamma * in_float32_row_chunks(x, lambda rows: F.rms_norm(rows, x.shape[-1:], None, epsilon))  # (..., d)
    return None

"""`linear`: activation(x W + b), the affine map every projection of the Transformer is made of.

Legend: d_in input width, d_out output width.
"""

from keras import ops

from attnkit import kernels

ACTIVATIONS = (None, "relu", "gelu")


def linear(x, kernel, bias=None, activation=None):
    """activation(x @ kernel + bias), as `keras.layers.Dense` computes it, fused where the backend can.

    On torch this is one GEMM with the bias added inside it (`kernels.torch_linear`): oneDNN's linear
    on the CPU, with the activation fused and its own backward, else `torch.nn.functional.linear` on
    the kernel's transposed view; half-precision products on a CPU without half-precision kernels
    run in float32 on the exact casts, rounded once. On tensorflow it is a 2-D MatMul, a BiasAdd and the
    activation, which a `tf.function` runs as one oneDNN matmul (`kernels.tensorflow_linear`). On jax
    it is `keras.ops.matmul` plus the bias and the activation, which XLA fuses; bfloat16 products
    are asked of XLA in float32 and rounded once (`kernels.matmul`, 2-3x faster on the CPU).

    Args:
        x: (..., d_in).
        kernel: (d_in, d_out), Keras's layout.
        bias: optional (d_out,).
        activation: None (default), "relu", or "gelu" (the exact erf form).

    Returns:
        (..., d_out).

    Raises:
        ValueError: an unknown activation, or `x`'s last axis not of length d_in.

    Example:
    >>> linear(ops.ones((2, 3)), ops.ones((3, 4)), ops.zeros((4,)), activation="relu").shape  # (2, 4)
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"`activation` must be one of {ACTIVATIONS}. Received: activation={activation!r}")
    x_shape, kernel_shape = _static_shape(x), _static_shape(kernel)
    d_in = kernel_shape[-2 if len(kernel_shape) >= 2 else 0] if kernel_shape else None  # matmul's contracted axis
    if x_shape and d_in is not None and x_shape[-1] is not None and x_shape[-1] != d_in:
        raise ValueError(f"`x`'s last axis must have the length of `kernel`'s first (d_in). Received: x of "
                         f"shape {x_shape}, kernel of shape {kernel_shape}")
    fused = kernels.linear(x, kernel, bias, activation)
    if fused is not None:
        return fused
    # Mixed dtypes, NumPy inputs and the other backends: keras.ops' own promotion rules. bfloat16 jax
    # arrays: the bias and the activation apply to the float32 products, rounded once at the end, as
    # the fused kernels of torch and tensorflow do (docs/decisions.md item 64).
    operands = (x, kernel) if bias is None else (x, kernel, bias)
    accumulated = kernels.jax_bfloat16(*(kernels.value_of(v) for v in operands))  # else keras' promotion
    y = kernels.matmul(x, kernel, float32_products=accumulated)  # (..., d_out)
    if bias is not None:
        y = ops.add(y, ops.cast(bias, "float32") if accumulated else bias)
    if activation == "relu":
        y = ops.relu(y)
    elif activation == "gelu" and accumulated:
        # The erf form, as torch's and tensorflow's kernels compute it: XLA's erfc (jax's GELU) costs
        # as much as the product before it (docs/decisions.md item 66).
        y = kernels.gelu_erf(y)
    elif activation == "gelu":
        y = ops.gelu(y, approximate=False)
    return ops.cast(y, "bfloat16") if accumulated else y


def _static_shape(x):
    """`x`'s shape as a tuple (None for axes unknown when traced), or None where it has none (a list)
    or its rank is unknown."""
    try:
        return tuple(x.shape)
    except (AttributeError, TypeError, ValueError):
        return None

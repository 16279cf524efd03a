"""`linear`: x W + b, the affine map every projection of the Transformer is made of.

Legend: d_in input width, d_out output width.
"""

from keras import ops

from attnkit.ops import _fused


def linear(x, kernel, bias=None):
    """x @ kernel + bias, as `keras.layers.Dense` computes it, in one fused GEMM where the backend has one.

    On torch this is `torch.nn.functional.linear` on the kernel's transposed view: the bias is added
    inside the GEMM, and half-precision kernels are laid out as torch's CPU kernels need them. On jax
    and tensorflow it is `keras.ops.matmul` plus the bias, which their compilers fuse.

    Args:
        x: (..., d_in).
        kernel: (d_in, d_out), Keras's layout, the same dtype as x.
        bias: optional (d_out,).

    Returns:
        (..., d_out).

    Example:
    >>> linear(ops.ones((2, 3)), ops.ones((3, 4)), ops.zeros((4,))).shape  # (2, 4)
    """
    x, kernel = ops.convert_to_tensor(x), ops.convert_to_tensor(kernel)
    bias = None if bias is None else ops.convert_to_tensor(bias)
    if x.dtype == kernel.dtype and (bias is None or bias.dtype == kernel.dtype):
        fused = _fused.linear(x, kernel, bias)
        if fused is not None:
            return fused
    # Mixed dtypes follow keras.ops' promotion rules.
    y = ops.matmul(x, kernel)
    return y if bias is None else ops.add(y, bias)

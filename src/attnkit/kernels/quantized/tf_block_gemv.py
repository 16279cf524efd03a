"""`block_gemv` on tensorflow: the same C products as a tensorflow op, so a decoding step's
tf.function reads each packed weight once (docs/decisions.md item 162).

Without it the step dequantizes every weight to a float32 temporary before its MatMul, every step
(docs/performance.md). The op (tf_block_gemv.cc) is compiled on first use with block_gemv's C
sources into one library (the system's `cc` and `c++`, tensorflow's headers and framework library),
cached as block_gemv's is, and loaded with `tf.load_op_library`; where that fails, `available()` is
False, one warning says so, and the products take the dequantize-then-MatMul path: the same
results, slower.

As on jax (jax_block_gemv.py): the kernel's products exactly; where the kernel declines (a group of
x summing to an infinity or NaN against weights with offsets) a `tf.cond` takes
`block_matmul.dequantized_product`; the gradient is that product's. A program compiled by XLA
(`jit_compile=True`) keeps the dequantize-then-MatMul path: XLA has no kernel for the op.

Legend: M rows of x, K inputs, N outputs, G = K / group.
"""

import os
import warnings

import tensorflow as tf

from attnkit.kernels.quantized import block_gemv, block_matmul

HANDLER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tf_block_gemv.cc")
_ops = None  # the loaded op library, False after a failed build, None before the first try


def available():
    """Whether the op is loaded (built now if needed)."""
    global _ops
    if _ops is None:
        try:
            _ops = tf.load_op_library(build())
        except (OSError, RuntimeError, ValueError, tf.errors.OpError) as error:
            warnings.warn(
                f"attnkit could not build its packed-weight tensorflow op ({error}); tensorflow's quantized products "
                "dequantize, then multiply: the same results, slower at small batches. A C and a C++ compiler fix it.",
                stacklevel=3,
            )
            _ops = False
    return bool(_ops)


def product(layout, x, values, scale, offset):
    """x (M, K) float32 tensor times W^T from packed blocks -> (M, N) float32: `block_gemv.block_gemv`'s
    products (q8 activations included), in a tf.function or eagerly. Check `available()` first.

    layout: (bits, zero, group, shape, activations); offset may be None.
    """
    if x.shape[0] == 0:
        return block_matmul.dequantized_product(layout, x, values, scale, offset)
    bits, zero, group, (n, _), activations = layout
    has_offset = offset is not None
    given = offset if has_offset else tf.zeros((0,), scale.dtype)  # not read without has_offset

    def dequantized(x, scale, given):
        return block_matmul.dequantized_product(layout, x, values, scale, given if has_offset else None)

    @tf.custom_gradient
    def run(x, scale, given):
        y, declined = _ops.attnkit_block_gemv(
            x, values, scale, given, bits=bits, zero=zero, group=group, n=n, has_offset=has_offset,
            q8=activations == "q8", threads=block_gemv.threads(),
        )  # y (M, N); declined: 1 where a group of x sums to an infinity or NaN against offsets
        y = tf.cond(tf.equal(declined, 1), lambda: tf.cast(dequantized(x, scale, given), tf.float32), lambda: y)

        def gradient(g):
            with tf.GradientTape() as tape:
                tape.watch([x, scale, given])
                y = dequantized(x, scale, given)
            dx, dscale, doffset = tape.gradient(y, [x, scale, given], output_gradients=g)
            return dx, dscale, tf.zeros_like(given) if doffset is None else doffset

        return y, gradient

    return run(x, scale, given)


def build():
    """The path of the library: block_gemv's C sources and the op, compiled against tensorflow's headers
    and linked to its framework library (cached per tensorflow version).

    Raises:
        OSError: a compiler is missing or failed.
    """
    flags = ("-O2", "-fPIC", "-w", *tf.sysconfig.get_compile_flags())
    return block_gemv.build_with("tf_block_gemv", HANDLER, flags, tuple(tf.sysconfig.get_link_flags()), key=f"tensorflow {tf.__version__}")

"""`block_gemv` on jax: the same C products as an XLA custom call (jax's FFI), so a jitted decoding
step reads each packed weight once (docs/decisions.md item 162).

Without it a jitted step dequantizes every weight to a float32 temporary and hands it to XLA's CPU
dot, which takes no fused producer: 4 bytes written and read per weight on every step, more than
the float32 model reads (docs/performance.md). The handler (jax_block_gemv.cc) is compiled on first
use with block_gemv's C sources into one library (the system's `cc` and `c++`, jaxlib's FFI headers),
cached as block_gemv's is; where that fails, `available()` is False, one warning says so, and the
products take the dequantize-then-dot path: the same results, slower.

The product is the kernel's exactly, and where the kernel declines (a group of x summing to an
infinity or NaN against weights with offsets: `block_gemv.block_gemv` returns None there) a
`lax.cond` takes `block_matmul.dequantized_product` instead, as torch's caller does. Its gradient is
that product's (a custom VJP): LoRA over packed weights trains the same under either path. The whole
is one `jax.jit` per layout, so an eager call reuses its program.

Legend: M rows of x, K inputs, N outputs, G = K / group.
"""

import functools
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from attnkit.kernels.quantized import block_gemv, block_matmul

HERE = os.path.dirname(os.path.abspath(__file__))
HANDLER = os.path.join(HERE, "jax_block_gemv.cc")
TARGET = "attnkit_block_gemv"
_registered = None  # True once the target is registered, False after a failed build, None before


def available():
    """Whether the custom call is registered with jax (built now if needed)."""
    global _registered
    if _registered is None:
        try:
            _register()
            _registered = True
        except (OSError, AttributeError, RuntimeError, ValueError) as error:
            warnings.warn(
                f"attnkit could not build its packed-weight XLA kernel ({error}); jax's quantized products "
                "dequantize, then multiply: the same results, slower at small batches. A C and a C++ compiler fix it.",
                stacklevel=3,
            )
            _registered = False
    return _registered


def product(layout, x, values, scale, offset):
    """x (M, K) float32 jax array times W^T from packed blocks -> (M, N) float32: `block_gemv.block_gemv`'s
    products (q8 activations included), under `jax.jit` or eagerly. Check `available()` first.

    layout: (bits, zero, group, shape, activations), hashable; offset may be None.
    """
    if x.shape[0] == 0:
        return block_matmul.dequantized_product(layout, x, values, scale, offset)
    has_offset = offset is not None
    if not has_offset:
        offset = np.zeros((0,), np.float32)  # not read: the handler reads it only with has_offset
    return _compiled(layout, has_offset, x, values, scale, offset)


def _fallback(layout, has_offset, x, values, scale, offset):
    return block_matmul.dequantized_product(layout, x, values, scale, offset if has_offset else None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _product(layout, has_offset, x, values, scale, offset):
    return _forward(layout, has_offset, x, values, scale, offset)[0]


def _forward(layout, has_offset, x, values, scale, offset):
    bits, zero, group, (n, _), activations = layout
    call = jax.ffi.ffi_call(TARGET, (jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32), jax.ShapeDtypeStruct((), jnp.int32)))
    y, declined = call(
        x, values, scale, offset, bits=np.int32(bits), zero=np.float32(zero), group=np.int64(group), n=np.int64(n),
        has_offset=bool(has_offset), q8=activations == "q8", threads=np.int32(block_gemv.threads()),
    )  # y (M, N); declined: 1 where a group of x sums to an infinity or NaN against offsets
    dequantized = functools.partial(_fallback, layout, has_offset)
    y = jax.lax.cond(declined == 1, lambda: dequantized(x, values, scale, offset).astype(jnp.float32), lambda: y)
    return y, (x, values, scale, offset)


def _backward(layout, has_offset, residuals, g):
    """The dequantized product's gradient with respect to x, scale and offset; none for the integers."""
    x, values, scale, offset = residuals
    _, pullback = jax.vjp(lambda x, scale, offset: _fallback(layout, has_offset, x, values, scale, offset), x, scale, offset)
    dx, dscale, doffset = pullback(g)
    return dx, np.zeros(values.shape, jax.dtypes.float0), dscale, doffset


_product.defvjp(_forward, _backward)
# one program per layout and shape, cached by jax: an eager call is not traced anew each time
_compiled = jax.jit(_product, static_argnums=(0, 1))


def _register():
    import ctypes

    library = ctypes.CDLL(build())
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(library.AttnkitBlockGemv), platform="cpu")


def build():
    """The path of the library: block_gemv's C sources and the handler, compiled against jaxlib's FFI
    headers (cached per jaxlib version).

    Raises:
        OSError: a compiler is missing or failed.
    """
    import jaxlib

    flags = ("-O2", "-std=c++17", "-fPIC", "-w", "-I", jax.ffi.include_dir())
    return block_gemv.build_with("jax_block_gemv", HANDLER, flags, key=f"jaxlib {jaxlib.__version__}")

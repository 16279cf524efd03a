"""One decoder-only block of a torch decoding step in one C call (decode_step.c; docs/decisions.md
item 143), for a model whose seven projections hold packed blocks.

A SmolLM2 step on the torch path runs ~50 small torch operations a block (norms, splits, the
rotation, the cache writes, the attention, the activation, each with its dispatch, temporaries and
thread fork-join) around its seven `block_gemv` products: at batch 1 those took two thirds of the
step (docs/performance.md). `decode_layer` runs the whole block in one OpenMP region, with the same
arithmetic in float32: `decoder_block` stays the block's definition, and this kernel is checked
against it (tests/kernels/test_decode_step.py), as the fused attention kernels are checked against
the explicit path.

What it takes (`fusable` says; otherwise the torch path runs): float32 activations, RMSNorm without
offset, SiLU gate, no q/k norms, the default scale 1/sqrt(d_k), projections holding 8-bit blocks of
any group that is a multiple of 8 or 4-bit blocks of 32 (as `block_gemv`), biases or not; inputs
as they are or rounded to 8-bit blocks (`activations="q8"`, item 144, as `block_gemv_q8` takes them).

Legend: M sequences (one new token each), D d_model, H / Hkv heads, d_k per-head width, S keys.
"""

import ctypes

from attnkit.kernels.quantized import block_gemv

ROLES = ("W_q", "W_k", "W_v", "W_o", "W_gate", "W_up", "W_down")  # decode_step.c's order


class Projection(ctypes.Structure):
    """decode_step.c's `struct projection`: one projection's packed tensors and layout."""

    _fields_ = [
        ("values", ctypes.c_void_p), ("scale", ctypes.c_void_p), ("offset", ctypes.c_void_p), ("bias", ctypes.c_void_p),
        ("n", ctypes.c_int64), ("k", ctypes.c_int64), ("group", ctypes.c_int64), ("bits", ctypes.c_int32),
        ("zero", ctypes.c_float), ("q8", ctypes.c_int32), ("half", ctypes.c_int32),
    ]


def fusable_layout(layout):
    """Whether `decode_layer` multiplies a projection of this `block_format`."""
    bits, group, activations = layout["bits"], layout["group"], layout.get("activations")
    if activations == "q8":
        return block_gemv.q8_takes(bits, group, layout["shape"][1])
    return activations is None and ((bits == 8 and group % 8 == 0) or (bits == 4 and group == 32))


def available():
    """Whether the compiled kernel is loaded (built now if needed)."""
    return block_gemv.available()


def projections(tensors):
    """The seven projections as a ctypes array for `decode_layer`.

    tensors: for each of `ROLES`, (values, scale, offset or None, bias or None, layout) as contiguous
    CPU torch tensors (values uint8 / int8; scale and offset float32, or both float16; bias float32) and
    the `block_format` dict; the caller keeps the tensors alive and unchanged (in-place writes are seen)."""
    array = (Projection * len(ROLES))()
    for entry, (values, scale, offset, bias, layout) in zip(array, tensors):
        n, k = layout["shape"]
        entry.values, entry.scale = values.data_ptr(), scale.data_ptr()
        entry.offset = None if offset is None else offset.data_ptr()
        entry.bias = None if bias is None else bias.data_ptr()
        entry.n, entry.k, entry.group, entry.bits, entry.zero = n, k, layout["group"], layout["bits"], float(layout["zero"])
        entry.q8 = layout.get("activations") == "q8"
        entry.half = block_gemv._half(scale, offset)
    return array


def decode_layer(x, norms, weights, heads, cos, sin, keys, values, start, keep, epsilon, threads):
    """Runs one block on x (M, D) float32 contiguous, in place; writes the new key and value at slot
    `start` of keys, values (M, Hkv, S_max, d_k) float32 contiguous and attends to slots [0, start + 1).

    Args:
        norms: the attention and feed-forward norms' gammas, (D,) float32 contiguous each.
        weights: `projections(...)`.
        heads: (H, Hkv, d_k).
        cos, sin: (M, d_k) float32 contiguous, this step's rotation.
        keep: (M, start + 1) uint8 contiguous (1: the key is seen) or None.
        epsilon: the norms' epsilon. threads: OpenMP threads.

    Raises:
        MemoryError: the kernel's scratch memory could not be allocated (x and the cache unchanged).
    """
    h, h_kv, d_k = heads
    m, d = x.shape
    smax, attended = keys.shape[2], start + 1
    p = ctypes.c_void_p
    status = block_gemv._load().decode_layer(
        p(x.data_ptr()), ctypes.c_int64(m), ctypes.c_int64(d), p(norms[0].data_ptr()), p(norms[1].data_ptr()),
        ctypes.c_float(epsilon), weights, ctypes.c_int64(h), ctypes.c_int64(h_kv), ctypes.c_int64(d_k),
        p(cos.data_ptr()), p(sin.data_ptr()), p(keys.data_ptr()), p(values.data_ptr()), ctypes.c_int64(smax),
        ctypes.c_int64(start), ctypes.c_int64(attended), None if keep is None else p(keep.data_ptr()),
        ctypes.c_float(d_k**-0.5), ctypes.c_int(threads),
    )
    if status == -1:
        raise MemoryError(f"decode_layer could not allocate its scratch memory for {m} sequences of {attended} keys")

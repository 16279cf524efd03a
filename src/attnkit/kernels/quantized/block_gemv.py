"""x W^T for a few rows of x on a CPU, W's packed blocks dequantized in registers (docs/decisions.md
item 136): the product of a batch-1 to batch-32 decoding step, which reads each weight once.

Dequantizing W to a float32 temporary and then running a GEMM (block_matmul's path) writes and reads
4 bytes per weight on every call, more than the float32 model itself reads; torch's own weight-only
CPU kernels were measured slower than a float32 `linear` on an AVX2 CPU (block_matmul.py). This
kernel (block_gemv.c) reads the packed bytes once and multiplies in float32, activations unrounded.

The C sources (with decode_step.c, which calls these products) are compiled on first use with the system's C compiler (`cc`, -O3 -march=native
-fopenmp) into ATTNKIT_CACHE (default ~/.cache/attnkit)/kernels, keyed by the source, the compiler
and the CPU's flags, written aside and renamed into place; it is loaded with ctypes and runs on
torch's own OpenMP threads (torch.get_num_threads()). Where no compiler is found or the build fails,
`available()` is False, one warning says so, and products take block_matmul's dequantize-then-GEMM
path: the same result, slower.

Legend: M rows of x, K inputs, N outputs, G = K / group.
"""

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
# one library: block_gemv.c's products and decode_step.c's decoder block, which multiplies with them
SOURCES = tuple(os.path.join(HERE, name) for name in ("block_gemv.h", "block_gemv.c", "block_gemv_q8.c", "decode_step.c"))
MAX_ROWS = 32  # beyond this a dequantize-then-GEMM (compute-bound) is the faster product
# -ffp-contract=off: a * b + c written in C stays a product and a sum, as torch computes it
# (block_dequantize is bit for bit block_matmul.dequantize); the kernels' FMAs are intrinsics
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC")
_library = None  # the loaded library, False after a failed build, None before the first try


def available():
    """Whether the compiled kernel is loaded (built now if needed)."""
    return _load() is not None


def block_gemv(x, values, scale, offset, *, bits, zero, group, shape, activations=None, library=None):
    """x (M, K) float32 CPU torch tensor times W^T from packed blocks -> (M, N) float32, or None where a
    group of x sums to an infinity or NaN and W has offsets or a zero point: the factored sums would
    give NaN where the product is infinite (the caller then dequantizes; NaN in x gives NaN either way).

    Args: as `block_matmul.dequantize` (values uint8 (N, K / 2) for bits 4, else int8 (N, K); scale
    and offset float32 or float16 (N, G), both of one dtype, offset possibly None), as CPU torch tensors.

    activations: None (x multiplied as it is), or "q8": x rounded to 8-bit blocks of 32 first, as
    llama.cpp rounds it, and integer dot products (block_gemv_q8.c; docs/decisions.md item 144; a
    layout `q8_takes`). A row that cannot be rounded (non-finite) is multiplied unrounded.

    library: a library from `build` (tests build one with other flags); default the kernel.

    Raises:
        RuntimeError: the kernel is not available (check `available()` first).
    """
    import torch

    library = _built(library)
    n, k = shape
    expected = torch.uint8 if bits == 4 else torch.int8
    if x.dtype != torch.float32 or values.dtype != expected:
        raise TypeError(f"block_gemv multiplies float32 x by {expected} values. Received: x {x.dtype}, values {values.dtype}")
    half = _half(scale, offset)
    x = x.contiguous()
    m = x.shape[0]
    y = torch.empty((m, n), dtype=torch.float32)
    values, scale = values.contiguous(), scale.contiguous()
    offset = None if offset is None else offset.contiguous()
    status = (library.block_gemv_q8 if activations == "q8" else library.block_gemv)(
        x.data_ptr(), m, k, values.data_ptr(), scale.data_ptr(), None if offset is None else offset.data_ptr(),
        half, bits, float(zero), group, n, y.data_ptr(), torch.get_num_threads(),
    )
    if status == -1:
        raise MemoryError(f"block_gemv could not allocate {m} x {k // group} floats")
    return None if status == 1 else y


def threads():
    """The kernels' OpenMP threads where torch does not set them (jax, tensorflow): OMP_NUM_THREADS
    where it is a positive number, else the CPUs this process may run on."""
    try:
        return max(1, int(os.environ.get("OMP_NUM_THREADS", "").split(",")[0]))
    except ValueError:
        pass
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # no affinity on this platform
        return max(1, os.cpu_count() or 1)


def takes_scales(scale, offset=None):
    """Whether the kernels read these scales and offsets (torch tensors or None): float32, or float16
    both (GGUF's own, widened exactly in the kernels)."""
    import torch

    dtypes = {t.dtype for t in (scale, offset) if t is not None}
    return dtypes in ({torch.float32}, {torch.float16})


def _half(scale, offset):
    """1 where the scales (and offsets) are float16, 0 where float32; a TypeError otherwise."""
    import torch

    if not takes_scales(scale, offset):
        raise TypeError(
            "The packed kernels read float32 or float16 scales, and offsets of the same dtype. Received: scale "
            f"{scale.dtype}, offset {None if offset is None else offset.dtype}"
        )
    return int(scale.dtype == torch.float16)


def q8_takes(bits, group, k):
    """Whether `activations="q8"` multiplies weights of this layout (4-bit groups of 32; 8-bit groups
    of 16 or of a multiple of 32; K a multiple of 32)."""
    return k % 32 == 0 and ((bits == 4 and group == 32) or (bits == 8 and (group == 16 or group % 32 == 0)))


def bfloat16_gemv(x, weight, library=None):
    """x (M, K) float32 CPU tensor times W^T for W bfloat16 (N, K), contiguous -> (M, N) float32: each
    weight widened exactly, float32 products and sums (a CPU without bfloat16 products; decision 139).

    Raises:
        RuntimeError: the kernel is not available (check `available()` first).
    """
    import torch

    library = _built(library)
    x, weight = x.contiguous(), weight.contiguous()
    (m, k), n = x.shape, weight.shape[0]
    y = torch.empty((m, n), dtype=torch.float32)
    library.bfloat16_gemv(x.data_ptr(), m, k, weight.data_ptr(), n, y.data_ptr(), torch.get_num_threads())
    return y


def dequantize(values, scale, offset, *, bits, zero, group, shape, library=None):
    """W (N, K) float32 CPU torch tensor from packed CPU torch tensors, as `block_matmul.dequantize`
    computes it (bit for bit), in one pass over the blocks (a prefill's GEMM operand).

    Raises:
        RuntimeError: the kernel is not available (check `available()` first).
    """
    import torch

    library = _built(library)
    n, k = shape
    half = _half(scale, offset)
    values, scale = values.contiguous(), scale.contiguous()
    offset = None if offset is None else offset.contiguous()
    w = torch.empty((n, k), dtype=torch.float32)
    library.block_dequantize(
        values.data_ptr(), scale.data_ptr(), None if offset is None else offset.data_ptr(), half, bits, float(zero), group, n, k,
        w.data_ptr(), torch.get_num_threads(),
    )
    return w


def round_q8(x, library=None):
    """x^ (M, K) float32 CPU torch tensor: x (M, K) float32 CPU, K a multiple of 32, rounded to 8-bit
    blocks as `block_gemv_q8` rounds it (`block_matmul.round_q8` on any backend; item 144).

    Raises:
        RuntimeError: the kernel is not available. MemoryError: no memory for the rounded integers.
    """
    import torch

    library = _built(library)
    x = x.contiguous()
    out = torch.empty_like(x)
    if library.block_gemv_q8_rounded(x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr(), torch.get_num_threads()) == -1:
        raise MemoryError(f"round_q8 could not allocate {x.shape[0]} x {x.shape[1]} bytes")
    return out


def _built(library=None):
    """`library`, else the kernel; a RuntimeError where it could not be built (check `available()`)."""
    library = library or _load()
    if library is None:
        raise RuntimeError("attnkit's block_gemv kernel is not available: see the warning given when it was built")
    return library


def _load():
    global _library
    if _library is None:
        try:
            _library = build()
        except (OSError, subprocess.SubprocessError) as error:
            warnings.warn(
                f"attnkit could not build its packed-weight CPU kernel ({error}); quantized products take the "
                "dequantize-then-GEMM path: the same results, slower at small batches. A C compiler (`cc`) fixes it.",
                stacklevel=3,
            )
            _library = False
    return _library or None


def _cpu_flags():
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


def build(flags=FLAGS):
    """The kernel compiled with `flags` (cached by source, compiler, flags and CPU), loaded by ctypes.

    Raises:
        OSError: no compiler, or the compiler failed.
    """
    compiler = compiler_named("CC", "cc")
    source = _contents(SOURCES)

    def compile_into(aside):
        run_compiler([compiler, *flags, *(name for name in SOURCES if name.endswith(".c")), "-o", aside])

    path = cached_library("block_gemv", source + compiler.encode() + " ".join(flags).encode(), compile_into)
    library = ctypes.CDLL(path)
    pointer, i64 = ctypes.c_void_p, ctypes.c_int64
    library.block_gemv.argtypes = [pointer, i64, i64, pointer, pointer, pointer, ctypes.c_int, ctypes.c_int, ctypes.c_float, i64, i64, pointer, ctypes.c_int]
    library.block_gemv.restype = ctypes.c_int
    library.block_gemv_q8.argtypes, library.block_gemv_q8.restype = library.block_gemv.argtypes, ctypes.c_int
    library.bfloat16_gemv.argtypes = [pointer, i64, i64, pointer, i64, pointer, ctypes.c_int]
    library.bfloat16_gemv.restype = None
    library.decode_layer.restype = ctypes.c_int  # its arguments: decode_step.py
    library.block_dequantize.argtypes = [pointer, pointer, pointer, ctypes.c_int, ctypes.c_int, ctypes.c_float, i64, i64, i64, pointer, ctypes.c_int]
    library.block_dequantize.restype = None
    library.block_gemv_q8_rounded.argtypes = [pointer, i64, i64, pointer, ctypes.c_int]
    library.block_gemv_q8_rounded.restype = ctypes.c_int
    return library


def compiler_named(variable, default):
    """The compiler $variable names, else `default`, as a path.

    Raises:
        OSError: it is not on PATH.
    """
    compiler = shutil.which(os.environ.get(variable, default))
    if compiler is None:
        raise OSError(f"no compiler found: neither ${variable} nor `{default}` is on PATH")
    return compiler


def run_compiler(command):
    """Runs one compiler command; an OSError with the compiler's message when it fails."""
    try:
        subprocess.run(command, check=True, capture_output=True, timeout=300)
    except subprocess.CalledProcessError as error:
        raise OSError(f"{command[0]} failed: {error.stderr.decode(errors='replace').strip()[:300]}") from None
    except subprocess.TimeoutExpired:
        raise OSError(f"{command[0]} did not finish in 300 s") from None


def cached_library(name, key_material, compile_into):
    """The path of a shared library in ATTNKIT_CACHE/kernels keyed by `key_material` and the CPU's flags,
    made by `compile_into(aside)` when absent: built aside and renamed into place, so processes
    building at once each write their own file."""
    key = hashlib.sha256(key_material + _cpu_flags().encode()).hexdigest()[:16]
    folder = os.path.join(os.environ.get("ATTNKIT_CACHE", os.path.expanduser("~/.cache/attnkit")), "kernels")
    path = os.path.join(folder, f"{name}-{key}.so")
    if not os.path.exists(path):
        os.makedirs(folder, exist_ok=True)
        handle, aside = tempfile.mkstemp(suffix=".so", dir=folder)
        os.close(handle)
        try:
            compile_into(aside)
            os.replace(aside, path)
        finally:
            if os.path.exists(aside):
                os.remove(aside)
    return path


def build_with(name, handler, cxx_flags, link_flags=(), key=""):
    """The path of a library of the C sources and one C++ `handler` that calls them (a backend's
    custom op), cached as `build`'s by all sources, the compilers, their flags, `key` and the CPU.

    Raises:
        OSError: a compiler is missing or failed.
    """
    cc, cxx = compiler_named("CC", "cc"), compiler_named("CXX", "c++")
    sources = [name for name in SOURCES if name.endswith(".c")]
    material = _contents((*SOURCES, handler)) + f"{cc} {cxx} {FLAGS} {cxx_flags} {link_flags} {key}".encode()

    def compile_into(aside):
        with tempfile.TemporaryDirectory() as work:
            objects = [os.path.join(work, os.path.basename(source) + ".o") for source in (*sources, handler)]
            for source, obj in zip(sources, objects):
                run_compiler([cc, *(flag for flag in FLAGS if flag != "-shared"), "-c", source, "-o", obj])
            run_compiler([cxx, *cxx_flags, "-c", handler, "-o", objects[-1]])
            run_compiler([cxx, "-shared", "-fopenmp", *objects, "-o", aside, *link_flags])

    return cached_library(name, material, compile_into)


def _contents(paths):
    """The files' bytes, one after the other (a build's cache key)."""
    data = b""
    for path in paths:
        with open(path, "rb") as f:
            data += f.read()
    return data

"""The machine's ceiling: which CPU this is, and the fastest matmul any installed engine runs on it.

A fraction of peak is only honest against the true ceiling. torch.mm alone is not it: on a 2-core
AVX-512 EPYC, XLA's float32 GEMM ran the 6-layer encoder at a higher rate than torch.mm's own
2048^3 product, and oneDNN's linear in torch ran at 2.2x torch.mm's float32 rate. So the peak of
each dtype is the best of torch (torch.mm and oneDNN's linear), XLA (jax), tensorflow (eager and
XLA-compiled) and numpy, each timed here on the same (2048, 2048) @ (2048, 2048)^T product.

    python benchmarks/peak.py      # prints the CPU line and the per-engine table
"""

import os
import platform

from timing import markdown_table, median_seconds

N = 2048
FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8")


def cpu_description():
    """'model name; flags: ...' from /proc/cpuinfo (the flags that decide the GEMM kernels)."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    model = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
    except OSError:
        return f"{model}; flags unknown (no /proc/cpuinfo)"
    present = [f for f in FLAGS if f in flags]
    absent = [f for f in FLAGS if f not in flags]
    return f"{model}, {os.cpu_count()} CPUs; has {' '.join(present) or 'none of'}; lacks {' '.join(absent) or 'nothing'}"


def _torch(dtype, repeats):
    import torch

    a = torch.randn(N, N, dtype=getattr(torch, dtype))
    b = torch.randn(N, N, dtype=getattr(torch, dtype)).t()
    return median_seconds(lambda: torch.mm(a, b), warmup=1, repeats=repeats)


def _torch_onednn(dtype, repeats):
    """oneDNN's linear, the GEMM attnkit's torch projections run (docs/decisions.md item 60)."""
    import torch

    a = torch.randn(N, N, dtype=getattr(torch, dtype))
    b = torch.randn(N, N, dtype=getattr(torch, dtype))
    return median_seconds(lambda: torch.ops.mkldnn._linear_pointwise(a, b, None, "none", [], "none"),
                          warmup=1, repeats=repeats)


def _jax(dtype, repeats):
    import jax
    import jax.numpy as jnp

    key_a, key_b = jax.random.split(jax.random.key(0))
    a = jax.random.normal(key_a, (N, N), dtype)
    b = jax.random.normal(key_b, (N, N), dtype)
    product = jax.jit(lambda x, y: x @ y.T)
    return median_seconds(lambda: product(a, b).block_until_ready(), warmup=2, repeats=repeats)


def _tensorflow(dtype, repeats, jit_compile):
    import tensorflow as tf

    a = tf.random.normal((N, N), dtype=dtype)
    b = tf.random.normal((N, N), dtype=dtype)
    product = tf.function(lambda x, y: tf.matmul(x, y, transpose_b=True), jit_compile=jit_compile)
    return median_seconds(lambda: product(a, b).numpy(), warmup=2, repeats=repeats)


def _numpy(dtype, repeats):
    import numpy as np

    if dtype != "float32":
        raise TypeError("numpy has no bfloat16 GEMM")
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((N, N), np.float32), rng.standard_normal((N, N), np.float32)
    return median_seconds(lambda: a @ b.T, warmup=1, repeats=repeats)


ENGINES = {
    "torch.mm": _torch,
    "torch (oneDNN linear)": _torch_onednn,
    "jax (XLA)": _jax,
    "tensorflow": lambda dtype, repeats: _tensorflow(dtype, repeats, jit_compile=False),
    "tensorflow (XLA)": lambda dtype, repeats: _tensorflow(dtype, repeats, jit_compile=True),
    "numpy": _numpy,
}


def matmul_peaks(repeats=3):
    """({dtype: best GFLOP/s}, {dtype: {engine: GFLOP/s or the reason it did not run}}).

    Engines that are not installed, or lack the dtype, are listed with the reason and left out of
    the best.
    """
    flop, best, by_engine = 2 * N**3, {}, {}
    for dtype in ("float32", "bfloat16"):
        by_engine[dtype] = {}
        for name, time_it in ENGINES.items():
            try:
                by_engine[dtype][name] = flop / time_it(dtype, repeats) / 1e9
            except Exception as e:  # noqa: BLE001 - an engine that cannot run is a row that says why
                by_engine[dtype][name] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        rates = [v for v in by_engine[dtype].values() if isinstance(v, float)]
        best[dtype] = max(rates)
    return best, by_engine


def peaks_table(by_engine):
    """A Markdown table: one row per engine, one column per dtype."""
    dtypes = list(by_engine)
    cell = lambda v: f"{v:.0f}" if isinstance(v, float) else f"({v})"  # noqa: E731
    rows = [[name] + [cell(by_engine[d][name]) for d in dtypes] for name in ENGINES]
    return markdown_table(["matmul 2048^3, A @ B^T", *(f"{d} GFLOP/s" for d in dtypes)], rows)


if __name__ == "__main__":
    print(cpu_description())
    best, by_engine = matmul_peaks()
    print(peaks_table(by_engine))
    print("peak: " + ", ".join(f"{d} {v:.0f} GFLOP/s" for d, v in best.items()))

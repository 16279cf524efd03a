"""One case of the long-sequence benchmark, in its own process so its peak memory is its own.

    KERAS_BACKEND=torch python benchmarks/long_attention.py {attnkit,torch,explicit} [--T 16384] [--repeats 1]

Self-attention B=1, h=8, T, d_k=64, float32, no mask, on the backend KERAS_BACKEND names (torch by
default). `attnkit` is `attnkit.ops.fused_attention` (compiled on jax and tensorflow, as Keras runs
models there), `torch` is
`torch.nn.functional.scaled_dot_product_attention` called directly (torch backend only), `explicit`
is `attnkit.ops.scaled_dot_product_attention` (weights requested), which must refuse above its
memory budget. Prints one JSON object: median seconds, peak memory in bytes above the resident size
with the inputs allocated (Linux VmHWM, reset through /proc/self/clear_refs), and the error, if any.
On jax and tensorflow a first, compiling call runs before the peak is reset and the timing starts.
"""

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "torch")
sys.path.insert(0, os.path.dirname(__file__))

import attnkit  # noqa: E402,F401
import keras  # noqa: E402
import numpy as np  # noqa: E402
from attnkit.ops import fused_attention, scaled_dot_product_attention  # noqa: E402


def status_kib(field):
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith(field + ":")).split()[1])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("case", choices=["attnkit", "torch", "explicit"])
    parser.add_argument("--T", type=int, default=16384)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    backend = keras.backend.backend()
    if args.case == "torch" and backend != "torch":
        parser.error(f"case 'torch' needs KERAS_BACKEND=torch, not {backend}")
    B, h, T, d_k = 1, 8, args.T, 64
    q, k, v = (keras.ops.convert_to_tensor(np.random.default_rng(i).normal(size=(B, h, T, d_k)).astype("float32"))
               for i in range(3))
    if args.case == "torch":
        import torch

        call = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v)  # noqa: E731
    elif args.case == "explicit":
        call = lambda: scaled_dot_product_attention(q, k, v)  # noqa: E731
    elif backend == "jax":
        import jax

        compiled = jax.jit(fused_attention)
        call = lambda: compiled(q, k, v).block_until_ready()  # noqa: E731
    elif backend == "tensorflow":
        import tensorflow as tf

        compiled = tf.function(fused_attention)
        call = lambda: compiled(q, k, v)  # noqa: E731  (synchronous on CPU)
    else:
        call = lambda: fused_attention(q, k, v)  # noqa: E731
    if args.case == "attnkit" and backend != "torch":
        call()  # compiles
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident size
    base = status_kib("VmRSS")
    times, error = [], None
    try:
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            call()
            times.append(time.perf_counter() - t0)
    except MemoryError as e:
        error = str(e)
    peak = (status_kib("VmHWM") - base) * 1024
    print(json.dumps(dict(case=args.case, T=T, seconds=statistics.median(times) if times else None,
                          peak_bytes=peak, error=error, backend=backend)))


if __name__ == "__main__":
    main()

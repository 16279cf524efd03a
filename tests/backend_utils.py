"""Backend-neutral helpers for the tests: NumPy conversion and gradients on torch, jax and tensorflow."""

import os

import keras
import numpy as np
import pytest
from keras import ops
from xla_flags import XLA_FAST_COMPILE  # noqa: F401  (re-exported for the tests that import it here)

BACKEND = keras.backend.backend()

# For a test whose subject does not depend on the backend of the pass that runs it (a subprocess that
# chooses its own, matplotlib's backend): `make test` runs it once, in the torch pass, not three times.
once_per_run = pytest.mark.skipif(BACKEND != "torch", reason="independent of the backend: runs in the torch pass")


def children(pid):
    """{pid: command line} of the processes whose parent is `pid`."""
    found = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                with open(f"/proc/{entry}/cmdline") as f:
                    command = f.read().replace("\0", " ")
            except OSError:
                continue
            if ppid == pid:
                found[int(entry)] = command
    return found


def to_numpy(x):
    if BACKEND == "torch" and hasattr(x, "detach"):
        x = x.detach()
    return np.asarray(ops.convert_to_numpy(x))


def value_and_grads(fn, *inputs):
    """Returns (fn(*inputs) as NumPy, [d sum(fn) / d input] as NumPy) on the current backend."""
    if BACKEND == "torch":
        import torch

        xs = [ops.convert_to_tensor(x).detach().requires_grad_(True) for x in inputs]
        out = fn(*xs)
        grads = torch.autograd.grad(out.float().sum(), xs)
        return to_numpy(out), [to_numpy(g) for g in grads]
    if BACKEND == "jax":
        import jax

        xs = [ops.convert_to_tensor(x) for x in inputs]
        out = fn(*xs)
        grads = jax.grad(lambda *a: fn(*a).astype("float32").sum(), argnums=tuple(range(len(xs))))(*xs)
        return to_numpy(out), [to_numpy(g) for g in grads]
    import tensorflow as tf

    xs = [tf.convert_to_tensor(x) for x in inputs]
    with tf.GradientTape() as tape:
        tape.watch(xs)
        out = fn(*xs)
        total = tf.reduce_sum(tf.cast(out, "float32"))
    grads = tape.gradient(total, xs)
    return to_numpy(out), [to_numpy(g) for g in grads]

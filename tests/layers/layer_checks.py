"""Shared helpers for the attention layer tests: fixed NumPy weights, and the same case run on every backend.

`backend_parity_case(name)` builds one layer with fixed NumPy weights and inputs and returns its outputs;
`outputs_on_other_backends()` runs all of those cases once in a subprocess per other backend (imports
take ~10 s, so the result is cached for the whole test session).

This module imports only NumPy, Keras and attnkit, so the subprocesses can import it on any backend.
"""

import functools
import importlib.util
import os
import subprocess
import sys
import tempfile

import numpy as np

import attnkit  # noqa: F401  (chooses the Keras backend before Keras is imported)
import keras

BACKENDS = ("torch", "jax", "tensorflow")
HERE = os.path.dirname(os.path.abspath(__file__))


def dense_weights(rng, d_in, d_out, bias=True, scale=None):
    """A (kernel, bias) pair in float32; bias is None when `bias` is False."""
    scale = 1.0 / np.sqrt(d_in) if scale is None else scale
    kernel = (rng.standard_normal((d_in, d_out)) * scale).astype("float32")
    b = (rng.standard_normal(d_out) * 0.1).astype("float32") if bias else None
    return kernel, b


def set_dense(dense, kernel, bias):
    dense.set_weights([kernel] if bias is None else [kernel, bias])


def set_mha_weights(layer, rng, d_q, d_kin, d_vin):
    """Builds `layer` (an attnkit MultiHeadAttention) and sets W_q, W_k, W_v, W_o to random NumPy weights.

    Returns:
        dict name -> (kernel, bias or None), the format of `reference.multi_head_attention`.
    """
    layer.build((None, None, d_q), (None, None, d_kin), (None, None, d_vin))
    hk, hv = layer.h * layer.d_k, layer.h * layer.d_v
    weights = {
        "W_q": dense_weights(rng, d_q, hk, layer.use_bias),
        "W_k": dense_weights(rng, d_kin, hk, layer.use_bias),
        "W_v": dense_weights(rng, d_vin, hv, layer.use_bias),
        "W_o": dense_weights(rng, hv, layer.d_model, layer.use_bias),
    }
    for name, (kernel, bias) in weights.items():
        set_dense(getattr(layer, name), kernel, bias)
    return weights


def set_additive_weights(layer, rng, d_q, d_k):
    """Builds an attnkit AdditiveAttention and sets W_q (d_q, units), W_k (d_k, units), v (units, 1)."""
    layer.build((None, None, d_q), (None, None, d_k))
    weights = {
        "W_q": dense_weights(rng, d_q, layer.units, bias=False)[0],
        "W_k": dense_weights(rng, d_k, layer.units, bias=False)[0],
        "v": dense_weights(rng, layer.units, 1, bias=False)[0],
    }
    for name, kernel in weights.items():
        set_dense(getattr(layer, name), kernel, None)
    return weights


def numpy_outputs(outputs):
    """Layer outputs (a tensor or a tuple of tensors) as a tuple of float NumPy arrays."""
    if not isinstance(outputs, (tuple, list)):
        outputs = (outputs,)
    result = []
    for x in outputs:
        if hasattr(x, "detach"):
            x = x.detach()
        result.append(np.asarray(keras.ops.convert_to_numpy(x)))
    return tuple(result)


# --- the same case on every backend -----------------------------------------------------------------

PARITY_CASES = ("MultiHeadAttention", "DotProductAttention", "AdditiveAttention")


def backend_parity_case(name):
    """Outputs of layer `name` with fixed NumPy weights and inputs on the current backend (float32).

    Each case exercises a mask, unequal lengths (T_q=5, T_k=7) and every output the layer has.
    """
    rng = np.random.default_rng(2024)
    B, T_q, T_k = 2, 5, 7
    keep = rng.random((B, T_q, T_k)) < 0.7
    keep[:, :, 0] = True
    if name == "MultiHeadAttention":
        q = rng.standard_normal((B, T_q, 6)).astype("float32")
        k = rng.standard_normal((B, T_k, 10)).astype("float32")
        v = rng.standard_normal((B, T_k, 3)).astype("float32")
        layer = attnkit.MultiHeadAttention(h=3, d_k=4, d_v=5, d_model=8)
        set_mha_weights(layer, rng, 6, 10, 3)
        masked = layer(q, k, v, mask=keep, return_attention_weights=True)
        causal = layer(q, k, v, causal=True)  # the fused path
        return numpy_outputs(masked) + numpy_outputs(causal)
    if name == "DotProductAttention":
        q = rng.standard_normal((B, 3, T_q, 4)).astype("float32")
        k = rng.standard_normal((B, 3, T_k, 4)).astype("float32")
        v = rng.standard_normal((B, 3, T_k, 6)).astype("float32")
        layer = attnkit.DotProductAttention()
        explicit = layer(q, k, v, 4, keep, return_attention_weights=True)
        fused = layer(q, k, v, 4, keep, causal=True)
        return numpy_outputs(explicit) + numpy_outputs(fused)
    if name == "AdditiveAttention":
        q = rng.standard_normal((B, 6)).astype("float32")
        k = rng.standard_normal((B, T_k, 9)).astype("float32")
        v = rng.standard_normal((B, T_k, 4)).astype("float32")
        layer = attnkit.AdditiveAttention(8)
        set_additive_weights(layer, rng, 6, 9)
        return numpy_outputs(layer(q, k, v, mask=keep[:, 0])) + numpy_outputs(layer(q[:, None], k, v))
    raise ValueError(f"unknown parity case {name!r}")


def _save_parity_cases(path):
    arrays = {}
    for name in PARITY_CASES:
        for i, x in enumerate(backend_parity_case(name)):
            arrays[f"{name}/{i}"] = x
    np.savez(path, **arrays)


@functools.cache
def outputs_on_other_backends():
    """{backend: {case name: tuple of arrays}} for the backends other than the current one that are
    installed (all three under `make test`; a GPU image may lack tensorflow).

    Runs one subprocess per backend, both at once, each computing every case in `PARITY_CASES`.
    """
    current = keras.backend.backend()
    others = [b for b in BACKENDS if b != current and importlib.util.find_spec(b) is not None]
    tmp = tempfile.mkdtemp(prefix="attnkit-parity-")
    script = "import sys; sys.path.insert(0, sys.argv[1]); import layer_checks; layer_checks._save_parity_cases(sys.argv[2])"
    procs = {}
    for backend in others:
        env = {**os.environ, "KERAS_BACKEND": backend}
        path = os.path.join(tmp, f"{backend}.npz")
        procs[backend] = (
            subprocess.Popen(
                [sys.executable, "-c", script, HERE, path], env=env,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            ),
            path,
        )
    results = {}
    for backend, (proc, path) in procs.items():
        _, err = proc.communicate(timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(f"the {backend} subprocess failed:\n{err[-4000:]}")
        with np.load(path) as data:
            results[backend] = {
                name: tuple(data[f"{name}/{i}"] for i in range(sum(k.startswith(name + "/") for k in data.files)))
                for name in PARITY_CASES
            }
    return results


def assert_same_on_every_backend(name, atol=1e-5):
    """The parity case `name` on this backend equals the other two backends' within `atol`."""
    here = backend_parity_case(name)
    others = outputs_on_other_backends()
    if not others:
        import pytest

        pytest.skip("no other Keras backend is installed")
    for backend, cases in others.items():
        there = cases[name]
        assert len(there) == len(here)
        for i, (a, b) in enumerate(zip(here, there)):
            assert a.shape == b.shape, (backend, i)
            np.testing.assert_allclose(a, b, rtol=0, atol=atol, err_msg=f"{name} output {i}: {backend}")

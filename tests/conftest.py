import os
import signal
import sys

# A process started in the background by a non-interactive shell (`cmd &`) inherits SIGINT ignored,
# and Python then raises no KeyboardInterrupt for it: the Ctrl-C tests would wait forever. Give the
# suite Python's usual handler, whatever launched it (its subprocesses then start with the default).
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# XLA's Triton GEMM on GPU computes some int8 x int8 -> int32 products wrongly under jit (jaxlib
# 0.11.2 on an H100; docs/decisions.md, item 14); the int8-quantization tests need cuBLAS's. No
# effect on CPU. Set before jax starts its backend.
if "--xla_gpu_enable_triton_gemm" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_triton_gemm=false"

# The jax pass compiles thousands of small programs, and XLA's CPU code generation at its default
# LLVM optimisation took a sixth of it: less optimisation (docs/decisions.md, item 146) cut two of its
# heaviest files from 278 s to 230 s, results within every tolerance. Users' programs keep XLA's default.
# (The tensorflow pass gained nothing from it, so it keeps the default too.) Subprocesses inherit it.
sys.path.insert(0, os.path.dirname(__file__))  # tests import reference.py, backend_utils.py, xla_flags.py
from xla_flags import XLA_FAST_COMPILE  # noqa: E402

if os.environ.get("KERAS_BACKEND") == "jax" and "--xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] += f" {XLA_FAST_COMPILE}"

# pytest-xdist runs N workers side by side (`make test`: 2 on 2 cores): each worker's backend takes
# its share of the cores, not all of them, so that N thread pools do not spin against each other on
# the same cores. Set before the backends start their pools; subprocesses inherit it; a value the
# user set is kept.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    _threads = str(max(1, (os.cpu_count() or 1) // _WORKERS))
    for _name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS"):
        os.environ.setdefault(_name, _threads)

import numpy as np
import pytest

import attnkit  # noqa: E402,F401  (chooses the Keras backend first)
import keras  # noqa: E402

if keras.backend.backend() == "jax":
    import jax

    # jax's GPU default for float32 matmuls is TF32 (~1e-3 relative); the references are float64
    # and the tolerances float32's. No effect on CPU, where float32 is already the default.
    jax.config.update("jax_default_matmul_precision", "highest")


def pytest_report_header(config):
    return f"keras backend: {keras.backend.backend()}"


# pytest-xdist hands whole files to its workers in collection order (`--no-loadscope-reorder` in the
# Makefile; its default puts the files with the most tests first, which left the few-test files that
# train for minutes to the end, one worker running them while the other idled). These files took the
# longest in the jax pass (their tests' seconds summed; 130-280 s each), so they start first.
HEAVY_FIRST = (
    "tests/test_translation.py",
    "tests/test_distributed_processes.py",
    "tests/finetune/test_finetune_processes.py",
    "tests/models/test_causal_lm.py",
    "tests/models/test_quantized_saving.py",
    "tests/ops/test_fused.py",
    "tests/explorer/test_explorer_causal_lm.py",
    "tests/faults/test_batches_and_edges.py",
    "tests/models/test_decoding.py",
    "tests/models/test_smollm2.py",
    "tests/ops/test_tiled_attention.py",
    "tests/test_cli_translation.py",
    "tests/test_distributed.py",
    "tests/models/test_transformer.py",
)


def pytest_collection_modifyitems(config, items):
    """The files of HEAVY_FIRST first, in its order; the others after, in collection order."""
    rank = {path: i for i, path in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(HEAVY_FIRST)))


@pytest.fixture(autouse=True)
def _float32_policy_and_seed():
    """Every test starts under float32 with fixed seeds, whatever the previous test set."""
    keras.config.set_dtype_policy("float32")
    keras.utils.set_random_seed(0)
    yield
    keras.config.set_dtype_policy("float32")


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


@pytest.fixture
def default_scores_budget(monkeypatch):
    """The explicit path's scores budget at its default (2 GiB) during the test, and after it."""
    from attnkit.ops import set_max_scores_bytes

    monkeypatch.delenv("ATTNKIT_MAX_SCORES_BYTES", raising=False)
    set_max_scores_bytes(None)
    yield
    set_max_scores_bytes(None)

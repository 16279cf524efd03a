"""Long sequences on the fused path: memory grows as T_k, not T_q * T_k, on every backend.

torch's SDPA and jax's accelerator kernels never materialize the scores. On tensorflow and on jax's
CPU backend, `fused_attention` computes scores above `BLOCKED_ABOVE_BYTES` in blocks of queries
(`attention._blocked`, whose numbers and gradients test_fused.py checks on every backend).
Legend: B batch, h heads, T_q/T_k lengths, d_k width.
"""

import numpy as np
import pytest

from attnkit.ops import attention, fused_attention, scaled_dot_product_attention, set_max_scores_bytes
from attnkit.ops import _fused
from backend_utils import BACKEND, to_numpy

MiB = 2**20


pytestmark = pytest.mark.usefixtures("default_scores_budget")


def qkv(T_q, T_k, B=1, h=2, d_k=4):
    rng = np.random.default_rng(0)
    return (rng.normal(size=(B, h, T, d_k)).astype("float32") for T in (T_q, T_k, T_k))


def test_memory_efficient_backends():
    expected = {"torch": True, "tensorflow": False}.get(BACKEND)
    if BACKEND == "jax":
        import jax

        expected = jax.default_backend() != "cpu"
    assert _fused.memory_efficient() is expected


def test_block_size_follows_the_threshold_and_the_budget():
    # (1, 8, T, T) float32: one query's scores are 8 * T * 4 bytes.
    assert attention.query_block_size((1, 8, 1024, 1024), "float32") is None  # 32 MiB of scores: one block
    assert attention.query_block_size((1, 8, 4096, 4096), "float32") == 128  # 512 MiB of scores
    assert attention.query_block_size((1, 8, 16384, 16384), "bfloat16") == 128  # half: float32 scores
    assert attention.query_block_size((1, 16, 4096, 65536), "float32") == 16  # 4 MiB per query
    # A traced batch of unknown size counts as 1; two unknown lead dimensions, or an unknown length, give up.
    assert attention.query_block_size((None, 8, 4096, 4096), "float32") == 128
    assert attention.query_block_size((None, 8, 1024, 1024), "float32") is None  # 32 MiB per example
    assert attention.query_block_size((None, None, 4096, 4096), "float32") is None
    assert attention.query_block_size((1, 8, None, 4096), "float32") is None
    set_max_scores_bytes(100)
    assert attention.query_block_size((1, 2, 5, 7), "float32") == 1  # 56 bytes per query
    assert attention.query_block_size((1, 2, 5, 3), "float32") == 4  # 24 bytes per query
    set_max_scores_bytes(50)
    with pytest.raises(MemoryError, match=r"shape \(1, 2, 1, 7\) float32"):
        attention.query_block_size((1, 2, 5, 7), "float32")


@pytest.mark.parametrize("causal", [False, True])
def test_fused_attention_runs_in_blocks_exactly_where_the_backend_would_materialize_scores(monkeypatch, causal):
    q, k, v = qkv(9, 7)
    mask = np.random.default_rng(1).random((1, 9, 7)) < 0.7  # (B, T_q, T_k), per query
    expected = to_numpy(scaled_dot_product_attention(q, k, v, mask, causal=causal)[0])
    calls = []
    blocked = attention._blocked
    monkeypatch.setattr(attention, "_blocked", lambda *args: calls.append(args[-1]) or blocked(*args))
    set_max_scores_bytes(2 * 7 * 4 * 4)  # room for 4 queries' scores (1, 2, 4, 7)
    np.testing.assert_allclose(to_numpy(fused_attention(q, k, v, mask, causal=causal)), expected, atol=1e-5)
    assert calls == ([] if _fused.memory_efficient() else [4])


def test_a_single_query_above_the_budget_is_refused_without_a_fused_kernel():
    q, k, v = qkv(5, 7)
    set_max_scores_bytes(2 * 7 * 4 - 1)  # one byte below one query's scores (1, 2, 1, 7)
    if _fused.memory_efficient():
        assert to_numpy(fused_attention(q, k, v)).shape == (1, 2, 5, 4)
    else:
        with pytest.raises(MemoryError, match=r"shape \(1, 2, 1, 7\) float32"):
            fused_attention(q, k, v)


def resident_peak_rise(function):
    """Rise of the process's peak resident memory (Linux VmHWM) while `function` runs, in bytes."""

    def kib(field):
        with open("/proc/self/status") as f:
            return int(next(line for line in f if line.startswith(field + ":")).split()[1])

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident size
    base = kib("VmRSS")
    function()
    return (kib("VmHWM") - base) * 1024


def test_long_sequence_memory_does_not_grow_as_the_scores(rng):
    # (1, 8, 8192, 8192) float32 scores would be 2 GiB; blocks of 128 queries hold 32 MiB. The bound
    # leaves room for the allocators' slack inside a long test session (up to ~150 MiB seen).
    q, k, v = (rng.normal(size=(1, 8, 8192, 16)).astype("float32") for _ in range(3))
    call = fused_attention
    if BACKEND == "jax":
        import jax

        call = jax.jit(fused_attention)
    q, k, v = (attention.ops.convert_to_tensor(x) for x in (q, k, v))
    to_numpy(call(q, k, v))  # compiles on jax, warms the allocators everywhere
    rise = resident_peak_rise(lambda: to_numpy(call(q, k, v)))
    assert rise < 512 * MiB, f"peak memory rose by {rise / MiB:.0f} MiB"
    # The same call with the weights requested would materialize the scores, and refuses above the budget.
    set_max_scores_bytes(2 * 1024 * MiB - 1)
    with pytest.raises(MemoryError, match="2.00 GiB"):
        scaled_dot_product_attention(q, k, v)


@pytest.mark.skipif(BACKEND != "tensorflow", reason="a batch of unknown size is traced by tf.function")
def test_blocks_under_tf_function_with_a_batch_of_unknown_size(monkeypatch):
    """Keras's fit may retrace with the batch dimension unknown: the blocks are sized per example."""
    import tensorflow as tf

    q, k, v = qkv(9, 7, B=3)
    mask = np.random.default_rng(1).random((3, 9, 7)) < 0.7  # (B, T_q, T_k)
    expected = to_numpy(scaled_dot_product_attention(q, k, v, mask, causal=True)[0])
    calls = []
    blocked = attention._blocked
    monkeypatch.setattr(attention, "_blocked", lambda *args: calls.append(args[-1]) or blocked(*args))
    set_max_scores_bytes(2 * 7 * 4 * 4)  # room for 4 queries' scores of one example (1, 2, 4, 7)
    spec = [tf.TensorSpec((None, 2, T, 4), tf.float32) for T in (9, 7, 7)] + [tf.TensorSpec((None, 9, 7), tf.bool)]
    run = tf.function(lambda q, k, v, m: fused_attention(q, k, v, m, causal=True), input_signature=spec)
    np.testing.assert_allclose(to_numpy(run(q, k, v, mask)), expected, atol=1e-5)
    assert calls == [4]

    @tf.function(input_signature=spec[:3])
    def grads(q, k, v):
        with tf.GradientTape() as tape:
            tape.watch([q, k, v])
            loss = tf.reduce_sum(fused_attention(q, k, v, causal=True) ** 2)
        return tape.gradient(loss, [q, k, v])

    def explicit_grads(q, k, v):
        q, k, v = (tf.constant(x) for x in (q, k, v))
        with tf.GradientTape() as tape:
            tape.watch([q, k, v])
            loss = tf.reduce_sum(scaled_dot_product_attention(q, k, v, causal=True)[0] ** 2)
        return tape.gradient(loss, [q, k, v])

    set_max_scores_bytes(None)  # the reference materializes all the scores
    wanted = explicit_grads(q, k, v)
    set_max_scores_bytes(2 * 7 * 4 * 4)
    for got, want in zip(grads(q, k, v), wanted):
        np.testing.assert_allclose(got.numpy(), want.numpy(), atol=1e-5)
    assert calls == [4, 4]

"""Long sequences on the fused path: memory grows as T_q + T_k, not T_q * T_k, on every backend.

torch's SDPA and jax's accelerator kernels never materialize the scores. On tensorflow and on jax's
CPU backend, `fused_attention` computes scores above `TILED_ABOVE_BYTES` a tile at a time
(`_tiled.tiled_attention`, whose numbers and gradients test_fused.py checks on every backend).
Legend: B batch, h heads, T_q/T_k lengths, d_k width.
"""

import numpy as np
import pytest
from keras import ops

from attnkit.ops import attention, broadcast_mask, fused_attention, scaled_dot_product_attention, set_max_scores_bytes
from attnkit import kernels as _fused
from attnkit.kernels import tiled as _tiled
from backend_utils import BACKEND, to_numpy, value_and_grads

MiB = 2**20


pytestmark = pytest.mark.usefixtures("default_scores_budget")


@pytest.fixture
def tiles_used(monkeypatch):
    """The tile of every call `fused_attention` makes to the tiled path, in order."""
    calls = []
    tiled = _tiled.tiled_attention
    monkeypatch.setattr(_tiled, "tiled_attention", lambda *args: calls.append(args[-1]) or tiled(*args))
    return calls


def qkv(T_q, T_k, B=1, h=2, d_k=4):
    rng = np.random.default_rng(0)
    return (rng.normal(size=(B, h, T, d_k)).astype("float32") for T in (T_q, T_k, T_k))


def test_memory_efficient_backends():
    expected = {"torch": True, "tensorflow": False}.get(BACKEND)
    if BACKEND == "jax":
        import jax

        expected = jax.default_backend() != "cpu"
    assert _fused.memory_efficient() is expected


def test_tile_follows_the_threshold_and_the_budget():
    # (B, 8, T, T) float32 scores; tiles of at most 4 MiB, 256 keys wide.
    assert attention.tile_for((1, 8, 1024, 1024), "float32") is None  # 32 MiB of scores: no tiles
    assert attention.tile_for((1, 8, 4096, 4096), "float32") == (1, 512, 256)  # 512 MiB of scores
    assert attention.tile_for((1, 8, 16384, 16384), "bfloat16") == (1, 512, 256)  # half: float32 scores
    assert attention.tile_for((1, 16, 4096, 65536), "float32") == (1, 256, 256)
    assert attention.tile_for((32, 8, 512, 512), "float32") == (1, 512, 256)  # one example at a time
    assert attention.tile_for((45, 2, 512, 512), "float32") == (3, 512, 256)  # a divisor of B, <= 4
    assert attention.tile_for((4, 300_000, 300), "float32") == (4, 1024, 256)  # at most 1024 queries
    assert attention.tile_for((1, 8, 8, 300_000), "float64") == (1, 8, 256)  # at most T_q queries
    # Unknown dimensions before the lengths count as 1 (one example a tile), unless there are two of them.
    assert attention.tile_for((None, 8, 4096, 4096), "float32") == (1, 512, 256)
    assert attention.tile_for((4, None, 4096, 4096), "float32") == (1, 1024, 256)
    assert attention.tile_for((None, 8, 1024, 1024), "float32") is None  # 32 MiB per example
    assert attention.tile_for((None, None, 4096, 4096), "float32") is None
    assert attention.tile_for((1, 8, None, 4096), "float32") is None
    # A lower budget lowers the threshold and the tile, down to one score per head.
    set_max_scores_bytes(100)
    assert attention.tile_for((1, 2, 5, 3), "float32") == (1, 4, 3)  # 120 bytes of scores; 96 per tile
    assert attention.tile_for((1, 2, 5, 7), "float32") == (1, 1, 7)  # 56 bytes per tile
    set_max_scores_bytes(130)
    assert attention.tile_for((6, 5, 3), "float32") == (2, 5, 3)  # 60 bytes per example
    set_max_scores_bytes(1)
    assert attention.tile_for((1, 2, 5, 7), "float32") == (1, 1, 1)


@pytest.mark.parametrize("causal", [False, True])
def test_fused_attention_runs_in_tiles_exactly_where_the_backend_would_materialize_scores(tiles_used, causal):
    q, k, v = qkv(9, 7)
    mask = np.random.default_rng(1).random((1, 9, 7)) < 0.7  # (B, T_q, T_k), per query
    expected = to_numpy(scaled_dot_product_attention(q, k, v, mask, causal=causal)[0])
    set_max_scores_bytes(2 * 7 * 4 * 4)  # room for 4 queries' scores (1, 2, 4, 7)
    np.testing.assert_allclose(to_numpy(fused_attention(q, k, v, mask, causal=causal)), expected, atol=1e-5)
    assert tiles_used == ([] if _fused.memory_efficient() else [(1, 4, 7)])


@pytest.mark.parametrize(
    "tile, mask_shape, causal",
    [
        ((1, 3, 2), (7, 5), False),  # one example at a time, a mask shared by all of them
        ((2, 4, 3), (4, 5), True),  # two examples at a time, key padding per example
        ((4, 2, 5), (4, 1, 7, 5), False),  # every example at once, a mask per example and query
        ((4, 7, 5), None, True),  # one tile holds everything; causal T_q > T_k leaves empty rows
    ],
)
def test_tiled_equals_explicit_for_any_tile_with_any_output_gradient(tile, mask_shape, causal):
    """A random output gradient, not the ones of sum(output), exercises D = rowsum(dO * O)."""
    rng = np.random.default_rng(2)
    q, k, v = (rng.normal(size=(4, 2, T, d)).astype("float32") for T, d in ((7, 3), (5, 3), (5, 4)))
    mask = None if mask_shape is None else rng.random(mask_shape) < 0.7
    d_out = ops.convert_to_tensor(rng.normal(size=(4, 2, 7, 4)).astype("float32"))
    keep = None if mask is None else broadcast_mask(mask, (4, 2, 7, 5))

    def tiled(q, k, v):
        return _tiled.tiled_attention(q, k, v, keep, causal, 0.5, tile) * d_out

    def explicit(q, k, v):
        return scaled_dot_product_attention(q, k, v, mask, causal=causal, scale=0.5)[0] * d_out

    out, grads = value_and_grads(tiled, q, k, v)
    want_out, want_grads = value_and_grads(explicit, q, k, v)
    np.testing.assert_allclose(out, want_out, atol=1e-5)
    for name, got, want in zip("qkv", grads, want_grads):
        np.testing.assert_allclose(got, want, atol=1e-5, err_msg=f"d{name}")


@pytest.mark.skipif(BACKEND != "jax", reason="jax's accelerator kernel takes some shapes only")
def test_inputs_an_accelerator_kernel_does_not_take_are_tiled(monkeypatch, tiles_used):
    """On a GPU jax's kernel takes (B, h, T, d) float32/half with d_k == d_v only; the rest must not
    fall back to scores of T_q * T_k."""
    import jax

    monkeypatch.setattr(_fused, "memory_efficient", lambda: True)  # as on a GPU
    set_max_scores_bytes(2 * 7 * 4 * 4)  # (1, 2, 9, 7) scores: 504 bytes, above the budget
    rng = np.random.default_rng(3)
    q, k, v = qkv(9, 7)
    assert _fused.has_kernel(q, v)
    cases = {
        "rank 3": (q[0], k[0], v[0]),
        "d_k != d_v": (q, k, rng.normal(size=(1, 2, 7, 6)).astype("float32")),
    }
    if jax.default_backend() == "cpu":  # on a GPU jax's kernel takes float16
        cases["float16"] = (q.astype("float16"), k.astype("float16"), v.astype("float16"))
    for name, (q_, k_, v_) in cases.items():
        assert not _fused.has_kernel(q_, v_), name
        set_max_scores_bytes(None)
        expected = to_numpy(scaled_dot_product_attention(q_, k_, v_, causal=True)[0])
        set_max_scores_bytes(2 * 7 * 4 * 4)
        got = to_numpy(fused_attention(q_, k_, v_, causal=True))
        np.testing.assert_allclose(got.astype("float32"), expected.astype("float32"), atol=2e-3, err_msg=name)
    assert len(tiles_used) == len(cases)


def test_nothing_is_refused_on_the_fused_path_whatever_the_budget():
    q, k, v = qkv(5, 7)
    expected = to_numpy(scaled_dot_product_attention(q, k, v, causal=True)[0])
    set_max_scores_bytes(1)  # below a single score of every head
    np.testing.assert_allclose(to_numpy(fused_attention(q, k, v, causal=True)), expected, atol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
def test_non_finite_inputs_over_the_budget_give_the_explicit_numbers(causal):
    """A query row of -inf (every score -inf: softmax 0 / 0), an infinite key and a NaN value, on the
    fused path with scores over the budget: the numbers of the explicit path, NaN where it has NaN,
    zeros on the rows with nothing to attend to. On torch such inputs leave the kernels (`_finite`)."""
    q, k, v = qkv(7, 9, B=2)
    q[0, 0, 2] = [-np.inf, 0, 0, 0]  # scores -inf wherever the keys' first element is positive
    k[0, 0, :, 0] = np.abs(k[0, 0, :, 0]) + 0.1
    k[1, 1, 3, 1] = np.inf
    v[1, 0, 0, 2] = np.nan  # a key every query sees, causal or not
    mask = np.ones((2, 7, 9), bool)
    mask[0, 4] = False  # nothing to attend to
    mask[0, 2, 6:] = False  # the -inf row has masked keys too
    expected = to_numpy(scaled_dot_product_attention(q, k, v, mask[:, None], causal=causal)[0])
    assert np.isnan(expected).any() and np.isnan(expected[0, 0, 2]).all() and not expected[0, :, 4].any()
    set_max_scores_bytes(1)  # below a single score of every head
    got = to_numpy(fused_attention(q, k, v, mask[:, None], causal=causal))
    np.testing.assert_allclose(got, expected, atol=1e-5)  # NaN where `expected` has NaN, and only there


@pytest.mark.skipif(BACKEND != "jax", reason="jax's accelerator kernel")
@pytest.mark.parametrize("budget", [None, 1])
@pytest.mark.parametrize("jit", [False, True])
def test_jax_kernel_leaves_non_finite_inputs_to_the_explicit_numbers(monkeypatch, jit, budget):
    """jax's kernel fills masked scores with a large finite number: a row whose kept scores are all
    -inf came out as the average of its masked values (seen on an H100). Non-finite inputs take the
    explicit path, or tiles over the budget, eagerly and under jit; finite ones keep the kernel."""
    import jax

    monkeypatch.setattr(_fused, "memory_efficient", lambda: True)  # jax's kernel, as on a GPU
    q, k, v = qkv(7, 9, B=2)
    q[0, 0, 2] = [-np.inf, 0, 0, 0]
    k[0, 0, :, 0] = np.abs(k[0, 0, :, 0]) + 0.1
    mask = np.ones((2, 1, 7, 9), bool)
    mask[0, 0, 2, 6:] = False
    finite_q = q.copy()
    finite_q[0, 0, 2] = 1.0
    expected = to_numpy(scaled_dot_product_attention(q, k, v, mask)[0])
    expected_finite = to_numpy(scaled_dot_product_attention(finite_q, k, v, mask)[0])
    assert np.isnan(expected[0, 0, 2]).all() and not np.isnan(np.delete(expected[0, 0], 2, axis=0)).any()
    set_max_scores_bytes(budget)
    fused = jax.jit(lambda q, k, v: fused_attention(q, k, v, mask)) if jit else (lambda q, k, v: fused_attention(q, k, v, mask))
    np.testing.assert_allclose(to_numpy(fused(q, k, v)), expected, atol=1e-5)
    np.testing.assert_allclose(to_numpy(fused(finite_q, k, v)), expected_finite, atol=1e-5)


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
    # (1, 8, 8192, 8192) float32 scores would be 2 GiB; a tile holds 4 MiB. The bound leaves room
    # for the allocators' slack inside a long test session.
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
def test_tiles_under_tf_function_with_a_batch_of_unknown_size(tiles_used):
    """Keras's fit may retrace with the batch dimension unknown: the tiles are sized per example."""
    import tensorflow as tf

    q, k, v = qkv(9, 7, B=3)
    mask = np.random.default_rng(1).random((3, 9, 7)) < 0.7  # (B, T_q, T_k)
    expected = to_numpy(scaled_dot_product_attention(q, k, v, mask, causal=True)[0])
    set_max_scores_bytes(2 * 7 * 4 * 4)  # room for 4 queries' scores of one example (1, 2, 4, 7)
    spec = [tf.TensorSpec((None, 2, T, 4), tf.float32) for T in (9, 7, 7)] + [tf.TensorSpec((None, 9, 7), tf.bool)]
    run = tf.function(lambda q, k, v, m: fused_attention(q, k, v, m, causal=True), input_signature=spec)
    np.testing.assert_allclose(to_numpy(run(q, k, v, mask)), expected, atol=1e-5)
    assert tiles_used == [(1, 4, 7)]

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
    assert tiles_used == [(1, 4, 7), (1, 4, 7)]

"""The explicit path refuses scores tensors above the memory budget instead of exhausting memory.

Legend: B batch, h heads, T_q/T_k lengths, d_k width. The budget is in bytes of one scores tensor
(B, h, T_q, T_k), float32 for float32 and half-precision inputs alike.
"""

import keras
import numpy as np
import pytest

import attnkit
from attnkit.ops import fused_attention, max_scores_bytes, scaled_dot_product_attention, set_max_scores_bytes
from backend_utils import to_numpy


pytestmark = pytest.mark.usefixtures("default_scores_budget")


def qkv(T_q, T_k, B=1, h=2, d_k=4, dtype="float32"):
    rng = np.random.default_rng(0)
    q = rng.normal(size=(B, h, T_q, d_k)).astype(dtype)
    k, v = (rng.normal(size=(B, h, T_k, d_k)).astype(dtype) for _ in range(2))
    return q, k, v


def test_default_budget_is_2_gib():
    assert max_scores_bytes() == 2 * 1024**3


def test_environment_variable_sets_the_budget(monkeypatch):
    monkeypatch.setenv("ATTNKIT_MAX_SCORES_BYTES", "1000")
    assert max_scores_bytes() == 1000


@pytest.mark.parametrize("value", ["abc", "0", "-5", "1.5"])
def test_bad_environment_variable_is_a_clear_error(monkeypatch, value):
    monkeypatch.setenv("ATTNKIT_MAX_SCORES_BYTES", value)
    with pytest.raises(ValueError, match="ATTNKIT_MAX_SCORES_BYTES must be a positive integer"):
        max_scores_bytes()


def test_set_overrides_the_environment_and_none_restores_it(monkeypatch):
    monkeypatch.setenv("ATTNKIT_MAX_SCORES_BYTES", "1000")
    set_max_scores_bytes(5000)
    assert max_scores_bytes() == 5000
    set_max_scores_bytes(None)
    assert max_scores_bytes() == 1000


@pytest.mark.parametrize("value", [0, -1, 1.5, "big", True])
def test_set_rejects_non_positive_integers(value):
    with pytest.raises(ValueError, match="`max_bytes` must be a positive integer"):
        set_max_scores_bytes(value)


def test_exactly_at_the_budget_runs_and_one_byte_less_refuses():
    q, k, v = qkv(5, 7)  # scores (1, 2, 5, 7) float32 = 280 bytes
    set_max_scores_bytes(280)
    out, weights = scaled_dot_product_attention(q, k, v)
    assert to_numpy(weights).shape == (1, 2, 5, 7)
    set_max_scores_bytes(279)
    with pytest.raises(MemoryError, match=r"shape \(1, 2, 5, 7\) float32 = 280 bytes, above the budget of 279 bytes"):
        scaled_dot_product_attention(q, k, v)
    set_max_scores_bytes(3 * 1024)
    q, k, v = qkv(40, 50)  # 16000 bytes
    with pytest.raises(MemoryError, match="= 15.62 KiB, above the budget of 3.00 KiB"):
        scaled_dot_product_attention(q, k, v)


def test_half_precision_scores_are_counted_as_float32():
    q, k, v = qkv(5, 7, dtype="float16")  # the scores of half inputs are float32: 280 bytes, not 140
    set_max_scores_bytes(200)
    with pytest.raises(MemoryError, match="float32"):
        scaled_dot_product_attention(q, k, v)


def test_message_names_the_size_the_budget_and_the_ways_out():
    q, k, v = qkv(16384, 16384, h=8, d_k=1)  # scores (1, 8, 16384, 16384) float32 = 8 GiB
    with pytest.raises(MemoryError) as info:
        scaled_dot_product_attention(q, k, v)
    message = str(info.value)
    for part in ("(1, 8, 16384, 16384)", "8.00 GiB", "budget of 2.00 GiB", "fused_attention",
                 "return_attention_weights=False", "set_max_scores_bytes", "ATTNKIT_MAX_SCORES_BYTES"):
        assert part in message


def test_fused_path_runs_where_the_explicit_path_refuses():
    q, k, v = qkv(5, 7)
    expected = to_numpy(scaled_dot_product_attention(q, k, v)[0])
    set_max_scores_bytes(100)  # below the (1, 2, 5, 7) scores' 280 bytes, above one query's 56
    with pytest.raises(MemoryError, match="budget"):
        scaled_dot_product_attention(q, k, v)
    # A fused kernel, or, without one (tensorflow, jax on CPU), tiles within the budget.
    np.testing.assert_allclose(to_numpy(fused_attention(q, k, v)), expected, atol=1e-5)


def test_multi_head_attention_refuses_weights_above_the_budget_but_runs_without_them():
    x = np.random.default_rng(0).normal(size=(2, 6, 8)).astype("float32")
    layer = attnkit.MultiHeadAttention(2, 4, 4, 8)
    layer(x)
    set_max_scores_bytes(2 * 2 * 6 * 6 * 4 - 1)  # one byte below the (2, 2, 6, 6) float32 scores
    with pytest.raises(MemoryError, match=r"shape \(2, 2, 6, 6\)"):
        layer(x, return_attention_weights=True)
    assert to_numpy(layer(x)).shape == (2, 6, 8)


def test_symbolic_shapes_are_not_checked():
    set_max_scores_bytes(1)
    inputs = keras.Input((None, 8))
    outputs = attnkit.MultiHeadAttention(2, 4, 4, 8)(inputs, return_attention_weights=True)
    assert tuple(outputs[1].shape) == (None, 2, None, None)

"""ALiBi biases and sliding-window masks against NumPy references."""

import numpy as np
import pytest
from backend_utils import to_numpy

from attnkit.ops.alibi import alibi_bias, alibi_slopes
from attnkit.ops.sliding_window import sliding_window_mask, window_keep


def test_alibi_slopes_power_of_two():
    np.testing.assert_allclose(alibi_slopes(8), [2.0 ** -(i + 1) for i in range(8)])


def test_alibi_slopes_not_power_of_two():
    # h = 6: the 4 slopes of h = 4, then every other slope of h = 8
    expected = [2.0 ** (-2 * (i + 1)) for i in range(4)] + [2.0 ** -1, 2.0 ** -3]
    np.testing.assert_allclose(alibi_slopes(6), expected)


def test_alibi_bias_reference():
    bias = to_numpy(alibi_bias(4, 3, 5, dtype="float32"))
    slopes = alibi_slopes(4)
    q_pos = np.arange(3)[:, None] + 2  # bottom-right alignment
    expected = slopes[:, None, None] * (np.arange(5)[None, :] - q_pos)[None]
    np.testing.assert_allclose(bias, expected, rtol=1e-6)
    assert np.all(bias[:, np.arange(3), np.arange(3) + 2] == 0)


def test_alibi_refusals():
    with pytest.raises(ValueError, match="`h` must be a positive integer"):
        alibi_slopes(0)
    with pytest.raises(ValueError, match="q_len"):
        alibi_bias(2, 0, 3)


@pytest.mark.parametrize("q_len,k_len,window", [(5, 5, 2), (5, 5, 9), (2, 6, 3), (4, 4, 1)])
def test_sliding_window_mask_reference(q_len, k_len, window):
    mask = to_numpy(sliding_window_mask(q_len, k_len, window))
    i = np.arange(q_len)[:, None] + (k_len - q_len)
    j = np.arange(k_len)[None, :]
    np.testing.assert_array_equal(mask, (j <= i) & (j > i - window))


def test_window_keep_from_positions():
    q = np.array([[3, 4]])
    k = np.array([[0, 1, 2, 3, 4]])
    keep = to_numpy(window_keep(q, k, window=2))
    np.testing.assert_array_equal(keep[0, 0], [[False, False, True, True, False], [False, False, False, True, True]])
    assert to_numpy(window_keep(q, k)).sum() == 4 + 5


def test_sliding_window_refusals():
    with pytest.raises(ValueError, match="`window` must be a positive integer"):
        sliding_window_mask(3, 3, 0)

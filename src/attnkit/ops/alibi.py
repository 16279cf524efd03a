"""ALiBi: attention with linear biases (Press et al., "Train Short, Test Long", 2022).

Each head i adds m_i * (j - i') to the score of query position i' and key position j, with slopes
m_i the geometric sequence 2^(-8/h), 2^(-16/h), ... (for h a power of two; otherwise the next
power of two's slopes interleaved, as the paper's code does). The bias is added to the scaled
scores, where the scores are masked afterwards (a causal mask keeps j <= i').

Legend: h heads, T_q/T_k query/key lengths.
"""

import math

import numpy as np
from keras import ops

from attnkit._validation import positive_int


def alibi_slopes(h):
    """The per-head slopes m (h,) as float64 NumPy numbers.

    Raises:
        ValueError, TypeError: `h` not a positive integer.
    """
    h = positive_int("h", h)

    def power_of_two_slopes(n):
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    closest = 2 ** math.floor(math.log2(h))
    slopes = power_of_two_slopes(closest)
    if closest != h:
        slopes += power_of_two_slopes(2 * closest)[0::2][: h - closest]
    return np.asarray(slopes, dtype="float64")


def alibi_bias(h, q_len, k_len, dtype="float32", offset=None):
    """The additive bias (h, T_q, T_k): m_i * (j - position of query i').

    Queries are aligned to the end of the keys (bottom-right, as attnkit's causal mask): query i'
    sits at key position i' + (T_k - T_q), unless `offset` gives it.

    Args:
        h: number of heads.
        q_len, k_len: query and key lengths.
        dtype: the bias dtype.
        offset: optional int, the key position of the first query. Default T_k - T_q.

    Returns:
        (h, T_q, T_k) tensor, 0 on each query's own position and negative for earlier keys.

    Example:
    >>> alibi_bias(8, 5, 5).shape  # (8, 5, 5)
    """
    q_len, k_len = positive_int("q_len", q_len), positive_int("k_len", k_len)
    offset = k_len - q_len if offset is None else int(offset)
    distance = np.arange(k_len)[None, :] - (np.arange(q_len)[:, None] + offset)  # (T_q, T_k)
    bias = alibi_slopes(h)[:, None, None] * distance[None]  # (h, T_q, T_k)
    return ops.convert_to_tensor(bias.astype(dtype))

"""A float64 NumPy reference for attention, written from the paper, independent of attnkit.

Masks here are already full keep-masks: boolean arrays broadcastable to (..., T_q, T_k), True = attend.
"""

import numpy as np


def softmax_rows(scores, keep=None):
    """Softmax over the last axis; masked entries 0; a row with nothing kept is all zeros."""
    scores = np.asarray(scores, np.float64)
    if keep is None:
        keep = np.ones(scores.shape, bool)
    keep = np.broadcast_to(keep, scores.shape)
    shifted = np.where(keep, scores, -np.inf)
    row_max = np.max(shifted, axis=-1, keepdims=True)
    row_max = np.where(np.isfinite(row_max), row_max, 0.0)
    e = np.where(keep, np.exp(shifted - row_max), 0.0)
    total = e.sum(-1, keepdims=True)
    return np.divide(e, total, out=np.zeros_like(e), where=total > 0)


def causal_keep(q_len, k_len):
    """Bottom-right aligned look-ahead keep-mask (T_q, T_k)."""
    return np.arange(k_len)[None, :] <= np.arange(q_len)[:, None] + (k_len - q_len)


def attention(q, k, v, keep=None, scale=None):
    """softmax(q k^T * scale) v in float64. Returns (output (..., T_q, d_v), weights (..., T_q, T_k))."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else scale
    weights = softmax_rows(q @ np.swapaxes(k, -1, -2) * scale, keep)
    return weights @ v, weights


def dense(x, kernel, bias=None):
    y = np.asarray(x, np.float64) @ np.asarray(kernel, np.float64)
    return y if bias is None else y + bias


def multi_head_attention(queries, keys, values, W_q, W_k, W_v, W_o, h, keep=None):
    """The paper's MultiHead(Q, K, V); each W_* is (kernel, bias_or_None); keep broadcasts to (B, h, T_q, T_k)."""
    B, T_q, _ = np.shape(queries)
    T_k = np.shape(keys)[1]

    def split(x):  # (B, T, h * d) -> (B, h, T, d)
        return x.reshape(x.shape[0], x.shape[1], h, -1).transpose(0, 2, 1, 3)

    q, k, v = split(dense(queries, *W_q)), split(dense(keys, *W_k)), split(dense(values, *W_v))
    heads, weights = attention(q, k, v, keep)
    concat = heads.transpose(0, 2, 1, 3).reshape(B, T_q, -1)
    return dense(concat, *W_o), weights


def additive_attention(query, key, value, W_q, W_k, v, keep=None):
    """Bahdanau: softmax(v^T tanh(q W_q + k W_k)) value. query (B, T_q, d_q). Returns (context, weights)."""
    q = dense(query, W_q)[:, :, None, :]  # (B, T_q, 1, units)
    k = dense(key, W_k)[:, None, :, :]  # (B, 1, T_k, units)
    scores = (np.tanh(q + k) @ np.asarray(v, np.float64)).squeeze(-1)  # (B, T_q, T_k)
    weights = softmax_rows(scores, keep)
    return weights @ np.asarray(value, np.float64), weights

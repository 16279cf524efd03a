"""`KVCache`: preallocated self-attention keys and values of a decoder's layers, for cached decoding
(the decoder-only `CausalLM` and the encoder-decoder `Decoder`).

Every layer's rotated keys and values live in one (B, h_kv, S_max, d_k) buffer allocated once;
a step writes its T new entries at slots [start, start + T) and attends to slots [0, start + T).
On jax and tensorflow it attends to all S_max slots, the unfilled ones hidden by the keep-mask: a
step is then one compiled program of fixed shapes (`CausalLM`); and jax compiles even each eager
operation for the shapes it sees, so a key length that grew every step compiled them all anew (about
3x the step's time, docs/performance.md).
`valid` (B, S_max) marks which slots hold real tokens (left padding does not), and `seen` (B,) counts
each row's real tokens, from which the next positions follow (docs/decisions.md item 34).

Legend: B batch, n layers, h_kv key/value heads, S_max capacity, d_k per-head width.
"""

import keras
import numpy as np
from keras import ops

from attnkit import kernels


class KVCache:
    """Keys, values and token bookkeeping for n layers.

    Args:
        n: layers.
        batch: B.
        num_kv_heads: h_kv.
        max_length: S_max, the most tokens (prompt and generated) the cache holds.
        d_k: per-head width of the keys.
        dtype: the model's compute dtype.
        d_v: per-head width of the values. Default d_k.

    Attributes:
        length: slots filled so far.
        valid: (B, S_max) NumPy bool, True where a slot holds a real (not padding) token.
        seen: (B,) NumPy int, real tokens per row so far.
    """

    def __init__(self, n, batch, num_kv_heads, max_length, d_k, dtype="float32", d_v=None):
        self.keys = [ops.zeros((batch, num_kv_heads, max_length, d_k), dtype) for _ in range(n)]  # (B, h_kv, S_max, d_k)
        self.values = [ops.zeros((batch, num_kv_heads, max_length, d_v or d_k), dtype) for _ in range(n)]
        self.max_length = max_length
        self.length = 0
        self.valid = np.zeros((batch, max_length), dtype=bool)
        self.seen = np.zeros((batch,), dtype="int64")

    @classmethod
    def of_buffers(cls, keys, values):
        """A cache holding the n given (B, h_kv, S_max, d) buffers and no bookkeeping: what a compiled
        step (`CausalLM`) writes into and returns, the host keeping `length`, `valid` and `seen`."""
        view = cls.__new__(cls)
        view.keys, view.values, view.max_length = list(keys), list(values), keys[0].shape[2]
        return view

    def check_room(self, new):
        """Raises a ValueError when `new` more tokens would not fit."""
        if self.length + new > self.max_length:
            raise ValueError(
                f"The KV cache holds {self.max_length} tokens; {self.length} are used and {new} more were given. "
                "Create it with a larger `max_length`."
            )

    @property
    def attended(self):
        """S, the slots a step attends to (and its keep-mask covers): those filled so far on torch, all
        S_max on jax and tensorflow (fixed shapes, so a step compiles once)."""
        return self.max_length if keras.backend.backend() in ("jax", "tensorflow") else self.length

    def update(self, layer, k, v, start):
        """Writes k, v (B, h_kv, T, d_k) at slots [start, start + T); returns slots [0, S) of both, S = `attended`."""
        if kernels._is_torch_tensor(k):
            # In place: the buffer is written, not copied, every step.
            self.keys[layer][:, :, start : start + k.shape[2]] = k
            self.values[layer][:, :, start : start + k.shape[2]] = v
        else:
            self.keys[layer] = ops.slice_update(self.keys[layer], (0, 0, start, 0), ops.cast(k, self.keys[layer].dtype))
            self.values[layer] = ops.slice_update(self.values[layer], (0, 0, start, 0), ops.cast(v, self.values[layer].dtype))
        S = self.attended
        if S == self.max_length:
            return self.keys[layer], self.values[layer]  # (B, h_kv, S_max, d_k)
        return self.keys[layer][:, :, :S], self.values[layer][:, :, :S]  # (B, h_kv, S, d_k)

    def reorder(self, rows):
        """Keeps the batch rows `rows` (N,) ints, in that order (beam search): B becomes N."""
        rows = np.asarray(rows)
        index = ops.convert_to_tensor(rows, "int32")
        self.keys = [ops.take(k, index, axis=0) for k in self.keys]
        self.values = [ops.take(v, index, axis=0) for v in self.values]
        self.valid, self.seen = self.valid[rows], self.seen[rows]

    def advance(self, valid_new):
        """Records T new slots; valid_new (B, T) bool. Returns their positions (B, T) (NumPy ints)."""
        valid_new = np.asarray(valid_new, dtype=bool)
        if valid_new.ndim != 2 or valid_new.shape[0] != self.valid.shape[0]:
            raise ValueError(
                f"The KV cache holds a batch of {self.valid.shape[0]} sequences; the new tokens must be "
                f"(batch, length) of that batch. Received: shape {valid_new.shape}"
            )
        self.check_room(valid_new.shape[1])
        positions = np.maximum(self.seen[:, None] + np.cumsum(valid_new, axis=1) - 1, 0)
        self.valid[:, self.length : self.length + valid_new.shape[1]] = valid_new
        self.seen += valid_new.sum(axis=1)
        self.length += valid_new.shape[1]
        return positions


def keep_mask(valid_keys, query_slots, window=None):
    """The keys each query may see: key slot j is visible to query slot i when j is valid, j <= i and,
    with a window, j > i - window.

    Args:
        valid_keys: (B, S) bool, NumPy.
        query_slots: (T,) the queries' slots, the last T of the S (cached decoding appends).
        window: None or a positive int.

    Returns:
        (keep, causal) for `DecoderOnlyLayer`: keep a (B, 1, T, S) keep-mask, or None with causal
        True (T > 1) or False (T = 1) when every key is valid and no window cuts. Then the mask is the
        plain bottom-right causal one, and the fused kernels' mask-free paths run (with a mask, torch's
        CPU kernel reads it per score; docs/performance.md).
    """
    S = valid_keys.shape[1]
    if valid_keys.all() and (window is None or window >= S):
        return None, len(query_slots) > 1
    slots = np.arange(S)[None, :]  # (1, S)
    query_slots = np.asarray(query_slots)[:, None]  # (T, 1)
    keep = slots <= query_slots  # (T, S)
    if window is not None:
        keep &= slots > query_slots - window
    keep = valid_keys[:, None, None, :] & keep[None, None]  # (B, 1, T, S)
    return keras.ops.convert_to_tensor(keep), False

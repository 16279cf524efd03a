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
        if kernels.is_torch_tensor(k):
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

    # Row operations for continuous batching (attnkit.server; docs/decisions.md item 115): sequences
    # join and leave a batch between steps. A row's keys are rotated at its own positions before they
    # are written, and `valid` says which of its slots it attends to, so where its slots lie does not
    # change what it computes: a prompt prefilled alone can be placed at any free run of slots.

    def rows(self, start, stop):
        """A cache of rows [start, stop) sharing this one's bookkeeping (NumPy views, written through)
        and, on torch, its buffers (views written in place); on jax and tensorflow `merge_rows` writes
        the view's new buffers back."""
        view = KVCache.of_buffers([k[start:stop] for k in self.keys], [v[start:stop] for v in self.values])
        view.length, view.valid, view.seen = self.length, self.valid[start:stop], self.seen[start:stop]
        return view

    def merge_rows(self, view, start):
        """Takes the step `view` (from `rows(start, ...)`) ran: its length and, off torch, its buffers."""
        self.length = view.length
        if not kernels.is_torch_tensor(self.keys[0]):
            self.keys = [_written(b, k, start, 0) for b, k in zip(self.keys, view.keys)]
            self.values = [_written(b, v, start, 0) for b, v in zip(self.values, view.values)]

    def place(self, row, source, source_row, at):
        """Copies row `source_row` of `source` (another cache of this layout), its slots [0, source.length),
        into row `row` at slots [at, at + source.length); the row's other slots become invalid."""
        n = source.length
        if not (0 <= at and at + n <= self.max_length):
            raise ValueError(f"Slots [{at}, {at + n}) are outside the cache's {self.max_length}")
        for buffers, sources in ((self.keys, source.keys), (self.values, source.values)):
            for i, (buffer, part) in enumerate(zip(buffers, sources)):
                buffers[i] = _written(buffer, part[source_row : source_row + 1, :, :n], row, at)  # (1, h_kv, n, d)
        valid = source.valid[source_row, :n].copy()  # copied first: `source` may be this cache
        self.valid[row] = False
        self.valid[row, at : at + n] = valid
        self.seen[row] = source.seen[source_row]

    def compact(self, count):
        """Moves the valid slots of rows [0, count) to the end of slots [0, L'), L' the most any row
        holds, in their order; the rest of the cache becomes invalid and `length` L'. Returns L'."""
        valid = self.valid[:count, : self.length]  # (count, L)
        held = valid.sum(axis=1)
        new_length = int(held.max()) if count else 0
        index = np.zeros((count, new_length), "int32")  # (count, L'): the slot each new slot reads
        new_valid = np.zeros((count, new_length), bool)
        for r in range(count):
            slots = np.flatnonzero(valid[r])
            index[r, new_length - len(slots):] = slots
            new_valid[r, new_length - len(slots):] = True
        if count and new_length:
            for buffers in (self.keys, self.values):
                for i, buffer in enumerate(buffers):
                    _, h, _, d = buffer.shape
                    gather = ops.broadcast_to(ops.convert_to_tensor(index[:, None, :, None]), (count, h, new_length, d))
                    moved = ops.take_along_axis(buffer[:count], gather, axis=2)  # (count, h_kv, L', d)
                    buffers[i] = _written(buffer, moved, 0, 0)
        self.valid[:] = False
        self.valid[:count, :new_length] = new_valid
        self.length = new_length
        return new_length

    def grow(self, max_length):
        """Room for `max_length` slots: the buffers are extended with empty slots."""
        extra = max_length - self.max_length
        if extra < 0:
            raise ValueError(f"The cache holds {self.max_length} slots; it cannot grow to {max_length}")
        for buffers in (self.keys, self.values):
            for i, buffer in enumerate(buffers):
                B, h, _, d = buffer.shape
                buffers[i] = ops.concatenate([buffer, ops.zeros((B, h, extra, d), buffer.dtype)], axis=2)
        self.valid = np.concatenate([self.valid, np.zeros((self.valid.shape[0], extra), bool)], axis=1)
        self.max_length = max_length

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


def _written(buffer, part, row, slot):
    """`buffer` (B, h, S, d) with `part` (b, h, s, d) written at rows [row, row + b), slots [slot, slot + s):
    in place on torch, a new array elsewhere."""
    if kernels.is_torch_tensor(buffer):
        buffer[row : row + part.shape[0], :, slot : slot + part.shape[2]] = part
        return buffer
    return ops.slice_update(buffer, (row, 0, slot, 0), ops.cast(part, buffer.dtype))


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

"""The per-token cross-entropy of a language model's logits on torch, with its own backward
(docs/decisions.md item 150).

torch's `cross_entropy` (what Keras's and transformers' losses call) writes the (N, V) log-softmax
in the forward, and in the backward a zero-filled (N, V) gradient of the picked entries and the
log-softmax's backward over both: six passes over an (N, V) tensor, 200 MB each for 1024 tokens of a
49152-word vocabulary. Here the forward reads the logits for each row's max and log-sum-exp, and
the backward writes softmax - one-hot, times the upstream gradient, in one pass: rows are taken a few
at a time so that each row's intermediate values stay in the cache.

Legend: N tokens, V vocabulary.
"""

import keras

from attnkit.kernels import onednn, tensor_checks

# rows per pass: 16 rows of a 49152-word vocabulary are 3 MB of float32
_ROWS = 16


def token_cross_entropy(targets, logits):
    """-log softmax(logits)[targets] per token, (N,), or None where this kernel does not take the inputs.

    Args:
        targets: (N,) integer class ids in [0, V) (torch raises an index error for others).
        logits: (N, V) float32 torch tensor.

    Returns:
        (N,) float32 on torch, for a float32 (N, V) tensor and (N,) integer ids; else None (the
        caller's `keras.ops` path gives the same numbers). A second derivative is refused.

    Example (torch):
    >>> token_cross_entropy(torch.tensor([0, 2]), torch.zeros(2, 3))  # log 3 each: tensor([1.0986, 1.0986])
    """
    if keras.backend.backend() != "torch":
        return None
    import torch

    logits, targets = tensor_checks.value_of(logits), tensor_checks.value_of(targets)
    if not (isinstance(logits, torch.Tensor) and isinstance(targets, torch.Tensor)):
        return None
    if logits.dtype != torch.float32 or logits.dim() != 2 or targets.dim() != 1 or targets.shape[0] != logits.shape[0]:
        return None
    if targets.is_floating_point() or targets.is_complex() or torch.compiler.is_compiling():
        return None
    return TokenCrossEntropy.apply(logits, targets.long())


def learned_rows(keep):
    """The indices (K,) of the True entries of `keep` (N,) bool, or None: torch only, outside
    `torch.compile`, and only when some entry is False (all rows learned: nothing to select).

    A chat's loss learns the assistant's tokens only, ~20% of a padded batch: the vocabulary
    projection (a fifth of a small model's products) and the cross-entropy are then taken on those
    rows alone. jax and tensorflow compile shapes known before the values, and project every row."""
    if keras.backend.backend() != "torch":
        return None
    import torch

    keep = tensor_checks.value_of(keep)
    if not isinstance(keep, torch.Tensor) or keep.dtype != torch.bool or keep.dim() != 1 or torch.compiler.is_compiling():
        return None
    rows = keep.nonzero().squeeze(1)  # (K,)
    return None if rows.shape[0] == keep.shape[0] else rows


def spread_rows(rows, values, n):
    """(n,) zeros with `values` (K,) at `rows` (K,) from `learned_rows` (torch; differentiable in values)."""
    return values.new_zeros(n).index_copy(0, rows, values)


def _token_cross_entropy_class():
    import torch
    from torch.autograd.function import once_differentiable

    class TokenCrossEntropy(torch.autograd.Function):
        """(N,) (max - picked logit) + log sum exp(logits - max); backward (softmax - one-hot) x
        upstream, a block of rows at a time."""

        @staticmethod
        def forward(ctx, logits, targets):
            # Each row's log-sum-exp kept as its max m and s = log sum exp(x - m), never added up:
            # m + s rounds by |m| eps, which would enter every loss and softmax entry; this way the
            # rounding scales with x - m, as in torch's log-softmax.
            peak = logits.amax(1)  # (N,) m
            spread = torch.empty_like(peak)  # (N,) s
            for i in range(0, logits.shape[0], _ROWS):
                shifted = logits[i : i + _ROWS] - peak[i : i + _ROWS, None]  # (rows, V), in the cache
                torch.log(shifted.exp_().sum(1), out=spread[i : i + _ROWS])
            picked = logits.gather(1, targets[:, None]).squeeze(1)  # (N,)
            ctx.save_for_backward(logits, targets, peak, spread)
            return (peak - picked) + spread

        @staticmethod
        @once_differentiable
        def backward(ctx, grad):
            logits, targets, peak, spread = ctx.saved_tensors
            grad = grad.contiguous()  # (N,)
            grad_logits = torch.empty_like(logits)  # (N, V)
            for i in range(0, logits.shape[0], _ROWS):
                block = grad_logits[i : i + _ROWS]
                torch.sub(logits[i : i + _ROWS], peak[i : i + _ROWS, None], out=block)
                block.sub_(spread[i : i + _ROWS, None]).exp_().mul_(grad[i : i + _ROWS, None])  # softmax x upstream
            rows = torch.arange(targets.shape[0], device=targets.device)
            grad_logits[rows, targets] -= grad  # minus the one-hot
            return grad_logits, None

    return TokenCrossEntropy


TokenCrossEntropy = onednn._LazyFunction(_token_cross_entropy_class)

"""The per-token cross-entropy on torch (`kernels.token_cross_entropy`, docs/decisions.md item 150):
losses and gradients against float64 NumPy and against torch's own `cross_entropy` (non-finite
logits included), what it leaves to `keras.ops`, and a refused second derivative.

Legend: N tokens, V vocabulary.
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backend_utils import BACKEND

from attnkit import kernels

pytestmark = pytest.mark.skipif(BACKEND != "torch", reason="the Function is torch's")

if BACKEND == "torch":
    import torch
    import torch.nn.functional as F


def _float64(logits, targets, upstream):
    """float64 (loss (N,), d loss . upstream / d logits (N, V))."""
    z = logits.astype(np.float64)
    shifted = z - z.max(1, keepdims=True)
    lse = np.log(np.exp(shifted).sum(1)) + z.max(1)
    softmax = np.exp(z - lse[:, None])
    onehot = np.zeros_like(z)
    onehot[np.arange(len(targets)), targets] = 1
    return lse - z[np.arange(len(targets)), targets], (softmax - onehot) * upstream[:, None].astype(np.float64)


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(0, 40), v=st.integers(1, 70), spread=st.sampled_from([1.0, 30.0, 1e4]),
    offset=st.sampled_from([0.0, 300.0, -1e4]), seed=st.integers(0, 2**16),
)
def test_losses_and_gradients_equal_float64(n, v, spread, offset, seed):
    rng = np.random.default_rng(seed)
    logits = (rng.standard_normal((n, v)) * spread + offset).astype("float32")
    targets = rng.integers(0, v, n)
    upstream = rng.standard_normal(n).astype("float32")
    x = torch.tensor(logits, requires_grad=True)
    loss = kernels.token_cross_entropy(torch.tensor(targets), x)
    assert "TokenCrossEntropy" in type(loss.grad_fn).__name__
    loss.backward(torch.tensor(upstream))
    want_loss, want_grad = _float64(logits, targets, upstream)
    # the rounding scales with the logits' spread within a row, not with their common offset
    np.testing.assert_allclose(loss.detach().numpy(), want_loss, rtol=1e-5, atol=2e-6 * spread)
    np.testing.assert_allclose(x.grad.numpy(), want_grad, rtol=1e-5, atol=2e-6)


def test_more_rows_than_one_block_and_non_finite_logits_equal_torchs():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((37, 50)).astype("float32")  # 37 rows: blocks of 16, 16 and 5
    logits[3, 7] = -np.inf  # a word ruled out: no loss change, zero gradient
    logits[5, :] = -np.inf  # a row of -inf: NaN, as torch's
    logits[9, 2] = np.nan
    logits[11, 4] = np.inf
    targets = rng.integers(0, 50, 37)
    targets[3] = 8
    upstream = torch.tensor(rng.standard_normal(37).astype("float32"))
    ours, theirs = (torch.tensor(logits, requires_grad=True) for _ in range(2))
    got = kernels.token_cross_entropy(torch.tensor(targets), ours)
    want = F.cross_entropy(theirs, torch.tensor(targets), reduction="none")
    got.backward(upstream), want.backward(upstream)
    assert torch.isnan(got[[5, 9, 11]]).all()  # a row of -inf, a NaN, a +inf: NaN, as torch's
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, equal_nan=True)
    torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-5, atol=1e-6, equal_nan=True)
    assert ours.grad[3, 7] == 0


def test_out_of_range_ids_are_refused():
    with pytest.raises((IndexError, RuntimeError)):
        kernels.token_cross_entropy(torch.tensor([0, 5]), torch.zeros(2, 5))
    with pytest.raises((IndexError, RuntimeError)):
        kernels.token_cross_entropy(torch.tensor([-1, 0]), torch.zeros(2, 5))


def test_a_second_derivative_is_refused():
    x = torch.randn(4, 6, requires_grad=True)
    (grad,) = torch.autograd.grad(kernels.token_cross_entropy(torch.tensor([0, 1, 2, 3]), x).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable|does not require grad|twice"):
        grad.sum().backward()


def test_inputs_it_leaves_to_keras_ops():
    ids = torch.tensor([0, 1])
    assert kernels.token_cross_entropy(ids, torch.zeros(2, 5).bfloat16()) is None
    assert kernels.token_cross_entropy(ids, torch.zeros(2, 5, dtype=torch.float64)) is None
    assert kernels.token_cross_entropy(ids, torch.zeros(1, 2, 5)) is None
    assert kernels.token_cross_entropy(ids.float(), torch.zeros(2, 5)) is None
    assert kernels.token_cross_entropy(ids, torch.zeros(3, 5)) is None
    assert kernels.token_cross_entropy(np.array([0, 1]), np.zeros((2, 5), "float32")) is None

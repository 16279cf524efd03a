"""torch's CPU fast paths (docs/decisions.md item 60): oneDNN's linear forward and backward, the
kept casts and joined kernels of mixed precision, and bfloat16 attention as two batched GEMMs.
Each is checked against float64 NumPy, against the path it replaces, and for the cases where it
must step aside. torch only: the other backends compile these products themselves.

Legend: N rows, d_in input width, d_out output width.
"""

import keras
import numpy as np
import pytest

import reference
from backend_utils import BACKEND, to_numpy

pytestmark = pytest.mark.skipif(BACKEND != "torch", reason="torch's own CPU kernels")

if BACKEND == "torch":
    import torch

    from attnkit import kernels as _fused
    from attnkit.kernels import kept as kept_values, onednn, torch_attention


def _float64_linear(x, kernel, bias, activation):
    y = x.astype(np.float64) @ kernel.astype(np.float64) + (0 if bias is None else bias.astype(np.float64))
    return np.maximum(y, 0) if activation == "relu" else y


@pytest.fixture(autouse=True)
def on_the_cpu():
    """These are the CPU's kernels: on a machine with a GPU, Keras would put variables and tensors there."""
    with keras.device("cpu"):  # "cpu", as Keras names its default: "cpu:0" would copy each variable per read
        yield


@pytest.fixture
def onednn_or_not(monkeypatch, request):
    """Runs the test with oneDNN's linear enabled and disabled (`ATTNKIT_ONEDNN=0`'s switch)."""
    monkeypatch.setattr(onednn, "ONEDNN", request.param)
    return request.param


@pytest.mark.parametrize("onednn_or_not", [True, False], indirect=True)
@pytest.mark.parametrize("activation", [None, "relu", "gelu"])
@pytest.mark.parametrize("shape", [(1, 7), (9, 7), (2, 5, 7)])
def test_linear_without_autograd_equals_float64(rng, onednn_or_not, activation, shape):
    x = rng.standard_normal(shape).astype("float32")
    kernel, bias = rng.standard_normal((7, 13)).astype("float32"), rng.standard_normal(13).astype("float32")
    with torch.no_grad():
        got = _fused.torch_linear(*(torch.from_numpy(a) for a in (x, kernel, bias)), activation)
    expected = _float64_linear(x, kernel, bias, activation)
    if activation == "gelu":
        expected = torch.nn.functional.gelu(torch.from_numpy(expected)).numpy()
    assert got.dtype == torch.float32 and tuple(got.shape) == (*shape[:-1], 13)
    np.testing.assert_allclose(got.numpy(), expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("post_op", [True, False])
@pytest.mark.parametrize("rows", [1, 9, 300])
def test_gelu_as_onednns_post_op_or_after_the_linear_equals_float64(rng, monkeypatch, post_op, rows):
    """GELU fused into oneDNN's linear (AVX-512) or applied in place after it (AVX2, item 155): the
    same values, and under autograd the same gradients, torch's GELU then."""
    monkeypatch.setattr(onednn, "gelu_post_op_pays", lambda: post_op)
    x = rng.standard_normal((rows, 7)).astype("float32")
    kernel, bias = rng.standard_normal((7, 13)).astype("float32"), rng.standard_normal(13).astype("float32")
    pre = torch.from_numpy(_float64_linear(x, kernel, bias, None)).requires_grad_(True)
    expected = torch.nn.functional.gelu(pre)
    with torch.no_grad():
        got = _fused.torch_linear(*(torch.from_numpy(a) for a in (x, kernel, bias)), "gelu")
    np.testing.assert_allclose(got.numpy(), expected.detach().numpy(), rtol=0, atol=1e-5)
    upstream = torch.from_numpy(rng.standard_normal((rows, 13)))
    xt, kt, bt = (torch.tensor(a, requires_grad=True) for a in (x, kernel, bias))
    y = _fused.torch_linear(xt, kt, bt, "gelu")
    y.backward(upstream.float())
    expected.backward(upstream)
    np.testing.assert_allclose(y.detach().numpy(), expected.detach().numpy(), rtol=0, atol=1e-5)
    np.testing.assert_allclose(xt.grad.numpy(), pre.grad.numpy() @ kernel.T, rtol=0, atol=1e-4)
    np.testing.assert_allclose(bt.grad.numpy(), pre.grad.numpy().sum(0), rtol=0, atol=1e-4)


@pytest.mark.parametrize("avx512", [True, False])
def test_without_autograd_the_kernels_view_goes_to_onednn_on_avx512_only(rng, monkeypatch, avx512):
    """item 156: on an AVX2 CPU addmm(b, x, K) reads a (d_in, d_out) kernel faster than oneDNN its
    transposed view; a contiguous (d_out, d_in) weight (a kept row-major copy) stays oneDNN's."""
    monkeypatch.setattr(onednn, "avx512", lambda: avx512)
    calls = []
    linear_pointwise = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda *a: calls.append(1) or linear_pointwise(*a))
    x = rng.standard_normal((9, 7)).astype("float32")
    kernel, bias = rng.standard_normal((7, 13)).astype("float32"), rng.standard_normal(13).astype("float32")
    with torch.no_grad():
        got = _fused.torch_linear(*(torch.from_numpy(a) for a in (x, kernel, bias)), "relu")
    np.testing.assert_allclose(got.numpy(), _float64_linear(x, kernel, bias, "relu"), rtol=0, atol=1e-5)
    assert len(calls) == (1 if avx512 else 0)
    assert onednn.view_pays(torch.from_numpy(kernel).t()) == avx512 and onednn.view_pays(torch.from_numpy(kernel))


def test_onednn_runs_where_it_should_and_only_there(rng):
    x2, x1 = torch.randn(4, 7), torch.randn(1, 7)
    kernel = torch.randn(7, 3)
    weight = kernel.t()
    assert onednn.takes(x2, weight, None) and not onednn.takes(x1, weight, None)  # one row: GEMV
    assert onednn.takes(x1, weight, None, packed=True)  # without the per-call reorder, one row too
    assert not onednn.takes(x2.double(), weight.double(), None)  # float64: torch's own
    assert not onednn.takes(x2.half(), weight.half(), None)
    assert not onednn.takes(x2, torch.randn(7, 6)[:, ::2].t(), None)  # a kernel with gaps
    on_meta = torch.empty(7, 3, device="meta").t()  # a device oneDNN's CPU operators cannot read, as a GPU's
    assert not onednn.takes(x2, on_meta, None, packed=True)
    assert not onednn.takes(x2, weight, torch.empty(3, device="meta"))
    with torch.backends.mkldnn.flags(enabled=False):  # the user switched oneDNN off
        assert not onednn.takes(x2, weight, None)
    kernel.requires_grad_(True)
    y = _fused.torch_linear(x2, kernel, None, "relu")
    assert "OneDNNLinear" in type(y.grad_fn).__name__
    y = _fused.torch_linear(x2, kernel, None, "gelu")  # GELU under autograd: torch's own
    assert "OneDNNLinear" not in type(y.grad_fn).__name__


@pytest.mark.parametrize("activation", [None, "relu"])
@pytest.mark.parametrize("needs", ["all", "x only", "kernel only"])
def test_onednn_gradients_equal_float64(rng, activation, needs):
    x = rng.standard_normal((2, 5, 7)).astype("float32")
    kernel = rng.standard_normal((7, 13)).astype("float32")
    bias = rng.standard_normal(13).astype("float32")
    x[0, 0] = 0  # a row whose pre-activations are exactly the bias
    upstream = rng.standard_normal((2, 5, 13)).astype("float32")
    xt, kt, bt = (torch.tensor(a, requires_grad=True) for a in (x, kernel, bias))
    if needs == "x only":
        kt.requires_grad_(False), bt.requires_grad_(False)
    if needs == "kernel only":
        xt.requires_grad_(False)
    y = _fused.torch_linear(xt, kt, bt, activation)
    assert "OneDNNLinear" in type(y.grad_fn).__name__
    y.backward(torch.from_numpy(upstream))
    pre = _float64_linear(x, kernel, bias, None)
    d_pre = upstream * (pre > 0) if activation == "relu" else upstream.astype(np.float64)
    np.testing.assert_allclose(y.detach().numpy(), _float64_linear(x, kernel, bias, activation), atol=1e-5)
    if needs != "kernel only":
        np.testing.assert_allclose(xt.grad.numpy(), d_pre @ kernel.T, atol=1e-5)
    else:
        assert xt.grad is None
    if needs != "x only":
        np.testing.assert_allclose(kt.grad.numpy(), x.reshape(-1, 7).T.astype(np.float64) @ d_pre.reshape(-1, 13), atol=1e-4)
        np.testing.assert_allclose(bt.grad.numpy(), d_pre.reshape(-1, 13).sum(0), atol=1e-5)
    else:
        assert kt.grad is None and bt.grad is None


def test_onednn_second_derivatives_equal_torchs(rng):
    x, kernel = (torch.tensor(rng.standard_normal(s).astype("float32"), requires_grad=True) for s in ((6, 5), (5, 4)))
    ours, theirs = x.detach().clone().requires_grad_(True), kernel.detach().clone().requires_grad_(True)
    y = _fused.torch_linear(x, kernel, None, "relu")
    (grad_x,) = torch.autograd.grad(y.pow(2).sum(), x, create_graph=True)
    grad_x.pow(2).sum().backward()
    y_ref = torch.relu(ours @ theirs)
    (grad_ref,) = torch.autograd.grad(y_ref.pow(2).sum(), ours, create_graph=True)
    grad_ref.pow(2).sum().backward()
    torch.testing.assert_close(grad_x, grad_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kernel.grad, theirs.grad, rtol=1e-4, atol=1e-4)


@pytest.fixture
def native_or_not(monkeypatch, request):
    """Runs the test as on a CPU with oneDNN's half-precision kernels and as on one without
    (`onednn.native_half`); only paths that run on either kind of CPU take this fixture."""
    monkeypatch.setattr(onednn, "native_half", lambda dtype: request.param)
    return request.param


@pytest.mark.parametrize("rows", [16, 64])
def test_bfloat16_linear_is_close_to_float64(rng, rows):
    x = rng.standard_normal((rows, 64)).astype("float32")
    kernel, bias = (rng.standard_normal((64, 32)) / 8).astype("float32"), rng.standard_normal(32).astype("float32")
    as_bf16 = [torch.from_numpy(a).bfloat16() for a in (x, kernel, bias)]
    with torch.no_grad():
        got = _fused.torch_linear(as_bf16[0], as_bf16[1], as_bf16[2], "relu")
    assert got.dtype == torch.bfloat16
    exact = _float64_linear(*(a.float().numpy() for a in as_bf16), "relu")  # the rounded inputs, exactly
    np.testing.assert_allclose(got.float().numpy(), exact, rtol=2**-7, atol=2**-7)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("activation", [None, "relu", "gelu"])
@pytest.mark.parametrize("autograd", [False, True])
def test_half_precision_linear_without_native_kernels_is_float32_arithmetic_rounded_once(rng, monkeypatch, dtype, activation, autograd):
    """On a CPU without oneDNN's half-precision kernels (an AVX2 EPYC, where oneDNN refuses a bfloat16
    linear) products of ONEDNN_BFLOAT16_MIN_ROWS rows or more run in float32 on the exact casts: the
    float64 result of the rounded inputs, rounded once to the dtype (within one unit of float32's
    order of additions); fewer rows stay in torch's half-precision GEMM."""
    monkeypatch.setattr(onednn, "native_half", lambda d: False)
    dtype = getattr(torch, dtype)
    x = torch.from_numpy(rng.standard_normal((2, 24, 48)).astype("float32")).to(dtype)  # 48 rows
    kernel = torch.from_numpy((rng.standard_normal((48, 40)) / 6).astype("float32")).to(dtype)
    bias = torch.from_numpy(rng.standard_normal(40).astype("float32")).to(dtype)
    assert onednn.half_as_float32(x, kernel.t()) and not onednn.takes(x, kernel.t(), bias)
    assert not onednn.half_as_float32(x[:1, :8], kernel.t())  # 8 rows: torch's own GEMM
    exact = _float64_linear(*(t.double().numpy() for t in (x, kernel, bias)), activation)
    if activation == "gelu":
        exact = torch.nn.functional.gelu(torch.from_numpy(exact)).numpy()
    if autograd:
        wide = [t.double().requires_grad_(True) for t in (x, kernel, bias)]  # float64 autograd, same values
        y = wide[0] @ wide[1] + wide[2]
        y = {None: y, "relu": torch.relu(y), "gelu": torch.nn.functional.gelu(y)}[activation]
        y.sum().backward()
        for t in (x, kernel, bias):
            t.requires_grad_(True)
        got = _fused.torch_linear(x, kernel, bias, activation)
        got.float().sum().backward()
        for ours, want in zip((x, kernel, bias), wide):
            assert ours.grad.dtype == dtype and ours.grad.shape == want.grad.shape
            # float32 gradients rounded to the dtype; their sums of up to 48 terms of |.| <= ~3
            np.testing.assert_allclose(ours.grad.double().numpy(), want.grad.numpy(), rtol=2**-6, atol=2**-5)
    else:
        packed = []
        monkeypatch.setattr(onednn, "packed", lambda weight, transposed: packed.append(weight))
        with torch.no_grad():
            got = _fused.torch_linear(x, kernel, bias, activation)
        assert packed == []  # the per-call float32 casts are not prepacked
    assert got.dtype == dtype and tuple(got.shape) == (2, 24, 40)
    rounded = torch.from_numpy(exact).to(dtype).double().numpy()
    # One unit in the last place of the dtype, plus float32's own error on 48 products.
    magnitude = np.abs(x.detach().double().numpy()) @ np.abs(kernel.detach().double().numpy()) + np.abs(bias.detach().double().numpy())
    bound = np.abs(rounded) * (2.0**-7 if dtype == torch.bfloat16 else 2.0**-10) + 48 * 2.0**-24 * magnitude
    np.testing.assert_array_less(np.abs(got.detach().double().numpy() - rounded), bound + 2.0**-24)


@pytest.mark.parametrize("native_or_not", [True, False], indirect=True)
def test_a_tied_vocabulary_projection_in_bfloat16_is_close_to_float64(rng, monkeypatch, native_or_not):
    """`times_transposed` (x weight^T for a (vocabulary, d) table) multiplies as `torch_linear` does:
    oneDNN's bfloat16 linear where the CPU has it, the float32 product of the casts where it has not,
    torch's bfloat16 GEMM for few rows; a bias of another dtype is refused by torch, not mixed in."""
    if native_or_not and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("oneDNN has no bfloat16 linear on this CPU (AVX2): it would refuse the product")
    weight = torch.from_numpy((rng.standard_normal((50, 24)) / 5).astype("float32")).bfloat16()
    packed, pack = [], onednn.packed
    monkeypatch.setattr(onednn, "packed", lambda w, transposed: packed.append(w) or pack(w, transposed))
    for rows in (3, 40):
        x = torch.from_numpy(rng.standard_normal((rows, 24)).astype("float32")).bfloat16()
        assert onednn.half_as_float32(x, weight) == (rows >= onednn.ONEDNN_BFLOAT16_MIN_ROWS and not native_or_not)
        with torch.no_grad():
            got = _fused.times_transposed(x, weight)
        assert got.dtype == torch.bfloat16 and tuple(got.shape) == (rows, 50)
        exact = x.double().numpy() @ weight.double().numpy().T
        np.testing.assert_allclose(got.double().numpy(), exact, rtol=2**-7, atol=2**-7)
    assert not onednn.half_as_float32(x, weight.t(), torch.zeros(50))  # float32 bias: not cast in silently
    assert all(w is weight for w in packed) and (len(packed) > 0) == native_or_not  # never a per-call cast


def _mixed_dense(rng, units=12):
    keras.config.set_dtype_policy("mixed_bfloat16")
    try:
        layer = keras.Sequential([keras.Input((6,)), __import__("attnkit").Linear(units)])
    finally:
        keras.config.set_dtype_policy("float32")
    x = rng.standard_normal((5, 6)).astype("float32")
    return layer, x


def _bf16_reference(x, kernel, bias):
    """The mixed-precision product: inputs and weights rounded to bfloat16, then the float64 product."""
    rounded = [torch.from_numpy(np.asarray(a, "float32")).bfloat16().double().numpy() for a in (x, kernel, bias)]
    return rounded[0] @ rounded[1] + rounded[2]


def test_a_kept_mixed_precision_cast_follows_every_assignment(rng):
    layer, x = _mixed_dense(rng)
    dense = layer.layers[-1]
    for step in range(3):
        with torch.no_grad():
            out = to_numpy(layer(x)).astype(np.float64)
        np.testing.assert_allclose(out, _bf16_reference(x, dense.kernel.numpy(), dense.bias.numpy()), rtol=2**-7, atol=2**-6)
        if step == 0:
            dense.kernel.assign(dense.kernel.numpy() * -2.0)  # in place: the tensor's version moves
        else:
            dense.kernel._value = torch.nn.Parameter(torch.from_numpy(rng.standard_normal((6, 12)).astype("float32")))


def test_mixed_precision_under_autograd_reaches_the_float32_variables(rng):
    layer, x = _mixed_dense(rng)
    with torch.no_grad():
        layer(x)  # fills the kept cast
    dense = layer.layers[-1]
    loss = layer(x).float().sum()
    loss.backward()
    grad = dense.kernel.value.grad
    assert grad is not None and grad.dtype == torch.float32
    np.testing.assert_allclose(grad.numpy(), np.broadcast_to(x.sum(0)[:, None], (6, 12)), rtol=2**-6, atol=2**-5)


def test_a_stateless_call_reads_its_own_values_not_the_kept_cast(rng):
    layer, x = _mixed_dense(rng)
    with torch.no_grad():
        layer(x)
        kernel, bias = rng.standard_normal((6, 12)).astype("float32"), rng.standard_normal(12).astype("float32")
        by_value = {id(v): a for v, a in zip(layer.trainable_variables, (kernel, bias))}
        values = [torch.from_numpy(by_value[id(v)]) for v in layer.trainable_variables]
        out, _ = layer.stateless_call(values, [], x)
    np.testing.assert_allclose(to_numpy(out).astype(np.float64), _bf16_reference(x, kernel, bias), rtol=2**-7, atol=2**-6)


def test_the_joined_projection_kernel_follows_every_assignment(rng):
    from attnkit import MultiHeadAttention

    mha = MultiHeadAttention(2, 3, 3, 8)
    x = rng.standard_normal((2, 4, 8)).astype("float32")
    mha(x)
    for _ in range(2):
        with torch.no_grad():
            out = to_numpy(mha(x))
        q, k, v = (x @ d.kernel.numpy() + d.bias.numpy() for d in (mha.W_q, mha.W_k, mha.W_v))
        heads = [reference.attention(*(p.reshape(2, 4, 2, 3).transpose(0, 2, 1, 3) for p in (q, k, v)))[0]]
        merged = heads[0].transpose(0, 2, 1, 3).reshape(2, 4, 6)
        np.testing.assert_allclose(out, merged @ mha.W_o.kernel.numpy() + mha.W_o.bias.numpy(), atol=1e-5)
        mha.W_k.kernel.assign(rng.standard_normal((8, 6)).astype("float32"))


def _bf16(rng, shape, scale=1.0):
    return torch.from_numpy((rng.standard_normal(shape) * scale).astype("float32")).bfloat16()


@pytest.mark.parametrize("native_or_not", [True, False], indirect=True)
@pytest.mark.parametrize("case", ["plain", "causal", "mask with empty rows", "4d mask"])
def test_bfloat16_attention_as_batched_gemms_is_close_to_float64(rng, native_or_not, case):
    from attnkit.ops import fused_attention

    q, k, v = _bf16(rng, (2, 3, 6, 8), 2.0), _bf16(rng, (2, 3, 6, 8), 2.0), _bf16(rng, (2, 3, 6, 5))
    mask, causal = None, case == "causal"
    if case == "mask with empty rows":
        mask = rng.random((2, 1, 1, 6)) < 0.6  # (B, 1, 1, T_k)
        mask[1] = False  # the second example sees no key at all
    if case == "4d mask":
        mask = rng.random((2, 3, 6, 6)) < 0.5
        mask[0, 1, 2] = False
    assert torch_attention.bmm_takes(q, k, v)
    with torch.no_grad():
        out = fused_attention(q, k, v, mask, causal=causal).float().numpy()
    keep = reference.causal_keep(6, 6) if causal else (np.ones((6, 6), bool) if mask is None else mask)
    expected = reference.attention(*(t.double().numpy() for t in (q, k, v)), np.broadcast_to(keep, (2, 3, 6, 6)))[0]
    empty = ~np.broadcast_to(keep, (2, 3, 6, 6)).any(-1)
    assert (out[empty] == 0).all()
    # bfloat16 scores (|score| <= ~20 here: 2^-8 relative) and weights: about 2^-5 of |v| <= 4.
    np.testing.assert_allclose(out, expected, rtol=0, atol=0.15)


def test_bfloat16_attention_propagates_nan_and_steps_aside_under_autograd(rng):
    from attnkit.ops import fused_attention

    q, k, v = _bf16(rng, (1, 2, 4, 8)), _bf16(rng, (1, 2, 4, 8)), _bf16(rng, (1, 2, 4, 8))
    k[0, 1, 2, 3] = float("nan")
    with torch.no_grad():
        out = fused_attention(q, k, v).float().numpy()
    assert np.isnan(out[0, 1]).all() and np.isfinite(out[0, 0]).all()  # every query of head 1 reads key 2
    q.requires_grad_(True)
    assert not torch_attention.bmm_takes(q, k, v)  # the flash kernel's backward keeps no (T_q, T_k) weights


@pytest.mark.parametrize("case", ["decoding step, padded batch", "causal prompt", "per-head mask", "no key"])
def test_grouped_bfloat16_attention_reads_each_kv_head_once_and_is_close_to_float64(rng, case):
    """h = 6 query heads over h_kv = 2 key/value heads, as `repeat_kv` pairs them (head j reads j // 3)."""
    from attnkit.ops.grouped_attention import grouped_query_attention, repeat_kv

    T_q = 1 if case.startswith("decoding") else 5
    q, k, v = _bf16(rng, (2, 6, T_q, 8), 2.0), _bf16(rng, (2, 2, 5, 8), 2.0), _bf16(rng, (2, 2, 5, 4))
    mask, causal = None, case == "causal prompt"
    if case.startswith("decoding"):
        mask = np.ones((2, 1, 1, 5), bool)
        mask[1, ..., :2] = False  # the second prompt is left-padded by two
    if case == "per-head mask":
        mask = rng.random((2, 6, T_q, 5)) < 0.6
    if case == "no key":
        mask = np.ones((2, 1, T_q, 5), bool)
        mask[0, 0, 3] = False
    assert torch_attention.bmm_takes(q, k, v)
    with torch.no_grad():
        out = grouped_query_attention(q, k, v, mask, causal=causal).float().numpy()
    keep = reference.causal_keep(T_q, 5) if causal else (np.ones((T_q, 5), bool) if mask is None else mask)
    keep = np.broadcast_to(keep, (2, 6, T_q, 5))
    repeated = [to_numpy(repeat_kv(t.double(), 3)) for t in (k, v)]  # (2, 6, 5, d)
    expected = reference.attention(q.double().numpy(), *repeated, keep)[0]
    assert out.shape == (2, 6, T_q, 4) and (out[~keep.any(-1)] == 0).all()
    np.testing.assert_allclose(out, expected, rtol=0, atol=0.15)


def test_grouped_bfloat16_attention_propagates_nan(rng):
    from attnkit.ops.grouped_attention import grouped_query_attention

    q, k, v = _bf16(rng, (1, 4, 1, 8)), _bf16(rng, (1, 2, 3, 8)), _bf16(rng, (1, 2, 3, 8))
    v[0, 1, 0, 0] = float("nan")  # read by query heads 2 and 3 only
    with torch.no_grad():
        out = grouped_query_attention(q, k, v).float().numpy()
    assert np.isnan(out[0, 2:, 0, 0]).all() and np.isfinite(out[0, :2]).all()


def test_a_kept_row_major_copy_follows_its_kernel(rng):
    kernel = torch.from_numpy(rng.standard_normal((7, 5)).astype("float32")).bfloat16()
    with torch.no_grad():
        first = onednn.row_major(kernel)
        assert first.is_contiguous() and torch.equal(first, kernel.t()) and onednn.row_major(kernel) is first
        kernel.mul_(-2)  # in place: the version moves
        second = onednn.row_major(kernel)
        assert second is not first and torch.equal(second, kernel.t())
    kernel.requires_grad_(True)
    graph = onednn.row_major(kernel)  # under autograd: part of the graph, not kept
    assert graph.requires_grad and graph is not second
    assert kept_values.derived(kernel, "row_major", lambda k: k.t().contiguous()) is None  # nothing kept in a graph
    kernel.requires_grad_(False)
    onednn.row_major(kernel)
    count = len(kept_values._DERIVED)
    del kernel, graph
    assert len(kept_values._DERIVED) == count - 1  # gone with its kernel


def _onednn_or_skip(dtype):
    if not (onednn._has_onednn_linear() and torch.backends.mkldnn.is_available()):
        pytest.skip("this torch has no oneDNN linear")
    if dtype == torch.bfloat16 and not onednn.native_half(dtype):
        pytest.skip("this CPU has no oneDNN bfloat16 kernels (AVX2): bfloat16 runs as float32 products")


def _kept_kernel(array, dtype):
    """(a Keras variable, a tensor `_kept` derives from it): the kind of kernel a mixed-precision cast
    or a joined [W_q | W_k | W_v] is. Keep the variable alive: the kept value goes with it."""
    variable = keras.Variable(array, dtype=dtype, trainable=False)  # no graph: the copy is kept
    return variable, kept_values.kept_value([variable], ("a test's copy",), lambda: variable.value.clone())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("activation", [None, "relu", "gelu"])
@pytest.mark.parametrize("rows", [1, 3, 31, 64])
def test_a_packed_weight_gives_the_plain_weights_products_bit_for_bit(rng, dtype, activation, rows):
    """Without autograd, a kept kernel runs oneDNN's linear on its prepacked (blocked) layout, for any
    number of rows (decision 71): the plain layout's numbers up to the order of additions, and float64
    NumPy's. Bit for bit on the AVX-512 EPYC from two rows on, but not on every CPU: on the H100 machine's
    host the float32 products of 1 and 3 rows differed in the last bits."""
    _onednn_or_skip(getattr(torch, dtype))
    variable, kernel = _kept_kernel((rng.standard_normal((24, 40)) / 4).astype("float32"), dtype)
    x = torch.from_numpy(rng.standard_normal((2, rows, 24)).astype("float32")).to(kernel.dtype)
    bias = torch.from_numpy(rng.standard_normal(40).astype("float32")).to(kernel.dtype)
    with torch.no_grad():
        got = _fused.torch_linear(x, kernel, bias, activation)
        packed = onednn.packed(kernel, transposed=True)
        assert packed is not None and packed.is_mkldnn and onednn.packed(kernel, transposed=True) is packed
        plain = torch.ops.mkldnn._linear_pointwise(x, kernel.t().contiguous(), bias, activation or "none", [], "none")
    assert got.dtype == kernel.dtype
    rtol, atol = (2**-7, 2**-9) if kernel.dtype == torch.bfloat16 else (1e-5, 1e-6)  # a bf16 ulp; 24 float32 additions
    np.testing.assert_allclose(got.double().numpy(), plain.double().numpy(), rtol=rtol, atol=atol)
    exact = _float64_linear(x.double().numpy(), kernel.double().numpy(), bias.double().numpy(), activation)
    if activation == "gelu":
        exact = torch.nn.functional.gelu(torch.from_numpy(exact)).numpy()
    tol = 2**-7 * 4 if kernel.dtype == torch.bfloat16 else 1e-5
    np.testing.assert_allclose(got.double().numpy(), exact, rtol=tol, atol=tol)


def test_only_kernels_whose_layouts_were_already_kept_are_packed(rng):
    """Packed: `_kept` values and half-precision variable tensors (item 60 keeps their (d_out, d_in)
    copies). Not: a float32 variable's tensor (a write through `.data` bypasses its version counter,
    so a kept copy could go stale), a tensor made per call, an empty kernel."""
    array = rng.standard_normal((6, 5)).astype("float32")
    parameter = torch.nn.Parameter(torch.from_numpy(array), requires_grad=False)
    assert not kept_values.packable(parameter) and kept_values.packable(torch.nn.Parameter(parameter.bfloat16(), requires_grad=False))
    assert not kept_values.packable(torch.from_numpy(array))  # made per call
    variable, kept = _kept_kernel(array, "float32")
    assert kept_values.packable(kept)
    assert onednn.packed(torch.nn.Parameter(torch.zeros(6, 0).bfloat16(), requires_grad=False), transposed=True) is None
    x = torch.from_numpy(rng.standard_normal((3, 6)).astype("float32"))
    with torch.no_grad():
        _fused.torch_linear(x, parameter, None)
        new = rng.standard_normal((6, 5)).astype("float32")
        parameter.data.copy_(torch.from_numpy(new))  # no version counter sees this write
        got = _fused.torch_linear(x, parameter, None)
        empty = _fused.torch_linear(x, torch.zeros(6, 0), torch.zeros(0))
    np.testing.assert_allclose(got.numpy(), x.numpy() @ new, rtol=1e-5, atol=1e-5)
    assert tuple(empty.shape) == (3, 0)


def test_a_packed_weight_follows_its_kernel_and_stays_out_of_graphs(rng):
    _onednn_or_skip(torch.float32)
    x = torch.from_numpy(rng.standard_normal((4, 6)).astype("float32"))
    variable, kernel = _kept_kernel(rng.standard_normal((6, 5)).astype("float32"), "float32")
    with torch.no_grad():
        first = _fused.torch_linear(x, kernel, None)
        variable.value.mul_(-2)  # in place: the kept copy, then its packed layout, must be made anew
        variable, kernel = variable, kept_values.kept_value([variable], ("a test's copy",), lambda: variable.value.clone())
        second = _fused.torch_linear(x, kernel, None)
        kernel.mul_(3)  # in place on the kept copy itself: its packed layout must be made anew
        third = _fused.torch_linear(x, kernel, None)
    np.testing.assert_allclose(second.numpy(), -2 * first.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(third.numpy(), -6 * first.numpy(), rtol=1e-5, atol=1e-5)
    kernel.requires_grad_(True)
    assert onednn.packed(kernel, transposed=True) is None  # a graph reads the kernel itself
    y = _fused.torch_linear(x, kernel, None)
    y.sum().backward()
    np.testing.assert_allclose(kernel.grad.numpy(), np.repeat(x.numpy().sum(0)[:, None], 5, axis=1), rtol=1e-5)
    with torch.inference_mode():
        made_in_inference = torch.randn(6, 5)
        assert onednn.packed(made_in_inference, transposed=True) is None  # no version counter to follow
        np.testing.assert_allclose(
            _fused.torch_linear(x, made_in_inference, None).numpy(), x.numpy() @ made_in_inference.numpy(),
            rtol=1e-5, atol=1e-5)


def test_a_tied_embedding_product_runs_on_its_packed_weight(rng):
    _onednn_or_skip(torch.bfloat16)
    x = torch.from_numpy(rng.standard_normal((1, 1, 8)).astype("float32")).bfloat16()  # a decoding step's one row
    table = torch.nn.Parameter(torch.from_numpy(rng.standard_normal((50, 8)).astype("float32")).bfloat16(), requires_grad=False)
    with torch.no_grad():
        got = _fused.times_transposed(x, table)
        assert onednn.packed(table, transposed=False) is not None
    np.testing.assert_allclose(got.double().numpy(), x.double().numpy() @ table.double().numpy().T, rtol=2**-7, atol=2**-7)


@pytest.mark.parametrize("rows", [1, 8, 31, 32, 64])
def test_bfloat16_products_of_few_rows_run_as_torchs_gemm_and_equal_float64(rng, rows):
    x = torch.from_numpy(rng.standard_normal((rows, 24)).astype("float32")).bfloat16()
    kernel = torch.from_numpy((rng.standard_normal((24, 40)) / 4).astype("float32")).bfloat16()
    many = rows >= onednn.ONEDNN_BFLOAT16_MIN_ROWS
    native = onednn.native_half(torch.bfloat16)
    assert onednn.takes(x, kernel.t(), None) == (many and native)
    assert onednn.takes(x, kernel.t(), None, packed=True) == native  # any rows on a packed weight
    assert onednn.half_as_float32(x, kernel.t()) == (many and not native)
    with torch.no_grad():
        got = _fused.torch_linear(x, kernel, None).float().numpy()
    exact = x.double().numpy() @ kernel.double().numpy()
    np.testing.assert_allclose(got, exact, rtol=2**-7, atol=2**-7)


def test_mixed_precision_sublayers_called_directly_equal_their_keras_calls(rng):
    """Under a mixed-precision parent, call_sublayer skips `__call__` (the parent's autocast scope is the
    one Keras would open); the encoder's output must equal running every sublayer through Keras."""
    from attnkit import Encoder
    from attnkit.layers import _sublayer

    keras.config.set_dtype_policy("mixed_bfloat16")
    try:
        encoder = Encoder(20, 6, 2, 4, 4, 8, 16, 2, 0.0)
    finally:
        keras.config.set_dtype_policy("float32")
    ids = rng.integers(1, 20, (3, 6))
    with torch.no_grad():
        direct = to_numpy(encoder(ids))
        original = _sublayer._keras_call_needed
        try:
            _sublayer._keras_call_needed = lambda layer, args, reads_cast_variables=True: True
            through_keras = to_numpy(encoder(ids))
        finally:
            _sublayer._keras_call_needed = original
    assert direct.dtype == through_keras.dtype
    np.testing.assert_array_equal(direct, through_keras)


def test_layers_built_and_called_under_inference_mode_keep_nothing_and_compute_the_same(rng):
    """Tensors made under torch.inference_mode have no version counter: nothing made from them is kept."""
    from attnkit import MultiHeadAttention

    x = rng.standard_normal((2, 3, 8)).astype("float32")
    with torch.inference_mode():
        mha = MultiHeadAttention(2, 4, 4, 8, num_kv_heads=1, dtype="bfloat16")
        first = mha(x)
        mha.W_q.kernel.assign(mha.W_q.kernel.numpy() * -1.0)
        second = mha(x)
        kernel = torch.randn(5, 4).bfloat16()
        got = _fused.torch_linear(torch.ones(2, 5).bfloat16(), kernel, None).double()
        torch.testing.assert_close(got, kernel.double().sum(0).expand(2, 4), rtol=2**-7, atol=2**-7)
    assert not torch.equal(first, second)  # the assignment is seen
    with torch.no_grad():
        assert torch.equal(mha(x), second)


def test_grouped_bfloat16_attention_keeps_its_scores_in_float32():
    """Scores near 200 are 1.0 apart in bfloat16: rounded, 200.5 and 200 would weigh the same."""
    from attnkit.ops.grouped_attention import grouped_query_attention

    q = torch.tensor([1.0, 1.0]).bfloat16().expand(1, 2, 1, 2)  # h = 2
    k = torch.tensor([[100.0, 100.5], [100.0, 100.0]]).bfloat16()[None, None]  # h_kv = 1: scores 200.5, 200
    v = torch.tensor([[1.0], [0.0]]).bfloat16()[None, None]
    assert torch_attention.bmm_takes(q, k, v)
    with torch.no_grad():
        out = grouped_query_attention(q, k, v, scale=1.0).float().numpy()
    np.testing.assert_allclose(out, 1 / (1 + np.exp(-0.5)), rtol=2**-7)


def test_a_value_of_nan_on_a_row_with_no_key_propagates_as_on_the_explicit_path():
    from attnkit.ops import fused_attention, scaled_dot_product_attention

    q, k, v = torch.ones(1, 1, 2, 4).bfloat16(), torch.ones(1, 1, 3, 4).bfloat16(), torch.ones(1, 1, 3, 4).bfloat16()
    v[0, 0, 1, 0] = float("nan")
    mask = np.array([[True, True, True], [False, False, False]])  # the second query sees no key
    with torch.no_grad():
        fused = fused_attention(q, k, v, mask).float().numpy()
        explicit = scaled_dot_product_attention(q, k, v, mask)[0].float().numpy()
    np.testing.assert_array_equal(np.isnan(fused), np.isnan(explicit))
    np.testing.assert_array_equal(fused[~np.isnan(fused)], explicit[~np.isnan(explicit)])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_kept_joins_and_copies_follow_data_assigned_under_the_same_tensor(rng, dtype):
    """`param.data = ...` (Module.to, vector_to_parameters) changes neither the tensor nor its version."""
    from torch.nn.utils import parameters_to_vector, vector_to_parameters

    from attnkit.layers.swiglu import SwiGLUFeedForward

    layer = SwiGLUFeedForward(d_ff=16, d_model=8, dtype=dtype)
    layer.build((1, 3, 8))
    x = torch.from_numpy(rng.standard_normal((1, 3, 8)).astype("float32")).to(getattr(torch, dtype))
    with torch.no_grad():
        layer(x)  # keeps the join and its copies
        vector = parameters_to_vector(layer.parameters())
        vector_to_parameters(torch.from_numpy(rng.standard_normal(vector.shape).astype("float32")).to(vector.dtype), layer.parameters())
        got = layer(x).double().numpy()
    W = {name: getattr(layer, name).kernel.numpy().astype(np.float64) for name in ("W_gate", "W_up", "W_down")}
    x64 = x.double().numpy()
    gate = x64 @ W["W_gate"]
    expected = (gate / (1 + np.exp(-gate)) * (x64 @ W["W_up"])) @ W["W_down"]
    tolerance = 1e-4 if dtype == "float32" else 0.1
    np.testing.assert_allclose(got, expected, rtol=tolerance, atol=tolerance)


def test_what_is_kept_under_inference_mode_serves_a_later_backward_through_frozen_weights(rng):
    from attnkit.layers.swiglu import SwiGLUFeedForward

    layer = SwiGLUFeedForward(d_ff=16, d_model=8, dtype="bfloat16")
    layer.build((2, 3, 8))
    layer.trainable = False
    x = torch.from_numpy(rng.standard_normal((2, 3, 8)).astype("float32")).bfloat16()
    with torch.inference_mode():
        layer(x)
    inputs = x.clone().requires_grad_(True)
    layer(inputs).float().sum().backward()
    assert inputs.grad is not None and torch.isfinite(inputs.grad).all()


@pytest.fixture
def one_python_thread(monkeypatch):
    """The whole-sequence path as in a process with no other Python thread: the suite's own browser
    tests leave Playwright's asyncio threads behind, which never run torch."""
    monkeypatch.setattr(torch_attention, "_other_python_threads", lambda: 0)


def _attention_expected(q, k, v, keep):
    """float64 attention of bfloat16 tensors, key/value heads repeated for grouped queries, and the
    rows with no key."""
    from attnkit.ops.grouped_attention import repeat_kv

    g = q.shape[1] // k.shape[1]
    k, v = (to_numpy(repeat_kv(t.double(), g)) for t in (k, v))
    keep = np.broadcast_to(keep, (*q.shape[:-1], k.shape[-2]))
    return reference.attention(q.double().numpy(), k, v, keep)[0], ~keep.any(-1)


@pytest.mark.parametrize("native_or_not", [True, False], indirect=True)
@pytest.mark.parametrize("case", ["plain", "causal", "padding with an empty example", "per-head mask", "grouped"])
def test_whole_sequences_in_bfloat16_run_in_chunks_close_to_float64(rng, monkeypatch, one_python_thread, native_or_not, case):
    """Whole sequences (more than BMM_MAX_ROWS query rows) take the batched GEMMs too, a few heads at a
    time; chunks of one group, of two (the last one short) and all at once give the same numbers."""
    from attnkit.ops.grouped_attention import grouped_query_attention

    T, h, h_kv = 40, 4, (2 if case == "grouped" else 4)
    q, k, v = _bf16(rng, (3, h, T, 8), 2.0), _bf16(rng, (3, h_kv, T, 8), 2.0), _bf16(rng, (3, h_kv, T, 6))
    mask, causal = None, case == "causal"
    if case.startswith("padding"):
        mask = np.ones((3, 1, 1, T), bool)
        mask[0, ..., :7] = False  # left padding
        mask[2] = False  # nothing to attend to
    if case == "per-head mask":
        mask = rng.random((3, h, T, T)) < 0.3
    keep = reference.causal_keep(T, T) if causal else (np.ones((T, T), bool) if mask is None else mask)
    expected, empty = _attention_expected(q, k, v, keep)
    assert torch_attention.bmm_takes(q, k, v) and q.shape[1] // k.shape[1] * T > torch_attention.BMM_MAX_ROWS
    outputs = []
    group_bytes = (h // h_kv) * T * T * 4  # float32 scores of one key/value head
    for chunk_bytes in (group_bytes, 2 * group_bytes, 2**40):
        monkeypatch.setattr(torch_attention, "BMM_CHUNK_BYTES", chunk_bytes)
        with torch.no_grad():
            outputs.append(grouped_query_attention(q, k, v, mask, causal=causal).float().numpy())
    for out in outputs[1:]:
        np.testing.assert_array_equal(out, outputs[0])
    assert (outputs[0][empty] == 0).all()
    # Exact float32 scores; the weights and the output rounded to bfloat16 (2^-8 of |v| <= ~4, summed).
    np.testing.assert_allclose(outputs[0], expected, rtol=0, atol=0.05)


@pytest.mark.parametrize("default_dtype", ["float64", "bfloat16"])
@pytest.mark.parametrize("T_q", [1, 40])
def test_bfloat16_batched_gemms_do_not_depend_on_torchs_default_dtype(rng, one_python_thread, default_dtype, T_q):
    """The float32 scores are float32 whatever `torch.set_default_dtype` says: a decoding step
    (T_q = 1) and a whole sequence give the numbers they give under the float32 default."""
    from attnkit.ops import fused_attention

    q, k, v = _bf16(rng, (2, 4, T_q, 16), 2.0), _bf16(rng, (2, 4, 40, 16), 2.0), _bf16(rng, (2, 4, 40, 16))
    assert torch_attention.bmm_takes(q, k, v)
    with torch.no_grad():
        want = fused_attention(q, k, v).float().numpy()
        previous = torch.get_default_dtype()
        torch.set_default_dtype(getattr(torch, default_dtype))
        try:
            got = fused_attention(q, k, v).float().numpy()
        finally:
            torch.set_default_dtype(previous)
    np.testing.assert_array_equal(got, want)


def test_whole_sequence_scores_stay_float32_and_the_matmul_precision_is_restored(one_python_thread):
    """Scores near 200 are 1.0 apart in bfloat16; the bfloat16 products behind the float32 scores'
    GEMM are exact for bfloat16 factors, and the process-wide precision goes back afterwards."""
    from attnkit.ops import fused_attention

    T = 48
    q = torch.ones(1, 1, T, 2).bfloat16()
    k = torch.tensor([[100.0, 100.5], [100.0, 100.0]]).bfloat16().repeat(T // 2, 1)[None, None]  # scores 200.5, 200
    v = torch.tensor([[1.0], [0.0]]).bfloat16().repeat(T // 2, 1)[None, None]
    before = torch.backends.mkldnn.matmul.fp32_precision
    assert torch_attention.bmm_takes(q, k, v)
    with torch.no_grad():
        out = fused_attention(q, k, v, scale=1.0).float().numpy()
    assert torch.backends.mkldnn.matmul.fp32_precision == before
    np.testing.assert_allclose(out, 1 / (1 + np.exp(-0.5)), rtol=2**-7)


def test_whole_sequences_keep_the_flash_kernel_beside_other_threads_or_above_the_scores_budget(rng, monkeypatch):
    """The bfloat16 products are a process-wide switch: with another Python thread alive (it could run
    a float32 matmul meanwhile) whole sequences stay on the flash kernel; a decoding step's few rows,
    whose float32 GEMM needs no switch, do not. Scores above the budget stay there too."""
    import threading

    q, k, v = _bf16(rng, (2, 2, 40, 8)), _bf16(rng, (2, 2, 40, 8)), _bf16(rng, (2, 2, 40, 8))
    step = q[:, :, :1]
    release = threading.Event()
    other = threading.Thread(target=release.wait)
    other.start()
    try:
        assert not torch_attention.bmm_takes(q, k, v) and torch_attention.bmm_takes(step, k, v)
        with torch.no_grad():
            during = _fused.attention(step, k, v, None, False, 0.5)
    finally:
        release.set()
        other.join()
    monkeypatch.setattr(torch_attention, "_other_python_threads", lambda: 0)
    with torch.no_grad():
        np.testing.assert_array_equal(during.float().numpy(), _fused.attention(step, k, v, None, False, 0.5).float().numpy())
    assert torch_attention.bmm_takes(q, k, v)
    monkeypatch.setattr(torch_attention, "BMM_MAX_SCORES_BYTES", 2 * 2 * 40 * 40 * 4 - 1)
    assert not torch_attention.bmm_takes(q, k, v)


def test_layers_compile_under_torch_compile(rng):
    """Keras's jit_compile=True on torch is torch.compile: Inductor failed to lower oneDNN's linear on our
    weights (LoweringException), so a compiled FeedForward did not run; it now takes Inductor's GEMMs
    (docs/decisions.md item 84)."""
    from attnkit.layers import FeedForward

    layer = FeedForward(16, 8)
    x = rng.normal(size=(4, 6, 8)).astype("float32")
    layer(x)
    kernels = [to_numpy(v) for v in (layer.fully_connected1.kernel, layer.fully_connected1.bias,
                                      layer.fully_connected2.kernel, layer.fully_connected2.bias)]
    want = _float64_linear(_float64_linear(x, *kernels[:2], "relu"), *kernels[2:], None)
    with torch.no_grad():
        got = torch.compile(lambda v: layer(v))(torch.from_numpy(x))
    np.testing.assert_allclose(to_numpy(got), want, rtol=1e-5, atol=1e-5)

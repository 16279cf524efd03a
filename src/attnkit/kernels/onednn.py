"""oneDNN's linear on torch's CPU tensors (docs/decisions.md items 60, 69, 71): when it takes the
operands, prepacked weights, the half-precision products on CPUs without their kernels, and its
autograd Function."""

import functools
import os

from attnkit.kernels import kept, tensor_checks


# Set ATTNKIT_ONEDNN=0 to run every torch projection through torch's default GEMM (`F.linear`).
ONEDNN = os.environ.get("ATTNKIT_ONEDNN", "1") != "0"


# Half-precision products of fewer rows than this run as torch's GEMM (`takes`, `half_as_float32`).
ONEDNN_BFLOAT16_MIN_ROWS = 32


@functools.cache
def native_half(dtype):
    """Whether this CPU's oneDNN multiplies torch's `dtype` (bfloat16 or float16) in its own
    half-precision kernels: bfloat16 from AVX-512 (natively with AVX512-BF16 or AMX) or AVX2-VNNI-2,
    float16 from AVX512-FP16 or AMX-FP16. Without them oneDNN refuses a bfloat16 linear ("could not
    create a primitive descriptor") and torch's own half-precision GEMM runs at ~8 GFLOP/s on an
    AVX2 EPYC, 5x slower than the same product in float32 (docs/decisions.md item 69)."""
    import torch

    supported = {torch.bfloat16: "_is_mkldnn_bf16_supported", torch.float16: "_is_mkldnn_fp16_supported"}
    check = getattr(torch.ops.mkldnn, supported[dtype], None)
    return bool(check is not None and torch.backends.mkldnn.is_available() and check())


def avx512():
    """Whether torch's CPU kernels run with AVX-512 or above, where oneDNN's choices here were measured
    (docs/decisions.md items 60, 71); on an AVX2 CPU two of them lose (items 155, 156)."""
    import torch

    return torch.backends.cpu.get_cpu_capability() not in ("DEFAULT", "AVX2")


def gelu_post_op_pays():
    """Whether oneDNN's linear applies GELU faster as its post-op than torch's GELU after it: on a CPU
    with AVX-512. With AVX2 only, the post-op took 1.3x the time of the linear then `gelu_` (an
    FFN's 3584 x 384 -> 1536 product: 59 against 46 ms), the same values (docs/decisions.md item 155)."""
    return avx512()


def view_pays(weight):
    """Whether oneDNN's linear, without autograd, reads `weight` (d_out, d_in) as fast as torch's GEMM
    reads its (d_in, d_out) kernel: yes for a contiguous weight, and for the kernel's transposed view
    on an AVX-512 CPU. On an AVX2 one addmm(b, x, K) ran 1.05-1.3x faster than oneDNN on the view
    (MiniLM's 5056 x 384 -> 1536: 44 against 58 ms; SmolLM2's 1024 x 576 -> 1536: 16.4 against 20.3
    ms; docs/decisions.md item 156)."""
    return weight.is_contiguous() or avx512()


def half_as_float32(x, weight, bias=None):
    """Whether `linear.torch_linear` multiplies these half-precision torch tensors (bfloat16 or float16, the
    bias too) in float32 on exact casts: on the CPU, ONEDNN_BFLOAT16_MIN_ROWS rows or more, where
    oneDNN has no native kernels for the dtype (`native_half`). Fewer rows stay in torch's half-precision GEMM, which reads the kernel
    once, where the cast would read it and write it twice as wide."""
    import torch

    if not (x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype and x.device.type == "cpu"):
        return False
    if bias is not None and bias.dtype != x.dtype:
        return False  # torch's own GEMM refuses the mix, as it does for fewer rows
    return x.dim() >= 2 and x.numel() >= ONEDNN_BFLOAT16_MIN_ROWS * x.shape[-1] > 0 and not native_half(x.dtype)


def takes(x, weight, bias, packed=False):
    """Whether oneDNN's linear computes x weight^T + bias for these torch tensors, x (..., d_in) and
    weight (d_out, d_in), contiguous or a transposed view of a contiguous (d_in, d_out) kernel: on the
    CPU, float32 or bfloat16, the latter where the CPU has oneDNN's bfloat16 kernels (`native_half`).
    With a weight in the plain layout, at least two float32 rows (for one row torch's GEMV is as fast
    or faster) or ONEDNN_BFLOAT16_MIN_ROWS bfloat16 ones; with a `packed` one any number of rows:
    without the per-call reorder the linear beats torch's GEMM at one row too (decision 71)."""
    import torch

    if not (ONEDNN and x.dtype in (torch.float32, torch.bfloat16) and weight.dtype == x.dtype):
        return False
    if torch.compiler.is_compiling():
        # torch.compile (Keras's jit_compile=True): Inductor lowers oneDNN's linear only on weights it
        # packed itself and failed on ours; it picks its own GEMMs (docs/decisions.md item 84).
        return False
    if any(t is not None and t.device.type != "cpu" for t in (x, weight, bias)):
        return False  # oneDNN's operators are the CPU's: elsewhere torch's own kernels, or its device error
    if x.dtype == torch.bfloat16 and not native_half(x.dtype):
        return False
    if not (x.dim() >= 2 and x.numel() >= (1 if packed else 2) * x.shape[-1] > 0 and weight.dim() == 2):
        return False
    if bias is not None and bias.dtype != x.dtype:
        return False
    if x.dtype == torch.bfloat16 and not packed and x.numel() < ONEDNN_BFLOAT16_MIN_ROWS * x.shape[-1]:
        # A decoding step's few rows: torch's bfloat16 GEMM (oneDNN too, on a kept (d_out, d_in) copy)
        # ran 1.1-1.3x faster than the linear primitive inside SmolLM2's step at batch 8.
        return False
    if not (weight.is_contiguous() or weight.t().is_contiguous()):
        return False
    return torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled and _has_onednn_linear()


def row_major(kernel):
    """`kernel.t().contiguous()`, the (d_out, d_in) layout of a (d_in, d_out) torch kernel, kept
    between calls where `kept.derived` can keep it."""
    copy = kept.derived(kernel, "row_major", lambda k: k.t().contiguous())
    return kernel.t().contiguous() if copy is None else copy


def packed(weight, transposed):
    """oneDNN's own blocked layout of a linear's weight, made once and kept (`kept.derived`), or None.

    `weight` is (d_out, d_in), or with `transposed` a (d_in, d_out) kernel. Given a weight in the
    plain layout, oneDNN's linear reorders it into its blocked layout on every call: prepacked
    (`torch.ops.mkldnn._reorder_linear_weight`, what torch's compiler does to frozen CPU models) the
    same products (bit for bit from two rows on), ran 1.03-1.08x faster for 2048 rows and 2-4x faster for a decoding
    step's 1-31 rows, where the reorder is most of the work (docs/decisions.md item 71). Only for
    `kept.packable` weights; None for others, which oneDNN then reads in the plain layout.
    """
    import torch

    if not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return None  # a torch without the operator: the plain layout
    if weight.numel() == 0 or not kept.packable(weight):
        return None  # oneDNN cannot reorder an empty weight (its plain linear returns the empty product)
    if transposed:
        return kept.derived(weight, "onednn_packed_t", lambda k: torch.ops.mkldnn._reorder_linear_weight(k.t().contiguous(), None))
    return kept.derived(weight, "onednn_packed", lambda w: torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), None))


def packed_linear(x, source, weight, bias, activation, transposed):
    """activation(x weight^T + bias) by oneDNN's linear on `source` prepacked (`packed`), or None
    where that path does not apply (autograd, a dtype or shape oneDNN does not take, a source that is
    not `kept.packable`). `weight` is the (d_out, d_in) weight; `source` the tensor it is read from:
    itself, or with `transposed` the (d_in, d_out) kernel it is a view of."""
    import torch

    if tensor_checks.records_graph(x, weight, bias) or not takes(x, weight, bias, packed=True):
        return None
    blocked = packed(source, transposed)
    if blocked is None:
        return None
    return torch.ops.mkldnn._linear_pointwise(x, blocked, bias, activation or "none", [], "none")


def _onednn_linear_class():
    import torch

    class OneDNNLinear(torch.autograd.Function):
        """activation(x @ kernel + bias), activation None or ReLU, by oneDNN forward and backward.

        oneDNN's linear operator has no backward of its own. The backward's products are linears too
        (`linear_grads`).
        """

        @staticmethod
        def forward(ctx, x, kernel, bias, relu):
            # x (..., d_in), kernel (d_in, d_out), bias (d_out,) or None -> (..., d_out)
            y = torch.ops.mkldnn._linear_pointwise(x, kernel.t(), bias, "relu" if relu else "none", [], "none")
            ctx.save_for_backward(x, kernel, y if relu else None)
            ctx.relu = relu
            return y

        @staticmethod
        def backward(ctx, grad):
            x, kernel, y = ctx.saved_tensors
            grad = grad.contiguous()  # the gradient of a sum arrives expanded, with strides of 0
            if ctx.relu:
                grad = grad.masked_fill(y <= 0, 0)  # ReLU's gradient: 0 where the output is 0
            grad_rows, x_rows = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1])  # (M, d_out), (M, d_in)
            needs_x, needs_kernel, needs_bias, _ = ctx.needs_input_grad
            grad_x, grad_kernel = linear_grads(grad_rows, x_rows, kernel, needs_x, needs_kernel)
            grad_x = None if grad_x is None else grad_x.reshape(x.shape)  # (..., d_in)
            grad_bias = grad_rows.sum(0) if needs_bias else None  # (d_out,)
            return grad_x, grad_kernel, grad_bias, None

    return OneDNNLinear


def linear_grads(grad_rows, x_rows, kernel, needs_x=True, needs_kernel=True):
    """The backward products of x kernel: (dX = dY kernel^T (M, d_in), dK = X^T dY (d_in, d_out)), each
    None where not needed, for grad_rows dY (M, d_out) and x_rows X (M, d_in), torch tensors.

    Where oneDNN takes them, both are oneDNN linears (dX a linear of dY with `kernel` as its
    (d_in, d_out) weight, dK one of X^T with dY^T as weight); under `create_graph` torch's own
    differentiable products, so second derivatives are torch's, and under torch.compile Inductor's."""
    import torch

    if torch.is_grad_enabled() or torch.compiler.is_compiling() or not takes(grad_rows, kernel, None):
        grad_x = grad_rows @ kernel.t() if needs_x else None
        grad_kernel = x_rows.t() @ grad_rows if needs_kernel else None
        return grad_x, grad_kernel
    lp = torch.ops.mkldnn._linear_pointwise
    grad_x = lp(grad_rows, kernel, None, "none", [], "none") if needs_x else None
    grad_kernel = lp(x_rows.t(), grad_rows.t(), None, "none", [], "none") if needs_kernel else None
    return grad_x, grad_kernel


class _LazyFunction:
    """The autograd Function made on first use (torch is imported only on the torch backend)."""

    def __init__(self, make):
        self.make, self.function = make, None

    def apply(self, *args):
        if self.function is None:
            self.function = self.make()
        return self.function.apply(*args)


OneDNNLinear = _LazyFunction(_onednn_linear_class)


def _has_onednn_linear():
    import torch

    return hasattr(torch.ops.mkldnn, "_linear_pointwise")

"""LoRA's projection x W + b + s (x A) B on torch as one autograd Function (docs/decisions.md item 149).

Written with Keras's ops, the update costs passes over the (M, d_out) output besides its products: s
times (x A) B, its sum with x W + b, and in the backward the scale's product again and the sum of the
two branches' input gradients. Here s multiplies inside the rank-r products (BLAS's alpha, or an
(r, M) factor) and both sums accumulate into a GEMM's own output (`addmm_`): the same products in
PEFT's order, x W + b + ((x A) B) s, and no other pass over an (M, d_out) or (M, d_in) tensor
than the copies torch makes of a non-contiguous x or an expanded upstream gradient.

Legend: M rows (x's leading axes together), d_in / d_out the projection's widths, r the rank.
"""

import keras

from attnkit.kernels import kept, onednn, tensor_checks


def lora_linear(x, kernel, bias, a, b, scale):
    """x kernel + bias + scale (x a) b, or None where this kernel does not take the operands.

    Args:
        x: (..., d_in). kernel: (d_in, d_out). bias: (d_out,) or None. a: (d_in, r). b: (r, d_out);
            tensors or Keras variables. scale: a Python number (LoRA's alpha / r).

    Returns:
        (..., d_out) on torch for tensors of one dtype, float32 or float64, of matching non-empty
        widths, a non-zero scale, outside torch.compile and autocast; else None (the caller's
        `keras.ops` path gives the same numbers).

    Example (torch):
    >>> lora_linear(torch.ones(2, 3), torch.ones(3, 4), None, torch.ones(3, 8), torch.zeros(8, 4), 2.0).shape  # (2, 4)
    """
    if keras.backend.backend() != "torch":
        return None  # XLA fuses the scale and the sums into the products' loops
    import torch

    x = tensor_checks.value_of(x)
    kernel, bias, a, b = (kept.variable_value(v) for v in (kernel, bias, a, b))
    operands = [t for t in (x, kernel, bias, a, b) if t is not None]
    if not all(isinstance(t, torch.Tensor) and t.dtype == x.dtype for t in operands):
        return None
    if x.dtype not in (torch.float32, torch.float64) or torch.compiler.is_compiling():
        return None
    if torch.is_autocast_enabled(x.device.type) or scale == 0:
        return None  # autocast casts each product itself; a zero scale would skip (x A) B, NaNs too
    if x.dim() < 1 or kernel.dim() != 2 or a.dim() != 2 or b.dim() != 2:
        return None
    d_in, d_out = kernel.shape
    if d_in == 0 or d_out == 0 or x.shape[-1] != d_in or a.shape[0] != d_in or b.shape[1] != d_out or a.shape[1] != b.shape[0]:
        return None  # the caller's path names the mismatch
    if bias is not None and tuple(bias.shape) != (d_out,):
        return None
    return LoRALinear.apply(x, kernel, bias, a, b, float(scale))


def _lora_linear_class():
    import torch

    from attnkit.kernels.linear import torch_linear

    class LoRALinear(torch.autograd.Function):
        """x kernel + bias + scale (x a) b with its own backward; see the module's docstring."""

        @staticmethod
        def forward(ctx, x, kernel, bias, a, b, scale):
            rows = x.reshape(-1, x.shape[-1])  # (M, d_in)
            h_t = _rank_product(a.t(), rows)  # (r, M): (x A)^T
            y = torch_linear(x, kernel, bias).contiguous()  # (..., d_out), a fresh output
            y.view(-1, y.shape[-1]).addmm_(h_t.t(), b, alpha=scale)  # + s (x A) B, in the GEMM's accumulation
            ctx.save_for_backward(x, kernel, a, b, h_t)
            ctx.scale = scale
            return y

        @staticmethod
        def backward(ctx, grad):
            x, kernel, a, b, h_t = ctx.saved_tensors
            needs_x, needs_kernel, needs_bias, needs_a, needs_b, _ = ctx.needs_input_grad
            rows = x.reshape(-1, x.shape[-1])  # (M, d_in)
            grad_rows = grad.reshape(-1, grad.shape[-1]).contiguous()  # (M, d_out); a sum's gradient arrives expanded
            # create_graph: out-of-place products of the inputs, differentiable again (the forward's
            # x A is not in the graph)
            differentiable = torch.is_grad_enabled()
            if differentiable:
                h_t = a.t() @ rows.t()
            product = (lambda p, q: p @ q.t()) if differentiable else _rank_product
            grad_h_t = product(b, grad_rows) * ctx.scale if needs_a or needs_x else None  # (r, M): d/d(x A)^T
            grad_a = product(grad_h_t, rows.t()).t().contiguous() if needs_a else None  # (d_in, r)
            grad_b = product(h_t, grad_rows.t()) * ctx.scale if needs_b else None  # (r, d_out)
            grad_x, grad_kernel = onednn.linear_grads(grad_rows, rows, kernel, needs_x, needs_kernel)
            if grad_x is not None:  # (M, d_in): dY W^T + dH A^T, the second product accumulated into the first
                grad_h = grad_h_t.t()  # (M, r)
                grad_x = torch.addmm(grad_x, grad_h, a.t()) if differentiable else grad_x.addmm_(grad_h, a.t())
                grad_x = grad_x.reshape(x.shape)
            grad_bias = grad_rows.sum(0) if needs_bias else None  # (d_out,)
            return grad_x, grad_kernel, grad_bias, grad_a, grad_b, None

    return LoRALinear


def _rank_product(p, q):
    """p q^T for a rank-r `p` (r, K) and `q` (N, K): (r, N), by oneDNN's linear where it takes them (q
    as its weight), else torch's GEMM. Both read the wide operand once; oneDNN's ran these skinny
    products 1.3-2x faster than MKL's GEMM on SmolLM2's widths."""
    import torch

    if onednn.takes(p, q, None) and p.dim() == 2:
        return torch.ops.mkldnn._linear_pointwise(p.contiguous(), q, None, "none", [], "none")
    return p @ q.t()


LoRALinear = onednn._LazyFunction(_lora_linear_class)

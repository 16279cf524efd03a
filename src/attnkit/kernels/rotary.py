"""The rotary embedding's rotation on torch tensors, in one fused multiply-add."""

from attnkit.kernels import tensor_checks


def rotate(x, cos, sin):
    """x * cos + rotate_half(x) * sin on torch tensors, cos and sin cast to x's dtype, or None (then
    `keras.ops`).

    x: (B, h, T, d); cos, sin: (B or 1, 1, T, d). The rotation runs twice per layer and decoding step:
    keras.ops' dispatch cost more than its arithmetic there.
    """
    if not tensor_checks.is_torch_tensor(x):
        return None
    import torch

    if not (isinstance(cos, torch.Tensor) and isinstance(sin, torch.Tensor)):
        return None
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)  # (B, h, T, d/2) each
    return torch.addcmul(x * cos, torch.cat((-x2, x1), dim=-1), sin)

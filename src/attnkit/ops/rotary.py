"""Rotary position embedding (Su et al., "RoFormer", 2021), in Hugging Face's rotate-half layout.

    RoPE(x, p) = x * cos(p * inv_freq) + rotate_half(x) * sin(p * inv_freq)
    inv_freq_i = theta^(-2i / d), i = 0 .. d/2 - 1;  rotate_half([x1, x2]) = [-x2, x1]

The two halves of each head's d features are rotated as pairs (x_i, x_{i + d/2}), the layout of
Hugging Face's Llama, Mistral and Qwen2 (llama.cpp's GGUF files store W_q and W_k permuted for
interleaved pairs; the GGUF loader undoes that, as transformers does).

Legend: B batch, h heads, T length, d per-head width (even).
"""

import numpy as np
from keras import ops

from attnkit._validation import positive_float, positive_int
from attnkit import kernels

# rope_scaling / rope_parameters "rope_type"s attnkit does not implement; refused by name.
IMPLEMENTED_ROPE_TYPES = ("default",)


def check_rope_scaling(rope_scaling, *, name="rope_scaling", source=None):
    """Returns None when `rope_scaling` (a config's dict, or None) asks for plain RoPE; refuses the rest.

    `name` is the field as the config spells it (transformers 5 writes `rope_parameters`, 4
    `rope_scaling`) and `source` the file it was read from, if any, so errors point at what to edit.

    Raises:
        ValueError: a scaling variant other than "default" (linear, dynamic, yarn, llama3, longrope ...).
    """
    where = f"{source}: " if source else ""
    if rope_scaling is None:
        return None
    if not isinstance(rope_scaling, dict):
        raise ValueError(f"{where}`{name}` must be a dict or None. Received: {name}={rope_scaling!r}")
    kind = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    if kind not in IMPLEMENTED_ROPE_TYPES:
        raise ValueError(
            f"{where}RoPE scaling {kind!r} is not implemented in attnkit (only {IMPLEMENTED_ROPE_TYPES}). "
            f"Received: {name}={rope_scaling!r}"
        )
    return None


def inverse_frequencies(d, theta=10000.0, dtype="float32"):
    """inv_freq (d/2,): theta^(-2i/d), computed in `dtype` as transformers computes it (float32).

    Raises:
        ValueError: `d` not a positive even integer, `theta` not a finite positive number.
    """
    d = positive_int("d", d)
    if d % 2:
        raise ValueError(f"`d` must be even for rotary embeddings. Received: d={d}")
    theta = positive_float("theta", theta)
    exponents = np.arange(0, d, 2).astype(dtype) / np.asarray(d, dtype)
    return (np.asarray(1.0, dtype) / (np.asarray(theta, dtype) ** exponents)).astype(dtype)


def rotary_cos_sin(positions, d, theta=10000.0, dtype="float32"):
    """cos and sin of the rotation angles for integer positions.

    Args:
        positions: (B, T) or (T,) integer positions (a cached step passes its offset + arange(T)).
        d: per-head width (even).
        theta: the base (`rope_theta` in a Hugging Face config).
        dtype: the angles' dtype; float32 matches transformers, float64 the references.

    Returns:
        (cos, sin), each (B, 1, T, d) (or (1, 1, T, d)), the d/2 angles repeated for both halves.
    """
    if isinstance(positions, np.ndarray) and positions.ndim in (1, 2) and dtype == "float32":
        # Host positions (a cached call's): the angles on the host, one tensor and two backend ops
        # instead of eight dispatches a decoding step (docs/decisions.md item 151). The float32
        # products round as the backend's do, so cos and sin are bit for bit the same. (Not for
        # other dtypes: jax without x64 would round a float64 product a second time to float32.)
        rows = 1 if positions.ndim == 1 else positions.shape[0]  # explicit: T or B may be 0
        angles = positions.astype(dtype).reshape((rows, positions.shape[-1], 1))  # (B or 1, T, 1)
        angles = angles * inverse_frequencies(d, theta, dtype)  # (B, T, d/2)
        angles = ops.convert_to_tensor(np.concatenate([angles, angles], axis=-1)[:, None])  # (B, 1, T, d)
        return ops.cos(angles), ops.sin(angles)
    inv_freq = ops.convert_to_tensor(inverse_frequencies(d, theta, dtype))  # (d/2,)
    positions = ops.cast(ops.convert_to_tensor(positions), dtype)
    if len(positions.shape) == 1:
        positions = ops.expand_dims(positions, 0)  # (1, T)
    angles = ops.expand_dims(positions, -1) * inv_freq  # (B, T, d/2)
    angles = ops.concatenate([angles, angles], axis=-1)  # (B, T, d)
    angles = ops.expand_dims(angles, 1)  # (B, 1, T, d): one rotation for every head
    return ops.cos(angles), ops.sin(angles)


def rotate_half(x):
    """[x1, x2] -> [-x2, x1] over the last axis, x (..., d)."""
    half = x.shape[-1] // 2
    return ops.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def apply_rotary(x, cos, sin):
    """Rotates x (B, h, T, d) by the angles of `rotary_cos_sin`, in x's dtype.

    Returns:
        (B, h, T, d): x * cos + rotate_half(x) * sin.

    Raises:
        ValueError: x's last axis differs from the angles' width.

    Example:
    >>> cos, sin = rotary_cos_sin(ops.arange(5), d=8)
    >>> apply_rotary(keras.random.normal((2, 4, 5, 8)), cos, sin).shape  # (2, 4, 5, 8)
    """
    x = ops.convert_to_tensor(x)
    if x.shape[-1] != cos.shape[-1]:
        raise ValueError(
            f"`x` must have width {cos.shape[-1]}, the rotary angles' width. Received: x.shape={tuple(x.shape)}"
        )
    fused = kernels.rotate(x, cos, sin)
    if fused is not None:
        return fused
    cos, sin = ops.cast(cos, x.dtype), ops.cast(sin, x.dtype)
    return x * cos + rotate_half(x) * sin

"""`RMSNorm`: root-mean-square layer normalization (Zhang and Sennrich, 2019), as Llama uses it.

    RMSNorm(x) = x / sqrt(mean(x^2) + epsilon) * gamma

No centring. Gemma scales by (1 + gamma) instead (`offset=1`, gamma then starts at zeros as its
checkpoints store it): the same function, the offset added to the scale (`norm_scale`).
Half-precision inputs are normalized in float32 and the result cast back before the scale is
applied, as transformers' LlamaRMSNorm does.

Legend: B batch, T length, d_model width.
"""

import keras
from keras import ops

from attnkit._validation import positive_float
from attnkit.layers._call_checks import CheckedCall
from attnkit import kernels
from attnkit.kernels.numerics import constant, scores_dtype


@keras.saving.register_keras_serializable(package="attnkit")
class RMSNorm(CheckedCall, keras.layers.Layer):
    """Root-mean-square normalization over the last axis, with a learned scale gamma (ones at start).

    Args:
        epsilon: added to the mean square. Default 1e-6.
        offset: added to gamma before it scales (Gemma: 1, its checkpoints store gamma - 1). Default 0.
        **kwargs: base `keras.layers.Layer` arguments (name, dtype, ...).

    Call arguments:
        x: (..., d_model).

    Returns:
        (..., d_model), x's shape and the layer's compute dtype.

    Raises:
        ValueError: a non-positive epsilon; an input of another width than the built one.
        TypeError: an input that is not floating-point (integers would be normalized in integers).

    Example:
    >>> RMSNorm(epsilon=1e-5)(keras.random.normal((2, 5, 576))).shape  # (2, 5, 576)
    """

    _call_checks = dict(floats=("x",))

    def __init__(self, *, epsilon=1e-6, offset=0.0, **kwargs):
        super().__init__(**kwargs)
        self.epsilon = positive_float("epsilon", epsilon)
        self.offset = check_norm_offset("offset", offset)
        self.supports_masking = True

    def build(self, x_shape):
        initializer = "ones" if self.offset == 0 else "zeros"  # a scale of 1 at start either way
        self.gamma = self.add_weight(name="gamma", shape=(x_shape[-1],), initializer=initializer)

    def call(self, x):
        if x.shape[-1] is not None and x.shape[-1] != self.gamma.shape[0]:
            raise ValueError(
                f"`x` must have last dimension {self.gamma.shape[0]}, the built width. Received: x.shape={tuple(x.shape)}"
            )
        gamma = norm_scale(self)  # (d_model,)
        fused = kernels.rms_norm(x, gamma, self.epsilon)
        if fused is not None:
            return fused
        dtype = keras.backend.standardize_dtype(x.dtype)
        work = scores_dtype(dtype)  # float32 for float16 / bfloat16
        x32 = ops.cast(x, work)
        mean_square = ops.mean(ops.square(x32), axis=-1, keepdims=True)  # (..., 1)
        normed = x32 * ops.rsqrt(mean_square + constant(self.epsilon, work))
        return ops.cast(gamma, dtype) * ops.cast(normed, dtype)

    def compute_output_shape(self, x_shape):
        return tuple(x_shape)

    def get_config(self):
        return {**super().get_config(), "epsilon": self.epsilon, "offset": self.offset}


def norm_scale(norm):
    """The scale an `RMSNorm` multiplies by: its gamma variable, or gamma + offset (Gemma's 1 + weight,
    added in the variable's dtype as transformers adds it in float32). The one place the offset is
    applied: the layer's call and CausalLM's torch decoding step both read it here."""
    if norm.offset == 0:
        return norm.gamma
    return ops.add(norm.gamma.value, ops.cast(norm.offset, norm.gamma.dtype))  # (d_model,)


def check_norm_offset(name, value):
    """0 or 1: the offsets of the RMSNorms attnkit's families use, refused otherwise by name."""
    if isinstance(value, bool) or value not in (0, 1):
        raise ValueError(f"`{name}` must be 0 (gamma) or 1 (1 + gamma, Gemma). Received: {name}={value!r}")
    return float(value)

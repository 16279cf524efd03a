"""`RMSNorm`: root-mean-square layer normalization (Zhang and Sennrich, 2019), as Llama uses it.

    RMSNorm(x) = x / sqrt(mean(x^2) + epsilon) * gamma

No centring and no offset. Half-precision inputs are normalized in float32 and the result cast back
before the scale is applied, as transformers' LlamaRMSNorm does.

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

    def __init__(self, *, epsilon=1e-6, **kwargs):
        super().__init__(**kwargs)
        self.epsilon = positive_float("epsilon", epsilon)
        self.supports_masking = True

    def build(self, x_shape):
        self.gamma = self.add_weight(name="gamma", shape=(x_shape[-1],), initializer="ones")

    def call(self, x):
        if x.shape[-1] is not None and x.shape[-1] != self.gamma.shape[0]:
            raise ValueError(
                f"`x` must have last dimension {self.gamma.shape[0]}, the built width. Received: x.shape={tuple(x.shape)}"
            )
        fused = kernels.rms_norm(x, self.gamma, self.epsilon)
        if fused is not None:
            return fused
        dtype = keras.backend.standardize_dtype(x.dtype)
        work = scores_dtype(dtype)  # float32 for float16 / bfloat16
        x32 = ops.cast(x, work)
        mean_square = ops.mean(ops.square(x32), axis=-1, keepdims=True)  # (..., 1)
        normed = x32 * ops.rsqrt(mean_square + constant(self.epsilon, work))
        return ops.cast(self.gamma, dtype) * ops.cast(normed, dtype)

    def compute_output_shape(self, x_shape):
        return tuple(x_shape)

    def get_config(self):
        return {**super().get_config(), "epsilon": self.epsilon}

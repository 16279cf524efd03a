"""`Linear`: a `keras.layers.Dense` whose product runs through `attnkit.ops.linear`.

The variables, the configuration, LoRA and quantization are Dense's own, so Dense weights copy across
unchanged; only the arithmetic differs: one fused GEMM with the bias on torch, in the weight layout
torch's CPU kernels need for bfloat16 (see `attnkit.ops.linear`).

Legend: d_in input width, d_out (`units`) output width.
"""

import keras

from attnkit.ops.linear import linear


@keras.saving.register_keras_serializable(package="attnkit")
class Linear(keras.layers.Dense):
    """Dense (x W + b, then the activation) computed by `attnkit.ops.linear`.

    Args and call arguments: those of `keras.layers.Dense`. x: (..., d_in) -> (..., units).

    Example:
    >>> Linear(4)(keras.ops.ones((2, 3))).shape  # (2, 4)
    """

    def call(self, inputs, training=None):
        # Quantized layers never get here: Keras routes them to Dense.quantized_call. `self.kernel`
        # includes a LoRA update when LoRA is enabled.
        x = linear(inputs, self.kernel, self.bias)
        return x if self.activation is None else self.activation(x)

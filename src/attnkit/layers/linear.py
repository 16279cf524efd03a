"""`Linear`: a `keras.layers.Dense` whose product runs through `attnkit.ops.linear`.

The variables, the configuration, LoRA and quantization are Dense's own, so Dense weights copy across
unchanged; only the arithmetic differs: one fused GEMM with the bias on torch, in the weight layout
torch's CPU kernels need for bfloat16, and ReLU in place on its output (see `attnkit.ops.linear`).

Legend: d_in input width, d_out (`units`) output width.
"""

import os
import warnings

import keras

from attnkit.kernels.quantized import block_linear
from attnkit.ops.linear import linear

# Dense's activation functions that `linear` applies itself (gelu: Keras's default is the exact form).
_FUSED_ACTIVATIONS = {keras.activations.linear: None, keras.activations.relu: "relu", keras.activations.gelu: "gelu"}


@keras.saving.register_keras_serializable(package="attnkit")
class Linear(keras.layers.Dense):
    """Dense (x W + b, then the activation) computed by `attnkit.ops.linear`.

    Args and call arguments: those of `keras.layers.Dense`. x: (..., d_in) -> (..., units).

    Example:
    >>> Linear(4)(keras.ops.ones((2, 3))).shape  # (2, 4)
    """

    def call(self, inputs, training=None):
        # Quantized layers never get here: Keras routes them to Dense.quantized_call.
        if self.lora_enabled:
            # PEFT's order, x W + (alpha / r) (x A) B, not Dense's x (W + (alpha / r) A B): the
            # d_in x d_out update is never formed, so a training step computes no gradient of that
            # size for the frozen W (docs/decisions.md item 134). x: (..., d_in), A (d_in, r), B (r, d_out).
            update = keras.ops.matmul(keras.ops.matmul(inputs, self.lora_kernel_a), self.lora_kernel_b)  # (..., d_out)
            return self.activation(linear(inputs, self._kernel, self.bias) + (self.lora_alpha / self.lora_rank) * update)
        fused = _FUSED_ACTIVATIONS.get(self.activation, "other")
        if fused != "other":
            return linear(inputs, self.kernel, self.bias, activation=fused)
        return self.activation(linear(inputs, self.kernel, self.bias))

    def quantized_call(self, inputs, training=None):
        # GGUF blocks kept packed (`attnkit.layers.block_quantized.keep_blocks`, docs/decisions.md item 127)
        if getattr(self, "block_format", None) is None:
            return super().quantized_call(inputs, training=training)
        offset = None if self.block_offset is None else self.block_offset.value
        bias = None if self.bias is None else self.bias.value
        y = block_linear(inputs, self.block_values.value, self.block_scale.value, offset, bias, **self.block_format)
        return self.activation(y)

    def quantize(self, mode=None, type_check=True, config=None):
        # Dense refuses its subclasses, whose `call` may differ; Keras routes a quantized layer to
        # Dense.quantized_call, so Dense's quantization applies to Linear as it is.
        super().quantize(mode, type_check=False, config=config)
        if mode in ("int8", "int4") and triton_gemm_on_gpu():
            warnings.warn(
                "XLA's Triton GEMM computes some int8 products wrongly on a GPU under jit (seen with "
                "jaxlib 0.11.2: errors of ~1 in a quantized encoder layer); set "
                "XLA_FLAGS=--xla_gpu_enable_triton_gemm=false before jax starts to use cuBLAS's",
                stacklevel=2,
            )


def triton_gemm_on_gpu():
    """Whether jax runs on a GPU with XLA's Triton GEMM enabled (its default)."""
    if keras.backend.backend() != "jax":
        return False
    import jax

    return jax.default_backend() in ("gpu", "cuda", "rocm") and "--xla_gpu_enable_triton_gemm=false" not in os.environ.get(
        "XLA_FLAGS", ""
    )

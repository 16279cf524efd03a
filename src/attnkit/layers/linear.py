"""`Linear`: a `keras.layers.Dense` whose product runs through `attnkit.ops.linear`.

The variables, the configuration, LoRA and quantization are Dense's own, so Dense weights copy across
unchanged; only the arithmetic differs: one fused GEMM with the bias on torch, in the weight layout
torch's CPU kernels need for bfloat16, and ReLU in place on its output (see `attnkit.ops.linear`).

Legend: d_in input width, d_out (`units`) output width.
"""

import os
import warnings

import keras

from attnkit import kernels
from attnkit.kernels.quantized import block_linear, dequantize
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
            scale = self.lora_alpha / self.lora_rank
            y = kernels.lora_linear(inputs, self._kernel, self.bias, self.lora_kernel_a, self.lora_kernel_b, scale)
            if y is None:
                y = linear(inputs, self._kernel, self.bias)  # (..., d_out)
                # Keras keeps A and B in float32: the update and the sum in float32 (PEFT's order; float64
                # for a float64 layer, which Keras's promotion and torch matmul would cut to float32),
                # rounded to the layer's dtype (docs/decisions.md item 160).
                wide = "float64" if keras.backend.standardize_dtype(y.dtype) == "float64" else "float32"
                a, b = (keras.ops.cast(w, wide) for w in (self.lora_kernel_a, self.lora_kernel_b))
                update = kernels.matmul(kernels.matmul(keras.ops.cast(inputs, wide), a), b)  # (..., d_out)
                y = keras.ops.cast(keras.ops.cast(y, wide) + scale * update, y.dtype)
            return self.activation(y)
        fused = _FUSED_ACTIVATIONS.get(self.activation, "other")
        if fused != "other":
            return linear(inputs, self.kernel, self.bias, activation=fused)
        return self.activation(linear(inputs, self.kernel, self.bias))

    def quantized_call(self, inputs, training=None):
        # GGUF blocks kept packed (`attnkit.layers.block_quantized.keep_blocks`, docs/decisions.md item 127)
        if not holds_blocks(self):
            return super().quantized_call(inputs, training=training)
        offset = None if self.block_offset is None else self.block_offset.value
        bias = None if self.bias is None else self.bias.value
        y = block_linear(inputs, self.block_values.value, self.block_scale.value, offset, bias, **self.block_format)
        if self.lora_enabled:  # x W + (alpha / r) (x A) B, W's blocks frozen (decision 140)
            update = keras.ops.matmul(keras.ops.matmul(inputs, self.lora_kernel_a), self.lora_kernel_b)
            y = y + (self.lora_alpha / self.lora_rank) * keras.ops.cast(update, y.dtype)
        return self.activation(y)

    # Packed blocks as a Dense (decision 140): the kernel they stand for, LoRA, and saving refused.

    @property
    def kernel(self):
        """Dense's kernel (d_in, d_out); for packed blocks their dequantization, LoRA's update merged."""
        if not holds_blocks(self):
            return super().kernel
        offset = None if self.block_offset is None else self.block_offset.value
        w = dequantize(self.block_values.value, self.block_scale.value, offset, **self.block_format)  # (N, K)
        kernel = keras.ops.transpose(w)  # (K, N)
        if self.lora_enabled:
            kernel = kernel + (self.lora_alpha / self.lora_rank) * keras.ops.matmul(self.lora_kernel_a, self.lora_kernel_b)
        return keras.ops.cast(kernel, self.compute_dtype)

    def enable_lora(self, rank, lora_alpha=None, a_initializer="he_uniform", b_initializer="zeros"):
        if not holds_blocks(self):
            return super().enable_lora(rank, lora_alpha, a_initializer, b_initializer)
        if self.lora_enabled:
            raise ValueError("lora is already enabled. This can only be done once per layer.")
        n, k = self.block_format["shape"]
        self._tracker.unlock()
        # float32, as Dense's own LoRA weights; the blocks are non-trainable variables already
        self.lora_kernel_a = self.add_weight(name="lora_kernel_a", shape=(k, rank), initializer=keras.initializers.get(a_initializer), dtype="float32")
        self.lora_kernel_b = self.add_weight(name="lora_kernel_b", shape=(rank, n), initializer=keras.initializers.get(b_initializer), dtype="float32")
        self._tracker.lock()
        self.lora_enabled, self.lora_rank = True, rank
        self.lora_alpha = lora_alpha if lora_alpha is not None else rank

    def save_own_variables(self, store):
        if holds_blocks(self):
            # a composite layer rebuilds its projections from its own arguments, so a reload would
            # make Keras's quantized kernel, not these blocks: refused rather than half restored
            raise ValueError(
                f"`{self.path}` holds packed blocks (a model loaded with dtype 'gguf', 'int8' or 'int4'), which "
                "a .keras file does not restore. Save the model loaded with dtype 'float32' or 'bfloat16' (then "
                "`model.quantize('int8')` gives a quantized model that saves), or keep the checkpoint itself"
            )
        return super().save_own_variables(store)

    def __delattr__(self, name):
        # Keras's Layer.__delattr__ runs a whole gc.collect() after each variable it deletes, to free a
        # device's buffer at once. `quantize` deletes every Dense's kernel, and one collection in a process
        # holding a backend and a model takes 0.1-1 s: quantizing a 32-projection model spent 10 s in
        # them. A variable in host memory is untracked and deleted as Keras does, without the collection
        # (reference counting frees it); on an accelerator Keras's own deletion runs (docs/decisions.md item 145).
        value = getattr(self, name, None)
        if isinstance(value, keras.Variable) and _in_host_memory(value.value):
            self._untrack_variable(value)
            super(keras.layers.Layer, self).__delattr__(name)
            return
        super().__delattr__(name)

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


def _in_host_memory(value):
    """Whether a variable's tensor lives in the CPU's memory (torch, jax or tensorflow); False when unknown."""
    device = getattr(value, "device", None)
    if hasattr(device, "type"):  # torch.device
        return device.type == "cpu"
    if hasattr(device, "platform"):  # a jax Device
        return device.platform == "cpu"
    return isinstance(device, str) and "CPU" in device.upper()  # tensorflow's device name


def triton_gemm_on_gpu():
    """Whether jax runs on a GPU with XLA's Triton GEMM enabled (its default)."""
    if keras.backend.backend() != "jax":
        return False
    import jax

    return jax.default_backend() in ("gpu", "cuda", "rocm") and "--xla_gpu_enable_triton_gemm=false" not in os.environ.get(
        "XLA_FLAGS", ""
    )


def holds_blocks(dense):
    """Whether a `Linear` holds packed blocks (`layers.block_quantized.keep_blocks`)."""
    return getattr(dense, "block_format", None) is not None

"""A `Linear` holding packed blocks as a Dense (docs/decisions.md item 140): its `kernel` is the blocks'
dequantization, LoRA trains on top of the frozen blocks, and saving is refused by name."""

import keras
import numpy as np
import pytest
from backend_utils import to_numpy

from attnkit.kernels.quantized.gguf_blocks import dequantize_numpy
from attnkit.kernels.quantized.weight_only import quantize_int4, quantize_int8
from attnkit.layers.block_quantized import keep_blocks
from attnkit.layers.linear import Linear

K, N = 64, 24


def block_layer(quantize, bias=True):
    rng = np.random.default_rng(0)
    dense = Linear(N, use_bias=bias)
    dense.build((None, K))
    if bias:
        dense.bias.assign(rng.standard_normal(N).astype("float32"))
    blocks = quantize(rng.standard_normal((N, K)).astype("float32"))
    keep_blocks(dense, blocks)
    return dense, dequantize_numpy(blocks).astype(np.float64)  # W (N, K)


@pytest.mark.parametrize("quantize", [quantize_int8, quantize_int4])
def test_the_kernel_is_the_blocks_dequantization(quantize):
    dense, w = block_layer(quantize)
    np.testing.assert_array_equal(to_numpy(dense.kernel), w.T.astype(np.float32))


@pytest.mark.parametrize("quantize", [quantize_int8, quantize_int4])
def test_lora_on_packed_blocks_adds_its_update_and_trains_only_the_adapter(quantize):
    dense, w = block_layer(quantize)
    dense.enable_lora(4, lora_alpha=8)
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((K, 4)).astype("float32"), rng.standard_normal((4, N)).astype("float32")
    dense.lora_kernel_a.assign(a)
    dense.lora_kernel_b.assign(b)
    x = rng.standard_normal((3, K)).astype("float32")
    expected = x @ w.T + to_numpy(dense.bias) + 2.0 * (x.astype(np.float64) @ a @ b)
    np.testing.assert_allclose(to_numpy(dense(x)), expected, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(to_numpy(dense.kernel), w.T + 2.0 * (a.astype(np.float64) @ b), rtol=1e-5, atol=1e-5)
    assert {v.name for v in dense.trainable_variables} == {"lora_kernel_a", "lora_kernel_b", "bias"}
    with pytest.raises(ValueError, match="lora is already enabled"):
        dense.enable_lora(2)


def test_a_training_step_moves_the_adapter():
    dense, _ = block_layer(quantize_int4, bias=False)
    dense.enable_lora(2)
    model = keras.Sequential([keras.Input((K,)), dense])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    before = to_numpy(dense.lora_kernel_b).copy()
    rng = np.random.default_rng(2)
    model.train_on_batch(rng.standard_normal((4, K)).astype("float32"), rng.standard_normal((4, N)).astype("float32"))
    assert np.abs(to_numpy(dense.lora_kernel_b) - before).max() > 0


def test_saving_packed_blocks_is_refused_naming_the_layer(tmp_path):
    dense, _ = block_layer(quantize_int8)
    model = keras.Sequential([keras.Input((K,)), dense])
    with pytest.raises(ValueError, match=r"holds packed blocks .* which a .keras file does not restore"):
        model.save(tmp_path / "packed.keras")

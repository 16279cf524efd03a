"""`kernels.quantized.weight_only` (docs/decisions.md item 138): float weights into int8 / int4 packed
blocks, each weight within half a quantization step of its float value, read back by the same
dequantization the kernels use; and `--dtype int4` on a projection whose input width is not a
multiple of 32."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from hypothesis.extra.numpy import arrays

from attnkit.kernels.quantized.gguf_blocks import dequantize_numpy
from attnkit.kernels.quantized.weight_only import quantize_int4, quantize_int8


def _within_half_a_step(weights, blocks, step):
    """Each dequantized weight within half its stored step (plus float32's rounding of the product)."""
    w = dequantize_numpy(blocks).astype(np.float64)
    assert w.shape == weights.shape
    assert np.all(np.abs(w - weights) <= 0.5 * step + 1e-6 * (np.abs(weights) + step) + 1e-45), np.max(np.abs(w - weights) / step)


finite = st.floats(-1e3, 1e3, allow_nan=False, width=32)


@settings(max_examples=40, deadline=None)
@given(arrays(np.float32, st.tuples(st.integers(1, 5), st.integers(1, 70)), elements=finite))
def test_int8_rows_are_within_half_a_step(weights):
    blocks = quantize_int8(weights)
    assert blocks.values.dtype == np.int8 and blocks.scale.shape == (weights.shape[0], 1) and blocks.group == weights.shape[1]
    step = np.abs(weights).max(axis=1, keepdims=True).astype(np.float64) / 127
    tiny = float(np.nextafter(np.float32(0), np.float32(1)))  # float32's smallest subnormal
    assert np.all((step == 0) | (blocks.scale <= step * (1 + 2**-22) + tiny))  # max / 127 rounded, no coarser
    _within_half_a_step(weights.astype(np.float64), blocks, blocks.scale.astype(np.float64))


@settings(max_examples=40, deadline=None)
@given(arrays(np.float32, st.tuples(st.integers(1, 5), st.sampled_from([32, 64, 96])), elements=finite))
def test_int4_groups_are_within_half_a_step(weights):
    blocks = quantize_int4(weights)
    n, k = weights.shape
    assert blocks.values.shape == (n, k // 2) and blocks.values.dtype == np.uint8 and blocks.scale.shape == (n, k // 32)
    _within_half_a_step(weights.astype(np.float64), blocks, np.repeat(blocks.scale.astype(np.float64), 32, axis=1))


def test_int4_refuses_a_width_that_is_not_whole_groups():
    with pytest.raises(ValueError, match=r"need K a multiple of 32. Received: W of shape \(2, 48\)"):
        quantize_int4(np.ones((2, 48), np.float32))


def test_int4_on_a_width_that_is_not_whole_groups_falls_to_keras_int4(tmp_path):
    """`load_causal_lm(dtype="int4")`: a projection with K % 32 != 0 (here W_down, K = d_ff = 48)
    takes Keras's int4; the model still computes close to the float one."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    from backend_utils import to_numpy

    from attnkit.pipelines.causal_checkpoint import load_causal_lm

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=48, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    float_lm, lm = load_causal_lm(str(tmp_path)), load_causal_lm(str(tmp_path), dtype="int4")
    block = lm.model.decoder_layers[0]
    assert block.feed_forward.W_down.quantization_mode == "int4" and getattr(block.feed_forward.W_down, "block_format", None) is None
    assert block.feed_forward.W_up.block_type == "int4"
    ids = np.arange(12, dtype="int32").reshape(2, 6)
    expected, ours = to_numpy(float_lm.model(ids)), to_numpy(lm.model(ids))
    assert 0 < np.abs(ours - expected).max() < 0.25 * np.abs(expected).max()
    # q8 activations would round the inputs of the packed products only: refused, naming the other
    with pytest.raises(ValueError, match=r"`activations='q8'` rounds .* `causal_lm/layer_0/feed_forward/W_down` \(an input width not a multiple of 32\)"):
        load_causal_lm(str(tmp_path), dtype="int4", activations="q8")


@pytest.mark.parametrize("quantize", [quantize_int8, quantize_int4])
def test_non_finite_weights_are_refused_naming_the_weight(quantize):
    w = np.ones((2, 32), np.float32)
    w[1, 3] = np.nan
    with pytest.raises(ValueError, match=r"layer/W_q holds 1 NaN or infinite weights \(the first at \(1, 3\)\)"):
        quantize(w, "layer/W_q")

"""Tests for DecoderLayer: torch parity, no look-ahead, cross-attention, cached decode steps, bad inputs."""

import numpy as np
import pytest

from attnkit.layers.decoder_layer import DecoderLayer
from attnkit.layers.kv_cache import KVCache, keep_mask
from backend_utils import BACKEND, to_numpy

B, T, S, H, D, D_FF = 3, 7, 6, 2, 8, 16
SOURCE_LENGTHS = (6, 4, 2)  # real source tokens per sequence; the rest is padding


def make_layer(rate=0.0, **kwargs):
    return DecoderLayer(H, D // H, D // H, D, D_FF, rate, **kwargs)


def source_keep(lengths=SOURCE_LENGTHS):
    return np.arange(S)[None, :] < np.array(lengths)[:, None]  # (B, S), True at real tokens


def inputs(rng):
    x = rng.standard_normal((B, T, D)).astype("float32")
    encoder_output = rng.standard_normal((B, S, D)).astype("float32")
    return x, encoder_output


def torch_decoder_layer_like(layer, rng):
    """A torch TransformerDecoderLayer (eval, no dropout) with random weights, copied into `layer`."""
    import torch

    theirs = torch.nn.TransformerDecoderLayer(
        D, H, dim_feedforward=D_FF, dropout=0.0, activation=layer.activation, layer_norm_eps=layer.epsilon,
        batch_first=True, norm_first=layer.norm_first,
    )
    with torch.no_grad():
        for p in theirs.parameters():  # torch's default init leaves biases 0 and norms 1: perturb all
            p.copy_(torch.from_numpy(rng.standard_normal(tuple(p.shape)).astype("float32") / np.sqrt(p.shape[-1])))
    if not layer.built:
        layer.build((None, None, D), (None, None, D))
    sd = {k: v.detach().numpy() for k, v in theirs.state_dict().items()}
    for ours, name in ((layer.self_attention, "self_attn"), (layer.cross_attention, "multihead_attn")):
        w_in, b_in = sd[f"{name}.in_proj_weight"], sd[f"{name}.in_proj_bias"]  # (3 D, D), (3 D,)
        for i, dense in enumerate((ours.W_q, ours.W_k, ours.W_v)):
            rows = slice(i * D, (i + 1) * D)
            dense.set_weights([w_in[rows].T, b_in[rows]])  # torch stores (out, in); Keras (in, out)
        ours.W_o.set_weights([sd[f"{name}.out_proj.weight"].T, sd[f"{name}.out_proj.bias"]])
    ff = layer.feed_forward
    ff.fully_connected1.set_weights([sd["linear1.weight"].T, sd["linear1.bias"]])
    ff.fully_connected2.set_weights([sd["linear2.weight"].T, sd["linear2.bias"]])
    for norm, name in zip(layer.norms, ("norm1", "norm2", "norm3")):
        norm.set_weights([sd[f"{name}.weight"], sd[f"{name}.bias"]])
    return theirs.eval()


@pytest.mark.skipif(BACKEND != "torch", reason="torch.nn.TransformerDecoderLayer needs the torch backend")
@pytest.mark.parametrize("norm_first", [False, True], ids=["post-LN", "pre-LN"])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_equals_torch_transformer_decoder_layer(rng, norm_first, activation):
    import torch

    layer = make_layer(norm_first=norm_first, activation=activation, epsilon=1e-5)
    theirs = torch_decoder_layer_like(layer, rng)
    x, encoder_output = inputs(rng)
    keep = source_keep()
    with torch.no_grad():
        want = theirs(
            torch.from_numpy(x), torch.from_numpy(encoder_output),
            tgt_mask=torch.nn.Transformer.generate_square_subsequent_mask(T), tgt_is_causal=True,
            memory_key_padding_mask=torch.from_numpy(~keep),
        ).numpy()
        want_unmasked = theirs(
            torch.from_numpy(x), torch.from_numpy(encoder_output),
            tgt_mask=torch.nn.Transformer.generate_square_subsequent_mask(T), tgt_is_causal=True,
        ).numpy()
    np.testing.assert_allclose(to_numpy(layer(x, encoder_output, None, keep)), want, atol=1e-5)
    np.testing.assert_allclose(to_numpy(layer(x, encoder_output)), want_unmasked, atol=1e-5)
    assert np.abs(want - want_unmasked).max() > 1e-3  # the source padding mattered


@pytest.mark.parametrize("norm_first", [False, True], ids=["post-LN", "pre-LN"])
def test_no_position_sees_the_future_but_every_position_sees_the_source(rng, norm_first):
    layer = make_layer(norm_first=norm_first)
    x, encoder_output = inputs(rng)
    keep = source_keep()
    base = to_numpy(layer(x, encoder_output, None, keep))
    for t in (0, 2, 5):
        changed = x.copy()
        changed[:, t + 1:] = rng.standard_normal(changed[:, t + 1:].shape)
        out = to_numpy(layer(changed, encoder_output, None, keep))
        np.testing.assert_allclose(out[:, : t + 1], base[:, : t + 1], atol=1e-6)
        assert np.abs(out[:, t + 1:] - base[:, t + 1:]).min(axis=-1).max() > 1e-4  # the change is visible later
    other_source = encoder_output.copy()
    other_source[0, 0] += 1.0  # a real source token of the first sequence
    out = to_numpy(layer(x, other_source, None, keep))
    assert np.abs(out[0] - base[0]).max(axis=-1).min() > 1e-4  # every target position attends to it
    np.testing.assert_array_equal(out[1:], base[1:])
    padded_source = encoder_output.copy()
    padded_source[~keep] += 3.0  # the source padding is never seen
    np.testing.assert_allclose(to_numpy(layer(x, padded_source, None, keep)), base, atol=1e-6)


def test_attention_weights_are_causal_and_skip_source_padding(rng):
    layer = make_layer()
    x, encoder_output = inputs(rng)
    keep = source_keep()
    out, self_weights, cross_weights = layer(x, encoder_output, None, keep, return_attention_weights=True)
    self_weights, cross_weights = to_numpy(self_weights), to_numpy(cross_weights)
    assert self_weights.shape == (B, H, T, T) and cross_weights.shape == (B, H, T, S)
    np.testing.assert_allclose(self_weights.sum(-1), 1.0, atol=1e-5)
    np.testing.assert_allclose(cross_weights.sum(-1), 1.0, atol=1e-5)
    assert np.all(self_weights[..., np.triu(np.ones((T, T), bool), k=1)] == 0)
    assert np.all(cross_weights.transpose(0, 3, 1, 2)[~keep] == 0)
    np.testing.assert_allclose(to_numpy(out), to_numpy(layer(x, encoder_output, None, keep)), atol=1e-5)


def test_target_keep_mask_hides_target_keys(rng):
    layer = make_layer()
    x, encoder_output = inputs(rng)
    target_keep = np.ones((B, T), bool)
    target_keep[:, 1] = False
    _, self_weights, _ = layer(x, encoder_output, target_keep, return_attention_weights=True)
    self_weights = to_numpy(self_weights)
    assert np.all(self_weights[..., 1] == 0)
    np.testing.assert_allclose(self_weights[:, :, 2:].sum(-1), 1.0, atol=1e-5)


@pytest.mark.parametrize("norm_first", [False, True], ids=["post-LN", "pre-LN"])
@pytest.mark.parametrize("chunks", [(1,) * T, (3, 1, 2, 1)], ids=["one-at-a-time", "chunks"])
def test_decode_steps_concatenated_equal_the_full_call(rng, norm_first, chunks):
    layer = make_layer(norm_first=norm_first)
    x, encoder_output = inputs(rng)
    keep = source_keep()[:, None, :]  # (B, 1, S): a (B, S) mask is ambiguous for the 3-query chunk, B == 3
    full, _, full_cross = layer(x, encoder_output, None, keep, return_attention_weights=True)
    cross_keys_values = layer.project_encoder_output(encoder_output)
    cache, outputs, cross = KVCache(1, B, H, T, D // H), [], []
    start = 0
    for size in chunks:
        cache.advance(np.ones((B, size), bool))
        mask, causal = keep_mask(cache.valid[:, :cache.attended], np.arange(start, start + size))
        out, weights = layer.decode_step(
            x[:, start:start + size], cross_keys_values, keep, cache=cache, layer_index=0, start=start, keep=mask,
            causal=causal, return_attention_weights=True,
        )
        start += size
        assert cache.length == start
        outputs.append(to_numpy(out))
        cross.append(to_numpy(weights))
    np.testing.assert_allclose(np.concatenate(outputs, axis=1), to_numpy(full), atol=1e-5)
    np.testing.assert_allclose(np.concatenate(cross, axis=2), to_numpy(full_cross), atol=1e-5)


def test_dropout_changes_outputs_only_in_training(rng):
    layer = make_layer(rate=0.3)
    x, encoder_output = inputs(rng)
    inference = to_numpy(layer(x, encoder_output))
    np.testing.assert_array_equal(to_numpy(layer(x, encoder_output, training=False)), inference)
    training = to_numpy(layer(x, encoder_output, None, None, True))  # the seeds' positional call
    assert np.abs(training - inference).max() > 1e-3


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(h=0), r"`h` must be a positive integer. Received: h=0"),
        (dict(d_model=-2), r"`d_model` must be a positive integer. Received: d_model=-2"),
        (dict(rate=1.0), r"`rate` must be a float in \[0, 1\). Received: rate=1.0"),
        (dict(activation="swish"), r"`activation` must be one of \('relu', 'gelu', 'gelu_tanh', 'silu'\). Received: activation='swish'"),
        (dict(epsilon=0.0), r"`epsilon` must be a finite positive number. Received: epsilon=0.0"),
    ],
)
def test_bad_constructor_arguments_raise(kwargs, message):
    args = dict(h=H, d_k=4, d_v=4, d_model=D, d_ff=D_FF, rate=0.1)
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        DecoderLayer(**args)


def test_bad_inputs_raise(rng):
    layer = make_layer()
    x, encoder_output = inputs(rng)
    layer(x, encoder_output)
    with pytest.raises(ValueError, match=r"`x` must have shape \(batch, length, d_model=8\). Received: x.shape=\(3, 7, 4\)"):
        layer(x[..., :4], encoder_output)
    with pytest.raises(
        ValueError,
        match=r"`encoder_output` must have shape \(batch, length, d_model=8\). Received: encoder_output.shape=\(3, 6, 5\)",
    ):
        layer(x, encoder_output[..., :5])
    with pytest.raises(
        ValueError,
        match=r"`x` and `encoder_output` must have the same batch size. Received shapes: x=\(3, 7, 8\), "
        r"encoder_output=\(2, 6, 8\)",
    ):
        layer(x, encoder_output[:2])
    with pytest.raises(
        ValueError, match=r"`padding_mask` of shape \(3, 5\) does not broadcast to the attention scores"
    ):
        layer(x, encoder_output, None, source_keep()[:, :5])
    with pytest.raises(
        ValueError, match=r"`lookahead_mask` of shape \(3, 6\) does not broadcast to the attention scores"
    ):
        layer(x, encoder_output, np.ones((B, S), bool))
    with pytest.raises(TypeError, match=r"`padding_mask` must be a boolean or integer mask, not float32"):
        layer(x, encoder_output, None, source_keep().astype("float32"))

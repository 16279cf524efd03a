"""Shared helpers for the encoder tests: torch reference layers with our weights, and round-trip checks.

`torch_encoder_layer_like(layer)` builds a torch.nn.TransformerEncoderLayer with the same sizes as an
attnkit EncoderLayer and copies its weights into ours; the checks below run one layer or model through
get_config/from_config, a .keras file, mixed_bfloat16 and one fit step.
"""

import numpy as np

import attnkit  # noqa: F401  (chooses the Keras backend before Keras is imported)
import keras

from backend_utils import to_numpy
from layer_harness import check_config_round_trip


def assert_close(actual, desired, atol=1e-5, rtol=0.0):
    np.testing.assert_allclose(to_numpy(actual), to_numpy(desired), atol=atol, rtol=rtol)


def torch_encoder_layer_like(layer, rng):
    """A torch TransformerEncoderLayer (eval, no dropout) with random weights, copied into `layer`.

    `layer` is an attnkit EncoderLayer with d_k = d_v = d_model / h.
    """
    import torch

    d_model = layer.d_model
    theirs = torch.nn.TransformerEncoderLayer(
        d_model, layer.h, dim_feedforward=layer.d_ff, dropout=0.0, activation=layer.activation,
        layer_norm_eps=layer.epsilon, batch_first=True, norm_first=layer.norm_first,
    )
    with torch.no_grad():
        for p in theirs.parameters():  # torch's default init leaves biases 0 and norms 1: perturb all
            p.copy_(torch.from_numpy(rng.standard_normal(tuple(p.shape)).astype("float32") / np.sqrt(p.shape[-1])))
    copy_torch_encoder_layer(theirs, layer)
    return theirs.eval()


def copy_torch_encoder_layer(theirs, layer):
    """Copies torch.nn.TransformerEncoderLayer weights into an attnkit EncoderLayer (built here if needed)."""
    d_model = layer.d_model
    if not layer.built:
        layer.build((None, None, d_model))
    sd = {k: v.detach().numpy() for k, v in theirs.state_dict().items()}
    w_in, b_in = sd["self_attn.in_proj_weight"], sd["self_attn.in_proj_bias"]  # (3 d_model, d_model), (3 d_model,)
    mha = layer.multihead_attention
    for i, dense in enumerate((mha.W_q, mha.W_k, mha.W_v)):
        rows = slice(i * d_model, (i + 1) * d_model)
        dense.set_weights([w_in[rows].T, b_in[rows]])  # torch stores (out, in); Keras (in, out)
    mha.W_o.set_weights([sd["self_attn.out_proj.weight"].T, sd["self_attn.out_proj.bias"]])
    ff = layer.feed_forward
    ff.fully_connected1.set_weights([sd["linear1.weight"].T, sd["linear1.bias"]])
    ff.fully_connected2.set_weights([sd["linear2.weight"].T, sd["linear2.bias"]])
    for norm, name in zip(layer.norms, ("norm1", "norm2")):
        norm.set_weights([sd[f"{name}.weight"], sd[f"{name}.bias"]])


def config_round_trip(layer, *inputs, **call_kwargs):
    """Rebuilds `layer` from its config, copies the weights, and checks the outputs are identical."""
    check_config_round_trip(layer, inputs, call_kwargs)


def keras_file_round_trip(model, inputs, path):
    """Saves a model to a .keras file, loads it, and checks the outputs are identical."""
    expected = model.predict(inputs, verbose=0)
    model.save(path)
    loaded = keras.saving.load_model(path)
    np.testing.assert_array_equal(loaded.predict(inputs, verbose=0), expected)


def mixed_bfloat16_close(make_layer, inputs, atol):
    """Runs the same layer under float32 and mixed_bfloat16 (same weights); returns the bf16 output."""
    full = make_layer()
    want = to_numpy(full(*inputs))
    keras.config.set_dtype_policy("mixed_bfloat16")
    try:
        half = make_layer()
        half(*inputs)
        half.set_weights(full.get_weights())
        got = half(*inputs)
    finally:
        keras.config.set_dtype_policy("float32")
    assert keras.backend.standardize_dtype(got.dtype) == "bfloat16"
    got = to_numpy(keras.ops.cast(got, "float32"))
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, want, atol=atol)
    return got


def fit_lowers_loss(model, x, y, epochs=3):
    """Compiles `model` with Adam and MSE, fits a few epochs, and checks the loss went down.

    The losses compared are evaluated without dropout: the training losses of single epochs move with
    the dropout draws, which differ between devices (3 epochs on a GPU went 0.197, 0.149, 0.259).
    """
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    before = model.evaluate(x, y, batch_size=len(y), verbose=0)
    history = model.fit(x, y, epochs=epochs, batch_size=len(y), verbose=0)
    after = model.evaluate(x, y, batch_size=len(y), verbose=0)
    assert np.all(np.isfinite(history.history["loss"]))
    assert after < before, (before, after)

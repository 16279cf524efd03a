"""Tests for Transformer: logits, no look-ahead, tied embeddings, serialization, fit, mixed precision."""

import numpy as np
import pytest

import keras
from attnkit.models.transformer import Transformer
from backend_utils import to_numpy

B, S, T, SRC_VOCAB, TGT_VOCAB, H, D, D_FF, N = 3, 6, 7, 11, 13, 2, 8, 16, 2
START, END = 1, 2


def make_model(rate=0.0, n=N, **kwargs):
    return Transformer(SRC_VOCAB, TGT_VOCAB, S, T, H, D // H, D // H, D, D_FF, n, rate, **kwargs)


def source_ids(rng, lengths=(6, 4, 2)):
    ids = rng.integers(3, SRC_VOCAB, (len(lengths), S))
    for row, length in enumerate(lengths):
        ids[row, length:] = 0
    return ids


def target_ids(rng):
    ids = rng.integers(3, TGT_VOCAB, (B, T))
    ids[:, 0] = START
    return ids


@pytest.mark.parametrize("norm_first", [False, True], ids=["post-LN", "pre-LN"])
def test_logits_shape_no_look_ahead_and_source_dependence(rng, norm_first):
    model = make_model(norm_first=norm_first)
    src, tgt = source_ids(rng), target_ids(rng)
    logits = model((src, tgt))
    assert tuple(logits.shape) == (B, T, TGT_VOCAB)
    assert keras.backend.standardize_dtype(logits.dtype) == "float32"
    base = to_numpy(logits)
    np.testing.assert_array_equal(to_numpy(model(src, tgt)), base)  # both call forms
    for t in (0, 2, 5):
        changed = tgt.copy()
        changed[:, t + 1:] = 3 + (changed[:, t + 1:] - 3 + 1) % (TGT_VOCAB - 3)  # another real token
        out = to_numpy(model((src, changed)))
        np.testing.assert_allclose(out[:, : t + 1], base[:, : t + 1], atol=1e-6)
        assert np.abs(out[:, t + 1:] - base[:, t + 1:]).max(axis=-1).min() > 1e-4
    other = src.copy()
    other[:, 0] = 3 + (other[:, 0] - 3 + 1) % (SRC_VOCAB - 3)  # another real first source token
    out = to_numpy(model((other, tgt)))
    assert np.abs(out - base).max(axis=-1).min() > 1e-4  # every target position of every sequence
    padded = src.copy()
    padded[:, 2:] = 0  # dropping real source tokens changes the rows that had them
    out = to_numpy(model((padded, tgt)))
    np.testing.assert_array_equal(out[2], base[2])  # the third source had only two tokens
    assert np.abs(out[:2] - base[:2]).max(axis=-1).min() > 1e-4


def test_tied_weights_share_the_decoder_token_embedding(rng):
    tied, untied = make_model(tie_weights=True), make_model()
    src, tgt = source_ids(rng), target_ids(rng)
    base = to_numpy(tied((src, tgt)))
    untied((src, tgt))
    assert not hasattr(tied, "model_last_layer")
    assert untied.count_params() - tied.count_params() == D * TGT_VOCAB  # no output kernel, the same bias
    embedding = tied.decoder.pos_encoding.token_embedding
    # logits = y E^T + b
    encoder_output, source_mask = tied.encode(src)
    y = to_numpy(tied.decoder(tgt, encoder_output, None, source_mask))
    want = y @ to_numpy(embedding.embeddings).T + to_numpy(tied.output_bias)
    np.testing.assert_allclose(base, want, atol=1e-5)
    # Changing the embedding of a token that is not in the input changes only that token's logits.
    unused = int(np.setdiff1d(np.arange(TGT_VOCAB), tgt)[0])
    for model in (tied, untied):
        before = to_numpy(model((src, tgt)))
        table = to_numpy(model.decoder.pos_encoding.token_embedding.embeddings).copy()
        table[unused] += rng.standard_normal(D)  # not a constant: a layer-normed y sums to 0
        model.decoder.pos_encoding.token_embedding.embeddings.assign(table)
        after = to_numpy(model((src, tgt)))
        others = np.arange(TGT_VOCAB) != unused
        np.testing.assert_allclose(after[..., others], before[..., others], atol=1e-6)
        if model is tied:
            assert np.abs(after[..., unused] - before[..., unused]).min() > 1e-4
        else:
            np.testing.assert_allclose(after[..., unused], before[..., unused], atol=1e-6)



@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_tied_logits_of_a_quantized_model_read_the_dequantized_embeddings(rng, mode):
    """`quantize` stores the token embeddings as integers and scales; the embedding's `embeddings`
    property returns the integers as they are. Tied logits read them as E: 2560x the float logits
    (int8), 172x (int4). They must be y E_q^T + b, E_q the table the quantized lookups read."""
    model = make_model(tie_weights=True)
    src, tgt = source_ids(rng), target_ids(rng)
    before = to_numpy(model((src, tgt)))
    model.quantize(mode)
    after = to_numpy(model((src, tgt)))
    embedding = model.decoder.pos_encoding.token_embedding
    assert embedding.quantization_mode == mode
    if mode == "int8":  # Keras's int8 lookup: the integer row divided by its scale
        table = to_numpy(embedding._embeddings).astype("float64") / to_numpy(embedding.embeddings_scale)[:, None]
    else:
        table = to_numpy(embedding(np.arange(TGT_VOCAB))).astype("float64")
    encoder_output, source_mask = model.encode(src)
    y = to_numpy(model.decoder(tgt, encoder_output, None, source_mask)).astype("float64")
    np.testing.assert_allclose(after, y @ table.T + to_numpy(model.output_bias), atol=1e-4)
    bound = {"int8": 0.1, "int4": 0.5}[mode]  # 4 bits on 8-wide rows round coarsely
    assert np.abs(after - before).max() < bound * np.abs(before).max()  # rounding, not integers read as E


@pytest.mark.parametrize("tie_weights", [False, True], ids=["untied", "tied"])
def test_config_and_keras_file_round_trips(rng, tmp_path, tie_weights):
    model = make_model(rate=0.1, norm_first=tie_weights, activation="gelu", epsilon=1e-5, tie_weights=tie_weights)
    src, tgt = source_ids(rng), target_ids(rng)
    expected = to_numpy(model((src, tgt)))
    clone = Transformer.from_config(model.get_config())
    assert clone.get_config() == model.get_config()
    clone((src, tgt))
    clone.set_weights(model.get_weights())
    np.testing.assert_array_equal(to_numpy(clone((src, tgt))), expected)
    path = tmp_path / "transformer.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert isinstance(loaded, Transformer) and loaded.get_config() == model.get_config()
    np.testing.assert_array_equal(to_numpy(loaded((src, tgt))), expected)


def test_fit_on_a_copy_task_lowers_the_loss(rng):
    model = make_model(rate=0.1, n=1)  # one layer per stack is enough to start learning to copy
    src = rng.integers(3, SRC_VOCAB, (16, S - 1))  # copy 5 tokens: target in = START + src, out = src + END
    target_in = np.concatenate([np.full((16, 1), START), src], axis=1)
    target_out = np.concatenate([src, np.full((16, 1), END)], axis=1)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-2), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    history = model.fit((src, target_in), target_out, epochs=3, batch_size=16, verbose=0)
    losses = history.history["loss"]
    assert np.all(np.isfinite(losses))
    assert losses[-1] < losses[0] - 0.1, losses


def test_mixed_bfloat16_gives_finite_float32_logits(rng):
    src, tgt = source_ids(rng), target_ids(rng)
    keras.config.set_dtype_policy("mixed_bfloat16")
    try:
        model = make_model(tie_weights=True)
        logits = model((src, tgt))
        untied_logits = make_model()((src, tgt))
    finally:
        keras.config.set_dtype_policy("float32")
    for out in (logits, untied_logits):
        assert keras.backend.standardize_dtype(out.dtype) == "float32"
        assert tuple(out.shape) == (B, T, TGT_VOCAB)
        assert np.all(np.isfinite(to_numpy(out)))
    assert keras.backend.standardize_dtype(model.decoder.decoder_layers[0].compute_dtype) == "bfloat16"


def test_one_tensor_instead_of_the_pair_raises(rng):
    model = make_model()
    message = r"A Transformer takes \(encoder_input, decoder_input\).*Received: one argument of shape \(3, 6\)"
    with pytest.raises(ValueError, match=message):
        model(source_ids(rng))  # unbuilt: the check runs in build
    model((source_ids(rng), target_ids(rng)))
    with pytest.raises(ValueError, match=message):
        model(source_ids(rng))  # built: in call

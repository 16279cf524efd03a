"""Tests for `attnkit.MultiHeadAttention`: exact values against the float64 reference, Keras and torch,
every backend, Keras citizenship (config, saving, fit, masks, mixed precision), dropout, the fused path,
and the errors."""

import keras
import numpy as np
import pytest
from keras import ops

import attnkit
import reference
from attnkit._validation import ArgumentTypeError
from attnkit.layers._keras_mask import keras_mask_of
from attnkit import kernels as _fused
from backend_utils import BACKEND, once_per_run, to_numpy, value_and_grads
from layer_harness import check_config_round_trip
from layer_checks import assert_same_on_every_backend, numpy_outputs, set_mha_weights

B, T_q, T_k, H = 2, 5, 7, 3  # all different, so no 2-D mask is ambiguous


def make_layer(rng, d_q=6, d_kin=10, d_vin=4, h=H, d_k=4, d_v=5, d_model=8, **kwargs):
    layer = attnkit.MultiHeadAttention(h, d_k, d_v, d_model, **kwargs)
    return layer, set_mha_weights(layer, rng, d_q, d_kin, d_vin)


def inputs(rng, t_q=T_q, t_k=T_k, d_q=6, d_kin=10, d_vin=4, batch=B):
    return (
        rng.standard_normal((batch, t_q, d_q)).astype("float32"),
        rng.standard_normal((batch, t_k, d_kin)).astype("float32"),
        rng.standard_normal((batch, t_k, d_vin)).astype("float32"),
    )


def expected(weights, q, k, v, h=H, keep=None):
    return reference.multi_head_attention(q, k, v, weights["W_q"], weights["W_k"], weights["W_v"], weights["W_o"], h, keep)


def assert_close(actual, desired, atol=1e-5):
    np.testing.assert_allclose(to_numpy(actual), desired, rtol=0, atol=atol)


# --- against the float64 reference ------------------------------------------------------------------


@pytest.mark.parametrize("return_weights", [False, True], ids=["fused", "explicit"])
def test_cross_attention_with_different_widths_matches_reference(rng, return_weights):
    layer, weights = make_layer(rng)
    q, k, v = inputs(rng)
    out = layer(q, k, v, return_attention_weights=return_weights)
    want, want_weights = expected(weights, q, k, v)
    if return_weights:
        out, w = out
        assert tuple(w.shape) == (B, H, T_q, T_k)
        assert_close(w, want_weights)
    assert tuple(out.shape) == (B, T_q, 8)
    assert_close(out, want)


def test_self_attention_defaults_keys_and_values_to_queries(rng):
    layer, weights = make_layer(rng, d_q=6, d_kin=6, d_vin=6)
    x = rng.standard_normal((B, T_q, 6)).astype("float32")
    assert_close(layer(x), expected(weights, x, x, x)[0])
    # values default to keys
    k = rng.standard_normal((B, T_k, 6)).astype("float32")
    assert_close(layer(x, k), expected(weights, x, k, k)[0])


def test_odd_long_sequence_matches_reference(rng):
    layer, weights = make_layer(rng, d_q=4, d_kin=4, d_vin=4, h=2, d_k=3, d_v=3, d_model=4)
    q, k, v = inputs(rng, t_q=7, t_k=267, d_q=4, d_kin=4, d_vin=4, batch=1)
    out, w = layer(q, k, v, return_attention_weights=True)
    want, want_w = expected(weights, q, k, v, h=2)
    assert_close(out, want)
    assert_close(w, want_w)
    assert_close(layer(q, k, v), want)


def test_without_bias_matches_reference(rng):
    layer, weights = make_layer(rng, use_bias=False)
    assert all(b is None for _, b in weights.values())
    assert len(layer.trainable_weights) == 4
    q, k, v = inputs(rng)
    assert_close(layer(q, k, v), expected(weights, q, k, v)[0])


def mask_cases(rng):
    """(mask as given, the same mask as a keep-mask broadcastable to (B, h, T_q, T_k))."""
    t_k = rng.random(T_k) < 0.6
    b_k = rng.random((B, T_k)) < 0.6
    q_k = rng.random((T_q, T_k)) < 0.6
    bqk = rng.random((B, T_q, T_k)) < 0.6
    bhqk = rng.random((B, H, T_q, T_k)) < 0.6
    b_k[:, 0] = False  # somewhere a key no query sees, and below rows with nothing to attend to
    bqk[0, 1] = False
    bhqk[1, 2, 3] = False
    return {
        "T_k": (t_k, t_k),
        "B,T_k": (b_k, b_k[:, None, None, :]),
        "T_q,T_k": (q_k, q_k),
        "B,T_q,T_k": (bqk, bqk[:, None]),
        "B,h,T_q,T_k": (bhqk, bhqk),
        "B,1,T_k int": (b_k[:, None, :].astype("int32"), b_k[:, None, None, :]),
        "1,1,T_q,1": (q_k[None, None, :, :1], q_k[:, :1]),
    }


@pytest.mark.parametrize(
    "case", ["T_k", "B,T_k", "T_q,T_k", "B,T_q,T_k", "B,h,T_q,T_k", "B,1,T_k int", "1,1,T_q,1"]
)
@pytest.mark.parametrize("return_weights", [False, True], ids=["fused", "explicit"])
def test_every_mask_shape_matches_reference(rng, case, return_weights):
    layer, weights = make_layer(rng)
    q, k, v = inputs(rng)
    mask, keep = mask_cases(rng)[case]
    want, want_w = expected(weights, q, k, v, keep=keep)
    out = layer(q, k, v, mask=mask, return_attention_weights=return_weights)
    if return_weights:
        out, w = out
        assert_close(w, want_w)
    assert_close(out, want)


@pytest.mark.parametrize("t_q,t_k", [(T_q, T_q), (T_q, T_k), (T_k, T_q)])
@pytest.mark.parametrize("return_weights", [False, True], ids=["fused", "explicit"])
def test_causal_is_bottom_right_aligned(rng, t_q, t_k, return_weights):
    layer, weights = make_layer(rng)
    q, k, v = inputs(rng, t_q=t_q, t_k=t_k)
    want, want_w = expected(weights, q, k, v, keep=reference.causal_keep(t_q, t_k))
    out = layer(q, k, v, causal=True, return_attention_weights=return_weights)
    if return_weights:
        out, w = out
        assert_close(w, want_w)
        if t_q > t_k:  # the first queries see no key: zero weights
            assert np.all(to_numpy(w)[:, :, : t_q - t_k] == 0)
    assert_close(out, want)


def test_causal_combines_with_padding_mask(rng):
    layer, weights = make_layer(rng)
    q, k, v = inputs(rng, t_q=T_k, t_k=T_k)
    padding = np.ones((B, T_k), bool)
    padding[0, -3:] = False
    keep = padding[:, None, None, :] & reference.causal_keep(T_k, T_k)
    want, want_w = expected(weights, q, k, v, keep=keep)
    assert_close(layer(q, k, v, mask=padding, causal=True), want)
    out, w = layer(q, k, v, mask=padding, causal=True, return_attention_weights=True)
    assert_close(out, want)
    assert_close(w, want_w)


# --- against Keras and torch ------------------------------------------------------------------------


def keras_mha_with_weights_of(layer, weights, d_q, d_kin, d_vin):
    """keras.layers.MultiHeadAttention holding the same weights as our layer."""
    h, d_k, d_v, d_model = layer.h, layer.d_k, layer.d_v, layer.d_model
    theirs = keras.layers.MultiHeadAttention(num_heads=h, key_dim=d_k, value_dim=d_v, output_shape=d_model)
    theirs.build((None, None, d_q), (None, None, d_vin), (None, None, d_kin))  # query, value, key
    (qk, qb), (kk, kb), (vk, vb), (ok, ob) = (weights[n] for n in ("W_q", "W_k", "W_v", "W_o"))
    theirs._query_dense.set_weights([qk.reshape(d_q, h, d_k), qb.reshape(h, d_k)])
    theirs._key_dense.set_weights([kk.reshape(d_kin, h, d_k), kb.reshape(h, d_k)])
    theirs._value_dense.set_weights([vk.reshape(d_vin, h, d_v), vb.reshape(h, d_v)])
    theirs._output_dense.set_weights([ok.reshape(h, d_v, d_model), ob])
    return theirs


@pytest.mark.parametrize("with_mask", [False, True], ids=["no-mask", "mask"])
def test_equals_keras_multi_head_attention(rng, with_mask):
    layer, weights = make_layer(rng)
    q, k, v = inputs(rng)
    theirs = keras_mha_with_weights_of(layer, weights, 6, 10, 4)
    mask = None
    if with_mask:
        mask = rng.random((B, T_q, T_k)) < 0.6
        mask[..., 0] = True  # Keras gives uniform weights, not zeros, to rows with nothing to attend to
    their_out, their_w = theirs(q, v, k, attention_mask=mask, return_attention_scores=True)
    our_out, our_w = layer(q, k, v, mask=mask, return_attention_weights=True)
    assert_close(our_out, to_numpy(their_out))
    assert_close(our_w, to_numpy(their_w))
    assert_close(layer(q, k, v, mask=mask), to_numpy(their_out))  # fused path too


def torch_mha_with_weights_of(layer, weights, embed_dim):
    import torch

    theirs = torch.nn.MultiheadAttention(embed_dim, layer.h, batch_first=True)
    (qk, qb), (kk, kb), (vk, vb), (ok, ob) = (weights[n] for n in ("W_q", "W_k", "W_v", "W_o"))
    with torch.no_grad():
        theirs.in_proj_weight.copy_(torch.from_numpy(np.concatenate([qk.T, kk.T, vk.T])))
        theirs.in_proj_bias.copy_(torch.from_numpy(np.concatenate([qb, kb, vb])))
        theirs.out_proj.weight.copy_(torch.from_numpy(ok.T.copy()))
        theirs.out_proj.bias.copy_(torch.from_numpy(ob))
    return theirs.eval()


@pytest.mark.skipif(BACKEND != "torch", reason="torch.nn.MultiheadAttention needs the torch backend")
def test_equals_torch_multi_head_attention_with_key_padding_mask(rng):
    import torch

    E = 12
    layer, weights = make_layer(rng, d_q=E, d_kin=E, d_vin=E, h=H, d_k=E // H, d_v=E // H, d_model=E)
    q, k, v = inputs(rng, d_q=E, d_kin=E, d_vin=E)
    theirs = torch_mha_with_weights_of(layer, weights, E)
    key_padding_mask = np.zeros((B, T_k), bool)  # torch: True = ignore
    key_padding_mask[0, -2:] = True
    key_padding_mask[1, 1] = True
    with torch.no_grad():
        their_out, their_w = theirs(
            *(torch.from_numpy(x) for x in (q, k, v)), key_padding_mask=torch.from_numpy(key_padding_mask),
            need_weights=True, average_attn_weights=False,
        )
        mask = attnkit.from_key_padding_mask(key_padding_mask)
        our_out, our_w = layer(q, k, v, mask=mask, return_attention_weights=True)
        assert_close(our_out, their_out.numpy())
        assert_close(our_w, their_w.numpy())
        assert_close(layer(q, k, v, mask=mask), their_out.numpy())
        # self-attention without a mask
        their_self = theirs(*(torch.from_numpy(q),) * 3, need_weights=False)[0]
        assert_close(layer(q), their_self.numpy())


# --- every backend ----------------------------------------------------------------------------------


@once_per_run  # compares the three backends, from whichever pass runs it
def test_same_weights_give_same_outputs_on_every_backend():
    assert_same_on_every_backend("MultiHeadAttention")


# --- Keras citizenship ------------------------------------------------------------------------------


def test_config_round_trip_gives_identical_outputs(rng):
    layer, _ = make_layer(
        rng, dropout=0.25, use_bias=False, kernel_initializer="he_normal", seed=7, name="mha"
    )
    config = layer.get_config()
    assert {k: config[k] for k in ("h", "d_k", "d_v", "d_model", "dropout", "use_bias", "seed")} == {
        "h": H, "d_k": 4, "d_v": 5, "d_model": 8, "dropout": 0.25, "use_bias": False, "seed": 7,
    }
    check_config_round_trip(layer, inputs(rng))


def test_keras_file_round_trip_in_functional_model(rng, tmp_path):
    q_in, kv_in = keras.Input((None, 6)), keras.Input((None, 10))
    layer = attnkit.MultiHeadAttention(H, 4, 5, 8, dropout=0.1)
    out, w = layer(q_in, kv_in, return_attention_weights=True)
    model = keras.Model([q_in, kv_in], [out, w])
    q, k, _ = inputs(rng)
    before = numpy_outputs(model([q, k]))
    path = tmp_path / "mha.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    restored = [x for x in loaded.layers if isinstance(x, attnkit.MultiHeadAttention)]
    assert len(restored) == 1 and restored[0].dropout == 0.1
    after = numpy_outputs(loaded([q, k]))
    for a, b in zip(before, after):
        np.testing.assert_array_equal(a, b)


def test_compute_output_shape_matches_call(rng):
    layer, _ = make_layer(rng)
    q, k, v = inputs(rng)
    assert layer.compute_output_shape(q.shape, k.shape, v.shape) == tuple(layer(q, k, v).shape) == (B, T_q, 8)
    symbolic = layer(keras.KerasTensor((None, 3, 6)), keras.KerasTensor((None, 11, 10)), keras.KerasTensor((None, 11, 4)))
    assert tuple(symbolic.shape) == (None, 3, 8)


def test_functional_model_with_keras_masks_trains(rng):
    # Label: does token 1 occur among the real tokens? Padding (0) is masked.
    vocab, T = 6, 8
    ids = rng.integers(2, vocab, size=(256, T))
    lengths = rng.integers(3, T + 1, size=256)
    has_one = rng.random(256) < 0.5
    for row, (n, one) in enumerate(zip(lengths, has_one)):
        if one:
            ids[row, rng.integers(0, n)] = 1
        ids[row, n:] = 0
    labels = has_one.astype("int32")

    tokens = keras.Input((T,), dtype="int32")
    x = keras.layers.Embedding(vocab, 16, mask_zero=True)(tokens)
    x = attnkit.MultiHeadAttention(2, 8, 8, 16)(x)
    x = keras.layers.GlobalAveragePooling1D()(x)
    out = keras.layers.Dense(2, activation="softmax")(x)
    model = keras.Model(tokens, out)
    model.compile(keras.optimizers.Adam(0.01), "sparse_categorical_crossentropy")
    history = model.fit(ids, labels, epochs=6, batch_size=32, verbose=0)
    losses = history.history["loss"]
    assert all(np.isfinite(losses))
    assert losses[-1] < 0.6 * losses[0], losses


def test_keras_mask_from_embedding_is_key_padding(rng):
    vocab, T = 9, 6
    ids = np.array([[3, 4, 5, 0, 0, 0], [1, 2, 3, 4, 5, 6], [7, 0, 0, 0, 0, 0]], "int32")
    embedding = keras.layers.Embedding(vocab, 6, mask_zero=True)
    layer, _ = make_layer(rng, d_q=6, d_kin=6, d_vin=6)
    x = embedding(ids)
    assert keras_mask_of(x) is not None
    plain = ops.convert_to_tensor(to_numpy(x))  # the same numbers with no Keras mask
    with_keras_mask = to_numpy(layer(x))
    with_explicit_mask = to_numpy(layer(plain, mask=attnkit.padding_mask(ids)))
    real = ids != 0
    np.testing.assert_allclose(with_keras_mask[real], with_explicit_mask[real], rtol=0, atol=1e-6)
    unmasked = to_numpy(layer(plain))
    assert np.abs(unmasked[0, :3] - with_keras_mask[0, :3]).max() > 1e-3  # the mask did something
    # appending padding changes nothing at the real tokens
    longer = np.concatenate([ids, np.zeros((3, 4), "int32")], axis=1)
    padded_out = to_numpy(layer(embedding(longer)))
    np.testing.assert_allclose(padded_out[:, :T][real], with_keras_mask[real], rtol=0, atol=1e-6)
    # the output keeps the queries' padding as its Keras mask
    np.testing.assert_array_equal(to_numpy(keras_mask_of(layer(x))), real)


def test_keras_mask_combines_with_an_explicit_mask_in_self_attention(rng):
    """An explicit `mask` (here causal) keeps Keras from filling the masks: the padding must still hold."""
    ids = np.array([[3, 4, 5, 0, 0, 0], [1, 2, 0, 0, 0, 0]], "int32")
    x = keras.layers.Embedding(9, 6, mask_zero=True)(ids)
    plain = ops.convert_to_tensor(to_numpy(x))
    layer, _ = make_layer(rng, d_q=6, d_kin=6, d_vin=6)
    look_ahead = np.tril(np.ones((6, 6), bool))
    got = to_numpy(layer(x, mask=look_ahead))
    want = to_numpy(layer(plain, mask=look_ahead[None] & (ids != 0)[:, None, :]))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    assert np.abs(got - to_numpy(layer(plain, mask=look_ahead))).max() > 1e-3  # the padding mattered
    # a functional model replays the same
    tokens = keras.Input((6,), dtype="int32")
    model = keras.Model(tokens, layer(keras.layers.Embedding(9, 6, mask_zero=True)(tokens), mask=look_ahead))
    embedded = model.layers[1](ids)
    np.testing.assert_allclose(
        to_numpy(model(ids)), to_numpy(layer(embedded, mask=look_ahead)), rtol=0, atol=1e-6
    )


def test_keras_mask_on_keys_in_cross_attention(rng):
    kv_ids = np.array([[3, 4, 0, 0, 0, 0, 0], [1, 2, 3, 4, 5, 0, 0]], "int32")
    embedding = keras.layers.Embedding(9, 10, mask_zero=True)
    layer, _ = make_layer(rng)
    q, _, v = inputs(rng)
    kv = embedding(kv_ids)
    plain = ops.convert_to_tensor(to_numpy(kv))
    with_keras_mask = to_numpy(layer(q, kv, v))
    explicit = to_numpy(layer(q, plain, v, mask=attnkit.padding_mask(kv_ids)))
    np.testing.assert_allclose(with_keras_mask, explicit, rtol=0, atol=1e-6)
    assert np.abs(with_keras_mask - to_numpy(layer(q, plain, v))).max() > 1e-3


def test_mixed_bfloat16_runs_close_to_float32(rng):
    q, k, v = inputs(rng)
    mask = rng.random((B, T_q, T_k)) < 0.7
    layer32, weights = make_layer(rng)
    want = to_numpy(layer32(q, k, v, mask=mask))
    keras.config.set_dtype_policy("mixed_bfloat16")
    layer16 = attnkit.MultiHeadAttention(H, 4, 5, 8)
    layer16.build(q.shape, k.shape, v.shape)
    layer16.set_weights(layer32.get_weights())
    assert layer16.W_q.kernel.dtype == "float32"  # variables stay float32, the compute is bfloat16
    for return_weights in (False, True):
        out = layer16(q, k, v, mask=mask, return_attention_weights=return_weights)
        if return_weights:
            out, w = out
            assert keras.backend.standardize_dtype(w.dtype) == "bfloat16"
            np.testing.assert_allclose(to_numpy(ops.sum(ops.cast(w, "float32"), -1)), 1.0, atol=2e-2)
        assert keras.backend.standardize_dtype(out.dtype) == "bfloat16"
        got = to_numpy(ops.cast(out, "float32"))
        assert np.all(np.isfinite(got))
        # bfloat16 keeps 8 significant bits (relative step 2**-8 ~ 0.0039). The inputs, the four
        # projections and the two attention matmuls each round once, so allow ~10 steps relative
        # to the output's scale (~1 here): 0.04. A wrong computation is off by O(1).
        scale = np.abs(want).max()
        np.testing.assert_allclose(got, want, rtol=0, atol=10 * 2**-8 * scale)


# --- dropout and the fused path ---------------------------------------------------------------------


def test_dropout_only_when_training(rng):
    layer, _ = make_layer(rng, dropout=0.5, seed=3)
    q, k, v = inputs(rng)
    inference = to_numpy(layer(q, k, v, training=False))
    np.testing.assert_array_equal(inference, to_numpy(layer(q, k, v)))
    np.testing.assert_array_equal(inference, to_numpy(layer(q, k, v, training=False)))
    trained = [to_numpy(layer(q, k, v, training=True)) for _ in range(2)]
    assert np.abs(trained[0] - inference).max() > 1e-3
    assert np.abs(trained[0] - trained[1]).max() > 1e-3  # a new dropout mask each call
    # the weights returned are the probabilities before dropout
    _, w = layer(q, k, v, training=True, return_attention_weights=True)
    np.testing.assert_allclose(to_numpy(ops.sum(w, -1)), 1.0, atol=1e-5)


@pytest.mark.parametrize("use_bias", [True, False])
def test_projections_of_one_input_in_one_matmul_equal_separate_ones(rng, monkeypatch, use_bias):
    """Self-attention (one input: [W_q | W_k | W_v] in one matmul) and cross-attention (keys is values:
    [W_k | W_v]) equal the same inputs passed as distinct tensors, projected one by one, and the
    reference; d_k != d_v, so a wrong split shows. The one-matmul path runs on torch only (the
    fastest there, not under XLA); it is forced here so that every backend checks it."""
    monkeypatch.setattr(_fused, "fuses_projections", lambda: True)
    widths = []  # how many projections each one-matmul call joined
    together_call = attnkit.MultiHeadAttention._project_together
    monkeypatch.setattr(attnkit.MultiHeadAttention, "_project_together",
                        lambda self, x, projections: widths.append(len(projections)) or together_call(self, x, projections))
    layer, weights = make_layer(rng, d_q=6, d_kin=6, d_vin=6, use_bias=use_bias)
    x, memory, _ = inputs(rng, d_q=6, d_kin=6)
    x_t, memory_t = ops.convert_to_tensor(x), ops.convert_to_tensor(memory)
    together = layer(x_t)
    apart = layer(x_t, ops.convert_to_tensor(x), ops.convert_to_tensor(x))
    np.testing.assert_allclose(to_numpy(together), to_numpy(apart), rtol=0, atol=1e-6)
    assert_close(together, expected(weights, x, x, x)[0])
    cross_together = layer(x_t, memory_t, memory_t)
    cross_apart = layer(x_t, memory_t, ops.convert_to_tensor(memory))
    np.testing.assert_allclose(to_numpy(cross_together), to_numpy(cross_apart), rtol=0, atol=1e-6)
    assert_close(cross_together, expected(weights, x, memory, memory)[0])
    _, (grad_together,) = value_and_grads(lambda a: layer(a), x)
    _, (grad_apart,) = value_and_grads(lambda a: layer(a, a + 0, a * 1), x)
    np.testing.assert_allclose(grad_together, grad_apart, rtol=0, atol=1e-5)
    assert 3 in widths and 2 in widths


@pytest.mark.parametrize("use_bias", [True, False])
def test_projections_into_and_out_of_heads_by_einsum_equal_the_dense_layers(rng, monkeypatch, use_bias):
    """jax projects into the heads and out of them with einsums against the kernels (no Dense call,
    no reshape of a matmul's result); forced on and off here so that every backend checks both, with
    d_k != d_v and every projection of a different input width."""
    layer, weights = make_layer(rng, use_bias=use_bias)
    q, k, v = inputs(rng)
    results = {}
    for einsum in (True, False):
        monkeypatch.setattr(_fused, "projects_into_heads", lambda einsum=einsum: einsum)
        calls = []
        for name in ("project_into_heads", "project_from_heads"):
            function = getattr(_fused, name)
            monkeypatch.setattr(_fused, name, lambda *a, f=function, n=name: calls.append(n) or f(*a))
        out, grads = value_and_grads(lambda q, k, v: layer(q, k, v), q, k, v)
        assert calls.count("project_into_heads") == 3 * calls.count("project_from_heads")
        assert bool(calls) == einsum
        results[einsum] = out, grads
        np.testing.assert_allclose(out, expected(weights, q, k, v)[0], rtol=0, atol=1e-5)
    np.testing.assert_allclose(results[True][0], results[False][0], rtol=0, atol=1e-6)
    for with_einsum, without in zip(results[True][1], results[False][1]):
        np.testing.assert_allclose(with_einsum, without, rtol=0, atol=1e-5)


def test_fused_and_explicit_paths_equal_with_gradients_and_empty_rows(rng):
    layer, _ = make_layer(rng)
    q, k, v = inputs(rng)
    mask = rng.random((B, T_q, T_k)) < 0.6
    mask[0, 2] = False  # a query with nothing to attend to
    mask[1, :, 3] = False
    fused_out, fused_grads = value_and_grads(lambda q, k, v: layer(q, k, v, mask=mask), q, k, v)
    explicit_out, explicit_grads = value_and_grads(
        lambda q, k, v: layer(q, k, v, mask=mask, return_attention_weights=True)[0], q, k, v
    )
    np.testing.assert_allclose(fused_out, explicit_out, rtol=0, atol=1e-5)
    # the empty row is the output projection of zeros: W_o's bias
    np.testing.assert_allclose(fused_out[0, 2], layer.get_weights()[-1], rtol=0, atol=1e-6)
    for f, e in zip(fused_grads, explicit_grads):
        assert np.all(np.isfinite(f)) and np.all(np.isfinite(e))
        np.testing.assert_allclose(f, e, rtol=0, atol=1e-5)
    assert np.all(fused_grads[1][1, 3] == 0) and np.all(fused_grads[2][1, 3] == 0)  # masked key: no gradient


def test_fused_and_explicit_paths_equal_causal_gradients(rng):
    layer, _ = make_layer(rng)
    q, k, v = inputs(rng, t_q=T_k, t_k=T_k)
    fused = value_and_grads(lambda q, k, v: layer(q, k, v, causal=True), q, k, v)
    explicit = value_and_grads(lambda q, k, v: layer(q, k, v, causal=True, return_attention_weights=True)[0], q, k, v)
    np.testing.assert_allclose(fused[0], explicit[0], rtol=0, atol=1e-5)
    for f, e in zip(fused[1], explicit[1]):
        np.testing.assert_allclose(f, e, rtol=0, atol=1e-5)


# --- errors -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("h", [0, -2])
def test_non_positive_heads_raise(h):
    with pytest.raises(ValueError, match=rf"`h` must be a positive integer\. Received: h={h}"):
        attnkit.MultiHeadAttention(h, 4, 4, 8)


@pytest.mark.parametrize(
    "kwargs,name",
    [(dict(h=1.5), "h"), (dict(d_k="8"), "d_k"), (dict(d_v=2.0), "d_v"), (dict(d_model=True), "d_model")],
)
def test_non_integer_sizes_raise_argument_type_error(kwargs, name):
    args = {"h": 2, "d_k": 4, "d_v": 4, "d_model": 8, **kwargs}
    with pytest.raises(ArgumentTypeError, match=rf"`{name}` must be a positive integer\. Received: {name}="):
        attnkit.MultiHeadAttention(**args)
    assert issubclass(ArgumentTypeError, TypeError) and issubclass(ArgumentTypeError, ValueError)


@pytest.mark.parametrize("dropout", [-0.1, 1.0, 1.5])
def test_dropout_outside_unit_interval_raises(dropout):
    with pytest.raises(ValueError, match=r"`dropout` must be a float in \[0, 1\)\. Received: dropout="):
        attnkit.MultiHeadAttention(2, 4, 4, 8, dropout=dropout)


def test_bad_inputs_raise(rng):
    layer, _ = make_layer(rng)
    q, k, v = inputs(rng)
    with pytest.raises(ValueError, match=r"`queries` must have rank 3.*Received: queries.shape=\(2, 6\)"):
        layer(q[:, 0], k, v)
    with pytest.raises(ValueError, match=r"`keys` must have rank 3.*Received: keys.shape=\(2, 7\, 10, 1\)"):
        layer(q, k[..., None], v)
    with pytest.raises(ValueError, match=r"same batch size.*queries=\(2, 5, 6\), keys=\(1, 7, 10\)"):
        layer(q, k[:1], v)
    with pytest.raises(ValueError, match=r"same length T_k.*keys=\(2, 7, 10\), values=\(2, 6, 4\)"):
        layer(q, k, v[:, :6])


@pytest.mark.parametrize(
    "shape", [(T_k + 1,), (B + 1, T_k), (T_q, T_q + 1), (B, T_q + 1, T_k), (B, H + 1, T_q, T_k), (1, B, H, T_q, T_k)]
)
@pytest.mark.parametrize("return_weights", [False, True])
def test_mask_that_does_not_broadcast_raises(rng, shape, return_weights):
    layer, _ = make_layer(rng)
    q, k, v = inputs(rng)
    with pytest.raises(ValueError, match=r"`mask` of shape .* does not broadcast to the attention scores of shape \(2, 3, 5, 7\)"):
        layer(q, k, v, mask=np.ones(shape, bool), return_attention_weights=return_weights)


def test_ambiguous_two_dimensional_mask_raises(rng):
    layer, _ = make_layer(rng)
    q, k, v = inputs(rng, t_q=B)
    with pytest.raises(ValueError, match=r"is ambiguous: the batch size and the query length are both 2"):
        layer(q, k, v, mask=np.ones((B, T_k), bool))


def test_float_mask_raises_and_explains_the_convention(rng):
    layer, _ = make_layer(rng)
    q, k, v = inputs(rng)
    with pytest.raises(attnkit.MaskDtypeError, match=r"True \(or a nonzero integer\) = may attend.*from_hide_mask"):
        layer(q, k, v, mask=np.ones((B, T_k), "float32"))
    assert issubclass(attnkit.MaskDtypeError, TypeError)

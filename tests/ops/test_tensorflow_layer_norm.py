"""tensorflow's layer norm inside a `tf.function`, compiled as one XLA function
(`_fused.tensorflow_layer_norm`, docs/decisions.md item 73): against float64 NumPy, against Keras's
own layer, with gradients, for shapes the graph does not know, nested in an XLA function, in `fit`.

Legend: B batch, T length, d normalized width.
"""

import keras
import numpy as np
import pytest

import attnkit
from attnkit import kernels as _fused
from attnkit.kernels import norms
from backend_utils import BACKEND

pytestmark = pytest.mark.skipif(BACKEND != "tensorflow", reason="tensorflow's graph path")

if BACKEND == "tensorflow":
    import tensorflow as tf

EPSILON = 1e-6


def _float64_norm(x, gamma, beta, epsilon=EPSILON):
    x = x.astype(np.float64)
    mean = x.mean(-1, keepdims=True)
    variance = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(variance + epsilon) * gamma + beta


def _operands(rng, shape=(3, 7, 48)):
    x = (rng.standard_normal(shape) * 3 + 1).astype("float32")
    gamma, beta = rng.standard_normal(shape[-1]).astype("float32"), rng.standard_normal(shape[-1]).astype("float32")
    return x, gamma, beta


def _keras_norm(gamma, beta, dtype):
    layer = keras.layers.LayerNormalization(epsilon=EPSILON, dtype=dtype)
    layer.build((None, gamma.shape[0]))
    layer.set_weights([gamma, beta])
    return layer


@pytest.mark.parametrize("dtype, rtol", [("float32", 1e-5), ("bfloat16", 2**-8), ("float16", 2**-11)])
def test_the_compiled_norm_equals_float64_and_keras_within_one_rounding(rng, dtype, rtol):
    x, gamma, beta = _operands(rng)
    xt = tf.cast(tf.constant(x), dtype)
    ours = tf.function(lambda x: _fused.tensorflow_layer_norm(x, tf.constant(gamma), tf.constant(beta), EPSILON))(xt)
    assert ours.dtype == xt.dtype and ours.shape == xt.shape
    exact = _float64_norm(tf.cast(xt, tf.float64).numpy(), gamma, beta)
    got = tf.cast(ours, tf.float64).numpy()
    np.testing.assert_allclose(got, exact, rtol=rtol, atol=rtol * np.abs(exact).max())
    keras_norm = _keras_norm(gamma, beta, "float32" if dtype == "float32" else f"mixed_{dtype}")
    theirs = tf.cast(tf.function(keras_norm)(xt), tf.float64).numpy()
    # The same formula, its moments summed in another order: one rounding of the dtype apart at most.
    np.testing.assert_allclose(got, theirs, rtol=rtol, atol=rtol * np.abs(theirs).max())


def test_eagerly_keras_runs_and_in_a_graph_the_compiled_function(rng, monkeypatch):
    x, gamma, beta = _operands(rng)
    assert _fused.tensorflow_layer_norm(tf.constant(x), gamma, beta, EPSILON) is None  # eager: no compilation
    calls = []
    compiled = norms._xla_layer_norm()
    monkeypatch.setattr(norms, "_xla_layer_norm", lambda: lambda *a: calls.append(a) or compiled(*a))
    layer = attnkit.AddNormalization(epsilon=EPSILON)
    layer.build(x.shape, x.shape)
    eager = layer(x, x).numpy()
    assert not calls
    graph = tf.function(lambda a: layer(a, a))(tf.constant(x)).numpy()
    assert len(calls) == 1
    np.testing.assert_allclose(graph, eager, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(graph, _float64_norm(2 * x, np.ones(48), np.zeros(48)), rtol=1e-5, atol=1e-5)


def test_other_operands_leave_it_to_keras(rng):
    x, gamma, beta = _operands(rng)

    answers = []

    @tf.function
    def refusals(x):
        answers.extend([
            _fused.tensorflow_layer_norm(x, None, beta, EPSILON),  # no scale: Keras's layer
            _fused.tensorflow_layer_norm(x, gamma, None, EPSILON),
            _fused.tensorflow_layer_norm(x, tf.cast(gamma, tf.bfloat16), beta, EPSILON),
            _fused.tensorflow_layer_norm(tf.cast(x, tf.float64), gamma, beta, EPSILON),
            _fused.tensorflow_layer_norm(x, gamma, beta, EPSILON),  # the one it takes
        ])
        return x

    refusals(tf.constant(x))  # traced once, in a graph
    assert [a is None for a in answers] == [True, True, True, True, False]


def test_gradients_equal_keras_layers(rng):
    x, gamma, beta = _operands(rng)
    keras_norm = _keras_norm(gamma, beta, "float32")
    gamma_v, beta_v = tf.Variable(gamma), tf.Variable(beta)

    @tf.function
    def grads(x):
        with tf.GradientTape(persistent=True) as tape:
            tape.watch(x)
            ours = tf.reduce_sum(_fused.tensorflow_layer_norm(x, gamma_v, beta_v, EPSILON) ** 3)
            theirs = tf.reduce_sum(keras_norm(x) ** 3)
        ours_g = tape.gradient(ours, [x, gamma_v, beta_v])
        theirs_g = tape.gradient(theirs, [x, *keras_norm.trainable_variables])
        return ours_g, theirs_g

    ours_g, theirs_g = grads(tf.constant(x))
    for a, b in zip(ours_g, theirs_g):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-4, atol=1e-4 * np.abs(b.numpy()).max())


def test_a_graph_for_shapes_it_does_not_know_leaves_it_to_keras_and_nested_xla_works(rng):
    """A graph traced for unknown shapes (`reduce_retracing`, an input signature with None) would make
    XLA compile at every new shape as it runs: there Keras's layer runs. Inside an XLA function too."""
    x, gamma, beta = _operands(rng, (2, 9, 16))
    spec = tf.TensorSpec((None, None, 16), tf.float32)
    answers = []
    tf.function(lambda x: answers.append(_fused.tensorflow_layer_norm(x, gamma, beta, EPSILON)) or x,
                input_signature=[spec])(tf.constant(x))
    assert answers == [None]
    layer = attnkit.AddNormalization(epsilon=EPSILON)
    layer.build((None, None, 16), (None, None, 16))
    relaxed = tf.function(lambda a: layer(a, a), input_signature=[spec])
    nested = tf.function(lambda x: _fused.tensorflow_layer_norm(x, gamma, beta, EPSILON) * 2.0, jit_compile=True)
    for shape in [(2, 9, 16), (5, 3, 16), (1, 1, 16), (0, 4, 16)]:
        a = rng.standard_normal(shape).astype("float32")
        np.testing.assert_allclose(relaxed(tf.constant(a)).numpy(), _float64_norm(2 * a, np.ones(16), np.zeros(16)),
                                   rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(nested(tf.constant(a)).numpy(), 2 * _float64_norm(a, gamma, beta), rtol=1e-5, atol=2e-5)


def test_under_a_distribution_strategy_every_norm_gets_its_gradient(rng):
    """Under MirroredStrategy the one shared compiled function lost the gradients of all norms but
    the first, without an error: Keras's layer runs there."""
    from attnkit.layers._sublayer import call_layer_norm

    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    with strategy.scope():
        norms = [keras.layers.LayerNormalization(epsilon=EPSILON) for _ in range(3)]
        for norm in norms:
            norm.build((None, 8))
    x = tf.constant(rng.standard_normal((4, 8)).astype("float32"))
    variables = [n.gamma.value for n in norms] + [n.beta.value for n in norms]

    def loss_of(x, norm_call):
        y = x
        for norm in norms:
            y = norm_call(norm, y) * 1.5
        return tf.reduce_sum(y * tf.range(8, dtype=tf.float32))

    @tf.function
    def gradients(x):
        def replica(x):
            with tf.GradientTape() as tape:
                tape.watch(x)
                loss = loss_of(x, call_layer_norm)
            return tape.gradient(loss, [x] + variables)

        return strategy.run(replica, args=(x,))

    got = gradients(x)
    with tf.GradientTape() as tape:  # eagerly: Keras's own layers
        tape.watch(x)
        loss = loss_of(x, lambda norm, y: norm(y))
    want = tape.gradient(loss, [x] + variables)
    assert all(g is not None for g in got) and all(w is not None for w in want)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-4, atol=1e-4)


def test_a_nan_stays_in_its_row(rng):
    x, gamma, beta = _operands(rng, (2, 3, 8))
    x[1, 2, 4] = np.nan
    got = tf.function(lambda x: _fused.tensorflow_layer_norm(x, gamma, beta, EPSILON))(tf.constant(x)).numpy()
    assert np.isnan(got[1, 2]).all() and np.isfinite(np.delete(got.reshape(6, 8), 5, axis=0)).all()


def test_an_encoder_trains_with_fit_and_predicts_as_its_eager_call(rng):
    ids = rng.integers(1, 20, (8, 6)).astype("int32")
    for norm_first in (False, True):
        encoder = attnkit.Encoder(20, 6, 2, 4, 4, 8, 16, 2, 0.0, norm_first=norm_first)
        model = keras.Sequential([keras.Input((6,), dtype="int32"), encoder, keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        target = rng.standard_normal((8, 6, 1)).astype("float32")
        history = model.fit(ids, target, epochs=3, batch_size=4, verbose=0).history["loss"]
        assert np.isfinite(history).all() and history[-1] < history[0]
        np.testing.assert_allclose(model.predict(ids, verbose=0), model(ids).numpy(), rtol=1e-5, atol=1e-5)


def test_a_second_model_trains_after_the_first_is_gone(tmp_path, capsys):
    """The compiled norm is one function for every model: given the variables themselves, it kept the
    first model's, and training a second translator after the first was gone raised "Called a
    function referencing variables which have been deleted" (the CLI's `train` twice in a process)."""
    import gc

    from attnkit import cli

    tiny = ["--epochs", "1", "--train-size", "128", "--batch-size", "64", "--d-model", "16", "--heads", "2",
            "--layers", "1", "--d-ff", "32", "--quiet"]
    for name in ("first", "second"):
        assert cli.main(["train", *tiny, "--output-dir", str(tmp_path / name)]) == 0, capsys.readouterr().err
        gc.collect()

"""tensorflow: the prepared model's step, one tf.function per shape (docs/decisions.md item 148), takes
batches of any padded length and any number of rows and computes what the same steps compute run
eagerly. (jax's step is Keras's own jit, which traces each shape anew; torch runs eagerly.)"""

import keras
import numpy as np
import pytest

from attnkit.finetune import data, lora, training
from attnkit.pipelines.causal_checkpoint import load_causal_lm

TARGETS = list(lora.TARGETS)
pytestmark = pytest.mark.skipif(keras.backend.backend() != "tensorflow", reason="tensorflow's per-shape step functions")


def _batches(lm):
    """Batches of 3 padded lengths and 3 row counts, the first shape twice (its compiled step reused)."""
    texts = ["a" * 5, "bb" * 6, "ccc" * 7, "dddd" * 8, "e" * 30, "f" * 9, "g" * 20]
    examples = [data.encode(lm, {"text": t}, 64) for t in texts]
    groups = [examples[0:2], examples[2:4], examples[4:7], examples[0:2], examples[5:6]]
    batches = [data.collate(g, lm.pad_id) for g in groups]
    assert len({b[0].shape for b in batches}) >= 4  # lengths 8, 16, 32 and rows 1, 2, 3
    return batches


def _trained(tiny_dir, eager):
    lm = load_causal_lm(tiny_dir)
    model = training.prepare(lm, targets=TARGETS, rank=4, alpha=8, optimizer=keras.optimizers.SGD(0.5), seed=1)
    if eager:
        model.compile(optimizer=keras.optimizers.SGD(0.5), loss=training.TokenLoss(), run_eagerly=True)
    batches = _batches(lm)
    losses = [training.train_step(model, inputs, targets) for inputs, targets in batches]
    evaluation = [data.encode(lm, {"text": t}, 64) for t in ("hello there", "x" * 17, "yz")]
    return losses, training.evaluate(model, evaluation, 2, lm.pad_id), lora.peft_tensors(model, TARGETS)


def test_compiled_steps_of_every_shape_equal_the_eager_steps(tiny_dir):
    losses, (eval_loss, perplexity), weights = _trained(tiny_dir, eager=False)
    eager_losses, (eager_eval, eager_perplexity), eager_weights = _trained(tiny_dir, eager=True)
    np.testing.assert_allclose(losses, eager_losses, rtol=1e-5)
    assert losses[0] != losses[3]  # the weights moved between the two steps on the same batch
    np.testing.assert_allclose(eval_loss, eager_eval, rtol=1e-5)
    np.testing.assert_allclose(perplexity, eager_perplexity, rtol=1e-5)
    assert weights.keys() == eager_weights.keys()
    for key in weights:
        np.testing.assert_allclose(weights[key], eager_weights[key], atol=1e-6, err_msg=key)


def test_tensorflow_traces_one_function_per_shape_and_reuses_it(tiny_dir, monkeypatch):
    """Each shape's step is traced once (the loss's Python runs only while tracing) and run compiled
    after, without XLA (where the token ids' check cannot run)."""
    calls = []
    loss_call = training.TokenLoss.call
    monkeypatch.setattr(training.TokenLoss, "call", lambda self, *a: calls.append(1) or loss_call(self, *a))
    lm = load_causal_lm(tiny_dir)
    model = training.prepare(lm, targets=TARGETS, rank=4, alpha=8, optimizer=keras.optimizers.SGD(0.1))
    assert not model.run_eagerly and model.jit_compile is False
    batches = _batches(lm)
    traced = []
    for inputs, targets in batches:
        training.train_step(model, inputs, targets)
        traced.append(len(calls))
    shapes = len({inputs.shape for inputs, _ in batches})
    assert len(model.train_function.by_shape) == shapes
    assert traced[3] == traced[2]  # batch 3 has batch 0's shape: its step is not traced again
    assert traced[-1] == shapes * traced[0]  # one trace a shape, the same number of loss calls each


def test_keras_fit_evaluate_and_predict_still_take_batches_of_any_size(tiny_dir):
    lm = load_causal_lm(tiny_dir)
    model = training.prepare(lm, targets=TARGETS, rank=4, alpha=8, optimizer=keras.optimizers.SGD(0.1))
    inputs, targets = data.collate([data.encode(lm, {"text": t}, 64) for t in ("ab", "cde", "fghij")], lm.pad_id)
    weights = training.token_weights(targets)
    history = model.fit(inputs, targets, sample_weight=weights, batch_size=2, epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"][0])
    assert np.isfinite(model.evaluate(inputs, targets, sample_weight=weights, batch_size=2, verbose=0))
    logits = model.predict(inputs, batch_size=2, verbose=0)  # batches of 2 rows, then 1
    np.testing.assert_allclose(logits, keras.ops.convert_to_numpy(model(inputs)), atol=1e-5)

"""A training step's loss projects the hidden states to the vocabulary itself (`TokenLoss(model)`;
docs/decisions.md item 160): on torch at the learned tokens only. The step equals the one of a loss
given the model's logits, LoRA or every weight, and an evaluation still gets the logits."""

import keras
import numpy as np
import pytest

from attnkit.finetune import data, lora, training
from attnkit.pipelines.causal_checkpoint import load_causal_lm
from tiny import date_chats

TARGETS = list(lora.TARGETS)


def _step(tiny_dir, projects, full=False, dtype="float32"):
    """(loss, trainable weights after one SGD step, rows the loss projected) of one step on a batch of
    chats (loss on the answers only) and a prompt/completion line."""
    lm = load_causal_lm(tiny_dir, dtype=dtype)
    model = training.prepare(lm, full=full, targets=TARGETS, rank=4, alpha=8, optimizer=keras.optimizers.SGD(0.5), seed=2)
    for _, _, dense in lora.projections(model, TARGETS) if not full else ():
        dense.lora_kernel_b.assign(np.random.default_rng(0).normal(0, 0.2, dense.lora_kernel_b.shape))
    assert model.loss_projects
    if not projects:  # the loss takes the model's logits (every row), as before item 160
        model.compile(optimizer=keras.optimizers.SGD(0.5), loss=training.TokenLoss())
        assert not model.loss_projects
    seen = []
    projection = model.logits_of
    model.logits_of = lambda x: seen.append((tuple(x.shape), keras.backend.standardize_dtype(x.dtype))) or projection(x)
    records = date_chats(3, seed=5) + [{"prompt": "Say hi: ", "completion": "hi"}]
    inputs, targets = data.collate([data.encode(lm, r, 128) for r in records], lm.pad_id)
    loss = training.train_step(model, inputs, targets)
    weights = [keras.ops.convert_to_numpy(v).astype("float32") for v in model.trainable_variables]
    return loss, weights, seen, targets


@pytest.mark.parametrize("full", [False, True], ids=["lora", "full"])
def test_the_step_equals_the_step_on_the_model_s_logits(tiny_dir, full):
    loss, weights, seen, targets = _step(tiny_dir, projects=True, full=full)
    reference_loss, reference_weights, reference_seen, _ = _step(tiny_dir, projects=False, full=full)
    learned, rows = int((targets != data.IGNORE).sum()), targets.size
    # (Keras's first step also calls the model once to build its loss: the model's logits, every row)
    assert reference_seen[-1] == (targets.shape + (32,), "float32")  # the model's forward projected every row
    assert 0 < learned < rows / 2  # the chats' prompts are not learned: most rows need no logits
    assert seen[-1] == ((learned if keras.backend.backend() == "torch" else rows, 32), "float32")  # the loss projected
    assert abs(loss - reference_loss) < 1e-6
    assert len(weights) == len(reference_weights) and (len(weights) >= 20 if full else len(weights) == 2 * 2 * len(TARGETS))
    for got, want in zip(weights, reference_weights):
        np.testing.assert_allclose(got, want, atol=1e-6, rtol=1e-6)


def test_a_batch_that_learns_no_token_steps_nothing(tiny_dir):
    """A process's share of a small last batch can be padding rows only: no row to project (K = 0),
    a zero loss and no change to the weights."""
    lm = load_causal_lm(tiny_dir)
    model = training.prepare(lm, targets=TARGETS, rank=4, alpha=8, optimizer=keras.optimizers.SGD(0.5), seed=2)
    before = [keras.ops.convert_to_numpy(v) for v in model.trainable_variables]
    inputs, targets = data.collate([data.encode(lm, r, 128) for r in date_chats(2, seed=5)], lm.pad_id)
    targets[:] = data.IGNORE
    weights = training.token_weights(targets)
    assert float(model.train_on_batch(inputs, targets, sample_weight=weights, return_dict=True)["loss"]) == 0.0
    for got, want in zip(model.trainable_variables, before):
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(got), want)


def test_bfloat16_hidden_states_are_projected_in_bfloat16(tiny_dir):
    """Keras's Loss casts its predictions to float32: the loss casts them back (exactly), so that the
    projection runs in the model's compute dtype as its own forward does."""
    loss, _, seen, _ = _step(tiny_dir, projects=True, dtype="bfloat16")
    reference_loss, _, _, _ = _step(tiny_dir, projects=False, dtype="bfloat16")
    assert seen[-1][1] == "bfloat16" and len(seen[-1][0]) == 2
    assert abs(loss - reference_loss) < 2e-2 * abs(reference_loss)


def test_a_bfloat16_model_under_lora_keeps_bfloat16_activations(tiny_dir):
    """Keras's LoRA factors are float32 under any policy; the update is added in float32 and rounded to
    the layer's dtype, as PEFT does (the sum was float32 from the first LoRA projection on, and
    tensorflow refused it)."""
    lm = load_causal_lm(tiny_dir, dtype="bfloat16")
    model = training.prepare(lm, targets=TARGETS, rank=4, alpha=8, optimizer=keras.optimizers.SGD(0.1))
    dense = next(iter(lora.projections(model, TARGETS)))[2]
    assert keras.backend.standardize_dtype(dense.lora_kernel_a.dtype) == "float32"
    dense.lora_kernel_b.assign(np.full(dense.lora_kernel_b.shape, 0.3, "float32"))
    x = keras.ops.convert_to_tensor(np.random.default_rng(0).normal(size=(3, dense.kernel.shape[0])), "bfloat16")
    y = dense(x)
    assert keras.backend.standardize_dtype(y.dtype) == "bfloat16"
    f32 = lambda t: keras.ops.convert_to_numpy(keras.ops.cast(t, "float32")).astype("float64")
    want = f32(x) @ f32(dense._kernel) + dense.lora_alpha / dense.lora_rank * (f32(x) @ f32(dense.lora_kernel_a) @ f32(dense.lora_kernel_b))
    np.testing.assert_allclose(f32(y), want, rtol=2e-2, atol=2e-2)
    inputs, _ = data.collate([data.encode(lm, r, 128) for r in date_chats(2, seed=1)], lm.pad_id)
    assert keras.backend.standardize_dtype(model(inputs, training=True).dtype) == "bfloat16"


def test_another_loss_compiled_in_gets_the_logits(tiny_dir):
    """Recompiled with a loss that does not project (Keras's own here), a training step hands it the
    logits: hidden states read as logits of d_model classes would be a wrong loss without a word."""
    lm = load_causal_lm(tiny_dir)
    model = training.prepare(lm, targets=TARGETS, rank=4, alpha=8, optimizer=keras.optimizers.SGD(0.1))
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    assert not model.loss_projects
    inputs, targets = data.collate([data.encode(lm, r, 128) for r in date_chats(2, seed=1)], lm.pad_id)
    targets = np.where(targets == data.IGNORE, 0, targets)
    assert tuple(model(inputs, training=True).shape) == inputs.shape + (model.vocab_size,)
    loss = float(model.train_on_batch(inputs, targets, return_dict=True)["loss"])
    assert np.isfinite(loss) and loss > 1.0  # a random tiny model's cross-entropy over 259 classes (~log 259)


def test_a_model_compiled_with_metrics_gives_them_and_the_loss_the_logits(tiny_dir):
    """Keras hands a training step's predictions to the compiled metrics as well: with metrics, the
    model returns logits and the loss takes them (an accuracy over d_model "classes" otherwise)."""
    lm = load_causal_lm(tiny_dir)
    model = training.prepare(lm, targets=TARGETS, rank=4, alpha=8, optimizer=keras.optimizers.SGD(0.1))
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=training.TokenLoss(head=model),
                  weighted_metrics=[keras.metrics.SparseCategoricalAccuracy(name="accuracy")])
    assert not model.loss_projects
    inputs, targets = data.collate([data.encode(lm, r, 128) for r in date_chats(2, seed=1)], lm.pad_id)
    assert tuple(model(inputs, training=True).shape) == inputs.shape + (model.vocab_size,)
    logs = model.train_on_batch(inputs, np.where(targets == data.IGNORE, 0, targets),
                                sample_weight=training.token_weights(targets), return_dict=True)
    assert np.isfinite(logs["loss"]) and 0.0 <= logs["accuracy"] <= 1.0


def test_token_loss_round_trips_its_config_and_refuses_another_reduction():
    loss = training.TokenLoss.from_config(training.TokenLoss(name="mine").get_config())
    assert loss.name == "mine" and loss.reduction == "sum" and loss.head is None
    with pytest.raises(ValueError, match="reduction"):
        training.TokenLoss(reduction="mean")


def test_evaluation_and_prediction_get_logits(tiny_dir):
    lm = load_causal_lm(tiny_dir)
    model = training.prepare(lm, targets=TARGETS, rank=4, alpha=8, optimizer=keras.optimizers.SGD(0.1))
    assert model.loss_projects
    inputs, targets = data.collate([data.encode(lm, r, 128) for r in date_chats(2, seed=1)], lm.pad_id)
    logits = keras.ops.convert_to_numpy(model(inputs))
    assert logits.shape == inputs.shape + (model.vocab_size,)
    hidden = model(inputs, training=True)
    assert tuple(hidden.shape) == inputs.shape + (model.d_model,)
    np.testing.assert_allclose(keras.ops.convert_to_numpy(model.logits_of(hidden)), logits, atol=1e-5)
    # the evaluation's loss (logits) equals the training step's (hidden states) on the same weights
    weights = training.token_weights(targets)
    evaluated = float(model.test_on_batch(inputs, targets, sample_weight=weights, return_dict=True)["loss"])
    projected = keras.ops.convert_to_numpy(training.TokenLoss(head=model)(targets, hidden, weights))
    np.testing.assert_allclose(projected, evaluated, rtol=1e-6)

"""The fine-tuning loop: Keras's `train_on_batch` on each batch, a cosine schedule with warm-up, AdamW,
the loss on the chosen tokens only, eval loss and perplexity per epoch, and a checkpoint that resumes
the run exactly (docs/decisions.md item 122).

Legend: B batch, L padded length, V vocabulary.
"""

import math
import time

import keras
import numpy as np
from keras import ops

from attnkit.finetune import data, lora


@keras.saving.register_keras_serializable(package="attnkit")
class TokenLoss(keras.losses.Loss):
    """Cross-entropy of the logits (B, L, V) against targets (B, L), averaged over the targets that are
    not `data.IGNORE` (transformers' causal-LM loss: a batch's mean over its learned tokens)."""

    def __init__(self, name="token_loss", **kwargs):
        super().__init__(name=name, reduction="sum_over_batch_size", **kwargs)

    def call(self, y_true, y_pred):
        targets = ops.cast(y_true, "int32")  # Keras hands targets over as floats
        keep = ops.not_equal(targets, data.IGNORE)
        per_token = ops.sparse_categorical_crossentropy(ops.where(keep, targets, 0), ops.cast(y_pred, "float32"), from_logits=True)
        weight = ops.cast(keep, "float32")
        return ops.sum(per_token * weight) / ops.maximum(ops.sum(weight), 1.0)  # a scalar: the reduction keeps it


def schedule(learning_rate, total_steps, warmup_fraction=0.03):
    """Linear warm-up from 0 to `learning_rate` over ~3% of the steps, then a cosine decay to 0."""
    warmup = min(max(1, round(warmup_fraction * total_steps)), max(total_steps - 1, 1))
    return keras.optimizers.schedules.CosineDecay(
        0.0, max(total_steps - warmup, 1), alpha=0.0, warmup_target=float(learning_rate), warmup_steps=warmup
    )


def prepare(lm, *, full=False, targets=("q", "k", "v", "o", "gate", "up", "down"), rank=8, alpha=16, optimizer=None, seed=0):
    """Makes `lm.model` trainable (LoRA on `targets`, or every weight with `full`) and compiles it with
    `optimizer` and `TokenLoss`. Returns the model."""
    model = lm.model
    keras.utils.set_random_seed(seed)  # LoRA's A initialisation
    if full:
        model.trainable = True
    else:
        lora.enable(model, targets, rank, alpha)
    # tensorflow traces train_on_batch for any batch size, and CausalLM needs known shapes (its host
    # bookkeeping): tensorflow runs the step eagerly; jax compiles it for each padded length.
    model.compile(optimizer=optimizer, loss=TokenLoss(), run_eagerly=keras.backend.backend() == "tensorflow")
    return model


def train_step(model, inputs, targets):
    """One optimizer step on a batch; returns its loss (float)."""
    model.reset_metrics()
    return float(model.train_on_batch(inputs, targets, return_dict=True)["loss"])


def evaluate(model, examples, batch_size, pad_id):
    """(mean loss over every learned token of `examples`, perplexity)."""
    total, count = 0.0, 0
    for start in range(0, len(examples), batch_size):
        inputs, targets = data.collate(examples[start : start + batch_size], pad_id)
        tokens = int((targets != data.IGNORE).sum())
        model.reset_metrics()
        loss = float(model.test_on_batch(inputs, targets, return_dict=True)["loss"])
        total, count = total + loss * tokens, count + tokens
    mean = total / max(count, 1)
    return mean, math.exp(min(mean, 700.0))


def run(model, train, *, epochs, batch_size, pad_id, seed, state, evaluation=(), save=None, save_every=0, on_step=None, log=print):
    """Trains `model` (prepared) on `train` [(ids, labels)] from `state` {"epoch", "step"} (0, 0 for a new
    run) to the end of `epochs`; `save(state)` writes a checkpoint every `save_every` steps (0: each
    epoch's end only) and at each epoch's end. Returns the state with "history" [{epoch, loss, eval_loss,
    perplexity, seconds}]."""
    history = list(state.get("history", []))
    for epoch in range(state["epoch"], epochs):
        order = data.batch_order(len(train), batch_size, seed, epoch)
        log(f"Epoch {epoch + 1}/{epochs}")
        bar = keras.utils.Progbar(len(order), stateful_metrics=["loss"])
        first = state["step"] if epoch == state["epoch"] else 0
        bar.update(first)
        started, losses = time.perf_counter(), list(state.get("epoch_losses", [])) if first else []
        for step in range(first, len(order)):
            inputs, targets = data.collate([train[i] for i in order[step]], pad_id)
            losses.append(train_step(model, inputs, targets))
            state = {**state, "epoch": epoch, "step": step + 1, "epoch_losses": losses}
            bar.update(step + 1, values=[("loss", losses[-1])])
            if save is not None and save_every and (step + 1) % save_every == 0 and step + 1 < len(order):
                save(state)
            if on_step is not None:
                on_step(state)
        record = {"epoch": epoch + 1, "loss": float(np.mean(losses)), "seconds": round(time.perf_counter() - started, 2)}
        if evaluation:
            record["eval_loss"], record["perplexity"] = evaluate(model, evaluation, batch_size, pad_id)
            log(f"eval_loss: {record['eval_loss']:.4f} - perplexity: {record['perplexity']:.3f}")
        history.append(record)
        state = {"epoch": epoch + 1, "step": 0, "epoch_losses": [], "history": history}
        if save is not None:
            save(state)
    return {**state, "history": history}

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

from attnkit import kernels
from attnkit.distributed.engines import commit_state
from attnkit.finetune import checkpoint, data, lora


@keras.saving.register_keras_serializable(package="attnkit")
class TokenLoss(keras.losses.Loss):
    """Cross-entropy of the logits (B, L, V) against targets (B, L), summed over the tokens weighted by
    `sample_weight` (B, L) (`token_weights`: 1 / count on each learned token, so the loss is the mean
    over a batch's learned tokens, transformers' causal-LM loss). A call without weights is refused:
    the sum alone is no loss anybody means.

    With `head`, the `CausalLM` compiled with this loss (`prepare`), a training step's predictions are
    its normed hidden states (B, L, d_model) (`CausalLM.loss_projects`): they are projected here with
    `head.logits_of`, on torch at the learned tokens only (`kernels.learned_rows`; docs/decisions.md
    item 160). An evaluation's predictions are the logits, as without `head`; their width tells the
    two apart (`loss_projects` holds only where d_model != V)."""

    def __init__(self, name="token_loss", *, head=None, **kwargs):
        reduction = kwargs.pop("reduction", "sum")  # in `get_config`'s dict: `from_config` passes it back
        if reduction != "sum":
            raise ValueError(f"TokenLoss sums its tokens weighted by `token_weights` (reduction \"sum\"). Received: reduction={reduction!r}")
        super().__init__(name=name, reduction="sum", **kwargs)
        self.head = head

    def __call__(self, y_true, y_pred, sample_weight=None):
        if sample_weight is None:
            raise ValueError("TokenLoss needs `sample_weight` (B, L) from `token_weights`; none was given")
        return super().__call__(y_true, y_pred, sample_weight)

    def call(self, y_true, y_pred):
        targets = ops.cast(y_true, "int32")  # Keras hands targets over as floats
        keep = ops.not_equal(targets, data.IGNORE)  # (B, L)
        ids = ops.reshape(ops.where(keep, targets, 0), (-1,))  # (B L,)
        width, rows = y_pred.shape[-1], None
        if self.head is not None and self.head.loss_projects and width == self.head.d_model:
            # Keras's Loss cast the hidden states to float32: back to the compute dtype (exact), in which
            # the model's own forward projects them
            hidden = ops.cast(ops.reshape(y_pred, (-1, width)), self.head.compute_dtype)  # (B L, d_model)
            rows = kernels.learned_rows(ops.reshape(keep, (-1,)))  # (K,) or None: every row
            if rows is not None:
                hidden, ids = ops.take(hidden, rows, axis=0), ops.take(ids, rows, axis=0)  # (K, d_model), (K,)
            logits = self.head.logits_of(hidden)  # (K or B L, V)
        else:
            # On 2-D logits (B L, V): Keras's torch path moves a 3-D input's classes to axis 1 for
            # torch's loss, a copy of the (B, L, V) logits and a log-softmax over a strided axis.
            logits = ops.reshape(ops.cast(y_pred, "float32"), (-1, width))  # (B L, V)
        per_token = kernels.token_cross_entropy(ids, logits)  # torch: one pass over the logits each way
        if per_token is None:
            per_token = ops.sparse_categorical_crossentropy(ids, logits, from_logits=True)
        if rows is not None:
            per_token = kernels.spread_rows(rows, per_token, targets.shape[0] * targets.shape[1])  # (B L,)
        return ops.reshape(per_token, ops.shape(targets)) * ops.cast(keep, "float32")  # (B, L)


def token_weights(targets, count=None, scale=1.0):
    """(B, L) float32: `scale / count` on each learned token of `targets` (B, L), 0 elsewhere; `count`
    defaults to the learned tokens of `targets`. A process's share of a batch takes the whole batch's
    count and scale = the processes P, whose gradients the engine averages: the mean of the P
    gradients is then the gradient of the whole batch's token mean."""
    keep = targets != data.IGNORE
    count = int(keep.sum()) if count is None else int(count)
    return keep.astype("float32") * np.float32(scale / max(count, 1))


def schedule(learning_rate, total_steps, warmup_fraction=0.03):
    """`WarmupCosine` over `total_steps`, warming up over ~3% of them (at least one)."""
    return WarmupCosine(learning_rate, total_steps, max(1, round(warmup_fraction * total_steps)))


@keras.saving.register_keras_serializable(package="attnkit")
class WarmupCosine(keras.optimizers.schedules.LearningRateSchedule):
    """A linear warm-up to `learning_rate` over `warmup_steps`, then a cosine decay, in which every one
    of `total_steps` steps learns (docs/decisions.md item 142).

    Step s (0-based) takes, with t = s + 1 and w = warmup_steps, T = total_steps:
        learning_rate * t / w                                          t <= w
        learning_rate * (1 + cos(pi * (t - w) / (T - w + 1))) / 2      t > w
    Keras's `CosineDecay` with warm-up starts at 0 and ends at 0: the first step did not move the
    weights, and a run of one step (a small file, one epoch) learned nothing.
    """

    def __init__(self, learning_rate, total_steps, warmup_steps):
        self.learning_rate, self.total_steps, self.warmup_steps = float(learning_rate), int(total_steps), int(warmup_steps)

    def __call__(self, step):
        t = keras.ops.cast(step, "float32") + 1.0
        w, span = float(self.warmup_steps), float(max(self.total_steps - self.warmup_steps + 1, 1))
        warm = self.learning_rate * t / w
        progress = keras.ops.minimum((t - w) / span, 1.0)
        decay = 0.5 * self.learning_rate * (1.0 + keras.ops.cos(math.pi * progress))
        return keras.ops.where(t <= w, warm, decay)

    def get_config(self):
        return {"learning_rate": self.learning_rate, "total_steps": self.total_steps, "warmup_steps": self.warmup_steps}


def prepare(lm, *, full=False, targets=("q", "k", "v", "o", "gate", "up", "down"), rank=8, alpha=16, optimizer=None, seed=0):
    """Makes `lm.model` trainable (LoRA on `targets`, or every weight with `full`) and compiles it with
    `optimizer` and `TokenLoss`. Returns the model."""
    model = lm.model
    keras.utils.set_random_seed(seed)  # LoRA's A initialisation
    if full:
        model.trainable = True
    else:
        lora.enable(model, targets, rank, alpha)
    # jax compiles the step for each padded length; tensorflow too, one function per shape (`PerShape`),
    # without XLA, inside which the token ids' check cannot run
    tensorflow = keras.backend.backend() == "tensorflow"
    # A training step's loss projects the hidden states itself, at the learned tokens where it can
    # (`TokenLoss`, `CausalLM.loss_projects`)
    model.compile(optimizer=optimizer, loss=TokenLoss(head=model), jit_compile=False if tensorflow else "auto")
    if tensorflow:
        model.train_function, model.test_function = PerShape(model, model.train_step), PerShape(model, model.test_step)
        _eagerly(model, lambda: model.make_predict_function(force=True))  # predict's batches: any size
    return model


def _eagerly(model, make):
    """What `make` returns, made with `model.run_eagerly` set: Keras's functions for batches of any size."""
    eager, model.run_eagerly = model.run_eagerly, True
    try:
        return make()
    finally:
        model.run_eagerly = eager


class PerShape:
    """tensorflow: Keras's compiled `train_on_batch` / `test_on_batch` step, one tf.function per shape
    of the batch (docs/decisions.md item 148).

    Keras traces its step with `reduce_retracing`: the second shape it sees (another padded length, a
    last batch of fewer rows) retraces it for unknown dimensions, which `CausalLM` refuses (it places
    positions on the host from the shape), and running eagerly gives up the compiled step. Each shape
    gets its own Keras function here, which never sees another shape. A `tf.data` iterator (Keras's
    `fit` and `evaluate`, whose batches have no known size) goes to Keras's function run eagerly."""

    def __init__(self, model, step):
        self.model, self.step, self.by_shape, self.default = model, step, {}, None

    def __call__(self, iterator):
        import tensorflow as tf

        if isinstance(iterator, (tf.data.Iterator, tf.distribute.DistributedIterator)):
            if self.default is None:
                self.default = _eagerly(self.model, lambda: self.model._make_function(self.step))
            return self.default(iterator)
        outputs = None
        for batch in iterator:  # train_on_batch and test_on_batch give one (x, y, sample_weight)
            key = tuple(None if t is None else (tuple(t.shape), str(t.dtype)) for t in keras.tree.flatten(batch))
            if key not in self.by_shape:
                self.by_shape[key] = self.model._make_function(self.step)
            outputs = self.by_shape[key](iter([batch]))
        return outputs


def train_step(model, inputs, targets, weights=None):
    """One optimizer step on a batch, its tokens weighted by `weights` (B, L) (default
    `token_weights(targets)`); returns its loss (float)."""
    weights = token_weights(targets) if weights is None else weights
    return float(model.train_on_batch(inputs, targets, sample_weight=weights, return_dict=True)["loss"])


def evaluate(model, examples, batch_size, pad_id, engine=None):
    """(mean loss over every learned token of `examples`, perplexity). With `engine`, each process
    evaluates its share of every batch, as in training."""
    total, count = 0.0, 0
    for start in range(0, len(examples), batch_size):
        inputs, targets = data.collate(examples[start : start + batch_size], pad_id)
        tokens = int((targets != data.IGNORE).sum())
        loss = float(model.test_on_batch(*weighted_share(inputs, targets, engine), return_dict=True)["loss"])
        total, count = total + _mean(engine, loss) * tokens, count + tokens
    mean = total / max(count, 1)
    return mean, math.exp(min(mean, 700.0))


def weighted_share(inputs, targets, engine=None):
    """(inputs, targets, weights) (b, L) each: this process's `share` of a whole batch (B, L) and its
    token weights, 1 / the whole batch's count of learned tokens, times P where the engine averages
    the P processes' gradients (torch) and times 1 where it sums them (tensorflow) or the shares make
    one global batch with one loss (jax's arrays over every process's devices). Either way the
    step's gradient is that of the whole batch's token mean."""
    rank, world = (0, 1) if engine is None else (engine.rank, engine.world)
    count = int((targets != data.IGNORE).sum())
    scale = world if engine is not None and engine.averages_gradients else 1
    inputs, targets = share(inputs, targets, rank, world)
    return inputs, targets, token_weights(targets, count, scale)


def _mean(engine, value):
    return float(value) if engine is None else engine.mean(value)


def share(inputs, targets, rank, world):
    """Process `rank`'s rows of a batch (B, L) split over `world` processes: ceil(B / world) rows each,
    the last shares filled up with rows that learn nothing (a last batch smaller than the others)."""
    rows = -(-inputs.shape[0] // world)
    pad = rows * world - inputs.shape[0]
    inputs = np.concatenate([inputs, np.full((pad, inputs.shape[1]), inputs[0, 0], inputs.dtype)])
    targets = np.concatenate([targets, np.full((pad, targets.shape[1]), data.IGNORE, targets.dtype)])
    return inputs[rank * rows : (rank + 1) * rows], targets[rank * rows : (rank + 1) * rows]


def check_finite(model, when):
    """Raises FloatingPointError if a trainable weight of `model` is NaN or infinite at `when`: a step
    whose loss was finite can still have stepped the weights there, and the model written after it
    would give NaN logits with a finite loss in its history. LoRA's merged kernels too: finite A and B
    of ~1e30 (AdamW's steps are ~ the learning rate) make an infinite W + (alpha / r) A B."""
    merged = [layer.kernel for layer in model._flatten_layers() if getattr(layer, "lora_enabled", False)]
    for variable in list(model.trainable_variables) + merged:
        # every process reads: a read may be a collective
        value = checkpoint.read_variable(variable) if isinstance(variable, keras.Variable) else ops.convert_to_numpy(variable)
        if not np.isfinite(value).all():
            name = variable.path if isinstance(variable, keras.Variable) else "a LoRA-merged kernel"
            raise FloatingPointError(f"{name} is not finite at {when}; lower --learning-rate "
                                     f"(a checkpoint already written is from before it)")


def run(model, train, *, epochs, batch_size, pad_id, seed, state, evaluation=(), save=None, save_every=0, on_step=None,
        engine=None, callbacks=(), log=print):
    """Trains `model` (prepared) on `train` [(ids, labels)] from `state` {"epoch", "step"} (0, 0 for a new
    run) to the end of `epochs`; `save(state)` writes a checkpoint every `save_every` steps (0: each
    epoch's end only) and at each epoch's end. With `engine` (attnkit.distributed.engines) of P
    processes, each process trains on its `share` of every batch; the losses are the whole batch's.
    `callbacks` (Keras callbacks) hear of the run's beginning, each step and the end. Returns the state
    with "history" [{epoch, loss, eval_loss, perplexity, seconds}]."""
    rank, world = (engine.rank, engine.world) if engine is not None else (0, 1)
    # jax: the first step then compiles the program the later ones run (`train_on_batch` and
    # `test_on_batch` reset the metrics themselves, after building their program).
    commit_state(model)
    for callback in callbacks:
        callback.on_train_begin()
    try:
        history = list(state.get("history", []))
        for epoch in range(state["epoch"], epochs):
            order = data.batch_order(len(train), batch_size, seed, epoch)
            log(f"Epoch {epoch + 1}/{epochs}")
            bar = keras.utils.Progbar(len(order), stateful_metrics=["loss"], verbose=1 if rank == 0 else 0)
            first = state["step"] if epoch == state["epoch"] else 0
            bar.update(first)
            started, losses = time.perf_counter(), list(state.get("epoch_losses", [])) if first else []
            for step in range(first, len(order)):
                inputs, targets = data.collate([train[i] for i in order[step]], pad_id)  # (B, L), the whole batch
                losses.append(_mean(engine, train_step(model, *weighted_share(inputs, targets, engine))))
                if not math.isfinite(losses[-1]):  # every later step, checkpoint and the written model would be NaN
                    raise FloatingPointError(f"the loss became {losses[-1]} at epoch {epoch + 1}, step {step + 1}; "
                                             f"lower --learning-rate (a checkpoint already written is from before it)")
                for callback in callbacks:
                    callback.on_train_batch_end(step)
                state = {**state, "epoch": epoch, "step": step + 1, "epoch_losses": losses}
                bar.update(step + 1, values=[("loss", losses[-1])])
                if save is not None and save_every and (step + 1) % save_every == 0 and step + 1 < len(order):
                    check_finite(model, f"epoch {epoch + 1}, step {step + 1}")
                    save(state)
                if on_step is not None:
                    on_step(state)
            check_finite(model, f"the end of epoch {epoch + 1}")  # the last step's update is in no loss yet
            record = {"epoch": epoch + 1, "loss": float(np.mean(losses)), "seconds": round(time.perf_counter() - started, 2)}
            if evaluation:
                record["eval_loss"], record["perplexity"] = evaluate(model, evaluation, batch_size, pad_id, engine)
                log(f"eval_loss: {record['eval_loss']:.4f} - perplexity: {record['perplexity']:.3f}")
                for callback in callbacks:  # a step watchdog times steps, not the evaluation
                    callback.on_train_batch_end(step)
            history.append(record)
            state = {"epoch": epoch + 1, "step": 0, "epoch_losses": [], "history": history}
            if save is not None:
                save(state)
    finally:
        for callback in callbacks:
            callback.on_train_end()
    return {**state, "history": history}

"""The training loop of one worker: a data order fixed by (seed, epoch), checkpoints, and `--resume`.

Epoch e visits the training examples in `np.random.default_rng([seed, e]).permutation(N)`, cut into
N // B global batches of B (the last N mod B examples sit the epoch out). Process p of P takes
examples p·b .. (p+1)·b - 1 of every global batch, b = B / P: whatever P, step s of epoch e averages
the gradients of the same B examples. Nothing about the order lives in a random generator's state, so
a resumed run sees the same batches as an uninterrupted one.

After every epoch process 0 writes a checkpoint (every process saves, since a save may take part in
collectives, but only process 0's copy is kept: `Engine.saving_directory`), CHECKPOINTS/epoch-EEEE/ holding
    model.weights.h5    the weights and the optimizer's state (Adam's moments and step count)
    state.json          the epoch count, the losses so far, the config, the layers' random-seed states
It is written into a hidden sibling and renamed into place when complete, so a checkpoint directory
that exists is whole; `--resume` takes the one with the highest epoch (docs/decisions.md item 42).

Legend: N examples, B global batch, P processes, b = B / P, S source length, T target length.
"""

import dataclasses
import json
import os
import shutil
import time

import keras
import numpy as np

from attnkit._seed import set_random_seed
from attnkit.dates import task as dates
from attnkit.dates.translator import build_model, make_arrays, make_optimizer
from attnkit.distributed.engines import CommittedState

CHECKPOINTS = "checkpoints"
WEIGHTS_FILE, STATE_FILE = "model.weights.h5", "state.json"
# Fields a resumed run may change: it may train for more epochs.
RESUMABLE_CHANGES = ("epochs",)


def epoch_order(n, batch_size, seed, epoch):
    """(N // B, B) example indices: the global batches of `epoch`, in order."""
    steps = n // batch_size
    if steps == 0:
        raise ValueError(f"--train-size must be at least --batch-size. Received: train_size={n}, batch_size={batch_size}")
    return np.random.default_rng([seed, epoch]).permutation(n)[: steps * batch_size].reshape(steps, batch_size)


def local_indices(order, rank, world):
    """(N // B * b,) this process's share of every global batch, batch after batch."""
    b = order.shape[1] // world
    return order[:, rank * b:(rank + 1) * b].reshape(-1)


def train(config, engine, *, checkpoint_dir=None, resume=False, callbacks=(), log=None):
    """Trains the date Transformer as process `engine.rank` of `engine.world`.

    Args:
        config: an `attnkit.dates.translator.TrainConfig`.
        engine: an `attnkit.distributed.engines.Engine`.
        checkpoint_dir: where process 0 writes a checkpoint after each epoch; None: no checkpoints.
        resume: continue from the last complete checkpoint in `checkpoint_dir`.
        callbacks: extra Keras callbacks for `fit`.
        log: called with one line of text after each epoch (process 0's loss over all processes).

    Returns:
        (model, tokenizer, validation pairs, losses): `losses[e]` is epoch e's mean loss over all B
        examples of its steps, the same number a one-process run logs.

    Raises:
        ValueError: `resume` without a checkpoint, or with one written for another configuration.
    """
    set_random_seed(config.seed)
    tokenizer = dates.CharTokenizer()
    train_pairs, validation = dates.train_validation_split(config.n_train, config.n_validation, seed=config.seed)
    source, decoder_input, decoder_target, weights = make_arrays(train_pairs, tokenizer, config.source_length)
    b = engine.local_batch(config.batch_size)
    with engine.scope():
        model = build_model(config, tokenizer)
        model.compile(
            optimizer=make_optimizer(config, len(source) // config.batch_size),  # epoch_order's steps
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        model((source[:b], decoder_input[:b]))  # creates the weights, so that they can be restored
        model.optimizer.build(model.trainable_variables)
        start, losses = 0, []
        if resume:
            start, losses = restore(model, checkpoint_dir, config)
            if log:
                log(f"resumed from {checkpoint(checkpoint_dir, start)} after epoch {start}")
        engine.prepare(model)
        for epoch in range(start, config.epochs):
            started = time.perf_counter()
            rows = local_indices(epoch_order(len(source), config.batch_size, config.seed, epoch), engine.rank, engine.world)
            history = model.fit(
                **engine.fit_arguments((source[rows], decoder_input[rows]), decoder_target[rows], weights[rows], b),
                epochs=epoch + 1, initial_epoch=epoch, shuffle=False, verbose=0, callbacks=[*callbacks, CommittedState()],
            )
            losses.append(engine.mean(history.history["loss"][-1]))
            seconds = time.perf_counter() - started
            if log:  # the benchmark reads the time and the rate (benchmarks/distributed.py)
                log(f"epoch {epoch + 1}/{config.epochs}: loss {losses[-1]!r}; {seconds:.3f} s, "
                    f"{len(rows) * engine.world / seconds:.1f} samples/s")
            if checkpoint_dir:
                with engine.saving_directory(checkpoint_dir) as directory:
                    save_checkpoint(model, directory, epoch + 1, losses, config)
    return model, tokenizer, validation, losses


def checkpoint(directory, epoch):
    return os.path.join(directory, f"epoch-{epoch:04d}")


def _seed_states(model):
    """The state variable of every `keras.random.SeedGenerator` in the model (the dropout layers')."""
    return [sg.state for layer in model._flatten_layers() for sg in getattr(layer, "_seed_generators", [])]


def save_checkpoint(model, directory, epoch, losses, config):
    """Writes CHECKPOINTS/epoch-EEEE whole or not at all, then removes the older ones."""
    os.makedirs(directory, exist_ok=True)
    final = checkpoint(directory, epoch)
    partial = os.path.join(directory, f".epoch-{epoch:04d}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    os.makedirs(partial)
    model.save_weights(os.path.join(partial, WEIGHTS_FILE))
    state = {
        "epoch": epoch, "losses": losses, "config": dataclasses.asdict(config),
        "seed_states": [keras.ops.convert_to_numpy(s.value).tolist() for s in _seed_states(model)],
    }
    with open(os.path.join(partial, STATE_FILE), "w") as f:
        json.dump(state, f)
        f.flush()
        os.fsync(f.fileno())
    if os.path.exists(final):  # an earlier run's, for the same epoch: replaced only by a whole one
        shutil.rmtree(final)
    os.rename(partial, final)
    for name in os.listdir(directory):
        if name.startswith("epoch-") and name != os.path.basename(final):
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)


def latest_checkpoint(directory):
    """The highest epoch with a complete checkpoint in `directory`, or 0."""
    if not directory or not os.path.isdir(directory):
        return 0
    epochs = [int(name[6:]) for name in os.listdir(directory) if name.startswith("epoch-") and name[6:].isdigit()]
    return max(epochs, default=0)


def restore(model, directory, config):
    """Loads the last complete checkpoint into `model` (built, with its optimizer built).

    Returns:
        (epochs done, losses so far).
    """
    epoch = latest_checkpoint(directory)
    if epoch == 0:
        raise ValueError(f"--resume: no complete checkpoint in {directory}")
    path = checkpoint(directory, epoch)
    with open(os.path.join(path, STATE_FILE)) as f:
        state = json.load(f)
    saved, current = state["config"], dataclasses.asdict(config)
    changed = [k for k in current if k not in RESUMABLE_CHANGES and saved.get(k) != current[k]]
    if changed:
        k = changed[0]
        raise ValueError(
            f"--resume: the checkpoint {path} was written with {k}={saved.get(k)!r}; this run has {k}={current[k]!r}. "
            f"Resume with the same settings (only --epochs may change)"
        )
    if epoch >= config.epochs:
        raise ValueError(f"--resume: {path} has already trained {epoch} epochs; ask for more with --epochs")
    model.load_weights(os.path.join(path, WEIGHTS_FILE))
    seeds = _seed_states(model)
    if len(seeds) != len(state["seed_states"]):
        raise ValueError(f"--resume: {path} holds {len(state['seed_states'])} random-seed states; the model has {len(seeds)}")
    for variable, value in zip(seeds, state["seed_states"]):
        variable.assign(np.asarray(value, dtype=keras.backend.standardize_dtype(variable.dtype)))
    return epoch, list(state["losses"])

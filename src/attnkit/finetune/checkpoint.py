"""The fine-tuning checkpoint, DIR/checkpoint/: the trainable weights, the optimizer's variables (its
step count, AdamW's moments) and where the run stands, written all or nothing
(`attnkit._atomic_save.replace_files`). The frozen base weights are not saved: --resume reloads them
from --model, which the checkpoint names, and refuses a run whose settings differ.

    weights.npz      t0..tN the model's trainable variables, o0..oM the optimizer's, in their order
    progress.json    {"settings": ..., "state": {"epoch", "step", "epoch_losses", "history"}}
"""

import json
import os

import numpy as np
from keras import ops

from attnkit._atomic_save import replace_files

FOLDER, WEIGHTS, PROGRESS = "checkpoint", "weights.npz", "progress.json"
RESUMABLE = ("epochs", "eval", "save_every")  # settings a resumed run may change


def save(directory, model, settings, state):
    arrays = {f"t{i}": read_variable(v) for i, v in enumerate(model.trainable_variables)}
    arrays.update({f"o{i}": read_variable(v) for i, v in enumerate(model.optimizer.variables)})

    def write_weights(path):
        with open(path, "wb") as f:
            np.savez(f, **arrays)

    def write_progress(path):
        with open(path, "w", encoding="utf-8") as f:
            json.dump({"settings": settings, "state": state}, f, indent=1)

    replace_files(os.path.join(directory, FOLDER), {WEIGHTS: write_weights, PROGRESS: write_progress})


def read_variable(variable):
    """A variable's value as a NumPy array."""
    value = variable.value
    # A tensorflow variable is read first: the optimizer's step count, a MirroredVariable under
    # MultiWorkerMirroredStrategy, has no array of its own to convert.
    return ops.convert_to_numpy(value.read_value() if hasattr(value, "read_value") else value)


def read_progress(directory):
    """(settings, state) of DIR's checkpoint, or FileNotFoundError naming it."""
    path = os.path.join(directory, FOLDER, PROGRESS)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--resume: no checkpoint in {directory} ({path} is missing)")
    with open(path, encoding="utf-8") as f:
        saved = json.load(f)
    return saved["settings"], saved["state"]


def check_settings(directory, saved, current):
    """Refuses resuming with settings other than the checkpoint's, except those in RESUMABLE."""
    # a --full run trains no LoRA: its lora_* settings mean nothing (one begun before --full refused
    # them may hold any), so they are not compared
    unused = ("lora_rank", "lora_alpha", "lora_targets") if saved.get("full") and current.get("full") else ()
    for key in current:
        if key not in RESUMABLE and key not in unused and saved.get(key) != current[key]:
            if key == "data_sha256" and saved.get(key) and saved.get("data") == current["data"]:
                raise ValueError(f"--resume: {current['data']} has changed since the checkpoint in {directory} was written "
                                 "(its SHA-256 differs); resume with the data the run began with, or start a new --output-dir")
            raise ValueError(
                f"--resume: the checkpoint in {directory} was written with {key}={saved.get(key)!r}; this run has "
                f"{key}={current[key]!r}. Resume with the same settings (only {', '.join(RESUMABLE)} may change)"
            )


def restore(directory, model):
    """Loads the checkpoint's trainable and optimizer variables into `model` (compiled, optimizer built)."""
    with np.load(os.path.join(directory, FOLDER, WEIGHTS)) as arrays:
        for prefix, variables in (("t", model.trainable_variables), ("o", model.optimizer.variables)):
            count = sum(1 for k in arrays.files if k.startswith(prefix))
            if count != len(variables):
                raise ValueError(f"--resume: the checkpoint in {directory} holds {count} {'trainable' if prefix == 't' else 'optimizer'} "
                                 f"variables; this model has {len(variables)}")
            for i, v in enumerate(variables):
                value = arrays[f"{prefix}{i}"]
                if tuple(value.shape) != tuple(v.shape):
                    raise ValueError(f"--resume: variable {v.path} has shape {tuple(v.shape)}; the checkpoint's has {value.shape}")
                v.assign(value)

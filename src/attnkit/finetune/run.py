"""`finetune`: a language model taught a user's JSON-lines data with LoRA (or every weight), written
to an output directory that attnkit, transformers and PEFT load (docs/decisions.md items 120-124).

    DIR/config.json, model.safetensors, tokenizer.json, tokenizer_config.json, generation_config.json
                     the merged model, a Hugging Face directory (`load_causal_lm(DIR)`, `attnkit chat --model DIR`)
    DIR/adapter/     adapter_config.json + adapter_model.safetensors, PEFT's format (LoRA runs only)
    DIR/finetune.json  the settings, the base model's path and each epoch's losses
    DIR/checkpoint/  what --resume continues from
"""

import json
import math
import os

import keras

from attnkit._atomic_save import file_sha256, replace_files
from attnkit._validation import positive_float, positive_int
from attnkit.distributed.engines import SingleEngine
from attnkit.finetune import checkpoint, data, lora, training
from attnkit.finetune.hf_directory import MODEL_FILES, model_config, write_model_directory
from attnkit.pipelines.causal_checkpoint import default_causal_lm_path, load_causal_lm

ADAPTER, ADAPTER_FILES, SUMMARY = "adapter", ("adapter_config.json", "adapter_model.safetensors"), "finetune.json"


def finetune(train_file, output_dir, *, eval_file=None, model=None, lora_rank=8, lora_alpha=16,
             lora_targets="q,k,v,o,gate,up,down", epochs=1, learning_rate=2e-4, batch_size=8, max_length=512, seed=0,
             resume=False, full=False, save_every=0, dtype="float32", weight_decay=0.0, on_step=None, engine=None,
             callbacks=(), log=print):
    """Fine-tunes `model` (a GGUF file or a Hugging Face directory; default SmolLM2-135M-Instruct) on
    `train_file` and writes `output_dir` (module docstring). Returns the history [{epoch, loss,
    eval_loss, perplexity, seconds}].

    With `engine` (one process of a multi-process run, attnkit.distributed.engines), this process trains
    on its share of every batch (`training.share`), the engine averages the gradients, and only
    process 0 writes `output_dir`; `batch_size` stays the global batch.

    Raises:
        ValueError: a bad line of the data (file, line, field), bad settings, an output directory that
            holds files without --resume, a --resume whose settings differ from the checkpoint's.
            An --output-dir that cannot be created, before the first step.
    """
    # data_sha256: --resume on an edited file would take other batches and another schedule (decision 159)
    settings = dict(
        data=os.path.abspath(train_file), data_sha256=_digest(train_file), eval=eval_file and os.path.abspath(eval_file),
        model=os.path.abspath(model) if model is not None else default_causal_lm_path(),
        lora_rank=positive_int("lora_rank", lora_rank), lora_alpha=positive_float("lora_alpha", lora_alpha),
        lora_targets=lora.parse_targets(lora_targets), epochs=positive_int("epochs", epochs),
        learning_rate=positive_float("learning_rate", learning_rate), batch_size=positive_int("batch_size", batch_size),
        max_length=positive_int("max_length", max_length), seed=int(seed), full=bool(full), dtype=dtype,
        weight_decay=float(weight_decay), save_every=int(save_every), backend=keras.backend.backend(),
    )
    if eval_file is not None and not os.path.isfile(eval_file):  # before the model loads, as --data (was a bare "[Errno 2]")
        raise ValueError(f"--eval {eval_file} cannot be read ({'a directory' if os.path.isdir(eval_file) else 'no such file'})")
    output_dir = os.path.abspath(output_dir)
    if os.path.lexists(output_dir) and not os.path.isdir(output_dir):  # refused now, not when the first checkpoint is written
        raise FileExistsError(f"--output-dir {output_dir} exists and is not a directory; choose a directory")
    engine = engine if engine is not None else SingleEngine()
    engine.local_batch(settings["batch_size"])  # a batch split evenly, or a ValueError naming --processes
    state = {"epoch": 0, "step": 0}
    if resume:
        saved, state = checkpoint.read_progress(output_dir)
        checkpoint.check_settings(output_dir, saved, settings)
        # A run stopped after its last checkpoint but before its outputs (finetune.json is written
        # last) resumes to write them; a finished one is asked for more epochs.
        if state["epoch"] >= settings["epochs"] and os.path.isfile(os.path.join(output_dir, SUMMARY)):
            raise ValueError(f"--resume: {output_dir} has already trained {state['epoch']} epochs; ask for more with --epochs")
    elif engine.rank == 0 and os.path.isdir(output_dir) and os.listdir(output_dir):  # the others: process 0 writes it
        raise FileExistsError(f"--output-dir {output_dir} already holds files; choose an empty directory, or pass --resume to continue its run")
    with engine.scope():  # jax: the model's variables and every step's batch over all processes' devices
        # The same initial values in every process before the checkpoint's replace them (jax checks
        # that a variable placed on all processes' devices is given the same value everywhere).
        keras.utils.set_random_seed(settings["seed"])
        lm = load_causal_lm(settings["model"], dtype=dtype)
        if lm.tokenizer is None:
            raise ValueError(f"The model at {lm.path} has no tokenizer (tokenizer.json); fine-tuning reads text")
        model_config(lm)  # a model no Hugging Face family written here expresses: refused before training, not after
        train = data.encode_file(lm, train_file, settings["max_length"])  # every line checked before training
        evaluation = data.encode_file(lm, eval_file, settings["max_length"]) if eval_file else []
        steps = settings["epochs"] * math.ceil(len(train) / settings["batch_size"])
        optimizer = keras.optimizers.AdamW(
            training.schedule(settings["learning_rate"], steps), weight_decay=settings["weight_decay"], epsilon=1e-8
        )
        model_ = training.prepare(lm, full=full, targets=settings["lora_targets"], rank=settings["lora_rank"],
                                  alpha=settings["lora_alpha"], optimizer=optimizer, seed=settings["seed"])
        optimizer.build(model_.trainable_variables)
        if resume:
            checkpoint.restore(output_dir, model_)
            log(f"Resuming at epoch {state['epoch'] + 1}, step {state['step']}")
        engine.prepare(model_)  # torch: process 0's weights everywhere, the gradients averaged

        def save(s):
            with engine.saving_directory(output_dir) as directory:
                checkpoint.save(directory, model_, settings, s)

        if engine.rank == 0:  # only process 0 writes it
            _create(output_dir)
        log(f"{len(train)} examples, {steps} steps; {sum(int(math.prod(v.shape)) for v in model_.trainable_variables):,} trainable weights")
        state = training.run(
            model_, train, epochs=settings["epochs"], batch_size=settings["batch_size"], pad_id=lm.pad_id, seed=settings["seed"],
            state=state, evaluation=evaluation, save=save, save_every=settings["save_every"], on_step=on_step, engine=engine,
            callbacks=callbacks, log=log,
        )
        with engine.saving_directory(output_dir) as directory:
            write_outputs(lm, directory, settings, state["history"])
    return state["history"]


def _digest(train_file):
    """The training file's SHA-256; a file that cannot be read named by its flag (was a bare "[Errno 2]")."""
    try:
        return file_sha256(train_file)
    except OSError as e:
        raise ValueError(f"--data {train_file} cannot be read ({e.strerror})") from None


def _create(output_dir):
    """--output-dir made before the first step: one that cannot be (a parent that is a file, no
    permission) failed at the first checkpoint, after an epoch's training, as a bare OSError."""
    try:
        os.makedirs(output_dir, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--output-dir {output_dir} cannot be created ({e.strerror}); choose a directory that can") from None


def write_outputs(lm, output_dir, settings, history):
    """DIR's merged model, adapter (LoRA) and finetune.json."""
    write_model_directory(lm, output_dir)
    if not settings["full"]:
        write_adapter(lm, os.path.join(output_dir, ADAPTER), settings, base=settings["model"])
    replace_files(output_dir, {SUMMARY: lambda path: _json(path, {"settings": settings, "history": history})})


def write_adapter(lm, directory, settings, base):
    from safetensors.numpy import save_file

    tensors = lora.peft_tensors(lm.model, settings["lora_targets"])
    config = lora.adapter_config(settings["lora_targets"], settings["lora_rank"], _number(settings["lora_alpha"]), base)
    replace_files(directory, {
        "adapter_config.json": lambda path: _json(path, config),
        "adapter_model.safetensors": lambda path: save_file(tensors, path, metadata={"format": "pt"}),
    })


def _number(x):
    return int(x) if float(x).is_integer() else float(x)


def read_summary(directory):
    path = os.path.join(directory, SUMMARY)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{directory} is not a fine-tuned directory: it has no {SUMMARY}")
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _json(path, value):
    with open(path, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=2)
        f.write("\n")

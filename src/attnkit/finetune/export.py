"""`export`: a fine-tuned directory handed to the Hugging Face ecosystem (docs/decisions.md item 123).

    OUT/             the merged model: transformers' AutoModelForCausalLM and AutoTokenizer load it
    OUT/adapter/     the LoRA adapter in PEFT's format; its base_model_name_or_path is the base model's
                     Hugging Face directory: --model itself when it was one, else OUT/base/
    OUT/base/        the base model (a GGUF file's weights as attnkit read them), when --model was a file
"""

import os
import shutil

from attnkit._atomic_save import replace_files
from attnkit.finetune.hf_directory import MODEL_FILES, write_model_directory
from attnkit.finetune.run import ADAPTER, ADAPTER_FILES, read_summary, write_adapter
from attnkit.pipelines.causal_checkpoint import load_causal_lm


def export(directory, out, force=False):
    """Writes OUT from the fine-tuned `directory` (module docstring); returns OUT's absolute path. An
    OUT that exists (other than an empty directory) is replaced only with `force`, and only when it is
    a model directory (config.json) other than the run's base model."""
    directory, out = os.path.abspath(directory), os.path.abspath(out)
    summary = read_summary(directory)
    settings = summary["settings"]
    if os.path.lexists(out) and not os.path.isdir(out):  # --force replaces a model directory, never a file
        raise FileExistsError(f"{out} exists and is not a directory; export writes a model directory")
    if os.path.lexists(out) and not (os.path.isdir(out) and not os.listdir(out)) and not force:
        raise FileExistsError(f"{out} already exists; pass --force to replace it")
    if os.path.isdir(out) and os.listdir(out) and not os.path.isfile(os.path.join(out, "config.json")):
        raise FileExistsError(f"{out} holds files but no config.json; attnkit writes an empty directory or replaces a model directory")
    if os.path.isdir(out) and os.path.isdir(settings["model"]) and os.path.samefile(out, settings["model"]):
        # replacing it would overwrite the user's base model with the merged one, and the adapter's
        # base_model_name_or_path would name the merged model: PEFT would apply the update twice
        raise FileExistsError(f"{out} is the base model the run was fine-tuned from (--model); export into another directory")
    replace_files(out, {name: _copier(os.path.join(directory, name)) for name in MODEL_FILES})
    if settings["full"]:
        _remove_adapter(out)
        return out
    base = settings["model"]
    if not os.path.isdir(base):  # a GGUF file: PEFT needs the base as a Hugging Face directory
        base_lm = load_causal_lm(base, dtype="float32")
        write_model_directory(base_lm, os.path.join(out, "base"))
        base = os.path.join(out, "base")
    adapter = os.path.join(directory, ADAPTER)
    replace_files(os.path.join(out, ADAPTER), {
        "adapter_model.safetensors": _copier(os.path.join(adapter, "adapter_model.safetensors")),
        "adapter_config.json": lambda path: _with_base(os.path.join(adapter, "adapter_config.json"), path, base),
    })
    return out


def _remove_adapter(out):
    """OUT/adapter of an earlier export into OUT, removed: left beside a fully fine-tuned model, PEFT
    would load another run's update. Only the adapter files attnkit writes go; a folder holding
    anything else is the user's, and stays."""
    folder = os.path.join(out, ADAPTER)
    if not os.path.isdir(folder) or os.path.islink(folder) or set(os.listdir(folder)) - set(ADAPTER_FILES):
        return
    for name in os.listdir(folder):
        os.remove(os.path.join(folder, name))
    os.rmdir(folder)


def _copier(source):
    if not os.path.isfile(source):
        raise FileNotFoundError(f"{source} is missing: the fine-tuned directory is incomplete")
    return lambda path: shutil.copyfile(source, path)


def _with_base(source, path, base):
    import json

    with open(source, encoding="utf-8") as f:
        config = json.load(f)
    config["base_model_name_or_path"] = base
    with open(path, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
        f.write("\n")

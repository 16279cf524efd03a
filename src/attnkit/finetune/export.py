"""`export`: a fine-tuned directory handed to the Hugging Face ecosystem (docs/decisions.md item 123).

    OUT/             the merged model: transformers' AutoModelForCausalLM and AutoTokenizer load it
    OUT/adapter/     the LoRA adapter in PEFT's format; its base_model_name_or_path is the base model's
                     Hugging Face directory: --model itself when it was one, else OUT/base/
    OUT/base/        the base model as attnkit read it, when --model was a GGUF file or a directory whose
                     modules PEFT would not find under the adapter's names (phi3's fused qkv_proj)

All of it is written aside and renamed into place together (`replace_tree`); an earlier export's
model files that this one does not write are removed, a user's other files stay.
"""

import json
import os
import shutil

from attnkit._atomic_save import replace_tree
from attnkit.checkpoints.export import stale_model_files
from attnkit.finetune.hf_directory import MODEL_FILES, WRITTEN_TYPES, write_model_files
from attnkit.finetune.run import ADAPTER, ADAPTER_FILES, read_summary, write_adapter
from attnkit.pipelines.causal_checkpoint import load_causal_lm


def export(directory, out, force=False):
    """Writes OUT from the fine-tuned `directory` (module docstring); returns OUT's absolute path. An
    OUT that exists (other than an empty directory) is replaced only with `force`, and only when it is
    a model directory (config.json) other than the run's base model."""
    if not os.fspath(out):  # os.path.abspath("") is the working directory, which --force would replace
        raise ValueError("OUT must not be empty. Received: OUT=''")
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
    full = settings["full"]
    for name in MODEL_FILES:
        _check_source(os.path.join(directory, name))
    adapter = os.path.join(directory, ADAPTER)
    for name in () if full else ADAPTER_FILES:
        _check_source(os.path.join(adapter, name))
    base, base_lm = settings["model"], None
    # a base inside OUT/base (--model OUT/base, the base an earlier export wrote): its files are the
    # user's model now, never an earlier export's to remove or replace
    written_base = os.path.realpath(os.path.join(out, "base"))
    base_inside = os.path.commonpath([os.path.realpath(base), written_base]) == written_base
    if not full and not peft_reads(base):
        if base_inside:
            raise FileExistsError(f"{out} holds the base model the run was fine-tuned from (--model {base}); export into another directory")
        # A GGUF file, or a directory whose modules PEFT would not find under the adapter's names (phi3's
        # fused qkv_proj: PEFT skips them without a word): the base as attnkit reads it, written beside.
        base_lm = load_causal_lm(base, dtype="float32")
        base = os.path.join(out, "base")

    def write(staging):
        for name in MODEL_FILES:
            shutil.copyfile(os.path.join(directory, name), os.path.join(staging, name))
        if full:
            return
        os.makedirs(os.path.join(staging, ADAPTER))
        shutil.copyfile(os.path.join(adapter, "adapter_model.safetensors"), os.path.join(staging, ADAPTER, "adapter_model.safetensors"))
        _with_base(os.path.join(adapter, "adapter_config.json"), os.path.join(staging, ADAPTER, "adapter_config.json"), base)
        if base_lm is not None:
            os.makedirs(os.path.join(staging, "base"))
            write_model_files(base_lm, os.path.join(staging, "base"))

    # An earlier export's files that this one does not write go (another model's tokenizer files, a
    # LoRA run's adapter beside a full run's weights, a GGUF base): left, they would be read with it.
    stale = stale_model_files(out) + [f"{ADAPTER}/{name}" for name in ADAPTER_FILES]
    if not base_inside:
        stale += [f"base/{name}" for name in stale_model_files(os.path.join(out, "base"))]
    replace_tree(out, write, remove=stale)
    return out


def peft_reads(base):
    """Whether PEFT finds the adapter's modules in `base` as it is: a Hugging Face directory of a
    family whose module names are the adapter's (`WRITTEN_TYPES`)."""
    try:
        with open(os.path.join(base, "config.json"), encoding="utf-8") as f:
            return json.load(f).get("model_type") in WRITTEN_TYPES
    except (OSError, ValueError, AttributeError):
        return False


def _check_source(path):
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} is missing: the fine-tuned directory is incomplete")


def _with_base(source, path, base):
    with open(source, encoding="utf-8") as f:
        config = json.load(f)
    config["base_model_name_or_path"] = base
    with open(path, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
        f.write("\n")

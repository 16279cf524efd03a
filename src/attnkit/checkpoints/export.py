"""`save_pretrained`: a `PretrainedEncoder` back to a Hugging Face directory (docs/decisions.md item 30).

    config.json, model.safetensors          the base model (BertModel, RobertaModel, ...), as AutoModel reads it
    tokenizer files                         copied from the loaded directory
    modules.json, sentence_bert_config.json, 1_Pooling/, k_Dense/, k_Normalize/
                                            the sentence-transformers pipeline

The files are written aside and renamed into place together (`attnkit._atomic_save.replace_tree`), so an
interrupted save leaves the old files or the new ones, never a mixture. Overwriting a model directory
replaces the files of a model (those above, and an earlier model's weights and modules that the new
one does not have: `stale_model_files`) and leaves every other file where it is: a user's README.md,
NOTES.md or eval_results/ (docs/decisions.md item 111), as transformers' `save_pretrained` does.
"""

import contextlib
import json
import os
import re
import shutil

import numpy as np

from attnkit._atomic_save import replace_tree
from attnkit.checkpoints.formats.weights import export_tensors
from attnkit.layers.linear import holds_blocks

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt", "vocab.json",
                   "merges.txt", "added_tokens.json", "sentencepiece.bpe.model", "spiece.model")
_ARCHITECTURE = {"xlm-roberta": "XLMRobertaModel"}  # else the family's base model class
_TRANSFORMER, _POOLING, _DENSE, _NORMALIZE = (
    "sentence_transformers.base.modules.transformer.Transformer",
    "sentence_transformers.sentence_transformer.modules.pooling.Pooling",
    "sentence_transformers.base.modules.dense.Dense",
    "sentence_transformers.base.modules.normalize.Normalize",
)


def save_pretrained(encoder, directory, *, overwrite=False):
    """Writes `encoder` (a `PretrainedEncoder`) to `directory`; see `PretrainedEncoder.save_pretrained`."""
    if not isinstance(directory, (str, os.PathLike)):
        raise TypeError(f"`directory` must be a path. Received: directory of type {type(directory).__name__}")
    held = [layer.path for layer in encoder.model._flatten_layers(include_self=False) if holds_blocks(layer)]
    if held:
        # its weights were rounded to int8 at load, and its products quantize their inputs: written as
        # float32 it would be another model (docs/decisions.md item 141)
        raise ValueError(
            f"An int8 encoder cannot be saved as a Hugging Face directory ({held[0]} holds int8 weights): "
            "save the model loaded with dtype='float32'"
        )
    directory = check_destination(directory, overwrite)
    created = not os.path.lexists(directory)
    try:
        replace_tree(directory, lambda staging: _write(encoder, staging), remove=stale_model_files(directory))
    except BaseException:
        if created:  # the directory this save made, left empty by its failure
            with contextlib.suppress(OSError):
                os.rmdir(directory)
        raise
    return directory


# Files of a Hugging Face / sentence-transformers model, the kind a save replaces: any of them left from
# an earlier model beside the new one would be read with it (a sharded checkpoint's index, the old
# model's prompts in config_sentence_transformers.json, its Dense layer's weights).
_MODEL_FILES = {
    "config.json", "model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
    "pytorch_model.bin.index.json", "modules.json", "sentence_bert_config.json", "config_sentence_transformers.json",
    "generation_config.json", "chat_template.jinja", "chat_template.json", "tokenizer.model", *TOKENIZER_FILES,
}
_SHARD = re.compile(r"(model|pytorch_model)-\d+-of-\d+\.(safetensors|bin)")
_MODULE_FOLDER = re.compile(r"\d+_(Pooling|Dense|Normalize)")
_MODULE_FILES = ("config.json", "model.safetensors", "pytorch_model.bin")


def stale_model_files(directory):
    """The files of `directory` (relative paths) that belong to a model, which a save replaces or, where
    the new model has none, removes; every other file is the user's and stays."""
    if not os.path.isdir(directory):
        return []
    found = []
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        if (name in _MODEL_FILES or _SHARD.fullmatch(name)) and os.path.isfile(path):
            found.append(name)
        elif _MODULE_FOLDER.fullmatch(name) and os.path.isdir(path) and not os.path.islink(path):
            found += [f"{name}/{f}" for f in _MODULE_FILES if os.path.isfile(os.path.join(path, f))]
    return found


def check_destination(directory, overwrite):
    """The absolute path `save_pretrained` may write, or FileExistsError / ValueError saying why not:
    an empty path (`os.path.abspath("")` is the working directory), an existing one without
    `overwrite`, and, even with it, anything but an empty directory or a model directory (config.json)."""
    if not os.fspath(directory):
        raise ValueError("`directory` must not be empty. Received: directory=''")
    directory = os.path.abspath(os.fspath(directory))
    if os.path.lexists(directory):
        if not overwrite:
            raise FileExistsError(f"{directory} already exists; pass overwrite=True to replace it")
        if not os.path.isdir(directory) or os.path.islink(directory):
            raise FileExistsError(f"{directory} exists and is not a directory; attnkit replaces only a directory")
        if os.listdir(directory) and not os.path.isfile(os.path.join(directory, "config.json")):
            raise FileExistsError(
                f"{directory} holds files but no config.json: it is not a model directory, and attnkit replaces "
                "only an empty one or a model directory"
            )
    return directory


def _write(encoder, directory):
    from safetensors.numpy import save_file

    config = dict(encoder.config)
    model_type = config.setdefault("model_type", encoder.family.model_types[0])
    config["architectures"] = [_ARCHITECTURE.get(model_type, encoder.family.architecture)]
    tensors = export_tensors(encoder.family, encoder.model, encoder.unused_weights)
    floats = {str(t.dtype) for t in tensors.values() if t.dtype.kind == "f"}
    if len(floats) == 1:
        (written,) = floats
        for key in ("dtype", "torch_dtype"):  # transformers 5's name, and 4's
            if key in config:
                config[key] = written  # a float16 source's "float16" would load this float32 export in float16
    _json(os.path.join(directory, "config.json"), config)
    save_file(tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    source = encoder.pipeline.transformer_path
    for name in TOKENIZER_FILES:
        if os.path.isfile(os.path.join(source, name)):
            shutil.copyfile(os.path.join(source, name), os.path.join(directory, name))
    extra = os.path.join(encoder.path, "config_sentence_transformers.json")
    if os.path.isfile(extra):
        shutil.copyfile(extra, os.path.join(directory, "config_sentence_transformers.json"))
    _write_modules(encoder, directory)


def _write_modules(encoder, directory):
    pipeline = encoder.pipeline
    _json(os.path.join(directory, "sentence_bert_config.json"), {
        "max_seq_length": encoder.max_length,
        "do_lower_case": pipeline.sentence_config.get("do_lower_case", False) is True,
    })
    modules = [("", _TRANSFORMER), ("1_Pooling", _POOLING)]
    modes = list(pipeline.pooling)
    _json(os.path.join(directory, "1_Pooling", "config.json"), {
        "embedding_dimension": encoder.d_model, "pooling_mode": modes[0] if len(modes) == 1 else modes,
        "include_prompt": pipeline.include_prompt,
    })
    for dense in pipeline.dense:
        folder = f"{len(modules)}_Dense"
        modules.append((folder, _DENSE))
        _write_dense(dense, os.path.join(directory, folder))
    if pipeline.normalize:
        folder = f"{len(modules)}_Normalize"
        modules.append((folder, _NORMALIZE))
        _json(os.path.join(directory, folder, "config.json"), {})
    _json(os.path.join(directory, "modules.json"), [
        {"idx": i, "name": str(i), "path": path, "type": module_type} for i, (path, module_type) in enumerate(modules)
    ])


def _write_dense(dense, folder):
    from safetensors.numpy import save_file

    d_in, d_out = dense.kernel.shape
    config = {"in_features": d_in, "out_features": d_out, "bias": dense.bias is not None,
              "activation_function": dense.activation}
    tensors = {"linear.weight": np.ascontiguousarray(dense.kernel.T)}
    if dense.bias is not None:
        tensors["linear.bias"] = np.ascontiguousarray(dense.bias)
    if dense.residual is not None:
        config["use_residual"] = True
        if not isinstance(dense.residual, str):
            tensors["residual.weight"] = np.ascontiguousarray(dense.residual.T)
    _json(os.path.join(folder, "config.json"), config)
    save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})


def _json(file, data):
    os.makedirs(os.path.dirname(file), exist_ok=True)
    with open(file, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2)
        f.write("\n")

"""The weight files of a checkpoint, and strict matching against the encoder the config describes
(docs/decisions.md item 28).

Files, in transformers' order of preference: model.safetensors; model.safetensors.index.json with
its shards; pytorch_model.bin (read with `torch.load(weights_only=True)`, which unpickles tensors
only); pytorch_model.bin.index.json with its shards.

Matching: every tensor the encoder needs is present with the shape the config implies, and every
stored tensor is either used, carried (the pooler, written back on export), a recognised task head
or a buffer; anything else is refused by name. Errors list the tensors.
"""

import os
import warnings

import numpy as np

from attnkit.checkpoints.formats.json import REQUIRED, read_json

SAFETENSORS, SAFETENSORS_INDEX = "model.safetensors", "model.safetensors.index.json"
PYTORCH, PYTORCH_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"
_SHOWN = 8  # tensor names listed in an error before "... and N more"


def read_state_dict(path):
    """{stored name: float32 array} and the file it came from (for messages).

    Raises:
        FileNotFoundError: no weights file, or a shard the index names is absent.
        ValueError: a truncated or corrupt file, an index that does not match its shards.
        ImportError: only pytorch_model.bin and torch is not installed.
    """
    for name, reader in ((SAFETENSORS, _safetensors), (SAFETENSORS_INDEX, None), (PYTORCH, _pytorch),
                         (PYTORCH_INDEX, None)):
        file = os.path.join(path, name)
        if os.path.isfile(file):
            if reader is not None:
                return reader(file), file
            shard_reader = _safetensors if name == SAFETENSORS_INDEX else _pytorch
            return _sharded(path, file, shard_reader), file
    raise FileNotFoundError(f"{path}: no {SAFETENSORS}, {SAFETENSORS_INDEX}, {PYTORCH} or {PYTORCH_INDEX}; {REQUIRED}")


def _safetensors(file):
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(file, framework="numpy") as f:
            return {name: _float32(f.get_tensor(name)) for name in f.keys()}
    except TypeError:
        return _safetensors_with_torch(file)  # bfloat16: NumPy has no such dtype
    except (SafetensorError, OSError, ValueError) as e:
        raise ValueError(f"{file}: cannot read the safetensors file, truncated or corrupt? ({e})") from None


def _safetensors_with_torch(file):
    torch = _torch(file)
    from safetensors.torch import load_file

    return {name: _float32(value.to(torch.float32).numpy()) for name, value in load_file(file).items()}


def _pytorch(file):
    torch = _torch(file)
    try:
        # weights_only: unpickles tensors and plain containers only, never arbitrary objects.
        state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises UnpicklingError, RuntimeError, EOFError ... on bad files
        raise ValueError(f"{file}: cannot read the PyTorch weights file, truncated, corrupt or not weights-only? ({e})") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"{file}: expected a dictionary of tensors (a state dict)")
    return {name: _float32(value.detach().to(torch.float32).numpy()) for name, value in state.items()}


def _torch(file):
    try:
        import torch
    except ImportError:
        raise ImportError(
            f"{file}: reading this weights file needs torch (pip install torch); or convert it to "
            "model.safetensors"
        ) from None
    return torch


def _float32(value):
    return np.asarray(value, dtype=np.float32)


def _sharded(path, index_file, reader):
    index = read_json(index_file)
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ValueError(f"{index_file}: `weight_map` must be an object of tensor name -> shard file")
    stored = {}
    for shard in sorted(set(weight_map.values())):
        file = os.path.join(path, shard)
        if os.path.dirname(os.path.normpath(shard)) or not os.path.isfile(file):
            raise FileNotFoundError(f"{index_file}: shard {shard!r} not found in {path}")
        tensors = reader(file)
        listed = {name for name, s in weight_map.items() if s == shard}
        if set(tensors) != listed:
            raise ValueError(
                f"{file}: the shard does not hold the tensors {index_file} lists for it: "
                f"{_names(sorted(listed ^ set(tensors)))}"
            )
        stored.update(tensors)
    return stored


def _names(names):
    shown = ", ".join(repr(n) for n in names[:_SHOWN])
    return shown + (f" ... and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")


def canonical_names(stored, family, file):
    """Stored names without the family's task-model prefix, original BERT's gamma/beta renamed."""
    renamed = {}
    for name, value in stored.items():
        canonical = name.removeprefix(family.prefix)
        for old, new in ((".LayerNorm.gamma", ".LayerNorm.weight"), (".LayerNorm.beta", ".LayerNorm.bias")):
            if canonical.endswith(old):
                canonical = canonical.removesuffix(old) + new
        if canonical in renamed:
            raise ValueError(f"{file}: the tensor {canonical!r} is stored twice (under {name!r} and another name)")
        renamed[canonical] = value
    return renamed


def match(stored, family, model, file, config_file):
    """Assigns the stored tensors to a built encoder, strictly.

    Args:
        stored: {stored name: float32 array}.
        family: the checkpoint's `Family`.
        model: a built `BertEncoder` of the config's sizes.
        file, config_file: the weights and config files, for messages.

    Returns:
        {name: array} of the carried tensors (the pooler), for export.

    Raises:
        ValueError: tensors missing, of the wrong shape, or stored but not part of such an encoder.
    """
    stored = canonical_names(stored, family, file)
    table = family.weight_table(model)
    expected = {name: _stored_shape(variable, transposed) for name, (variable, transposed) in table.items()}
    carried_shapes = family.carried(model.d_model)
    missing = [n for n in expected if n not in stored]
    if missing:
        raise ValueError(
            f"{file}: {len(missing)} tensors that {config_file} implies are missing: "
            f"{_names([f'{n} {expected[n]}' for n in missing])}; do the config and the weights belong together?"
        )
    wrong = [n for n, shape in {**expected, **carried_shapes}.items() if n in stored and stored[n].shape != shape]
    if wrong:
        raise ValueError(
            f"{file}: tensors with shapes other than {config_file} implies: "
            f"{_names([f'{n} {tuple(stored[n].shape)}, expected {({**expected, **carried_shapes})[n]}' for n in wrong])}"
        )
    unknown = sorted(
        n for n in stored
        if n not in expected and n not in carried_shapes and n not in family.ignored
        and not n.startswith(family.heads)
    )
    if unknown:
        raise ValueError(
            f"{file}: {len(unknown)} stored tensors are not part of the {family.name} encoder {config_file} "
            f"describes (n={model.n}, d_model={model.d_model}): {_names(unknown)}; "
            "do the config and the weights belong together?"
        )
    carried = [n for n in carried_shapes if n in stored]
    if carried and len(carried) != len(carried_shapes):  # written back on export: half a pooler would not load there
        raise ValueError(
            f"{file}: the pooler is incomplete: {_names(carried)} stored without "
            f"{_names([n for n in carried_shapes if n not in stored])}"
        )
    heads = sorted(n for n in stored if n not in expected and n not in carried_shapes and n.startswith(family.heads))
    if heads:  # transformers says the same of a base model loaded from a task model's checkpoint
        prefixes = sorted({p for p in family.heads for n in heads if n.startswith(p)})
        warnings.warn(
            f"{file}: {len(heads)} tensors of task heads ({', '.join(prefixes)}) are not loaded: attnkit runs "
            f"the base {family.name} encoder, and export writes the base model only",
            stacklevel=4,
        )
    for name, (variable, transposed) in table.items():
        variable.assign(stored[name].T if transposed else stored[name])
    return {n: stored[n] for n in carried_shapes if n in stored}


def _stored_shape(variable, transposed):
    shape = tuple(variable.shape)
    return shape[::-1] if transposed else shape


def export_tensors(family, model, carried):
    """{name: float32 array} of the base model, as transformers' `save_pretrained` names them."""
    from keras import ops

    tensors = {}
    for name, (variable, transposed) in family.weight_table(model).items():
        value = np.asarray(ops.convert_to_numpy(variable), dtype=np.float32)
        tensors[name] = np.ascontiguousarray(value.T if transposed else value)
    tensors.update({name: np.ascontiguousarray(value) for name, value in carried.items()})
    return tensors

"""Reading a Hugging Face BERT-architecture directory with `safetensors` and `tokenizers` only.

A directory holds config.json, model.safetensors, and tokenizer.json or vocab.txt; sentence-transformers
directories add sentence_bert_config.json (the maximum length) and 1_Pooling/config.json (the pooling).
Every problem is a `FileNotFoundError` or `ValueError` that names the file and what is wrong with it.

Legend: V vocabulary size, P maximum positions, n layers, d_model width, d_ff feed-forward width.
"""

import json
import os

import numpy as np

SUPPORTED_MODEL_TYPES = ("bert",)
SUPPORTED_ACTIVATIONS = ("gelu", "relu")
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
_REQUIRED = "a model directory holds config.json, model.safetensors, and tokenizer.json or vocab.txt"


def check_directory(path):
    """Returns `path` as a string, or raises if it is not an existing directory."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        what = "is not a directory" if os.path.exists(path) else "does not exist"
        raise FileNotFoundError(f"Model directory {path} {what}; {_REQUIRED}")
    return path


def _read_json(file, *, required=True):
    if not os.path.isfile(file):
        if required:
            raise FileNotFoundError(f"{file}: file not found; {_REQUIRED}")
        return None
    try:
        with open(file, encoding="utf-8") as f:
            data = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{file}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{file}: expected a JSON object. Received: {type(data).__name__}")
    return data


def read_config(path):
    """Reads config.json into the keyword arguments of `attnkit.models.BertEncoder`.

    Raises:
        FileNotFoundError: no config.json.
        ValueError: not JSON, another architecture, missing or invalid sizes.
    """
    file = os.path.join(path, CONFIG_FILE)
    config = _read_json(file)
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"{file}: model_type {model_type!r} is not supported; attnkit loads BERT-architecture "
            f"encoders (model_type {', '.join(map(repr, SUPPORTED_MODEL_TYPES))})"
        )
    sizes = {}
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                "intermediate_size", "max_position_embeddings"):
        value = config.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{file}: `{key}` must be a positive integer. Received: {key}={value!r}")
        sizes[key] = value
    d_model, h = sizes["hidden_size"], sizes["num_attention_heads"]
    if d_model % h:
        raise ValueError(
            f"{file}: `hidden_size` must be a multiple of `num_attention_heads`. "
            f"Received: hidden_size={d_model}, num_attention_heads={h}"
        )
    activation = config.get("hidden_act", "gelu")
    if activation not in SUPPORTED_ACTIVATIONS:
        raise ValueError(
            f"{file}: hidden_act {activation!r} is not supported; expected one of {SUPPORTED_ACTIVATIONS}"
        )
    position_type = config.get("position_embedding_type", "absolute")
    if position_type != "absolute":
        raise ValueError(f"{file}: position_embedding_type {position_type!r} is not supported; expected 'absolute'")
    return dict(
        vocab_size=sizes["vocab_size"],
        sequence_length=sizes["max_position_embeddings"],
        h=h,
        d_k=d_model // h,
        d_v=d_model // h,
        d_model=d_model,
        d_ff=sizes["intermediate_size"],
        n=sizes["num_hidden_layers"],
        rate=float(config.get("hidden_dropout_prob", 0.1)),
        type_vocab_size=int(config.get("type_vocab_size", 2)),
        epsilon=float(config.get("layer_norm_eps", 1e-12)),
        activation=activation,
        pad_id=int(config.get("pad_token_id") or 0),
    )


def expected_shapes(config):
    """The Hugging Face weight names of a BertModel and their shapes, from `read_config`'s result."""
    V, P, d_model, d_ff = config["vocab_size"], config["sequence_length"], config["d_model"], config["d_ff"]
    shapes = {
        "embeddings.word_embeddings.weight": (V, d_model),
        "embeddings.position_embeddings.weight": (P, d_model),
        "embeddings.token_type_embeddings.weight": (config["type_vocab_size"], d_model),
        "embeddings.LayerNorm.weight": (d_model,),
        "embeddings.LayerNorm.bias": (d_model,),
    }
    for i in range(config["n"]):
        prefix = f"encoder.layer.{i}."
        for name in ("attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense"):
            shapes[prefix + name + ".weight"] = (d_model, d_model)  # torch Linear: (out, in)
            shapes[prefix + name + ".bias"] = (d_model,)
        shapes[prefix + "intermediate.dense.weight"] = (d_ff, d_model)
        shapes[prefix + "intermediate.dense.bias"] = (d_ff,)
        shapes[prefix + "output.dense.weight"] = (d_model, d_ff)
        shapes[prefix + "output.dense.bias"] = (d_model,)
        for norm in ("attention.output.LayerNorm", "output.LayerNorm"):
            shapes[prefix + norm + ".weight"] = (d_model,)
            shapes[prefix + norm + ".bias"] = (d_model,)
    return shapes


def read_weights(path, config):
    """Reads model.safetensors into {Hugging Face name: float32 array}, checked against the config.

    Names with the "bert." prefix of the task heads (BertForMaskedLM, ...) are accepted; weights the
    encoder does not use (pooler, heads, position_ids) are ignored.

    Raises:
        FileNotFoundError: no model.safetensors.
        ValueError: a truncated or corrupt file, a missing weight, a weight of the wrong shape.
    """
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    file = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(file):
        raise FileNotFoundError(f"{file}: file not found; {_REQUIRED}")
    try:
        stored = load_file(file)
    except (SafetensorError, OSError, ValueError, TypeError) as e:
        raise ValueError(f"{file}: cannot read the safetensors file, truncated or corrupt? ({e})") from None
    stored = {name.removeprefix("bert."): value for name, value in stored.items()}
    weights = {}
    for name, shape in expected_shapes(config).items():
        if name not in stored:
            raise ValueError(f"{file}: weight {name!r} is missing (config.json implies shape {shape})")
        value = stored[name]
        if tuple(value.shape) != shape:
            raise ValueError(
                f"{file}: weight {name!r} has shape {tuple(value.shape)}; config.json implies {shape}"
            )
        weights[name] = np.asarray(value, dtype=np.float32)
    return weights


def read_tokenizer(path):
    """A `tokenizers.Tokenizer` from tokenizer.json, else a WordPiece tokenizer from vocab.txt.

    Padding and truncation stored in the file are switched off: the caller pads each batch to its
    longest sequence and truncates at the model's maximum length.
    """
    from tokenizers import Tokenizer
    from tokenizers.implementations import BertWordPieceTokenizer

    tokenizer_file, vocab_file = os.path.join(path, "tokenizer.json"), os.path.join(path, "vocab.txt")
    if not os.path.isfile(tokenizer_file) and not os.path.isfile(vocab_file):
        raise FileNotFoundError(f"{path}: neither tokenizer.json nor vocab.txt found; {_REQUIRED}")
    file = tokenizer_file if os.path.isfile(tokenizer_file) else vocab_file
    try:
        if file == tokenizer_file:
            tokenizer = Tokenizer.from_file(tokenizer_file)
        else:
            settings = _read_json(os.path.join(path, "tokenizer_config.json"), required=False) or {}
            tokenizer = BertWordPieceTokenizer(vocab_file, lowercase=settings.get("do_lower_case", True))
    except Exception as e:  # tokenizers raises a bare Exception on a malformed file
        raise ValueError(f"{file}: cannot read the tokenizer ({e})") from None
    tokenizer.no_padding()
    tokenizer.no_truncation()
    return tokenizer


def read_sentence_settings(path, config):
    """The maximum length in tokens and the pooling mode ("mean" or "cls") for sentence embeddings.

    The length is sentence_bert_config.json's max_seq_length when present, else the config's
    max_position_embeddings (never more than that). The pooling is 1_Pooling/config.json's, else mean.
    """
    file = os.path.join(path, "sentence_bert_config.json")
    settings = _read_json(file, required=False) or {}
    max_length = settings.get("max_seq_length", config["sequence_length"])
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 2:
        raise ValueError(f"{file}: `max_seq_length` must be an integer >= 2. Received: {max_length!r}")
    pooling_file = os.path.join(path, "1_Pooling", "config.json")
    pooling = _read_json(pooling_file, required=False) or {"pooling_mode_mean_tokens": True}
    modes = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}
    chosen = [key for key, value in pooling.items() if key.startswith("pooling_mode") and value is True]
    if len(chosen) != 1 or chosen[0] not in modes:
        raise ValueError(f"{pooling_file}: attnkit supports exactly one of mean or CLS pooling. Received: {chosen}")
    return min(max_length, config["sequence_length"]), modes[chosen[0]]

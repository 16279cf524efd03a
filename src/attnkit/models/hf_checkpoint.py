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
        ValueError: not JSON, another architecture, missing or invalid sizes, an invalid optional field
            (hidden_dropout_prob, layer_norm_eps, type_vocab_size, pad_token_id), naming the key.
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
    rate = _optional_number(file, config, "hidden_dropout_prob", 0.1)
    if not 0 <= rate < 1:
        raise ValueError(f"{file}: `hidden_dropout_prob` must be in [0, 1). Received: hidden_dropout_prob={rate!r}")
    epsilon = _optional_number(file, config, "layer_norm_eps", 1e-12)
    if not epsilon > 0:
        raise ValueError(f"{file}: `layer_norm_eps` must be a positive number. Received: layer_norm_eps={epsilon!r}")
    type_vocab_size = config.get("type_vocab_size", 2)
    if isinstance(type_vocab_size, bool) or not isinstance(type_vocab_size, int) or type_vocab_size <= 0:
        raise ValueError(
            f"{file}: `type_vocab_size` must be a positive integer. Received: type_vocab_size={type_vocab_size!r}"
        )
    pad_id = config.get("pad_token_id", 0)
    if pad_id is None:  # no padding token: pad with 0, which is never attended to (see PretrainedEncoder)
        pad_id = 0
    if isinstance(pad_id, bool) or not isinstance(pad_id, int) or not 0 <= pad_id < sizes["vocab_size"]:
        raise ValueError(
            f"{file}: `pad_token_id` must be null or an integer in [0, vocab_size={sizes['vocab_size']}). "
            f"Received: pad_token_id={pad_id!r}"
        )
    return dict(
        vocab_size=sizes["vocab_size"],
        sequence_length=sizes["max_position_embeddings"],
        h=h,
        d_k=d_model // h,
        d_v=d_model // h,
        d_model=d_model,
        d_ff=sizes["intermediate_size"],
        n=sizes["num_hidden_layers"],
        rate=rate,
        type_vocab_size=type_vocab_size,
        epsilon=epsilon,
        activation=activation,
        pad_id=pad_id,
    )


def _optional_number(file, config, key, default):
    """config[key] as a float (`default` when absent); anything but a real number is refused, naming the key."""
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:  # value != value: NaN
        raise ValueError(f"{file}: `{key}` must be a number. Received: {key}={value!r}")
    return float(value)


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

    Names with the "bert." prefix of the task heads (BertForMaskedLM, ...) are accepted, and so are the
    original BERT's layer norm names `LayerNorm.gamma`/`LayerNorm.beta` (for `.weight`/`.bias`); weights the
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
    for name in list(stored):  # the original BERT's names, which transformers also maps
        for old_suffix, new_suffix in ((".LayerNorm.gamma", ".LayerNorm.weight"), (".LayerNorm.beta", ".LayerNorm.bias")):
            if name.endswith(old_suffix):
                canonical = name.removesuffix(old_suffix) + new_suffix
                if canonical in stored:
                    raise ValueError(f"{file}: both {name!r} and {canonical!r} are stored; expected one of them")
                stored[canonical] = stored.pop(name)
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


def read_tokenizer(path, *, vocab_size=None):
    """A `tokenizers.Tokenizer` from tokenizer.json, else a WordPiece tokenizer from vocab.txt.

    A vocab.txt tokenizer follows tokenizer_config.json as transformers' BertTokenizer does:
    `do_lower_case` (default true), `strip_accents` (null: strip when lowercasing; true: strip; false:
    keep) and `tokenize_chinese_chars` (default true: a CJK character is a word of its own).

    Padding and truncation stored in the file are switched off: the caller pads each batch to its
    longest sequence and truncates at the model's maximum length.

    Args:
        path: the model directory.
        vocab_size: config.json's vocab_size; when given, a tokenizer that can produce an id >= it is
            refused (the id would index past the embedding table).

    Raises:
        FileNotFoundError: neither tokenizer.json nor vocab.txt.
        ValueError: an unreadable tokenizer, invalid tokenizer_config.json settings, or more tokens
            than `vocab_size`.
    """
    from tokenizers import Tokenizer
    from tokenizers.implementations import BertWordPieceTokenizer

    tokenizer_file, vocab_file = os.path.join(path, "tokenizer.json"), os.path.join(path, "vocab.txt")
    if not os.path.isfile(tokenizer_file) and not os.path.isfile(vocab_file):
        raise FileNotFoundError(f"{path}: neither tokenizer.json nor vocab.txt found; {_REQUIRED}")
    file = tokenizer_file if os.path.isfile(tokenizer_file) else vocab_file
    options = {} if file == tokenizer_file else _word_piece_options(os.path.join(path, "tokenizer_config.json"))
    try:
        if file == tokenizer_file:
            tokenizer = Tokenizer.from_file(tokenizer_file)
        else:
            tokenizer = BertWordPieceTokenizer(vocab_file, **options)
    except Exception as e:  # tokenizers raises a bare Exception on a malformed file
        raise ValueError(f"{file}: cannot read the tokenizer ({e})") from None
    if vocab_size is not None:
        ids = tokenizer.get_vocab(with_added_tokens=True).values()
        largest = max(ids, default=-1)
        if largest >= vocab_size:
            raise ValueError(
                f"{file}: the tokenizer has ids up to {largest} ({len(ids)} tokens), but "
                f"{os.path.join(path, CONFIG_FILE)} has vocab_size={vocab_size}: the tokenizer does not "
                "belong to these weights"
            )
    tokenizer.no_padding()
    tokenizer.no_truncation()
    return tokenizer


def _word_piece_options(file):
    """BertWordPieceTokenizer's keyword arguments from tokenizer_config.json (defaults when absent)."""
    settings = _read_json(file, required=False) or {}
    lowercase = settings.get("do_lower_case", True)
    strip_accents = settings.get("strip_accents")
    chinese = settings.get("tokenize_chinese_chars", True)
    for key, value, allowed in (("do_lower_case", lowercase, "true or false"),
                                ("strip_accents", strip_accents, "null, true or false"),
                                ("tokenize_chinese_chars", chinese, "true or false")):
        if not (isinstance(value, bool) or (value is None and key == "strip_accents")):
            raise ValueError(f"{file}: `{key}` must be {allowed}. Received: {key}={value!r}")
    # strip_accents None: tokenizers' BertNormalizer then strips exactly when lowercasing, as transformers does
    return dict(lowercase=lowercase, strip_accents=strip_accents, handle_chinese_chars=chinese)


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

"""The sentence-transformers pipeline of a model directory, run as sentence-transformers runs it
(docs/decisions.md item 29).

modules.json lists the modules in order: Transformer (the encoder, at its path), Pooling, then any
Dense and Normalize. Without modules.json, sentence-transformers runs the directory as Transformer
and mean Pooling, without Normalize, and so does attnkit. Any other module type is refused by name.

Legend: N texts, T tokens, d_model the encoder's width, d the embedding width after Dense.
"""

import math
import os
from typing import NamedTuple

import numpy as np

from attnkit.checkpoints.formats.json import read_json
from attnkit.checkpoints.formats.weights import read_state_dict

MODULES_FILE = "modules.json"
MODULE_KINDS = ("Transformer", "Pooling", "Dense", "Normalize")
POOLING_MODES = ("cls", "max", "mean", "mean_sqrt_len_tokens", "weightedmean", "lasttoken")
# The boolean keys of sentence-transformers' older Pooling config, in its order of concatenation.
LEGACY_POOLING_KEYS = {
    "pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max", "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean", "pooling_mode_lasttoken": "lasttoken",
}
# Dense's activation_function (a torch.nn class path) -> its NumPy form.
DENSE_ACTIVATIONS = {
    "torch.nn.modules.activation.Tanh": np.tanh,
    "torch.nn.modules.linear.Identity": lambda x: x,
    "torch.nn.modules.activation.ReLU": lambda x: np.maximum(x, 0),
    "torch.nn.modules.activation.Sigmoid": lambda x: 1 / (1 + np.exp(-x)),
    "torch.nn.modules.activation.SiLU": lambda x: x / (1 + np.exp(-x)),
    "torch.nn.modules.activation.GELU": lambda x: 0.5 * x * (1 + np.vectorize(math.erf)(x / math.sqrt(2))),
}
# sentence-transformers imports the path it is given, so torch's public alias names the same class.
DENSE_ACTIVATIONS.update({"torch.nn." + name.rsplit(".", 1)[1]: f for name, f in DENSE_ACTIVATIONS.items()})
SENTENCE_TRANSFORMERS_CONFIG = "config_sentence_transformers.json"
_SENTENCE_CONFIG_FILES = ("sentence_bert_config.json", "sentence_roberta_config.json",
                          "sentence_distilbert_config.json", "sentence_xlm-roberta_config.json")


class Dense(NamedTuple):
    """One Dense module: y = activation(x W + b) (+ x, or + x R, with use_residual)."""

    path: str
    kernel: np.ndarray  # (d_in, d_out)
    bias: np.ndarray  # (d_out,) or None
    activation: str  # a DENSE_ACTIVATIONS key
    residual: object  # None, "identity", or a (d_in, d_out) array

    def __call__(self, x):  # x: (N, d_in) -> (N, d_out)
        y = x @ self.kernel
        if self.bias is not None:
            y = y + self.bias
        y = DENSE_ACTIVATIONS[self.activation](y).astype(np.float32)
        if self.residual is None:
            return y
        return y + (x if isinstance(self.residual, str) else x @ self.residual)


class Pipeline(NamedTuple):
    """A directory's modules: where the encoder is, how its token vectors become an embedding."""

    transformer_path: str  # the Transformer module's directory (config.json, weights, tokenizer)
    modules: tuple  # modules.json's entries, or None when the directory has none
    pooling: tuple  # pooling modes, concatenated in this order
    dense: tuple  # Dense modules, in order
    normalize: bool  # a Normalize module ends the pipeline
    sentence_config: dict  # the Transformer's sentence_bert_config.json, {} when absent
    include_prompt: bool = True  # Pooling's include_prompt: False leaves a prompt's tokens out of the pooling
    prompts: tuple = ()  # config_sentence_transformers.json's prompts, as (name, text) pairs
    default_prompt_name: str = None  # the prompt `encode` adds when none is named
    config_overrides: tuple = ()  # sentence_bert_config.json's config_kwargs, (field, value) pairs over config.json


def read_modules(root):
    """modules.json's entries as (kind, directory) pairs, checked; None when the file is absent."""
    file = os.path.join(root, MODULES_FILE)
    entries = read_json(file, required=False, kind=list)
    if entries is None:
        return None
    modules = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or not isinstance(entry.get("type"), str):
            raise ValueError(f"{file}: entry {i} must be an object with a string `type`. Received: {entry!r}")
        module_type, path = entry["type"], entry.get("path", "")
        kind = module_type.rsplit(".", 1)[-1]
        if not module_type.startswith("sentence_transformers.") or kind not in MODULE_KINDS:
            raise ValueError(
                f"{file}: module {entry.get('name', i)!r} has type {module_type!r}, which attnkit does not run; "
                f"it runs sentence-transformers' {', '.join(MODULE_KINDS)}"
            )
        if not isinstance(path, str) or os.path.isabs(path) or ".." in path.replace("\\", "/").split("/"):
            raise ValueError(f"{file}: module {entry.get('name', i)!r} has path {path!r}; expected a folder inside {root}")
        modules.append((kind, os.path.join(root, path)))
    kinds = [kind for kind, _ in modules]
    order = [k for k in kinds if k != "Dense"]
    if kinds[:1] != ["Transformer"] or order[:2] != ["Transformer", "Pooling"] or order.count("Transformer") != 1 \
            or order.count("Pooling") != 1 or kinds.count("Normalize") > 1 or (
                "Normalize" in kinds and kinds[-1] != "Normalize") or kinds.index("Pooling") != 1:
        raise ValueError(
            f"{file}: attnkit runs Transformer, Pooling, then any Dense modules and at most one Normalize last. "
            f"Received: {kinds}"
        )
    return modules


def read_pipeline(root, d_model_of):
    """The pipeline of the model directory `root`.

    Args:
        root: the directory.
        d_model_of: transformer_path -> the encoder's width, to check Pooling's and Dense's sizes.

    Raises:
        ValueError: an unknown module (named), modules out of order, an invalid Pooling or Dense config.
    """
    modules = read_modules(root)
    if modules is None:
        return Pipeline(root, None, ("mean",), (), False, {})
    transformer_path = modules[0][1]
    width = d_model_of(transformer_path)
    pooling, include_prompt = _read_pooling(modules[1][1], width)
    width *= len(pooling)
    dense = []
    for kind, path in modules[2:]:
        if kind == "Dense":
            dense.append(_read_dense(path, width))
            width = dense[-1].kernel.shape[1]
        else:
            _check_normalize(path)
    sentence_config = {}
    for name in _SENTENCE_CONFIG_FILES:
        sentence_config = read_json(os.path.join(transformer_path, name), required=False)
        if sentence_config is not None:
            break
    sentence_config = sentence_config or {}
    _check_tokenizer_settings(os.path.join(transformer_path, name), sentence_config)
    _check_transformer_output(os.path.join(transformer_path, name), sentence_config)
    if not isinstance(sentence_config.get("do_lower_case", False), bool):  # sentence-transformers lowercases on any truthy value
        raise ValueError(f"{os.path.join(transformer_path, name)}: `do_lower_case` must be true or false. "
                         f"Received: do_lower_case={sentence_config['do_lower_case']!r}")
    prompts, default_prompt_name = _read_prompts(os.path.join(root, SENTENCE_TRANSFORMERS_CONFIG))
    return Pipeline(transformer_path, tuple(modules), pooling, tuple(dense), modules[-1][0] == "Normalize",
                    sentence_config, include_prompt, prompts, default_prompt_name,
                    _config_overrides(os.path.join(transformer_path, name), sentence_config))


def _read_prompts(file):
    """config_sentence_transformers.json's prompts as (name, text) pairs and its default_prompt_name,
    checked as sentence-transformers checks them; ((), None) when the file is absent."""
    config = read_json(file, required=False) or {}
    prompts = config.get("prompts") or {}
    if not isinstance(prompts, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in prompts.items()):
        raise ValueError(f"{file}: `prompts` must map prompt names to prompt texts. Received: prompts={prompts!r}")
    default = config.get("default_prompt_name")
    if default is not None and default not in prompts:
        raise ValueError(
            f"{file}: default_prompt_name {default!r} is not one of the prompts {sorted(prompts)}"
        )
    return tuple(prompts.items()), default


# Of processor_kwargs / tokenizer_args: model_max_length (read), and options of `from_pretrained` that
# only say where and how to load the files, not how to tokenize.
_READ_OR_LOADING_ONLY = frozenset({
    "model_max_length", "trust_remote_code", "revision", "use_fast", "token", "use_auth_token", "cache_dir",
    "local_files_only", "force_download", "proxies",
})


def _check_tokenizer_settings(file, sentence_config):
    """Refuses the tokenizer settings of sentence_bert_config.json that attnkit does not apply:
    sentence-transformers passes `processor_kwargs` (formerly `tokenizer_args`) to the tokenizer's
    loading and `processing_kwargs` to every tokenizer call (truncation side, max_length, special
    tokens, lowercasing); of these attnkit reads model_max_length alone (`max_length`)."""
    for key in ("processor_kwargs", "tokenizer_args", "processing_kwargs"):
        value = sentence_config.get(key)
        if value is None:
            continue
        if not isinstance(value, dict):
            raise ValueError(f"{file}: `{key}` must be an object of tokenizer settings. Received: {key}={value!r}")
        unread = sorted(set(value) - (_READ_OR_LOADING_ONLY if key != "processing_kwargs" else set()))
        if unread:
            raise ValueError(
                f"{file}: `{key}` sets {unread}, which attnkit does not apply to its tokenizer (it reads "
                f"`model_max_length` of processor_kwargs / tokenizer_args only). Received: {key}={value!r}"
            )


# What sentence-transformers' Transformer module hands to Pooling when its config says nothing else: the
# encoder's last hidden states (AutoModel, forward's last_hidden_state) as token_embeddings.
_TRANSFORMER_OUTPUT = {
    "transformer_task": "feature-extraction",
    "modality_config": {"text": {"method": "forward", "method_output_name": "last_hidden_state"}},
    "module_output_name": "token_embeddings",
}


def _check_transformer_output(file, sentence_config):
    """Refuses a Transformer module that hands Pooling anything but the last hidden states: another
    task's model (a classification or masked-LM head), another output (pooler_output), or another
    feature name, which sentence-transformers runs or fails on and attnkit would silently replace."""
    for key, expected in _TRANSFORMER_OUTPUT.items():
        value = sentence_config.get(key)
        if value is not None and value != expected:
            raise ValueError(
                f"{file}: `{key}` {value!r} is not supported; attnkit's Transformer module gives Pooling the "
                f"encoder's last hidden states ({key}={expected!r})"
            )


def _check_normalize(path):
    """Refuses a Normalize module that normalises another feature than the sentence embedding (its
    module_input_name, e.g. token_embeddings) or writes it under another name: sentence-transformers
    then leaves the sentence embedding as it is, and attnkit would normalise it."""
    file = os.path.join(path, "config.json")
    config = read_json(file, required=False) or {}
    for key in ("module_input_name", "module_output_name"):
        if config.get(key) not in ("sentence_embedding", None):
            raise ValueError(
                f"{file}: `{key}` {config[key]!r} is not supported; attnkit's Normalize normalises the "
                "sentence_embedding in place"
            )


def _config_overrides(file, sentence_config):
    """sentence_bert_config.json's config_kwargs (formerly config_args): fields sentence-transformers
    sets over config.json's when it loads the encoder (`AutoConfig.from_pretrained(path, **kwargs)`)."""
    given = {key: sentence_config[key] for key in ("config_kwargs", "config_args") if sentence_config.get(key) is not None}
    for key, value in given.items():
        if not isinstance(value, dict):
            raise ValueError(f"{file}: `{key}` must be an object of config fields. Received: {key}={value!r}")
    if len(given) == 2 and given["config_kwargs"] != given["config_args"]:
        raise ValueError(f"{file}: `config_kwargs` and its older name `config_args` differ: {given}")
    return tuple(next(iter(given.values()), {}).items())


def _read_pooling(path, d_model):
    file = os.path.join(path, "config.json")
    config = read_json(file)
    if "pooling_mode" in config:
        modes = config["pooling_mode"]
        modes = (modes,) if isinstance(modes, str) else modes
        if not isinstance(modes, (list, tuple)) or not modes:
            raise ValueError(f"{file}: `pooling_mode` must be a mode or a list of modes. Received: {modes!r}")
    else:  # the older format: one boolean per mode; none set means mean
        for key in LEGACY_POOLING_KEYS:  # sentence-transformers takes any truthy value ("false" too) as set
            if not isinstance(config.get(key, False), bool):
                raise ValueError(f"{file}: `{key}` must be true or false. Received: {key}={config[key]!r}")
        modes = tuple(mode for key, mode in LEGACY_POOLING_KEYS.items() if config.get(key) is True) or ("mean",)
    unknown = [m for m in modes if m not in POOLING_MODES]
    if unknown:
        raise ValueError(f"{file}: pooling modes {unknown} are not known; expected modes of {POOLING_MODES}")
    dimension = config.get("embedding_dimension", config.get("word_embedding_dimension", d_model))
    if dimension != d_model:
        raise ValueError(f"{file}: `embedding_dimension` is {dimension!r}, but the encoder's width is {d_model}")
    include_prompt = config.get("include_prompt", True)
    if not isinstance(include_prompt, bool):
        raise ValueError(f"{file}: `include_prompt` must be true or false. Received: include_prompt={include_prompt!r}")
    return tuple(modes), include_prompt


def _read_dense(path, d_in):
    file = os.path.join(path, "config.json")
    config = read_json(file)
    for key in ("in_features", "out_features"):
        value = config.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{file}: `{key}` must be a positive integer. Received: {key}={value!r}")
    if config["in_features"] != d_in:
        raise ValueError(f"{file}: `in_features` is {config['in_features']}, but the embeddings before it have width {d_in}")
    activation = config.get("activation_function", "torch.nn.modules.activation.Tanh")
    if not isinstance(activation, str) or activation not in DENSE_ACTIVATIONS:  # a list is not hashable
        raise ValueError(f"{file}: activation_function {activation!r} is not supported; expected one of {sorted(DENSE_ACTIVATIONS)}")
    for key in ("module_input_name", "module_output_name"):
        if config.get(key, "sentence_embedding") not in ("sentence_embedding", None):
            raise ValueError(f"{file}: `{key}` {config[key]!r} is not supported; attnkit's Dense maps sentence_embedding")
    d_out, bias, residual = config["out_features"], config.get("bias", True), config.get("use_residual", False)
    expected = {"linear.weight": (d_out, d_in)}
    if bias:
        expected["linear.bias"] = (d_out,)
    if residual and d_in != d_out:
        expected["residual.weight"] = (d_out, d_in)
    stored, weights_file = read_state_dict(path)
    problems = sorted(set(stored) ^ set(expected)) + [
        n for n in expected if n in stored and tuple(stored[n].shape) != expected[n]
    ]
    if problems:
        raise ValueError(
            f"{weights_file}: expected exactly the tensors {expected} for {file}. "
            f"Received: {({n: tuple(v.shape) for n, v in stored.items()})}"
        )
    return Dense(
        path, stored["linear.weight"].T, stored.get("linear.bias"), activation,
        None if not residual else ("identity" if d_in == d_out else stored["residual.weight"].T),
    )


def pool(modes, hidden, mask, prompt_length=0):
    """Pooled token vectors, concatenated over `modes`, as sentence-transformers' Pooling computes them.

    Args:
        modes: pooling modes.
        hidden: float32 (B, T, d_model) token vectors.
        mask: bool (B, T), True at real tokens (right-padded).
        prompt_length: the leading tokens (a prompt's, [CLS] included) left out of the pooling, as
            Pooling's include_prompt=False leaves them out: masked for every mode, while weightedmean
            still counts positions from the first token.

    Returns:
        float32 (B, len(modes) * d_model).
    """
    first = mask.argmax(axis=1)  # (B,) the first real token
    if prompt_length:
        mask = mask.copy()
        mask[:, :prompt_length] = False
    weights = mask[..., None].astype(np.float32)  # (B, T, 1)
    lengths = np.maximum(weights.sum(axis=1), 1e-9)  # (B, 1)
    vectors = []
    for mode in modes:
        if mode == "cls":
            vectors.append(hidden[np.arange(len(hidden)), mask.argmax(axis=1)])  # the first real token
        elif mode == "max":
            vectors.append(np.where(mask[..., None], hidden, -np.inf).max(axis=1))
        elif mode == "mean":
            vectors.append((hidden * weights).sum(axis=1) / lengths)
        elif mode == "mean_sqrt_len_tokens":
            vectors.append((hidden * weights).sum(axis=1) / np.sqrt(lengths))
        elif mode == "weightedmean":
            # position weights 1, 2, ... counted from the first real token
            position = np.arange(1, hidden.shape[1] + 1, dtype=np.float32)[None, :, None] - first[:, None, None]
            weighted = weights * position  # (B, T, 1)
            vectors.append((hidden * weighted).sum(axis=1) / np.maximum(weighted.sum(axis=1), 1e-9))
        else:  # lasttoken: the last real token
            last = hidden.shape[1] - 1 - mask[:, ::-1].argmax(axis=1)
            vectors.append(hidden[np.arange(len(hidden)), last] * mask[np.arange(len(hidden)), last][:, None])
    return np.concatenate(vectors, axis=-1).astype(np.float32)


def max_length(pipeline, tokenizer_config, max_position_embeddings):
    """The longest input in tokens, with sentence-transformers' precedence (its Transformer module):
    tokenizer_args' model_max_length, else sentence_bert_config.json's max_seq_length, else
    tokenizer_config.json's model_max_length capped at config.json's max_position_embeddings (the
    cap applies to that last source only); no limit anywhere: max_position_embeddings.
    """
    settings = pipeline.sentence_config
    tokenizer_args = settings.get("processor_kwargs", settings.get("tokenizer_args")) or {}
    explicit = tokenizer_args.get("model_max_length", settings.get("max_seq_length"))
    if explicit is not None:
        return _length("max_seq_length", explicit)
    stored = (tokenizer_config or {}).get("model_max_length")
    if stored is None:
        return max_position_embeddings
    return min(_length("model_max_length", stored), max_position_embeddings)


def _length(key, value):
    if isinstance(value, float) and value.is_integer():  # tokenizer configs hold 1e30 for "no limit"
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"`{key}` must be a positive integer. Received: {key}={value!r}")
    return value

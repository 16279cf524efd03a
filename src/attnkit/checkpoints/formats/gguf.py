"""Reading a llama.cpp GGUF file: the model's configuration, its dequantized weights under Hugging
Face's names, its tokenizer and its chat template (docs/decisions.md item 35).

The `gguf` package reads the file and dequantizes every tensor to float32. llama.cpp stores W_q and
W_k of Llama models permuted for its interleaved rotary layout; they are permuted back to Hugging
Face's rotate-half layout, as transformers' GGUF loader does. The tokenizer is rebuilt with
`tokenizers` from the vocabulary, merges and token types in the metadata, the way transformers'
GGUF integration builds it (byte-level BPE, control tokens special, user-defined tokens added).

Legend: V vocabulary, n layers, h / h_kv heads, d_k per-head width.
"""

import struct

import numpy as np

from attnkit.checkpoints.families.decoders import GGUF_ARCHITECTURES
from attnkit.kernels.quantized import PACKED_TYPES, repack

# GGUF architectures attnkit builds, and whether W_q / W_k are stored permuted (llama.cpp's converter
# permutes them for "llama" only): from the family files (docs/decisions.md item 101).
ARCHITECTURES = {arch: layout.permuted for arch, (_, layout) in GGUF_ARCHITECTURES.items()}

# tokenizer.ggml.pre values whose split is GPT-2's own (the ByteLevel pre-tokenizer's regex), and the
# ones with a split regex of their own, as transformers' GGUF_PRE_TOKENIZER_SPLITS has them.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
GPT2_PRE_TOKENIZERS = ("default", "gpt-2", "gpt2", "smollm")
SPLIT_PRE_TOKENIZERS = {
    "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
}

_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


# The `<architecture>.` metadata keys attnkit reads (or checks are at their neutral values); any other is refused.
ARCHITECTURE_KEYS = frozenset({
    "vocab_size", "block_count", "context_length", "embedding_length", "feed_forward_length",
    "attention.head_count", "attention.head_count_kv", "attention.key_length", "attention.value_length",
    "attention.layer_norm_rms_epsilon", "rope.dimension_count", "rope.freq_base", "rope.scaling.type",
    "rope.scaling.factor", "rope.scale_linear", "rope.scaling.original_context_length",
})


def read_gguf(path, keep_packed=False):
    """Reads a GGUF file.

    `keep_packed`: the projections' quantized tensors are returned as `BlockWeights` (their blocks
    repacked exactly, not dequantized: docs/decisions.md item 125); a type attnkit cannot keep packed
    is refused by name. float tensors, the embeddings and the norms are float32 arrays either way.
    A tied output (no output.weight) whose token_embd is of a type kept packed becomes an untied
    lm_head holding token_embd's blocks, the embeddings a float32 copy of the same values: a
    decoding step then reads the packed blocks for the vocabulary's product, not 4 bytes a weight
    (docs/decisions.md item 137).

    Returns:
        (config, weights, tokenizer_info): a Hugging Face-style config dict (model_type, sizes,
        rope_theta, rms_norm_eps, tie_word_embeddings, ...), {HF name: float32 array} with torch's
        (out, in) layout, and a dict of the tokenizer metadata (tokens, merges, token types, special
        ids, pre-tokenizer, chat_template, add_bos_token).

    Raises:
        ValueError: an architecture no family reads (llama, qwen2, qwen3), a RoPE scaling, a quantization type
            `gguf` cannot dequantize, an unknown tensor, a malformed file.
    """
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
    except OSError as error:
        raise ValueError(f"{path} is not a readable GGUF file: {error}") from None
    except (ValueError, KeyError, IndexError, OverflowError, struct.error) as error:
        # a file cut inside its header reads past the end of gguf's arrays: IndexError, which named no file
        raise ValueError(f"{path} is not a readable GGUF file (cut short, or not GGUF): {type(error).__name__}: {error}") from None
    meta = {name: field for name, field in reader.fields.items()}

    def value(key, default=None):
        field = meta.get(key)
        return default if field is None else field.contents()

    arch = value("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported by attnkit (supported: {sorted(ARCHITECTURES)}). Received: {path}"
        )
    unread = sorted(k for k in meta if k.startswith(f"{arch}.") and k[len(arch) + 1:] not in ARCHITECTURE_KEYS)
    if unread:  # e.g. attention.sliding_window, expert_count: they change the math, and attnkit would not apply them
        raise ValueError(
            f"GGUF metadata attnkit does not implement: {', '.join(f'{k}={value(k)!r}' for k in unread)}. Received: {path}"
        )
    scaling = value(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        raise ValueError(f"RoPE scaling {scaling!r} is not implemented in attnkit. Received: {path}")
    for key in (f"{arch}.rope.scaling.factor", f"{arch}.rope.scale_linear"):
        if scaling is None and value(key) not in (None, 1, 1.0):  # llama.cpp scales linearly when no type is given
            raise ValueError(f"RoPE scaling ({key}={value(key)!r}) is not implemented in attnkit. Received: {path}")

    def size(key, default=None):
        """`<arch>.key` as an integer >= 1 (`default` when absent); a missing size, or one per layer
        (an array), is refused by name."""
        number = value(f"{arch}.{key}", default)
        if isinstance(number, bool) or not isinstance(number, (int, np.integer)) or number <= 0:
            raise ValueError(f"GGUF metadata `{arch}.{key}` must be a positive integer. Received: {number!r} in {path}")
        return int(number)

    h = size("attention.head_count")
    h_kv = size("attention.head_count_kv", h)
    d_model = size("embedding_length")
    d_k = size("attention.key_length", d_model // h or None)
    if value(f"{arch}.attention.value_length") not in (None, d_k):
        raise ValueError(
            f"A value head width other than the key's ({arch}.attention.value_length={value(f'{arch}.attention.value_length')!r}) "
            f"is not implemented in attnkit's decoder. Received: {path}"
        )
    rotary_dims = value(f"{arch}.rope.dimension_count", d_k)
    if rotary_dims != d_k:
        raise ValueError(f"Partial rotary embeddings ({rotary_dims} of {d_k} dims) are not implemented in attnkit. Received: {path}")
    tensor_names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in tensor_names:
        raise ValueError(f"RoPE frequency factors (rope_freqs, Llama 3.1 scaling) are not implemented in attnkit. Received: {path}")
    tokens = value("tokenizer.ggml.tokens")
    config = {
        "model_type": arch,
        "vocab_size": size("vocab_size", len(tokens) if tokens is not None else None),
        "num_hidden_layers": size("block_count"),
        "hidden_size": d_model,
        "intermediate_size": size("feed_forward_length"),
        "num_attention_heads": h,
        "num_key_value_heads": h_kv,
        "head_dim": d_k,
        "rope_theta": float(value(f"{arch}.rope.freq_base", 10000.0)),
        "rms_norm_eps": float(value(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "hidden_act": "silu",
    }
    weights = {}
    for tensor in reader.tensors:
        name = _hf_name(tensor.name, GGUF_ARCHITECTURES[arch][1].layer_names, path)
        packed = keep_packed and tensor.tensor_type.name not in FLOAT_TYPES and (name.endswith("proj.weight") or name == "lm_head.weight")
        array = _packed(tensor, path) if packed else dequantize(tensor, path)
        if ARCHITECTURES[arch] and (".attn_q." in tensor.name or ".attn_k." in tensor.name):
            heads = h if ".attn_q." in tensor.name else h_kv
            array = array.take_rows(unpermute(np.arange(array.shape[0])[:, None], heads)[:, 0]) if packed else unpermute(array, heads)
        weights[name] = array
        if keep_packed and config["tie_word_embeddings"] and tensor.name == "token_embd.weight" and tensor.tensor_type.name in PACKED_TYPES:
            weights["lm_head.weight"] = _packed(tensor, path)  # the same weights, dequantized in the product
            config["tie_word_embeddings"] = False
    tokenizer_info = {
        "model": value("tokenizer.ggml.model"), "pre": value("tokenizer.ggml.pre", "default"), "tokens": tokens,
        "merges": value("tokenizer.ggml.merges"), "token_type": value("tokenizer.ggml.token_type"),
        "bos_token_id": value("tokenizer.ggml.bos_token_id"), "eos_token_id": value("tokenizer.ggml.eos_token_id"),
        "unk_token_id": value("tokenizer.ggml.unknown_token_id"), "pad_token_id": value("tokenizer.ggml.padding_token_id"),
        "add_bos_token": bool(value("tokenizer.ggml.add_bos_token", False)), "chat_template": value("tokenizer.chat_template"),
    }
    return config, weights, tokenizer_info


def _hf_name(gguf_name, layer_names, path):
    parts = gguf_name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in layer_names:
        return f"model.layers.{parts[1]}.{layer_names[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in _TOP_NAMES:
        return f"{_TOP_NAMES[parts[0]]}.{parts[1]}"
    raise ValueError(f"GGUF tensor {gguf_name!r} is not one attnkit knows how to load. Received: {path}")


def dequantize(tensor, path="the file"):
    """A GGUF tensor as a float32 array of its logical shape (rows = outputs), via `gguf.quants`.

    Raises:
        ValueError: a quantization type `gguf` does not dequantize, named.
    """
    from gguf import quants

    try:
        array = quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError:
        raise ValueError(
            f"GGUF tensor {tensor.name!r} has quantization type {tensor.tensor_type.name}, which attnkit cannot "
            f"dequantize (the gguf package does not implement it). Received: {path}"
        ) from None
    shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dims innermost first
    return np.ascontiguousarray(array, dtype="float32").reshape(shape)


FLOAT_TYPES = ("F32", "F16", "BF16", "F64")


def _packed(tensor, path):
    """A projection's quantized GGUF tensor as `BlockWeights` (N outputs, K inputs), refused by name
    where attnkit cannot keep its type packed."""
    if tensor.tensor_type.name not in PACKED_TYPES:
        # a type gguf cannot dequantize either (I8, Q8_1, ...) is refused as such: repack's advice to
        # load it with dtype='float32' would fail there too
        dequantize(tensor, path)
    shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dims innermost first
    try:
        return repack(tensor.data, tensor.tensor_type.name, shape, name=tensor.name)
    except ValueError as error:
        raise ValueError(f"{error}. Received: {path}") from None


def unpermute(weights, heads):
    """Undoes llama.cpp's permutation of W_q / W_k (out, in): per head, interleaved pairs back to halves.

    (heads * d_k, in) viewed as (heads, d_k / 2, 2, in) -> (heads, 2, d_k / 2, in), as transformers'
    GGUF loader does.
    """
    d_half = weights.shape[0] // heads // 2
    w = weights.reshape(heads, d_half, 2, *weights.shape[1:])  # (heads, d_k/2, 2, in)
    return np.ascontiguousarray(w.swapaxes(2, 1).reshape(weights.shape))


def bytes_to_unicode():
    """GPT-2's map of the 256 bytes to printable characters (byte-level BPE's alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def build_tokenizer(info, path="the file"):
    """A `tokenizers.Tokenizer` from GGUF tokenizer metadata, as transformers' GGUF integration builds it.

    Raises:
        ValueError: a tokenizer model other than byte-level BPE ("gpt2"), or a pre-tokenizer whose
            split attnkit does not know, named.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    if info["model"] != "gpt2":
        raise ValueError(
            f"GGUF tokenizer model {info['model']!r} is not supported by attnkit (only byte-level BPE, 'gpt2'). Received: {path}"
        )
    pre = info["pre"] or "default"
    if pre not in GPT2_PRE_TOKENIZERS and pre not in SPLIT_PRE_TOKENIZERS:
        raise ValueError(f"GGUF pre-tokenizer {pre!r} is not supported by attnkit. Received: {path}")
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {
        token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode("utf-8")): index
        for index, token in enumerate(info["tokens"])
    }
    merges = [tuple(merge.split(" ")) for merge in info["merges"] or ()]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    if pre in SPLIT_PRE_TOKENIZERS:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(SPLIT_PRE_TOKENIZERS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel(add_prefix_space=True, trim_offsets=True, use_regex=True)
    types = info["token_type"] or ()
    control = [
        AddedToken(token, normalized=False, special=True)
        for token, kind in zip(info["tokens"], types) if kind == 3 and set(token) <= alphabet  # 3: CONTROL
    ]
    tokenizer.add_special_tokens(control)
    user = [AddedToken(token, normalized=False, special=False) for token, kind in zip(info["tokens"], types) if kind == 4]
    if user:
        tokenizer.add_tokens(user)
    bos = info.get("bos_token_id")
    if info.get("add_bos_token") and bos is not None:
        bos_token = info["tokens"][bos]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos_token} $A", pair=f"{bos_token} $A {bos_token} $B", special_tokens=[(bos_token, bos)]
        )
    return tokenizer

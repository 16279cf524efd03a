"""tokenizer.json rebuilt as transformers' tokenizer class rebuilds it (transformers 5).

transformers does not run tokenizer.json as it is for a class with its own `__init__`: it takes the
vocabulary (and merges) from the file and builds the model, normalizer, pre-tokenizer and
post-processor again from tokenizer_config.json and the class's defaults
(`TokenizersBackend.convert_to_native_format`, then e.g. `BertTokenizer.__init__`). A tokenizer.json
whose normalizer disagrees with tokenizer_config.json (sentence-transformers saves a Lowercase
normalizer next to do_lower_case false) therefore tokenizes differently there. This module does
the same rebuild with `tokenizers` only, for the classes attnkit's encoder families use:

    BertTokenizer, DistilBertTokenizer, ElectraTokenizer   WordPiece, BertNormalizer, BertPreTokenizer
    RobertaTokenizer                                        byte-level BPE, no normalizer
    XLMRobertaTokenizer                                     Unigram, the file's Precompiled charsmap only
    LlamaTokenizer                                          BPE with byte fallback, Metaspace (`legacy`,
                                                            `add_prefix_space`), the file's post-processor
    PreTrainedTokenizerFast, TokenizersBackend             tokenizer.json as it is

Any other class is refused: its `__init__` would rebuild the file in ways not replicated here.
A rebuilt class starts without the file's added tokens; `added_tokens.add_tokens` then adds those
transformers adds (tokenizer_config.json's added_tokens_decoder, special tokens, extra special tokens).
"""

import json
import os

from attnkit.checkpoints.tokenizers import added_tokens

# AutoTokenizer's class for a model_type when no tokenizer_class is named (TOKENIZER_MAPPING_NAMES)
_CLASS_OF_MODEL_TYPE = {"bert": "BertTokenizer", "distilbert": "BertTokenizer", "electra": "BertTokenizer",
                        "roberta": "RobertaTokenizer", "xlm-roberta": "XLMRobertaTokenizer"}
_AS_IS = ("PreTrainedTokenizerFast", "TokenizersBackend", "PreTrainedTokenizer", "PythonBackend")


def resolve_class(tokenizer_config, config):
    """The class AutoTokenizer builds: tokenizer_config.json's tokenizer_class, else config.json's,
    else the model_type's; "Fast" dropped (BertTokenizerFast is BertTokenizer in transformers 5)."""
    name = tokenizer_config.get("tokenizer_class") or config.get("tokenizer_class")
    if name is None:
        return _CLASS_OF_MODEL_TYPE.get(config.get("model_type"))
    return name if name == "PreTrainedTokenizerFast" else name.removesuffix("Fast")


def rebuild(data, name, settings, files):
    """`data` (tokenizer.json as a dict) rebuilt as class `name` builds it from `settings`
    (tokenizer_config.json); returns a `tokenizers.Tokenizer`. `files`: (tokenizer.json,
    tokenizer_config.json) paths, for messages. None for `name`: no class known, the file as it is."""
    from tokenizers import Tokenizer

    if name == "LlamaTokenizer" and byte_level(data):
        name = None  # AutoTokenizer loads a byte-level file declared LlamaTokenizer (Llama 3's) as it is
    if name is None or name in _AS_IS:
        tokenizer, defaults = Tokenizer.from_str(json.dumps(data)), {}
    else:
        builder = _BUILDERS.get(name)
        if builder is None:
            raise ValueError(
                f"{files[1]}: tokenizer_class {name!r}: transformers rebuilds {os.path.basename(files[0])} with that "
                f"class's own settings, which attnkit does not replicate; it loads {', '.join(sorted(_BUILDERS))} "
                f"and {', '.join(_AS_IS[:2])} (tokenizer.json as it is)"
            )
        # the class builds from the vocabulary alone; the added tokens come next, as transformers adds them
        tokenizer = builder({**data, "added_tokens": []}, settings, files)
        defaults = default_tokens(name)
    settings = with_file_pad_token(data, settings, name)
    return added_tokens.add_tokens(
        tokenizer, settings, file_tokens=data.get("added_tokens") or [], defaults=defaults,
        path=os.path.dirname(files[1]), settings_file=files[1],
    )


def with_file_pad_token(data, settings, name):
    """`settings` with the pad token of tokenizer.json's padding where neither they nor class `name`'s
    `__init__` name one: TokenizersBackend.__init__ then takes it from there (and adds it as a special token)."""
    padding = data.get("padding")
    named = "pad_token" in settings or "pad_token" in default_tokens(name)
    if isinstance(padding, dict) and "pad_token" in padding and not named:
        return {**settings, "pad_token": padding["pad_token"]}
    return settings


def default_tokens(name):
    """{special token key: text} of class `name`'s `__init__` ({} for a file run as it is)."""
    builder = _BUILDERS.get(name)
    return _DEFAULT_TOKENS[builder] if builder is not None else {}


def _bert(data, settings, files):
    """BertTokenizer.__init__: WordPiece(vocab, unk_token) with its defaults, BertNormalizer from
    do_lower_case (default true), strip_accents, tokenize_chinese_chars (default true), [CLS] $A [SEP]."""
    from tokenizers import decoders, models, normalizers, pre_tokenizers, processors

    lowercase, strip_accents, chinese = bert_options(settings, files[1])
    unk, cls, sep = (_token(settings, key, default, files[1])
                     for key, default in (("unk_token", "[UNK]"), ("cls_token", "[CLS]"), ("sep_token", "[SEP]")))
    vocab = _vocab(data, "WordPiece", files[0])
    tokenizer = _with_model(data, models.WordPiece({}, unk_token=unk), vocab=vocab)
    tokenizer.normalizer = normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=chinese, strip_accents=strip_accents, lowercase=lowercase
    )
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece(prefix="##")
    cls_id, sep_id = (_token_id(tokenizer, token, key, files) for token, key in ((cls, "cls_token"), (sep, "sep_token")))
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{cls}:0 $A:0 {sep}:0", pair=f"{cls}:0 $A:0 {sep}:0 $B:1 {sep}:1",
        special_tokens=[(cls, cls_id), (sep, sep_id)],
    )
    return tokenizer


def _roberta(data, settings, files):
    """RobertaTokenizer.__init__: BPE(vocab, merges) with no unknown token, no normalizer,
    ByteLevel(add_prefix_space) (default false), RobertaProcessing(trim_offsets) (default true)."""
    from tokenizers import decoders, models, pre_tokenizers, processors

    add_prefix_space = _flag(settings, "add_prefix_space", False, files[1])
    trim_offsets = _flag(settings, "trim_offsets", True, files[1])
    cls, sep = (_token(settings, key, default, files[1]) for key, default in (("cls_token", "<s>"), ("sep_token", "</s>")))
    vocab = _vocab(data, "BPE", files[0])
    model = models.BPE({}, [], dropout=None, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False)
    tokenizer = _with_model(data, model, vocab=vocab, merges=data["model"].get("merges", []))
    tokenizer.normalizer = None
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.RobertaProcessing(
        (sep, _token_id(tokenizer, sep, "sep_token", files)), (cls, _token_id(tokenizer, cls, "cls_token", files)),
        trim_offsets, add_prefix_space,
    )
    return tokenizer


def _xlm_roberta(data, settings, files):
    """XLMRobertaTokenizer.__init__: Unigram(vocab, unk_id=3), the file's Precompiled normalizer alone
    (its other normalizers dropped), WhitespaceSplit + Metaspace(add_prefix_space, default true),
    <s> $A </s>."""
    from tokenizers import decoders, models, pre_tokenizers, processors

    add_prefix_space = _flag(settings, "add_prefix_space", True, files[1])
    bos, eos = (_token(settings, key, default, files[1]) for key, default in (("bos_token", "<s>"), ("eos_token", "</s>")))
    vocab = _vocab(data, "Unigram", files[0])
    data = {**data, "normalizer": _precompiled(data.get("normalizer"))}
    tokenizer = _with_model(data, models.Unigram([("<unk>", 0.0)], unk_id=0, byte_fallback=False), vocab=vocab, unk_id=3)
    scheme = "always" if add_prefix_space else "never"
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme)]
    )
    tokenizer.decoder = decoders.Metaspace(replacement="▁", prepend_scheme=scheme)
    bos_id, eos_id = (_token_id(tokenizer, token, key, files) for token, key in ((bos, "bos_token"), (eos, "eos_token")))
    tokenizer.post_processor = processors.TemplateProcessing(
        single=[bos, "$A", eos], pair=[bos, "$A", eos, eos, "$B", eos], special_tokens=[(bos, bos_id), (eos, eos_id)]
    )
    return tokenizer


def _llama(data, settings, files):
    """LlamaTokenizer.__init__ (docs/decisions.md item 95): BPE(vocab, merges) with byte fallback, fused
    unknowns and no unknown token; no normalizer; Metaspace(split=False) prepending "▁" to the first
    piece of the text (`legacy` false, the default, or null), to every piece between special tokens
    (`legacy` true) or never (`add_prefix_space` false; null is true); decoding "▁" as a space, byte
    tokens as bytes, and the first space dropped when one was prepended. The file's post-processor
    stays (`add_bos_token` / `add_eos_token` are dropped by transformers when there is a tokenizer.json);
    a file without one gets $A alone."""
    from tokenizers import decoders, models, pre_tokenizers, processors

    legacy = settings.get("legacy", False)
    if legacy is not None and not isinstance(legacy, bool):
        raise ValueError(f"{files[1]}: `legacy` must be null, true or false. Received: legacy={legacy!r}")
    add_prefix_space = settings.get("add_prefix_space")
    if add_prefix_space is not None and not isinstance(add_prefix_space, bool):
        raise ValueError(f"{files[1]}: `add_prefix_space` must be null, true or false. "
                         f"Received: add_prefix_space={add_prefix_space!r}")
    add_prefix_space = add_prefix_space is not False
    vocab = _vocab(data, "BPE", files[0])
    model = models.BPE({}, [], dropout=None, fuse_unk=True, byte_fallback=True)
    tokenizer = _with_model(data, model, vocab=vocab, merges=data["model"].get("merges", []))
    tokenizer.normalizer = None
    # transformers' _get_prepend_scheme: legacy null counts as false
    scheme = ("always" if legacy else "first") if add_prefix_space else "never"
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme, split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix_space:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tokenizer.decoder = decoders.Sequence(steps)
    if tokenizer.post_processor is None:  # TokenizersBackend.update_post_processor, neither bos nor eos added
        tokenizer.post_processor = processors.TemplateProcessing(single="$A:0", pair="$A:0 $B:1", special_tokens=[])
    return tokenizer


def byte_level(data):
    """Whether tokenizer.json names a ByteLevel step anywhere (transformers' test reads the file's text)."""
    return '"ByteLevel"' in json.dumps(data)


# the special tokens of each class's __init__, which transformers adds when not in the vocabulary's added tokens
_BERT_TOKENS = {"unk_token": "[UNK]", "sep_token": "[SEP]", "pad_token": "[PAD]", "cls_token": "[CLS]", "mask_token": "[MASK]"}
_ROBERTA_TOKENS = {"bos_token": "<s>", "eos_token": "</s>", "sep_token": "</s>", "cls_token": "<s>", "unk_token": "<unk>",
                   "pad_token": "<pad>", "mask_token": "<mask>"}
_LLAMA_TOKENS = {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>"}
_BUILDERS = {"BertTokenizer": _bert, "DistilBertTokenizer": _bert, "ElectraTokenizer": _bert,
             "RobertaTokenizer": _roberta, "XLMRobertaTokenizer": _xlm_roberta, "LlamaTokenizer": _llama}
_DEFAULT_TOKENS = {_bert: _BERT_TOKENS, _roberta: _ROBERTA_TOKENS, _xlm_roberta: _ROBERTA_TOKENS, _llama: _LLAMA_TOKENS}


def bert_options(settings, file):
    """(do_lower_case, strip_accents, tokenize_chinese_chars) with BertTokenizer's defaults; strip_accents
    None strips exactly when lowercasing, in BertNormalizer as in transformers."""
    lowercase = _flag(settings, "do_lower_case", True, file)
    chinese = _flag(settings, "tokenize_chinese_chars", True, file)
    strip_accents = settings.get("strip_accents")
    if strip_accents is not None and not isinstance(strip_accents, bool):
        raise ValueError(f"{file}: `strip_accents` must be null, true or false. Received: strip_accents={strip_accents!r}")
    return lowercase, strip_accents, chinese


def _flag(settings, key, default, file):
    value = settings.get(key, default)
    if not isinstance(value, bool):
        raise ValueError(f"{file}: `{key}` must be true or false. Received: {key}={value!r}")
    return value


def _token(settings, key, default, file):
    """A special token's text; older files store an AddedToken as {"content": ...}."""
    value = settings.get(key, default)
    if isinstance(value, dict):
        value = value.get("content")
    if not isinstance(value, str):
        raise ValueError(f"{file}: `{key}` must be a token string. Received: {key}={settings.get(key)!r}")
    return value


def _token_id(tokenizer, token, key, files):
    """The id of a special token, which must be in the vocabulary: transformers would append it as a new
    token, an id past the embedding table."""
    token_id = tokenizer.token_to_id(token)
    if token_id is None:
        raise ValueError(f"{files[1]}: `{key}` {token!r} is not in the vocabulary of {files[0]}")
    return token_id


def _vocab(data, kind, file):
    """The vocabulary of tokenizer.json's model, which must be the class's kind of model."""
    model = data.get("model") or {}
    # transformers' older files (DistilBERT's) omit the model type; the keys still tell WordPiece
    found = model.get("type") or ("WordPiece" if "max_input_chars_per_word" in model else None)
    if found != kind or "vocab" not in model:
        raise ValueError(f"{file}: `model.type` is {found!r}, but the tokenizer class builds a {kind} model from it")
    return model["vocab"]


def _with_model(data, model, **parts):
    """A Tokenizer of `data` whose model is `model` (the class's settings) with `parts` (vocab, merges,
    unk_id) from the file."""
    from tokenizers import Tokenizer

    built = json.loads(Tokenizer(model).to_str())["model"]
    return Tokenizer.from_str(json.dumps({**data, "model": {**built, **parts}}))


def _precompiled(normalizer):
    """The Precompiled normalizer of tokenizer.json's normalizer (alone or in a Sequence), or None: the
    charsmap `convert_to_native_format` hands to XLMRobertaTokenizer."""
    found = normalizer.get("normalizers", [normalizer]) if isinstance(normalizer, dict) else []
    return next((item for item in found if item.get("type") == "Precompiled" and "precompiled_charsmap" in item), None)

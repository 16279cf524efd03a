"""The added tokens transformers 5 gives a tokenizer it loads from a directory, applied to a
`tokenizers.Tokenizer` (docs/decisions.md item 92).

An added token is matched in the text before the model splits it (`[MASK]`, `<tool>`, a word added
with `add_tokens`), so which tokens are added, and with which flags, changes the ids. transformers
takes them from tokenizer_config.json, not from tokenizer.json:

- `added_tokens_decoder` ({id: {"content", "lstrip", "rstrip", "normalized", "single_word",
  "special"}}) when the file has one; otherwise, as older files were read, added_tokens.json
  ({token: id}) and tokenizer.json's own `added_tokens`
  (`PreTrainedTokenizerBase._from_pretrained`);
- then every special token not yet added: the named ones (`bos_token` ... `mask_token`, with the
  tokenizer class's defaults), any other `*_token` string, and `extra_special_tokens` (formerly
  `additional_special_tokens`), each as a special token that the normalizer does not see
  (`TokenizersBackend.__init__`).

A class that rebuilds tokenizer.json (`tokenizer_class`) starts from its vocabulary alone, so the
file's added tokens count only where tokenizer_config.json has no `added_tokens_decoder`; a
tokenizer.json run as it is keeps its own and gains those. Tokens are added in transformers' order
through the same `tokenizers` calls, which give a token outside the vocabulary the next free id
(whatever id the file wrote). `split_special_tokens: true` tokenizes the special tokens' text as
any other text.
"""

import os

from attnkit.checkpoints.formats.json import read_json

# PreTrainedTokenizerBase.SPECIAL_TOKENS_ATTRIBUTES, in its order
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_FLAGS = ("lstrip", "rstrip", "normalized", "single_word", "special")


def add_tokens(tokenizer, settings, *, file_tokens, defaults, path, settings_file):
    """Adds to `tokenizer` the tokens transformers adds on loading, in its order.

    Args:
        tokenizer: the `tokenizers.Tokenizer` as built from tokenizer.json (its own added tokens kept
            or not, as the class does).
        settings: tokenizer_config.json as a dict.
        file_tokens: tokenizer.json's `added_tokens` list ([] for vocab.txt).
        defaults: {special token key: text} of the tokenizer class's `__init__`.
        path: the directory (for added_tokens.json and special_tokens_map.json).
        settings_file: tokenizer_config.json's path, for messages.

    Raises:
        ValueError: a malformed added token or special token, named by file and field.
    """
    settings = dict(settings)
    if "added_tokens_decoder" in settings:
        decoder = _decoder(settings["added_tokens_decoder"], settings_file)
    else:
        settings.update(_special_tokens_map(path, settings))
        decoder = _legacy_decoder(path, settings, file_tokens, settings_file)
    present = tokenizer.get_added_tokens_decoder().values()
    to_add = [token for _, token in sorted(decoder.items()) if _key(token) not in {_key(t) for t in present}]
    by_text = {token.content: token for token in decoder.values()}
    named = {key: settings.get(key, defaults.get(key)) for key in SPECIAL_TOKEN_KEYS}
    named.update({key: value for key, value in settings.items()  # model-specific special tokens
                  if key.endswith("_token") and key not in SPECIAL_TOKEN_KEYS and isinstance(value, str)})
    extra = settings.get("extra_special_tokens") or settings.get("additional_special_tokens") or []
    if isinstance(extra, dict):
        named.update(extra)
        extra = []
    if not isinstance(extra, list):
        raise ValueError(f"{settings_file}: `extra_special_tokens` must be a list of tokens. Received: {extra!r}")
    special = [(key, value) for key, value in named.items() if value is not None]
    special += [(f"extra_special_tokens[{i}]", value) for i, value in enumerate(extra)]
    contents = {token.content for token in present} | {token.content for token in to_add}
    for key, value in special:
        token = by_text.get(_text(value, key, settings_file)) if key in named else None
        token = token or _token(value, key, settings_file, special=True)
        if token.content not in contents:
            contents.add(token.content)
            to_add.append(token)
    named_texts = {_text(value, key, settings_file) for key, value in named.items() if value is not None}
    to_add = [_special(token) if not token.special and token.content in named_texts else token for token in to_add]
    if to_add:
        tokenizer.add_tokens(to_add)
    split = settings.get("split_special_tokens", False)
    if not isinstance(split, bool):
        raise ValueError(f"{settings_file}: `split_special_tokens` must be true or false. Received: split_special_tokens={split!r}")
    tokenizer.encode_special_tokens = split
    return tokenizer


def special_token_texts(settings, *, defaults, path, settings_file):
    """{key: text} of the named special tokens set (`special_tokens_map`, which `apply_chat_template` gives
    the chat template): tokenizer_config.json's, special_tokens_map.json's where it has no
    added_tokens_decoder, else the class's defaults; a token set to null is left out, as transformers does."""
    if "added_tokens_decoder" not in settings:
        settings = {**settings, **_special_tokens_map(path, settings)}
    named = {key: settings.get(key, defaults.get(key)) for key in SPECIAL_TOKEN_KEYS}
    return {key: _text(value, key, settings_file) for key, value in named.items() if value is not None}


def _key(token):
    """What transformers compares to tell an added token already there (its repr: text and flags)."""
    return (token.content, *(getattr(token, flag) for flag in _FLAGS))


def _special(token):
    from tokenizers import AddedToken

    return AddedToken(token.content, **{**{flag: getattr(token, flag) for flag in _FLAGS}, "special": True})


def _text(value, key, file):
    """The text of a token given as a string, a serialized AddedToken or an AddedToken."""
    value = value.get("content") if isinstance(value, dict) else getattr(value, "content", value)
    if not isinstance(value, str):
        raise ValueError(f"{file}: `{key}` must be a token string. Received: {key}={value!r}")
    return value


def _token(value, key, file, *, special=None):
    """An AddedToken from a string (normalized exactly when not special, as transformers makes it),
    a serialized AddedToken (`special` where it gives none) or an AddedToken."""
    from tokenizers import AddedToken

    if isinstance(value, AddedToken):
        return value
    if isinstance(value, str):
        return AddedToken(value, special=bool(special), normalized=not special)
    if not isinstance(value, dict):
        raise ValueError(f"{file}: `{key}` must be a token string or an AddedToken object. Received: {key}={value!r}")
    fields = {name: item for name, item in value.items() if name != "__type"}
    unknown = sorted(set(fields) - {"content", *_FLAGS})
    if unknown or not isinstance(fields.get("content"), str):
        raise ValueError(f"{file}: `{key}` must be an AddedToken object (content, {', '.join(_FLAGS)}). Received: {key}={value!r}")
    for flag in _FLAGS:
        if not isinstance(fields.get(flag, False), bool):
            raise ValueError(f"{file}: `{key}.{flag}` must be true or false. Received: {flag}={fields[flag]!r}")
    if special is not None and "special" not in fields:
        fields["special"] = special
    return AddedToken(**fields)


def _decoder(decoder, file):
    """tokenizer_config.json's added_tokens_decoder as {id: AddedToken}."""
    if not isinstance(decoder, dict):
        raise ValueError(f"{file}: `added_tokens_decoder` must be an object of {{id: token}}. Received: {type(decoder).__name__}")
    tokens = {}
    for index, value in decoder.items():
        if not (isinstance(index, str) and index.isdigit()):
            raise ValueError(f"{file}: `added_tokens_decoder` keys must be token ids. Received: {index!r}")
        tokens[int(index)] = _token(value, f"added_tokens_decoder[{index}]", file)
    return tokens


def _special_tokens_map(path, settings):
    """special_tokens_map.json's special tokens, which older files kept apart (read only without
    added_tokens_decoder, as transformers reads it: an object is a special AddedToken, with its flags)."""
    file = os.path.join(path, "special_tokens_map.json")
    values = {}
    for key, value in (read_json(file, required=False) or {}).items():
        if key == "extra_special_tokens" and isinstance(value, list):
            existing = list(settings.get("extra_special_tokens") or [])
            added = [_token({**item, "special": True}, key, file) if isinstance(item, dict) else item for item in value]
            values[key] = existing + [item for item in added if item not in existing]
        elif isinstance(value, dict):
            values[key] = _token({**value, "special": True}, key, file)
        else:
            values[key] = value
    return values


def _legacy_decoder(path, settings, file_tokens, settings_file):
    """The added tokens of a directory without added_tokens_decoder: added_tokens.json's, then
    tokenizer.json's (the later of two at one id wins)."""
    tokens = {}
    file = os.path.join(path, "added_tokens.json")
    found = read_json(file, required=False)
    if found is not None:
        special = {_text(settings[key], key, settings_file) for key in SPECIAL_TOKEN_KEYS if settings.get(key) is not None}
        special |= {_text(t, "extra_special_tokens", settings_file) for t in settings.get("extra_special_tokens") or []}
        for text, index in found.items():
            if isinstance(index, bool) or not isinstance(index, int):
                raise ValueError(f"{file}: each token's id must be an integer. Received: {text!r}: {index!r}")
            tokens[index] = _token(text, text, file, special=text in special)
    for item in file_tokens:
        tokens[item["id"]] = _token({k: v for k, v in item.items() if k != "id"}, "added_tokens", settings_file)
    return tokens


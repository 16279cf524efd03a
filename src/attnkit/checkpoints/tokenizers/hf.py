"""The model directory and its tokenizer, read with `tokenizers` only.

The config and weights are read by `attnkit.checkpoints.families`, the sentence-transformers modules by
`attnkit.pipelines.sentence_pipeline`. Every problem is a `FileNotFoundError` or `ValueError` that names
the file and what is wrong with it.
"""

import json
import os

from attnkit.checkpoints.formats.json import read_json as _read_json, REQUIRED as _REQUIRED
from attnkit.checkpoints.tokenizers import tokenizer_class

CONFIG_FILE = "config.json"


def check_directory(path):
    """Returns `path` as a string, or raises if it is not an existing directory."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        what = "is not a directory" if os.path.exists(path) else "does not exist"
        raise FileNotFoundError(f"Model directory {path} {what}; {_REQUIRED}")
    return path


def read_tokenizer(path, *, vocab_size=None, lowercase=False):
    """A `tokenizers.Tokenizer` from tokenizer.json, else a WordPiece tokenizer from vocab.txt.

    Both are rebuilt as the tokenizer class AutoTokenizer picks rebuilds them from
    tokenizer_config.json and its defaults, whatever tokenizer.json's own pipeline says
    (`tokenizer_class`; vocab.txt: BertTokenizer). BertTokenizer: `do_lower_case` (default true),
    `strip_accents` (null: strip when lowercasing; true: strip; false: keep),
    `tokenize_chinese_chars` (default true: a CJK character is a word of its own), and the
    [CLS] / [SEP] tokens; RobertaTokenizer and XLMRobertaTokenizer: `add_prefix_space`. A class whose
    rebuild attnkit does not replicate is refused. Added and special tokens are those transformers adds
    from tokenizer_config.json (`added_tokens`: added_tokens_decoder, the special tokens,
    extra_special_tokens, split_special_tokens).

    Padding and truncation stored in the file are switched off: the caller pads each batch to its
    longest sequence and truncates at the model's maximum length.

    Args:
        path: the model directory.
        vocab_size: config.json's vocab_size; when given, a tokenizer that can produce an id >= it is
            refused (the id would index past the embedding table).
        lowercase: lowercase the text first, as sentence_bert_config.json's do_lower_case asks
            (sentence-transformers prepends a Lowercase normalizer unless there is one).

    Raises:
        FileNotFoundError: neither tokenizer.json nor vocab.txt.
        ValueError: an unreadable tokenizer, invalid tokenizer_config.json settings, a tokenizer class
            not replicated, or more tokens than `vocab_size`.
    """
    tokenizer_file, vocab_file = os.path.join(path, "tokenizer.json"), os.path.join(path, "vocab.txt")
    if not os.path.isfile(tokenizer_file) and not os.path.isfile(vocab_file):
        raise FileNotFoundError(f"{path}: neither tokenizer.json nor vocab.txt found; {_REQUIRED}")
    file = tokenizer_file if os.path.isfile(tokenizer_file) else vocab_file
    tokenizer = _rebuilt(path, file)
    if vocab_size is not None:
        ids = tokenizer.get_vocab(with_added_tokens=True).values()
        largest = max(ids, default=-1)
        if largest >= vocab_size:
            raise ValueError(
                f"{file}: the tokenizer has ids up to {largest} ({len(ids)} tokens), but "
                f"{os.path.join(path, CONFIG_FILE)} has vocab_size={vocab_size}: the tokenizer does not "
                "belong to these weights"
            )
    if lowercase:
        from tokenizers import normalizers

        current = tokenizer.normalizer
        if current is None or "Lowercase" not in repr(current) and "lowercase=True" not in repr(current):
            tokenizer.normalizer = normalizers.Sequence([normalizers.Lowercase()] + ([current] if current else []))
    tokenizer.no_padding()
    tokenizer.no_truncation()
    return tokenizer


def truncation_side(path):
    """tokenizer_config.json's truncation_side: "right" (default) or "left"."""
    file = os.path.join(path, "tokenizer_config.json")
    side = (_read_json(file, required=False) or {}).get("truncation_side", "right")
    if side not in ("right", "left"):
        raise ValueError(f"{file}: `truncation_side` must be 'right' or 'left'. Received: truncation_side={side!r}")
    return side


def read_tokenizer_config(path):
    """tokenizer_config.json as a dict ({} when absent)."""
    return _read_json(os.path.join(path, "tokenizer_config.json"), required=False) or {}


def _rebuilt(path, file):
    """tokenizer.json (or vocab.txt's WordPiece tokenizer) as transformers' tokenizer class rebuilds it
    from tokenizer_config.json (see `tokenizer_class`)."""
    from tokenizers.implementations import BertWordPieceTokenizer


    settings_file = os.path.join(path, "tokenizer_config.json")
    settings = _read_json(settings_file, required=False) or {}
    try:
        if file.endswith(".json"):
            with open(file, encoding="utf-8") as f:
                data = json.load(f)
            name = tokenizer_class.resolve_class(settings, _read_json(os.path.join(path, CONFIG_FILE), required=False) or {})
        else:  # vocab.txt: a WordPiece vocabulary, which transformers reads with BertTokenizer
            data, name = json.loads(BertWordPieceTokenizer(file).to_str()), "BertTokenizer"
            data["added_tokens"] = []  # BertWordPieceTokenizer's own; transformers adds the tokenizer_config.json's
        return tokenizer_class.rebuild(data, name, settings, (file, settings_file))
    except ValueError as e:
        if str(e).startswith(path):
            raise  # ours: it names the file and field
        raise ValueError(f"{file}: cannot read the tokenizer ({e})") from None
    except Exception as e:  # tokenizers raises a bare Exception on a malformed file
        raise ValueError(f"{file}: cannot read the tokenizer ({e})") from None

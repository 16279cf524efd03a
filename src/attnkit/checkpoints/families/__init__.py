"""Hugging Face encoder checkpoints as `BertEncoder`s: one mapping table per family (docs/decisions.md
item 27), the weight files (item 28), strict matching of config against weights (item 28).

    family, arguments, config = read_config(path)   # which family, BertEncoder(**arguments)
"""

import os

from attnkit.checkpoints.families import bert, distilbert, electra, roberta
from attnkit.checkpoints.families.defaults import with_defaults
from attnkit.checkpoints.formats.json import read_json

FAMILIES = (bert.FAMILY, distilbert.FAMILY, roberta.FAMILY, electra.FAMILY)
CONFIG_FILE = "config.json"
# Architecture class name prefixes, for configs that name a class but no model_type (longest first).
_ARCHITECTURES = (("XLMRoberta", "xlm-roberta"), ("DistilBert", "distilbert"), ("Roberta", "roberta"),
                  ("Electra", "electra"), ("Bert", "bert"))
# Google's original BERT config (bert_config.json renamed): these keys and no model_type.
_BERT_KEYS = {"vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"}


def family_named(model_type):
    """The `Family` whose model_types hold `model_type`, or None."""
    return next((f for f in FAMILIES if model_type in f.model_types), None)


def supported_model_types():
    return tuple(t for f in FAMILIES for t in f.model_types)


def model_type_of(file, config):
    """config.json's model_type; without one, from `architectures`, else BERT for Google's original
    configs (BERT's size keys), as transformers would need to be told."""
    model_type = config.get("model_type")
    if model_type is not None:
        return model_type
    architectures = config.get("architectures") or []
    for architecture in architectures if isinstance(architectures, list) else []:
        for prefix, name in _ARCHITECTURES:
            if isinstance(architecture, str) and architecture.startswith(prefix):
                return name
    if _BERT_KEYS <= set(config) and not architectures:
        return "bert"
    raise ValueError(
        f"{file}: no `model_type`, and neither `architectures` nor the keys name a family attnkit loads "
        f"({', '.join(supported_model_types())}). Received: architectures={config.get('architectures')!r}"
    )


def read_config(path, overrides=()):
    """config.json's family and the `BertEncoder` arguments it implies.

    Args:
        path: the encoder's directory.
        overrides: (field, value) pairs set over config.json's (sentence_bert_config.json's
            config_kwargs, as sentence-transformers passes them to transformers' AutoConfig).

    Returns:
        (family, arguments, config): the `Family`, BertEncoder keyword arguments, config.json's dict.

    Raises:
        FileNotFoundError: no config.json.
        ValueError: not JSON, a family attnkit lacks (named), a field it cannot compute (named), an
            invalid size. An absent field takes transformers' default (`defaults.CONFIG_DEFAULTS`).
    """
    file = os.path.join(path, CONFIG_FILE)
    config = read_json(file)
    if overrides:
        if not isinstance(config, dict):
            raise ValueError(f"{file} must hold a JSON object. Received: {type(config).__name__}")
        config = {**config, **dict(overrides)}
        file = f"{file} (with sentence_bert_config.json's config_kwargs {dict(overrides)})"
    model_type = model_type_of(file, config)
    family = family_named(model_type)
    if family is None:
        raise ValueError(
            f"{file}: model_type {model_type!r} is not supported; attnkit loads the encoder families "
            f"{', '.join(repr(t) for t in supported_model_types())}"
        )
    # Absent fields take transformers' defaults for the model_type (docs/decisions.md item 94).
    return family, family.arguments(file, with_defaults(model_type, config)), config

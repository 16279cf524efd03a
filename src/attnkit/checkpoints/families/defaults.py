"""What a config.json field that is absent means: the default of transformers' config class for the
model_type, as its source states it (transformers 5.24: BertConfig, RobertaConfig, XLMRobertaConfig,
ElectraConfig, DistilBertConfig), for every field attnkit reads (docs/decisions.md item 94).

transformers fills an absent field with that default and builds the model from it; attnkit does the
same here, without importing transformers. A default size the weights disagree with is then refused
by the strict matching (item 28), where transformers would initialise the missing tensors randomly.
Fields absent from a table (position_embedding_type, is_decoder, ...) are read with their neutral
value where they are read.
"""

_BERT = dict(
    vocab_size=30522, hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
    hidden_act="gelu", hidden_dropout_prob=0.1, max_position_embeddings=512, type_vocab_size=2,
    layer_norm_eps=1e-12, pad_token_id=0,
)

CONFIG_DEFAULTS = {
    "bert": _BERT,
    "roberta": {**_BERT, "vocab_size": 50265, "pad_token_id": 1},
    "xlm-roberta": {**_BERT, "pad_token_id": 1},  # XLMRobertaConfig's vocab_size is BERT's 30522
    "electra": {**_BERT, "embedding_size": 128, "hidden_size": 256, "num_attention_heads": 4, "intermediate_size": 1024},
    "distilbert": dict(
        vocab_size=30522, max_position_embeddings=512, n_layers=6, n_heads=12, dim=768, hidden_dim=3072,
        dropout=0.1, activation="gelu", pad_token_id=0,
    ),
}

# DistilBertConfig's attribute_map: the standard names set its own fields, and win over them when
# both are present (they are set last).
ALIASES = {"distilbert": {"hidden_size": "dim", "num_attention_heads": "n_heads", "num_hidden_layers": "n_layers"}}


def with_defaults(model_type, config):
    """config.json's fields as transformers' config class for `model_type` holds them: aliases
    renamed, absent fields at their defaults. An explicit null stays null (and is refused where a
    size is read, as transformers' strict config refuses it)."""
    config = dict(config)
    for alias, name in ALIASES.get(model_type, {}).items():
        if alias in config:
            config[name] = config.pop(alias)
    return {**CONFIG_DEFAULTS[model_type], **config}

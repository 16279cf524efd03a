"""`Family`: what attnkit knows of one encoder family's checkpoints (docs/decisions.md item 27).

A family is a mapping table, not an encoder: its config fields become `BertEncoder` arguments and
its tensor names become that encoder's variables.
"""

from typing import Callable, NamedTuple


class Family(NamedTuple):
    """One encoder family.

    Attributes:
        name: the family's name in messages and docs ("BERT", ...).
        model_types: config.json `model_type` values of the family.
        prefix: the base model's prefix in task checkpoints ("bert." in BertForMaskedLM).
        architecture: the base model class written on export ("BertModel").
        arguments: (file, config) -> BertEncoder keyword arguments; refuses what it cannot compute.
        weight_table: built BertEncoder -> {tensor name: (variable, transposed)}.
        carried: d_model -> {tensor name: shape}: base-model tensors attnkit reads but does not run
            (the pooler); kept on the encoder and written back on export.
        heads: name prefixes of task heads (masked-LM, classifier ...): recognised and not run.
        ignored: exact names of stored buffers that are not weights (position_ids).
    """

    name: str
    model_types: tuple
    prefix: str
    architecture: str
    arguments: Callable
    weight_table: Callable
    carried: Callable
    heads: tuple
    ignored: tuple = ("embeddings.position_ids", "embeddings.token_type_ids")

"""BERT (model_type "bert", and Google's original configs without one): the mapping table."""

from attnkit.checkpoints.families import _bert_layout
from attnkit.checkpoints.families.family import Family


def arguments(file, config):
    return _bert_layout.encoder_arguments(file, config)


FAMILY = Family(
    name="BERT",
    model_types=("bert",),
    prefix="bert.",
    architecture="BertModel",
    arguments=arguments,
    weight_table=_bert_layout.weight_table,
    carried=_bert_layout.pooler_shapes,
    heads=("cls.", "classifier.", "qa_outputs."),
)

"""ELECTRA (the discriminator, or ElectraModel): BERT's tensor names with embeddings of width
`embedding_size`, projected to `hidden_size` by `embeddings_project` when the two differ. No pooler."""

from attnkit.checkpoints.families import _bert_layout
from attnkit.checkpoints.formats import fields as _fields
from attnkit.checkpoints.families.family import Family


def arguments(file, config):
    embedding_size = _fields.positive_int(file, config, "embedding_size")
    return _bert_layout.encoder_arguments(file, config, embedding_size=embedding_size)


FAMILY = Family(
    name="ELECTRA",
    model_types=("electra",),
    prefix="electra.",
    architecture="ElectraModel",
    arguments=arguments,
    weight_table=_bert_layout.weight_table,
    carried=lambda d_model: {},
    heads=("discriminator_predictions.", "generator_predictions.", "generator_lm_head.", "classifier.",
           "qa_outputs."),
)

"""RoBERTa and XLM-R: BERT's tensor names, positions counted past the padding id.

transformers' RobertaEmbeddings gives real tokens positions padding_idx + 1, padding_idx + 2, ... and
padding tokens padding_idx: `BertEncoder(positions="after_padding")`. Its token-type table has one row.
"""

from attnkit.models.checkpoints import _bert_layout
from attnkit.models.checkpoints.family import Family


def arguments(file, config):
    return dict(_bert_layout.encoder_arguments(file, config, pad_default=1), positions="after_padding")


FAMILY = Family(
    name="RoBERTa / XLM-R",
    model_types=("roberta", "xlm-roberta"),
    prefix="roberta.",
    architecture="RobertaModel",
    arguments=arguments,
    weight_table=_bert_layout.weight_table,
    carried=_bert_layout.pooler_shapes,
    heads=("lm_head.", "classifier.", "qa_outputs."),
)

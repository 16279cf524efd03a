"""RoBERTa and XLM-R: BERT's tensor names, positions counted past the padding id.

transformers' RobertaEmbeddings gives real tokens positions padding_idx + 1, padding_idx + 2, ... and
padding tokens padding_idx: `BertEncoder(positions="after_padding")`. Its token-type table has one row.
"""

from attnkit.checkpoints.families import _bert_layout
from attnkit.checkpoints.families.family import Family


def arguments(file, config):
    arguments = _bert_layout.encoder_arguments(file, config)
    pad = config["pad_token_id"]
    if pad == -1:
        # No token id equals -1, so every token counts, from position -1 + 1 = 0: BERT's absolute
        # positions (docs/decisions.md item 94).
        return arguments
    positions = arguments["sequence_length"]
    if pad is not None and not 0 <= pad < positions - 1:
        # transformers would look up position pad + 1 < 0, or past the last one.
        raise ValueError(
            f"{file}: RoBERTa counts positions from pad_token_id + 1, so `pad_token_id` must be null, -1 or in "
            f"[0, max_position_embeddings - 1) = [0, {positions - 1}). Received: pad_token_id={pad}, "
            f"max_position_embeddings={positions}"
        )
    return dict(arguments, positions="after_padding")


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

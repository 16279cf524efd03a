"""DistilBERT: its own tensor and config names, no token types, layer norms with epsilon 1e-12
(fixed in transformers' code, not read from the config).

Sinusoidal positions (`sinusoidal_pos_embds`) are stored in position_embeddings like learned ones,
so they load the same way.
"""

from attnkit.checkpoints.families import _bert_layout
from attnkit.checkpoints.formats import fields as _fields
from attnkit.checkpoints.families.family import Family


def arguments(file, config):
    vocab_size = _fields.positive_int(file, config, "vocab_size")
    d_model = _fields.positive_int(file, config, "dim")
    h = _fields.positive_int(file, config, "n_heads")
    d_k = _fields.heads_divide(file, d_model, h, "dim", "n_heads")
    return dict(
        vocab_size=vocab_size,
        sequence_length=_fields.positive_int(file, config, "max_position_embeddings"),
        h=h, d_k=d_k, d_v=d_k, d_model=d_model,
        d_ff=_fields.positive_int(file, config, "hidden_dim"),
        n=_fields.positive_int(file, config, "n_layers"),
        rate=_fields.dropout(file, config, "dropout"),
        type_vocab_size=0,
        epsilon=1e-12,
        activation=_fields.activation(file, config, "activation"),
        pad_id=_fields.pad_id(file, config, vocab_size),
    )


def weight_table(model):
    embedding = model.token_position_embedding
    table = {
        "embeddings.word_embeddings.weight": (embedding.token_embedding.embeddings, False),
        "embeddings.position_embeddings.weight": (embedding.position_embedding.embeddings, False),
        "embeddings.LayerNorm.weight": (model.embedding_norm.gamma, False),
        "embeddings.LayerNorm.bias": (model.embedding_norm.beta, False),
    }
    for i, layer in enumerate(model.encoder_layers):
        attention, feed_forward = layer.multihead_attention, layer.feed_forward
        dense_layers = {
            "attention.q_lin": attention.W_q,
            "attention.k_lin": attention.W_k,
            "attention.v_lin": attention.W_v,
            "attention.out_lin": attention.W_o,
            "ffn.lin1": feed_forward.fully_connected1,
            "ffn.lin2": feed_forward.fully_connected2,
        }
        norms = {"sa_layer_norm": layer.norms[0], "output_layer_norm": layer.norms[1]}
        table.update(_bert_layout.layer_entries(f"transformer.layer.{i}.", dense_layers, norms))
    return table


FAMILY = Family(
    name="DistilBERT",
    model_types=("distilbert",),
    prefix="distilbert.",
    architecture="DistilBertModel",
    arguments=arguments,
    weight_table=weight_table,
    carried=lambda d_model: {},
    heads=("vocab_transform.", "vocab_layer_norm.", "vocab_projector.", "pre_classifier.", "classifier.",
           "qa_outputs."),
    ignored=("embeddings.position_ids",),
)

"""The mapping table shared by BERT, RoBERTa, XLM-R and ELECTRA: their `BertModel`-style tensor names
onto a `BertEncoder`'s variables, and their config.json fields onto its arguments.

A table entry is name -> (variable, transposed): torch's Linear stores (out, in), Keras's Dense kernel
(in, out), hence the transposes.
"""

from attnkit.checkpoints.formats import fields as _fields


def encoder_arguments(file, config, *, embedding_size=None):
    """A BertEncoder's keyword arguments from a BertConfig-style config.json (model_type bert,
    roberta, xlm-roberta, electra) with its defaults filled in; the fields attnkit does not compute
    are refused by name."""
    position_type = config.get("position_embedding_type", "absolute")
    if position_type != "absolute":
        raise ValueError(
            f"{file}: position_embedding_type {position_type!r} is not supported; attnkit's encoders "
            "use absolute learned positions ('absolute')"
        )
    _fields.refuse_true(file, config, "is_decoder", "a causal self-attention")
    _fields.refuse_true(file, config, "add_cross_attention", "cross-attention layers")
    vocab_size = _fields.positive_int(file, config, "vocab_size")
    d_model = _fields.positive_int(file, config, "hidden_size")
    h = _fields.positive_int(file, config, "num_attention_heads")
    d_k = _fields.heads_divide(file, d_model, h, "hidden_size", "num_attention_heads")
    type_vocab_size = _fields.positive_int(file, config, "type_vocab_size")
    return dict(
        vocab_size=vocab_size,
        sequence_length=_fields.positive_int(file, config, "max_position_embeddings"),
        h=h, d_k=d_k, d_v=d_k, d_model=d_model,
        d_ff=_fields.positive_int(file, config, "intermediate_size"),
        n=_fields.positive_int(file, config, "num_hidden_layers"),
        rate=_fields.dropout(file, config, "hidden_dropout_prob"),
        type_vocab_size=type_vocab_size,
        epsilon=_fields.epsilon(file, config, "layer_norm_eps"),
        activation=_fields.activation(file, config, "hidden_act"),
        pad_id=_fields.pad_id(file, config, vocab_size),
        embedding_size=embedding_size,
    )


def weight_table(model):
    """{BertModel tensor name: (variable, transposed)} for a built `BertEncoder`."""
    embedding = model.token_position_embedding
    table = {
        "embeddings.word_embeddings.weight": (embedding.token_embedding.embeddings, False),
        "embeddings.position_embeddings.weight": (embedding.position_embedding.embeddings, False),
        "embeddings.LayerNorm.weight": (model.embedding_norm.gamma, False),
        "embeddings.LayerNorm.bias": (model.embedding_norm.beta, False),
    }
    if model.token_type_embedding is not None:
        table["embeddings.token_type_embeddings.weight"] = (model.token_type_embedding.embeddings, False)
    if model.embedding_projection is not None:  # ELECTRA's name, outside "embeddings."
        table["embeddings_project.weight"] = (model.embedding_projection.kernel, True)
        table["embeddings_project.bias"] = (model.embedding_projection.bias, False)
    for i, layer in enumerate(model.encoder_layers):
        attention, feed_forward = layer.multihead_attention, layer.feed_forward
        dense_layers = {
            "attention.self.query": attention.W_q,
            "attention.self.key": attention.W_k,
            "attention.self.value": attention.W_v,
            "attention.output.dense": attention.W_o,
            "intermediate.dense": feed_forward.fully_connected1,
            "output.dense": feed_forward.fully_connected2,
        }
        norms = {"attention.output.LayerNorm": layer.norms[0], "output.LayerNorm": layer.norms[1]}
        table.update(layer_entries(f"encoder.layer.{i}.", dense_layers, norms))
    return table


def layer_entries(prefix, dense_layers, norms):
    """Table entries of one layer: {prefix + name + ".weight"/".bias": (variable, transposed)}."""
    entries = {}
    for name, dense in dense_layers.items():
        entries[prefix + name + ".weight"] = (dense.kernel, True)
        entries[prefix + name + ".bias"] = (dense.bias, False)
    for name, norm in norms.items():
        entries[prefix + name + ".weight"] = (norm.gamma, False)
        entries[prefix + name + ".bias"] = (norm.beta, False)
    return entries


def pooler_shapes(d_model):
    """BertModel's pooler (tanh(W h_[CLS] + b)): read, not run, written back on export."""
    return {"pooler.dense.weight": (d_model, d_model), "pooler.dense.bias": (d_model,)}

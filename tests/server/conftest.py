"""A tiny random llama (with a chat template) and a tiny BERT, served in-process on port 0."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from serve_helpers import write_tiny_llama, write_tiny_model  # noqa: E402

TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"


@pytest.fixture(scope="session")
def tiny_llama_path(tmp_path_factory):
    pytest.importorskip("transformers", reason="the tiny language model is written with transformers")
    path = tmp_path_factory.mktemp("tiny_llama_chat")
    write_tiny_llama(path)
    (path / "chat_template.jinja").write_text(TEMPLATE)
    return str(path)


@pytest.fixture(scope="session")
def tiny_bert_path(tmp_path_factory):
    return write_tiny_model(str(tmp_path_factory.mktemp("tiny_bert_embed")))


@pytest.fixture(scope="module")
def lm(tiny_llama_path):
    from attnkit.pipelines.causal_checkpoint import load_causal_lm

    return load_causal_lm(tiny_llama_path)


@pytest.fixture(scope="module")
def encoder(tiny_bert_path):
    from attnkit.pipelines.encoder import load_pretrained

    return load_pretrained(tiny_bert_path)

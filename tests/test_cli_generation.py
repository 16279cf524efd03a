"""`attnkit generate` and `attnkit chat` on a tiny random llama directory with a byte-level tokenizer."""

import io
import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from attnkit.cli import main  # noqa: E402
from attnkit.models.gguf_checkpoint import bytes_to_unicode  # noqa: E402

TEMPLATE = "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}<s>assistant: {% endif %}"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    path = tmp_path_factory.mktemp("tiny_llama")
    vocab = {c: i for i, c in enumerate(bytes_to_unicode().values())}
    vocab["<s>"] = 256
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<s>"])
    tokenizer.save(str(path / "tokenizer.json"))
    json.dump({"chat_template": TEMPLATE, "eos_token": "<s>"}, open(path / "tokenizer_config.json", "w"))
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=257, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, eos_token_id=256)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return str(path)


def test_generate_streams_text(model_dir, capsys):
    assert main(["generate", "hello", "--model", model_dir, "--max-new-tokens", "5", "--temperature", "0.8", "--seed", "1"]) == 0
    first = capsys.readouterr().out
    assert main(["generate", "hello", "--model", model_dir, "--max-new-tokens", "5", "--temperature", "0.8", "--seed", "1"]) == 0
    assert capsys.readouterr().out == first and first.endswith("\n")


def test_chat_reads_piped_stdin(model_dir, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("hi there\n\nand again\n"))
    assert main(["chat", "--model", model_dir, "--max-new-tokens", "3", "--top-k", "5"]) == 0
    assert len(capsys.readouterr().out.splitlines()) >= 2  # two replies (a reply may itself hold a newline)


def test_bad_options_are_one_line(model_dir, capsys):
    assert main(["generate", "x", "--top-p", "1.5"]) == 2
    assert main(["generate", "x", "--model", "/no/such/model"]) == 1
    err = capsys.readouterr().err
    assert "No such model" in err and "Traceback" not in err

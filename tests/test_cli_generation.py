"""`attnkit generate` and `attnkit chat` on a tiny random llama directory with a byte-level tokenizer."""

import io
import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from attnkit.cli import main  # noqa: E402
from attnkit.checkpoints.formats.gguf import bytes_to_unicode  # noqa: E402

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


def test_dtype_option_loads_the_weights_quantized(model_dir, capsys, monkeypatch):
    from attnkit.cli import generation

    loaded = []
    load = generation.load_causal_lm
    monkeypatch.setattr(generation, "load_causal_lm", lambda *a, **k: loaded.append(load(*a, **k)) or loaded[-1])
    greedy = ["generate", "hello", "--model", model_dir, "--max-new-tokens", "4"]
    assert main(greedy + ["--dtype", "int8"]) == 0
    assert loaded[-1].model.decoder_layers[0].attention.W_q.quantization_mode == "int8"
    assert main(greedy + ["--dtype", "gguf"]) == 1  # a directory: one line, naming the option's value
    assert main(greedy + ["--dtype", "int2"]) == 2
    err = capsys.readouterr().err
    assert "attnkit: error: `dtype='gguf'` keeps a GGUF file's quantized blocks" in err and "invalid choice: 'int2'" in err
    assert "Traceback" not in err
    # --activations q8 (item 144): refused in one line for a float model, and for blocks whose inputs
    # are not whole blocks of 32 (this model's d_ff is 48); tests/models/test_gguf_packed.py loads it
    assert main(greedy + ["--activations", "q8"]) == 1
    assert main(greedy + ["--dtype", "int8", "--activations", "q8"]) == 1
    err = capsys.readouterr().err
    assert "attnkit: error: `activations='q8'` rounds the inputs of packed products" in err and "Traceback" not in err
    assert "q8 activations need 4-bit groups of 32 or 8-bit groups of 16 or of a multiple of 32" in err and "`W_down`" in err


def test_bad_options_are_one_line(model_dir, capsys):
    assert main(["generate", "x", "--top-p", "1.5"]) == 2
    assert main(["generate", "x", "--model", "/no/such/model"]) == 1
    err = capsys.readouterr().err
    assert "No such model" in err and "Traceback" not in err


def test_heads_draws_the_language_models_causal_attention(model_dir, tmp_path, capsys):
    from attnkit.pipelines.causal_checkpoint import load_causal_lm

    lm = load_causal_lm(model_dir)
    weights, tokens = lm.attentions("hello world", 0)  # (h, T, T)
    ids = lm.encode("hello world")
    reference = transformers.LlamaForCausalLM.from_pretrained(model_dir, attn_implementation="eager")
    with torch.no_grad():
        expected = reference(torch.tensor([ids]), output_attentions=True).attentions[0][0].numpy()  # (h, T, T)
    assert weights.shape == expected.shape == (4, len(ids), len(ids))
    assert abs(weights - expected).max() < 1e-5
    assert abs(weights[:, *np.triu_indices(len(ids), 1)]).max() == 0  # no weight on later tokens

    output = tmp_path / "lm.png"
    assert main(["heads", "hello world", "--lm", "--model", model_dir, "--layer", "-1", "--output", str(output)]) == 0
    assert output.stat().st_size > 0
    assert f"wrote 4 heads of layer 0 over {len(tokens)} tokens to {output}" in capsys.readouterr().err
    assert main(["heads", "hello", "--lm", "--model", model_dir, "--layer", "1", "--output", str(tmp_path / "b.png")]) == 2
    assert "--layer must be in [-1, 0]" in capsys.readouterr().err


def _copy_without(model_dir, tmp_path, *files, template=True):
    """A copy of the tiny model without `files`, and without its chat template unless `template`."""
    import shutil

    path = tmp_path / "model"
    shutil.copytree(model_dir, path)
    for name in files:
        (path / name).unlink()
    if not template:
        json.dump({"eos_token": "<s>"}, open(path / "tokenizer_config.json", "w"))
    return str(path)


def _one_line_error(capsys):
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("attnkit: error: ") and "Traceback" not in err
    return err


def test_chat_template_option_without_a_template_says_to_drop_it(model_dir, tmp_path, capsys):
    path = _copy_without(model_dir, tmp_path, template=False)
    assert main(["generate", "hello", "--model", path, "--chat-template"]) == 1
    err = _one_line_error(capsys)
    assert f"The model directory {path} has no chat template (none in chat_template.jinja or tokenizer_config.json's chat_template)" in err
    assert "drop --chat-template" in err and "instead of `chat`" not in err


def test_chat_without_a_template_fails_before_reading_input(model_dir, tmp_path, capsys, monkeypatch):
    path = _copy_without(model_dir, tmp_path, template=False)
    stdin = io.StringIO("hi there\n")
    monkeypatch.setattr("sys.stdin", stdin)
    assert main(["chat", "--model", path]) == 1
    assert stdin.tell() == 0  # nothing read: an interactive user typed nothing in vain
    assert "has no chat template" in _one_line_error(capsys)


@pytest.mark.parametrize("command", [["generate", "hello"], ["chat"], ["heads", "hello", "--lm"]])
def test_a_model_without_a_tokenizer_names_the_file_looked_for(model_dir, tmp_path, capsys, monkeypatch, command):
    path = _copy_without(model_dir, tmp_path, "tokenizer.json")
    stdin = io.StringIO("hi there\n")
    monkeypatch.setattr("sys.stdin", stdin)
    options = ["--output", str(tmp_path / "heads.png")] if command[0] == "heads" else []
    assert main([*command, "--model", path, *options]) == 1
    err = _one_line_error(capsys)
    assert f"The model directory {path} has no tokenizer: attnkit reads tokenizer.json, which is not there" in err
    assert "token ids" not in err and stdin.tell() == 0


def test_a_rope_refusal_names_the_config_json_field(model_dir, tmp_path, capsys):
    path = _copy_without(model_dir, tmp_path)
    config = json.load(open(f"{path}/config.json"))
    config.pop("rope_scaling", None)
    config["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}
    json.dump(config, open(f"{path}/config.json", "w"))
    assert main(["generate", "hello", "--model", path]) == 1
    err = _one_line_error(capsys)
    assert f"{path}/config.json: RoPE scaling 'yarn' is not implemented" in err and "Received: rope_parameters={" in err


def test_named_chat_templates_give_the_default_one_as_transformers_does(model_dir, tmp_path):
    """tokenizer_config.json may hold [{"name", "template"}, ...]: transformers applies "default" to a
    chat without tools; attnkit refused the list as not a str."""
    import shutil

    from attnkit.pipelines.causal_checkpoint import load_causal_lm

    path = tmp_path / "named"
    shutil.copytree(model_dir, path)
    named = [{"name": "tool_use", "template": "TOOLS " + TEMPLATE}, {"name": "default", "template": TEMPLATE}]
    json.dump({"chat_template": named, "eos_token": "<s>"}, open(path / "tokenizer_config.json", "w"))
    messages = [{"role": "user", "content": "hi"}]
    expected = transformers.AutoTokenizer.from_pretrained(path).apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert load_causal_lm(str(path)).chat_prompt(messages) == expected == load_causal_lm(model_dir).chat_prompt(messages)
    json.dump({"chat_template": named[:1], "eos_token": "<s>"}, open(path / "tokenizer_config.json", "w"))
    with pytest.raises(ValueError, match=r"`chat_template` holds the templates \['tool_use'\] and none named 'default'"):
        load_causal_lm(str(path))

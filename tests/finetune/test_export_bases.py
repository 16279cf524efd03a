"""What `attnkit export` writes beside the merged model: the adapter's base where PEFT would not find
the adapter's modules in --model itself (phi3's fused qkv_proj and gate_up_proj), the base's context
length, and, over another model's directory, none of that model's files left to be read with the new
one (its chat_template.jinja, added_tokens.json: a probe found transformers reading them)."""

import json
import os
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from attnkit.cli import main  # noqa: E402
from attnkit.finetune import export, finetune  # noqa: E402
from tiny import date_chats, save_tiny_llama, write_jsonl  # noqa: E402

SETTINGS = dict(epochs=1, batch_size=4, learning_rate=5e-2, lora_rank=4, lora_alpha=8, max_length=128, log=lambda *a: None)
IDS = torch.arange(3, 30)[None]
CONTEXT = 192  # the base's, other than any default; longer than the training chats


def _logits(directory):
    return transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)(IDS).logits.detach().numpy()


@pytest.fixture(scope="module")
def phi3_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("phi3")
    (root / "base").mkdir()
    base = save_tiny_llama(root / "base", family="phi3", tie_word_embeddings=False, max_position_embeddings=CONTEXT)
    train = write_jsonl(root / "train.jsonl", date_chats(8))
    out, exported = str(root / "out"), str(root / "exported")
    finetune(train, out, model=base, **SETTINGS)
    export(out, exported)
    return dict(base=base, out=out, exported=exported)


def test_a_phi3_adapter_loads_in_peft_on_the_base_written_beside_it(phi3_run):
    """PEFT looked for q_proj, k_proj, ... in phi3's own directory, found only o_proj and down_proj, and
    dropped the rest of the adapter without a word (logits 0.22 off the merged model's)."""
    peft = pytest.importorskip("peft")
    adapter = os.path.join(phi3_run["exported"], "adapter")
    with open(os.path.join(adapter, "adapter_config.json")) as f:
        base = json.load(f)["base_model_name_or_path"]
    assert base == os.path.join(phi3_run["exported"], "base")
    np.testing.assert_allclose(_logits(base), _logits(phi3_run["base"]), atol=1e-5)  # the same model, as llama
    plain = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    before = plain(IDS).logits.detach().numpy()
    adapted = peft.PeftModel.from_pretrained(plain, adapter)(IDS).logits.detach().numpy()
    assert np.abs(adapted - before).max() > 1e-2  # the adapter changes the model
    np.testing.assert_allclose(adapted, _logits(phi3_run["exported"]), atol=2e-5)


def test_the_written_directories_keep_the_base_models_context_length(phi3_run):
    """It was 8192 whatever the base's: a 64-token model claimed 8192 in transformers and `serve`."""
    for directory in (phi3_run["out"], phi3_run["exported"], os.path.join(phi3_run["exported"], "base")):
        with open(os.path.join(directory, "config.json")) as f:
            assert json.load(f)["max_position_embeddings"] == CONTEXT, directory
        assert transformers.AutoTokenizer.from_pretrained(directory).model_max_length == CONTEXT


def test_force_over_another_model_leaves_none_of_its_files_and_keeps_the_users(tiny_dir, tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", date_chats(4))
    out = str(tmp_path / "out")
    finetune(train, out, model=tiny_dir, **SETTINGS)
    other = tmp_path / "other"
    shutil.copytree(tiny_dir, other)
    (other / "chat_template.jinja").write_text("STALE {{ messages[0]['content'] }}")
    (other / "added_tokens.json").write_text(json.dumps({"<extra>": 259}))
    (other / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<|endoftext|>", "bos_token": "<|endoftext|>"}))
    (other / "README.md").write_text("mine")
    export(out, str(other), force=True)
    assert sorted(os.listdir(other)) == sorted(["README.md", "adapter", "config.json", "generation_config.json",
                                                "model.safetensors", "tokenizer.json", "tokenizer_config.json"])
    assert (other / "README.md").read_text() == "mine"
    tokenizer = transformers.AutoTokenizer.from_pretrained(other)
    ours = transformers.AutoTokenizer.from_pretrained(out)
    messages = [{"role": "user", "content": "Normalise: 3/3/21"}]
    assert tokenizer.apply_chat_template(messages, tokenize=False) == ours.apply_chat_template(messages, tokenize=False)
    assert (tokenizer.eos_token, tokenizer.bos_token, len(tokenizer)) == (ours.eos_token, ours.bos_token, len(ours))


def test_full_fine_tune_flags_and_files_on_the_command_line(tiny_dir, tmp_path, capsys):
    train = write_jsonl(tmp_path / "train.jsonl", date_chats(4))
    # LoRA's settings beside --full were ignored without a word
    assert main(["finetune", "--data", train, "--model", tiny_dir, "--output-dir", str(tmp_path / "x"), "--full",
                 "--lora-rank", "2", "--lora-targets", "v"]) == 2
    assert capsys.readouterr().err.strip() == ("attnkit: error: --full trains every weight, without LoRA; --lora-rank, "
                                               "--lora-targets would be ignored: leave them out")
    # a missing --eval was a bare "[Errno 2]", after the model had loaded
    assert main(["finetune", "--data", train, "--eval", str(tmp_path / "none.jsonl"), "--model", str(tmp_path / "no-model"),
                 "--output-dir", str(tmp_path / "y")]) == 1
    assert capsys.readouterr().err.strip() == f"attnkit: error: --eval {tmp_path / 'none.jsonl'} cannot be read (no such file)"
    full = str(tmp_path / "full")
    assert main(["finetune", "--data", train, "--model", tiny_dir, "--output-dir", full, "--full", "--batch-size", "4",
                 "--max-length", "128"]) == 0
    capsys.readouterr()
    assert main(["export", full, str(tmp_path / "exported")]) == 0
    printed = capsys.readouterr().out
    assert "a full fine-tune: no adapter" in printed and "PEFT" not in printed  # it named an adapter it had not written
    assert not os.path.exists(tmp_path / "exported" / "adapter")


def test_a_base_inside_out_is_never_removed_by_a_later_export(phi3_run, tmp_path):
    """Fine-tuned again from the base an export wrote (--model OUT/base), then exported into OUT: that
    base's files were listed as an earlier export's and removed, and the adapter named the emptied folder."""
    exported = tmp_path / "exported"
    shutil.copytree(phi3_run["exported"], exported)
    base = str(exported / "base")
    before = {name: (exported / "base" / name).read_bytes() for name in os.listdir(base)}
    train = write_jsonl(tmp_path / "train.jsonl", date_chats(4))
    again = str(tmp_path / "again")
    finetune(train, again, model=base, **SETTINGS)
    export(again, str(exported), force=True)
    assert {name: (exported / "base" / name).read_bytes() for name in os.listdir(base)} == before
    with open(exported / "adapter" / "adapter_config.json") as f:
        assert json.load(f)["base_model_name_or_path"] == base


def test_a_full_run_begun_with_lora_settings_resumes(tiny_dir, tmp_path):
    """--full with LoRA flags is refused now; a run begun before that saved them and must still resume
    (a --full run's lora_* settings are not compared)."""
    from attnkit.finetune import checkpoint

    saved = dict(full=True, lora_rank=4, lora_alpha=8.0, lora_targets=["v"], epochs=1)
    checkpoint.check_settings(str(tmp_path), saved, dict(saved, lora_rank=8, lora_alpha=16.0, lora_targets=["q", "v"], epochs=2))
    with pytest.raises(ValueError, match="lora_rank=4"):  # a LoRA run's are compared
        checkpoint.check_settings(str(tmp_path), dict(saved, full=False), dict(saved, full=False, lora_rank=8))


def test_an_empty_out_is_refused_not_read_as_the_working_directory(tiny_dir, tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", date_chats(4))
    out = str(tmp_path / "out")
    finetune(train, out, model=tiny_dir, **SETTINGS)
    with pytest.raises(ValueError, match="OUT must not be empty"):
        export(out, "", force=True)


def test_a_model_built_in_code_is_written_without_a_context_length():
    """`PretrainedCausalLM(path=None)`: the base's context length was read from None, a TypeError."""
    from types import SimpleNamespace

    from attnkit.finetune.hf_directory import base_context_length

    assert base_context_length(SimpleNamespace(path=None)) is None

"""`attnkit finetune` end to end on a tiny model: the output directory runs in attnkit, `attnkit export`'s
in transformers (token-identical greedy generation) and its adapter in PEFT (the merged model's logits);
--resume after an interruption ends where an uninterrupted run ends."""

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from attnkit.cli import main  # noqa: E402
from attnkit.finetune import finetune  # noqa: E402
from attnkit.pipelines.causal_checkpoint import load_causal_lm  # noqa: E402
from tiny import date_chats, write_jsonl  # noqa: E402

SETTINGS = dict(epochs=2, batch_size=4, learning_rate=5e-2, lora_rank=4, lora_alpha=8, max_length=128, log=lambda *a: None)


@pytest.fixture(scope="module")
def run(tiny_dir, tmp_path_factory):
    """A fine-tuned directory (through the command line) and its export."""
    root = tmp_path_factory.mktemp("ft")
    train = write_jsonl(root / "train.jsonl", date_chats(12) + [{"prompt": "a", "completion": "b"}, {"text": "hello"}])
    evaluation = write_jsonl(root / "eval.jsonl", date_chats(4, seed=1))
    out, exported = str(root / "out"), str(root / "exported")
    assert main(["finetune", "--data", train, "--eval", evaluation, "--model", tiny_dir, "--output-dir", out, "--epochs", "2",
                 "--batch-size", "4", "--learning-rate", "0.05", "--lora-rank", "4", "--lora-alpha", "8", "--max-length", "128"]) == 0
    assert main(["export", out, exported]) == 0
    return dict(train=train, out=out, exported=exported, root=root)


def test_exported_model_generates_as_attnkit(run):
    lm = load_causal_lm(run["out"])  # `attnkit chat --model DIR` loads it so
    hf = transformers.AutoModelForCausalLM.from_pretrained(run["exported"], dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(run["exported"])
    messages = [{"role": "user", "content": "Normalise: 3/3/21"}]
    ids = lm.chat_ids(messages)
    assert tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=True)["input_ids"] == ids
    ours = lm.generate_ids([ids], max_new_tokens=12, stop_tokens=[])[0]
    theirs = hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=None, attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    assert [int(t) for t in ours] == theirs[0, len(ids):].tolist()
    np.testing.assert_allclose(lm.logits(ids)[0], hf(torch.tensor([ids])).logits[0].detach().numpy(), atol=2e-5)


def test_peft_loads_the_adapter_with_the_merged_outputs(run):
    base = transformers.AutoModelForCausalLM.from_pretrained(
        __import__("json").load(open(os.path.join(run["exported"], "adapter", "adapter_config.json")))["base_model_name_or_path"],
        dtype=torch.float32)
    plain = base(torch.arange(3, 30)[None]).logits.detach().numpy()
    adapted = peft.PeftModel.from_pretrained(base, os.path.join(run["exported"], "adapter"))
    merged = transformers.AutoModelForCausalLM.from_pretrained(run["exported"], dtype=torch.float32)
    ids = torch.arange(3, 30)[None]
    got, want = adapted(ids).logits.detach().numpy(), merged(ids).logits.detach().numpy()
    assert np.abs(got - plain).max() > 1e-2  # the adapter changes the model
    np.testing.assert_allclose(got, want, atol=2e-5)


def test_resume_after_an_interruption_ends_as_one_run(run, tiny_dir):
    straight = os.path.join(run["root"], "straight")
    finetune(run["train"], straight, model=tiny_dir, **SETTINGS)
    cut = os.path.join(run["root"], "cut")

    def stop(state):
        if state["epoch"] == 1 and state["step"] == 2:  # epoch 2, after its second step and a checkpoint
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        finetune(run["train"], cut, model=tiny_dir, save_every=1, on_step=stop, **SETTINGS)
    with pytest.raises(ValueError, match="--resume: the checkpoint .* was written with lora_rank=4"):
        finetune(run["train"], cut, model=tiny_dir, resume=True, **{**SETTINGS, "lora_rank": 2})
    with open(run["train"], "rb") as f:
        kept = f.read()
    with open(run["train"], "ab") as f:  # an edited file took other batches, silently
        f.write(b'{"text": "one more"}\n')
    with pytest.raises(ValueError, match="--resume: .*train.jsonl has changed since the checkpoint"):
        finetune(run["train"], cut, model=tiny_dir, resume=True, **SETTINGS)
    with open(run["train"], "wb") as f:
        f.write(kept)
    finetune(run["train"], cut, model=tiny_dir, resume=True, **SETTINGS)
    from safetensors.numpy import load_file

    a, b = (load_file(os.path.join(d, "adapter", "adapter_model.safetensors")) for d in (straight, cut))
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_array_equal(a[key], b[key])


def test_errors_are_one_line(run, tiny_dir, capsys, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"prompt": 1, "completion": "x"}\n')
    assert main(["finetune", "--data", str(bad), "--model", tiny_dir, "--output-dir", str(tmp_path / "o")]) == 1
    assert main(["finetune", "--data", run["train"], "--model", tiny_dir, "--output-dir", run["out"]]) == 1  # not empty
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and "line 2: field \"prompt\" must be a string" in err[0] and "already holds files" in err[1]
    for data, why in ((tmp_path / "absent.jsonl", "No such file"), (tmp_path, "Is a directory")):
        assert main(["finetune", "--data", str(data), "--model", tiny_dir, "--output-dir", str(tmp_path / "o2")]) == 1
        assert f"--data {data} cannot be read ({why}" in capsys.readouterr().err
    assert not (tmp_path / "o2").exists()


def test_export_replaces_an_existing_directory_only_with_force(run, capsys):
    weights = os.path.join(run["exported"], "model.safetensors")
    before = open(weights, "rb").read()
    capsys.readouterr()
    assert main(["export", run["out"], run["exported"]]) == 1
    assert capsys.readouterr().err.strip().endswith("already exists; pass --force to replace it")
    assert open(weights, "rb").read() == before
    assert main(["export", run["out"], run["exported"], "--force"]) == 0

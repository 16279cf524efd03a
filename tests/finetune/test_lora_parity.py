"""One LoRA step of attnkit against one of PEFT on transformers, from the same weights, data and optimizer."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import keras  # noqa: E402

from attnkit.finetune import data, lora, training  # noqa: E402
from attnkit.pipelines.causal_checkpoint import load_causal_lm  # noqa: E402
from tiny import date_chats  # noqa: E402

RANK, ALPHA, SGD_LR, ADAMW_LR = 4, 8.0, 0.5, 0.02
TARGETS = list(lora.TARGETS)
# Keras adds Adam's epsilon to sqrt(v) before the bias correction, torch after it: the same update
# only where epsilon is negligible against sqrt(v); a gradient of ~1e-7 differed by 3e-4 at 1e-8.
EPS = 1e-12


def _reference_batch(examples, pad_id):
    """(input ids (B, L+1), labels (B, L+1)) as transformers takes them: labels unshifted, -100 where no loss."""
    length = max(len(ids) for ids, _ in examples)
    ids = np.full((len(examples), length), pad_id, "int64")
    labels = np.full((len(examples), length), -100, "int64")
    for row, (i, l) in enumerate(examples):
        ids[row, : len(i)], labels[row, : len(l)] = i, l
    return torch.tensor(ids), torch.tensor(labels)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_one_lora_step_matches_peft(tiny_dir, optimizer):
    lm = load_causal_lm(tiny_dir)
    records = date_chats(4, seed=3) + [{"prompt": "Say hi: ", "completion": "hi"}, {"text": "plain text"}]
    examples = [data.encode(lm, r, 128) for r in records]
    keras_opt = keras.optimizers.SGD(SGD_LR) if optimizer == "sgd" else keras.optimizers.AdamW(ADAMW_LR, weight_decay=0.01, epsilon=EPS)
    model = training.prepare(lm, targets=TARGETS, rank=RANK, alpha=ALPHA, optimizer=keras_opt)
    rng = np.random.default_rng(0)
    start = {}
    for i, name, dense in lora.projections(model, TARGETS):
        for variable in (dense.lora_kernel_a, dense.lora_kernel_b):  # B non-zero: the step moves both
            value = rng.normal(0, 0.2, variable.shape).astype("float32")
            variable.assign(value)
    start = lora.peft_tensors(model, TARGETS)

    base = transformers.AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    config = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=[lora.TARGETS[t][1].split(".")[1] for t in TARGETS])
    reference = peft.get_peft_model(base, config)
    state = {k.replace(".weight", ".default.weight"): torch.tensor(v) for k, v in start.items()}
    missing = reference.load_state_dict(state, strict=False)
    assert not missing.unexpected_keys
    params = [p for p in reference.parameters() if p.requires_grad]
    assert len(params) == len(start)
    torch_opt = (torch.optim.SGD(params, lr=SGD_LR) if optimizer == "sgd"
                 else torch.optim.AdamW(params, lr=ADAMW_LR, weight_decay=0.01, eps=EPS))

    inputs, targets = data.collate(examples, lm.pad_id)
    loss = training.train_step(model, inputs, targets)
    ids, labels = _reference_batch(examples, lm.pad_id)
    out = reference(input_ids=ids, labels=labels)
    out.loss.backward()
    torch_opt.step()

    assert abs(loss - out.loss.item()) < 1e-5
    got = lora.peft_tensors(model, TARGETS)
    expected = {k.replace(".default.weight", ".weight"): v.detach().numpy()
                for k, v in reference.state_dict().items() if "lora_" in k}
    assert got.keys() == expected.keys()
    moved = max(np.abs(expected[k] - start[k]).max() for k in got)
    assert moved > 1e-2  # the step is large enough for the comparison to mean something
    for key in got:
        np.testing.assert_allclose(got[key], expected[key], atol=1e-4, rtol=0, err_msg=key)

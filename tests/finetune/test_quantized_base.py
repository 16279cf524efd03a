"""Fine-tuning a model loaded with dtype "int8" / "gguf"-style packed blocks (docs/decisions.md item 140):
LoRA trains on top of the frozen blocks and its adapter is written; `full` writes the blocks'
dequantized weights. The layer-level maths is tested on every backend in
tests/layers/test_block_linear_layer.py; this runs the whole command once, on torch."""

import json
import os

import numpy as np
import pytest
from backend_utils import BACKEND

if BACKEND != "torch":
    pytest.skip("the layer-level checks run on every backend; the whole run once", allow_module_level=True)

safetensors = pytest.importorskip("safetensors.numpy")

from attnkit.finetune.run import finetune  # noqa: E402
from attnkit.pipelines.causal_checkpoint import load_causal_lm  # noqa: E402


def _data(path):
    with open(path, "w") as f:
        for i in range(6):
            f.write(json.dumps({"messages": [{"role": "user", "content": f"say {i}"}, {"role": "assistant", "content": f"{i} {i} {i}"}]}) + "\n")
    return str(path)


def test_lora_on_an_int8_base_trains_and_writes_the_adapter(tiny_dir, tmp_path):
    out = tmp_path / "run"
    history = finetune(_data(tmp_path / "train.jsonl"), str(out), model=tiny_dir, dtype="int8", epochs=3, batch_size=3,
                       learning_rate=5e-2, lora_rank=4, max_length=96, log=lambda *a: None)
    losses = [h["loss"] for h in history]
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]
    adapter = safetensors.load_file(os.path.join(out, "adapter", "adapter_model.safetensors"))
    assert adapter and max(np.abs(v).max() for k, v in adapter.items() if "lora_B" in k) > 0


def test_full_fine_tuning_of_an_int8_base_writes_float_weights_close_to_it(tiny_dir, tmp_path):
    out = tmp_path / "full"
    finetune(_data(tmp_path / "train.jsonl"), str(out), model=tiny_dir, dtype="int8", epochs=1, batch_size=3,
             learning_rate=1e-9, full=True, max_length=96, log=lambda *a: None)
    written, base = load_causal_lm(str(out)), load_causal_lm(tiny_dir, dtype="int8")
    ids = np.arange(10, 22, dtype="int32").reshape(2, 6)
    # the blocks' dequantized weights (a learning rate of 1e-9 moves the trainable norms by nothing visible)
    np.testing.assert_allclose(written.logits(ids), base.logits(ids), atol=1e-4)

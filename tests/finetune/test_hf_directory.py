"""`write_model_directory` for the families beyond llama: a model with Qwen3's q/k norms is written as
qwen3 with its norms (a llama config loaded without them, silently other logits), and a model no
written family expresses (Gemma's GELU, offset norms, scaled embeddings) is refused before training."""

import json
import pathlib
import types

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from attnkit.finetune.hf_directory import model_config, write_model_directory  # noqa: E402
from attnkit.models.causal_lm import CausalLM  # noqa: E402
from attnkit.pipelines.causal_checkpoint import load_causal_lm  # noqa: E402


def test_qwen3_is_written_with_its_q_and_k_norms(tiny_dir, tmp_path):
    base = tmp_path / "qwen3"
    base.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (base / name).write_bytes((pathlib.Path(tiny_dir) / name).read_bytes())
    torch.manual_seed(0)
    config = transformers.Qwen3Config(vocab_size=259, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, eos_token_id=258)
    model = transformers.Qwen3ForCausalLM(config)
    with torch.no_grad():  # norms away from 1, so that leaving them out shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.5)
    model.save_pretrained(base)
    out = tmp_path / "out"
    write_model_directory(load_causal_lm(str(base)), str(out))
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen3"
    ids = torch.arange(3, 40)[None]
    written = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    np.testing.assert_allclose(written(ids).logits.detach().numpy(), model(ids).logits.detach().numpy(), atol=2e-5)


def test_a_model_no_written_family_expresses_is_refused():
    model = CausalLM(259, 1, 32, 4, 48, activation="gelu_tanh", norm_offset=1.0, embedding_scale=32 ** 0.5)
    lm = types.SimpleNamespace(model=model)
    with pytest.raises(ValueError, match="activation='gelu_tanh', norm_offset=1.0"):
        model_config(lm)

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


@pytest.mark.parametrize("generation, defaults", [
    ({"do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 0}, {"temperature": 0.6, "top_k": None, "top_p": 0.9}),
    ({"do_sample": True, "repetition_penalty": 1.1}, {"temperature": 1.0, "top_k": 50, "top_p": None, "repetition_penalty": 1.1}),
    ({"temperature": 0.7}, {"temperature": 0.0}),  # no do_sample: greedy, and written so
])
def test_the_base_models_decoding_defaults_survive_the_written_directory(tiny_dir, tmp_path, generation, defaults):
    """A written generation_config.json without "do_sample" made a base that samples at 0.6 greedy in
    attnkit (`attnkit chat --model DIR`) and in transformers."""
    base = tmp_path / "base"
    base.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json", "model.safetensors"):
        (base / name).write_bytes((pathlib.Path(tiny_dir) / name).read_bytes())
    (base / "generation_config.json").write_text(json.dumps({**generation, "eos_token_id": 258}))
    assert load_causal_lm(str(base)).generation_defaults == defaults
    out = tmp_path / "out"
    write_model_directory(load_causal_lm(str(base)), str(out))
    assert load_causal_lm(str(out)).generation_defaults == defaults
    theirs = transformers.GenerationConfig.from_pretrained(out)
    assert theirs.do_sample == (defaults["temperature"] > 0)
    for key in ("temperature", "top_p", "repetition_penalty"):
        if defaults.get(key):
            assert getattr(theirs, key) == defaults[key]

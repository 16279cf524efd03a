"""The decoder families added as one family file each (Qwen3, Gemma, Phi-3; docs/decisions.md items
101-103) against transformers on random-initialised directories saved at test time, on every backend:
logits within 1e-5 with left padding, greedy tokens identical to `generate`, cached equal to uncached;
on torch the cached step (`_torch_decoding`) equals the layers bit for bit. Configs and families
attnkit does not run exactly are refused by name."""

import json
import os
import re

import numpy as np
import pytest
from backend_utils import BACKEND, once_per_run, to_numpy
from plain_step import assert_plain_step_equals_layers

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from attnkit.checkpoints.families import decoders as families  # noqa: E402
from attnkit.pipelines.causal_checkpoint import is_causal_checkpoint, load_causal_lm, model_arguments  # noqa: E402

SMALL = dict(vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=6,
             num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)
CASES = {
    # head_dim 8 != 48 / 6: the q/k norms' width is the head's
    "qwen3": ("Qwen3", dict(head_dim=8, rope_theta=1000.0, attention_bias=True)),
    # head_dim 12 != 48 / 6; the embeddings' scale sqrt(48) and the norms' 1 + weight
    "gemma": ("Gemma", dict(head_dim=12)),
    # a window of 4 on every layer, shorter than the prompts
    "phi3": ("Phi3", dict(sliding_window=4)),
}


def _save(tmp_path_factory, kind, **extra):
    """A random-initialised transformers model of `kind` saved to a new directory; its norms' weights
    are randomised too (ones, or Gemma's zeros, would hide a norm applied wrongly)."""
    torch.manual_seed(0)
    name, fields = CASES[kind]
    config = getattr(transformers, f"{name}Config")(**SMALL, **{**fields, **extra})
    ref = getattr(transformers, f"{name}ForCausalLM")(config).eval()
    with torch.no_grad():
        for tensor_name, weight in ref.named_parameters():
            if "norm" in tensor_name:
                weight.add_(torch.randn_like(weight) * 0.5)
    path = tmp_path_factory.mktemp(kind)
    ref.save_pretrained(path)
    return ref, str(path)


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory):
    ref, path = _save(tmp_path_factory, request.param)
    return ref, load_causal_lm(path)


def test_logits_match_transformers(pair):
    ref, lm = pair
    ids = np.random.default_rng(0).integers(0, 96, (2, 9))
    mask = np.ones((2, 9), int)
    mask[1, :3] = 0  # left padding on the second row
    with torch.no_grad():
        expected = ref(torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()
    ours = to_numpy(lm.model(ids.astype("int32"), attention_mask=mask))
    assert np.abs(expected).max() > 0.3  # logits that tell the families' options apart
    np.testing.assert_allclose(ours[0], expected[0], atol=1e-5)
    np.testing.assert_allclose(ours[1, 3:], expected[1, 3:], atol=1e-5)  # real tokens only


def test_greedy_generation_matches_transformers_and_cached_equals_uncached(pair):
    ref, lm = pair
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12]]  # left padded in one batch
    ours = lm.generate_ids(prompts, max_new_tokens=6, stop_tokens=[])
    for prompt, out in zip(prompts, ours):
        with torch.no_grad():
            expected = ref.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert out == expected[0, len(prompt):].tolist()
    sampled = dict(max_new_tokens=6, stop_tokens=[], temperature=0.9, seed=3)
    assert lm.generate_ids(prompts, **sampled) == lm.generate_ids(prompts, **sampled, use_cache=False)


@pytest.mark.skipif(BACKEND != "torch", reason="the plain torch decoding step is the torch backend's")
def test_the_plain_torch_step_runs_and_equals_the_layers_bit_for_bit(pair, monkeypatch):
    """`_torch_decoding` runs `decoder_block` over kept tensors: with q/k norms, 1 + weight norms, GeGLU
    and the embeddings' scale its logits and cache are the layers' own, for a prefill and the steps."""
    assert_plain_step_equals_layers(pair[1].model, monkeypatch)


@once_per_run
def test_a_family_is_one_file_and_one_registry_line():
    """Each family's tensor names cover every role of its block once (joined tensors split into theirs)."""
    roles = {"q", "k", "v", "o", "gate", "up", "down", "attention_norm", "feed_forward_norm"}
    assert families.model_types() == ("llama", "mistral", "qwen2", "qwen3", "gemma", "phi3")
    for family in families.FAMILIES:
        named = list(family.layer_weights) + [r for parts in family.joined.values() for r in parts]
        expected = roles | ({"q_norm", "k_norm"} if family.name == "Qwen3" else set())
        assert sorted(named) == sorted(expected), family.name
    assert {arch: layout.permuted for arch, (_, layout) in families.GGUF_ARCHITECTURES.items()} == {
        "llama": True, "qwen2": False, "qwen3": False}


def _edit(path, **fields):
    file = os.path.join(path, "config.json")
    with open(file) as f:
        config = json.load(f)
    config.update(fields)
    with open(file, "w") as f:
        json.dump(config, f)


@once_per_run
@pytest.mark.parametrize("kind, fields, match", [
    ("gemma", dict(model_type="gemma2"), r"model_type 'gemma2' is not a decoder attnkit loads \(Gemma 2's attention and final-logit soft-capping"),
    ("gemma", dict(model_type="gemma3_text"), r"model_type 'gemma3_text' is not a decoder attnkit loads \(Gemma 3's"),
    ("qwen3", dict(model_type="qwen3_moe"), r"model_type 'qwen3_moe' is not a decoder attnkit loads \(mixture-of-experts"),
    ("gemma", dict(use_bidirectional_attention=True), r"`use_bidirectional_attention`=True is not implemented in attnkit"),
    ("gemma", dict(hidden_act="silu"), r"hidden_act 'silu' is not implemented in attnkit for model_type 'gemma'"),
    ("phi3", dict(rope_scaling={"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4}),
     r"RoPE scaling 'longrope' is not implemented in attnkit"),
    ("phi3", dict(rope_scaling={"type": "su", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4}),
     r"RoPE scaling 'su' is not implemented in attnkit"),
    ("phi3", dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}),
     r"`rope_parameters\.partial_rotary_factor` other than 1 is not implemented"),
    ("qwen3", dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}), r"RoPE scaling 'yarn' is not implemented"),
])
def test_what_a_family_cannot_run_exactly_is_refused_by_name(tmp_path_factory, kind, fields, match):
    _, path = _save(tmp_path_factory, kind)
    _edit(path, **fields)
    assert is_causal_checkpoint(path)  # the decoder loader names it, not the encoder loader
    with pytest.raises(ValueError, match=r"config\.json: " + match):
        load_causal_lm(path)


@once_per_run
def test_absent_fields_take_each_config_classes_defaults():
    """head_dim, tie_word_embeddings, rms_norm_eps and hidden_act absent: transformers' defaults."""
    base = {**SMALL, "hidden_size": 48}
    for name, model_type in (("Qwen3", "qwen3"), ("Gemma", "gemma"), ("Phi3", "phi3")):
        reference = getattr(transformers, f"{name}Config")(**SMALL)
        args = model_arguments({**base, "model_type": model_type})
        expected_d_k = getattr(reference, "head_dim", None) or 48 // 6  # Qwen3 128, Gemma 256, Phi-3 none
        assert args["d_k"] == expected_d_k, name
        assert args["tie_embeddings"] == reference.tie_word_embeddings
        assert args["epsilon"] == reference.rms_norm_eps
    assert model_arguments({**base, "model_type": "gemma"})["embedding_scale"] == 48 ** 0.5


@once_per_run
def test_a_gemma_tokenizer_is_refused_by_name(tmp_path_factory):
    """transformers rebuilds a Gemma tokenizer.json as GemmaTokenizer, which attnkit does not replicate."""
    from tokenizers import Tokenizer, models

    _, path = _save(tmp_path_factory, "gemma")
    Tokenizer(models.BPE({"a": 0, "b": 1}, [])).save(os.path.join(path, "tokenizer.json"))
    with pytest.raises(ValueError, match=r"tokenizer_config\.json: transformers rebuilds tokenizer\.json as GemmaTokenizer"):
        load_causal_lm(path)


def _write_gguf(path, arch, ref):
    """A GGUF file of `arch` holding transformers model `ref`'s tensors under llama.cpp's names, as its
    converter writes a Qwen3 (no permutation), with a byte-level BPE vocabulary of t0 .. t95."""
    gguf = pytest.importorskip("gguf")
    config = ref.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(64)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list([f"t{i}" for i in range(config.vocab_size)])
    writer.add_token_merges([])
    names = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    layer = {hf: name for name, hf in families.qwen3.FAMILY.gguf["qwen3"].layer_names.items()}
    for name, tensor in ref.state_dict().items():
        stem, kind = name.rsplit(".", 1)
        if stem.startswith("model.layers."):
            i, sub = stem[len("model.layers."):].split(".", 1)
            gguf_name = f"blk.{i}.{layer[sub]}.{kind}"
        else:
            gguf_name = f"{names[stem]}.{kind}"
        writer.add_tensor(gguf_name, tensor.numpy().astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


@once_per_run
def test_a_qwen3_gguf_file_loads_with_its_q_and_k_norms(tmp_path_factory):
    ref, _ = _save(tmp_path_factory, "qwen3", attention_bias=False)
    path = _write_gguf(tmp_path_factory.mktemp("gguf") / "qwen3.gguf", "qwen3", ref)
    ids = np.random.default_rng(2).integers(0, 96, (1, 9))
    with torch.no_grad():
        expected = ref(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(load_causal_lm(path).logits(ids), expected, atol=1e-5)


@once_per_run
@pytest.mark.parametrize("arch", ["gemma", "phi3", "gemma2"])
def test_gguf_architectures_without_a_reader_are_refused_by_name(tmp_path, arch):
    gguf = pytest.importorskip("gguf")
    from attnkit.checkpoints.formats.gguf import read_gguf

    writer = gguf.GGUFWriter(str(tmp_path / "m.gguf"), arch)
    writer.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=f"GGUF architecture '{arch}' is not supported by attnkit"):
        read_gguf(tmp_path / "m.gguf")


@once_per_run
def test_a_weight_of_the_wrong_shape_is_named_in_the_checkpoints_layout(tmp_path_factory):
    """The message printed the kernel's (in, out) shapes under the checkpoint's (out, in) name: a
    (40, 48) gate_proj read as "(48, 40); the model expects (48, 80)"."""
    from safetensors.numpy import load_file, save_file

    _, path = _save(tmp_path_factory, "qwen3")
    file = os.path.join(path, "model.safetensors")
    weights = load_file(file)
    name = "model.layers.1.mlp.gate_proj.weight"
    assert weights[name].shape == (80, 48)
    weights[name] = weights[name][:40]
    save_file(weights, file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=re.escape(f"Weight '{name}' has shape (40, 48); the model expects (80, 48)")):
        load_causal_lm(path)

"""CausalLM against transformers on random-initialised llama, mistral and qwen2 directories saved at
test time; cached decoding against uncached; generation options."""

import re

import numpy as np
import pytest
from backend_utils import BACKEND, to_numpy
from plain_step import assert_plain_step_equals_layers

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from attnkit.pipelines.causal_checkpoint import load_causal_lm  # noqa: E402
from attnkit.models.causal_lm import CausalLM  # noqa: E402
from attnkit.models.generation import choose, generate  # noqa: E402

SMALL = dict(vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2)


def _save(tmp_path_factory, kind, **extra):
    torch.manual_seed(0)
    config_cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig, "qwen2": transformers.Qwen2Config}[kind]
    model_cls = {"llama": transformers.LlamaForCausalLM, "mistral": transformers.MistralForCausalLM, "qwen2": transformers.Qwen2ForCausalLM}[kind]
    ref = model_cls(config_cls(**SMALL, **extra)).eval()
    path = tmp_path_factory.mktemp(kind)
    ref.save_pretrained(path)
    return ref, str(path)


CASES = {
    "llama": dict(rope_theta=500.0, tie_word_embeddings=False),
    "llama_bias_tied": dict(attention_bias=True, mlp_bias=True, tie_word_embeddings=True),
    "mistral": dict(sliding_window=3),
    "qwen2": dict(rope_theta=1000.0),
    "qwen2_mlp_bias": dict(mlp_bias=True),  # transformers' Qwen2 MLP has no biases whatever the config says
}


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory):
    kind = request.param.split("_")[0]
    ref, path = _save(tmp_path_factory, kind, **CASES[request.param])
    return ref, load_causal_lm(path)


def test_logits_match_transformers(pair):
    ref, lm = pair
    ids = np.random.default_rng(0).integers(0, 96, (2, 9))
    mask = np.ones((2, 9), int)
    mask[1, :3] = 0  # left padding on the second row
    with torch.no_grad():
        expected = ref(torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()
    ours = to_numpy(lm.model(ids.astype("int32"), attention_mask=mask))
    np.testing.assert_allclose(ours[0], expected[0], atol=1e-5)
    np.testing.assert_allclose(ours[1, 3:], expected[1, 3:], atol=1e-5)  # real tokens only


def test_greedy_generation_matches_transformers_left_padded(pair):
    ref, lm = pair
    prompts = [[5, 6, 7, 8, 9], [10, 11]]
    ours = lm.generate_ids(prompts, max_new_tokens=6, stop_tokens=[])
    for prompt, out in zip(prompts, ours):
        with torch.no_grad():
            expected = ref.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert out == expected[0, len(prompt):].tolist()


def test_cached_equals_uncached_token_by_token(pair):
    _, lm = pair
    prompts = [[1, 2, 3, 4], [7, 8]]
    cached = lm.generate_ids(prompts, max_new_tokens=8, stop_tokens=[], temperature=0.9, seed=3)
    uncached = lm.generate_ids(prompts, max_new_tokens=8, stop_tokens=[], temperature=0.9, seed=3, use_cache=False)
    assert cached == uncached


def test_cached_calls_read_the_variables_now_and_trace_each_shape_once(pair, monkeypatch):
    """On jax and tensorflow a cached call is one compiled program, on torch plain torch code: it must see
    weights assigned after it was made, and serve every decoding step from one trace."""
    _, lm = pair
    model = lm.model
    ids = np.array([[3, 4, 5, 6, 7]], "int32")
    traced = []
    forward = model._forward
    monkeypatch.setattr(model, "_forward", lambda *args, **kwargs: traced.append(1) or forward(*args, **kwargs))

    def cached_logits(capacity):
        cache = model.new_cache(1, capacity)
        steps = [model(ids[:, :2], cache=cache)] + [model(ids[:, t : t + 1], cache=cache) for t in range(2, 5)]
        return np.concatenate([to_numpy(s) for s in steps], axis=1)  # (1, 5, V)

    before = to_numpy(model(ids))
    np.testing.assert_allclose(cached_logits(37), before, atol=1e-5)
    # jax, tensorflow: the prefill and one step shape are traced; torch runs them as plain torch code.
    # And the uncached call.
    assert len(traced) == (0 if BACKEND == "torch" else 2) + 1
    scale = model.final_norm.weights[0]
    old = to_numpy(scale)
    scale.assign(old * 1.5 + 0.25)
    try:
        after = to_numpy(model(ids))
        assert np.abs(after - before).max() > 1e-2
        np.testing.assert_allclose(cached_logits(37), after, atol=1e-5)
    finally:
        scale.assign(old)


@pytest.mark.skipif(BACKEND != "torch", reason="the plain torch decoding step is the torch backend's")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_the_plain_torch_step_computes_what_the_layers_compute_bit_for_bit(pair, dtype, monkeypatch):
    """`_torch_decoding` restates the layers' composition: its logits and cache must be the layers' own,
    on every checkpoint kind (biases, sliding windows, tied heads), with left padding and a window that
    cuts, for a prefill and the steps after it."""
    _, lm = pair
    config = lm.model.get_config()
    model = CausalLM.from_config({**config, "dtype": dtype})
    model.build()
    model.set_weights(lm.model.get_weights())
    assert_plain_step_equals_layers(model, monkeypatch)


@pytest.mark.skipif(BACKEND != "torch", reason="the plain torch decoding step is the torch backend's")
def test_the_plain_torch_step_with_as_many_key_value_heads_as_query_heads(monkeypatch):
    """h_kv = h: the layers attend through `fused_attention`, not the grouped op."""
    model = CausalLM(vocab_size=64, n=2, d_model=32, h=4, d_ff=48, num_kv_heads=4, sliding_windows=[None, 3])
    model.build()
    assert_plain_step_equals_layers(model, monkeypatch)


@pytest.mark.skipif(BACKEND != "torch", reason="the plain torch decoding step is the torch backend's")
def test_the_plain_torch_step_leaves_quantized_lora_and_mixed_models_to_the_layers(monkeypatch):
    from attnkit.models import _torch_decoding

    ids = np.array([[3, 4, 5]], "int32")

    def runs_plain(model):
        ran = []
        plain = _torch_decoding.forward
        monkeypatch.setattr(_torch_decoding, "forward", lambda *args: ran.append(plain(*args)) or ran[-1])
        model(ids, cache=model.new_cache(1, 4))
        monkeypatch.setattr(_torch_decoding, "forward", plain)
        return ran[-1] is not None

    make = dict(vocab_size=64, n=2, d_model=32, h=4, d_ff=48, num_kv_heads=2)
    assert runs_plain(CausalLM(**make))
    assert not runs_plain(CausalLM(**make, dtype="mixed_bfloat16"))
    lora = CausalLM(**make)
    lora(ids)
    lora.decoder_layers[1].feed_forward.W_up.enable_lora(2)
    assert not runs_plain(lora)
    quantized = CausalLM(**make)
    quantized(ids)
    quantized.quantize("int8")
    assert not runs_plain(quantized)
    tied_lora = CausalLM(**make)  # LoRA on the tied embedding: its `embeddings` is no variable then
    tied_lora(ids)
    tied_lora.embedding.enable_lora(2)
    assert not runs_plain(tied_lora)
    mixed_block = CausalLM(**make)  # a policy set on one block reaches its sublayers' calls
    mixed_block(ids)
    mixed_block.decoder_layers[0].dtype_policy = "mixed_bfloat16"
    assert not runs_plain(mixed_block)


@pytest.mark.skipif(BACKEND != "torch", reason="the plain torch decoding step is the torch backend's")
def test_a_stateless_call_runs_on_the_values_it_is_given_not_the_variables():
    """`stateless_call` maps the variables to other values: the plain step, which reads the variables'
    own tensors, must not run (it returned the variables' logits without a word)."""
    import keras

    model = CausalLM(vocab_size=64, n=2, d_model=32, h=4, d_ff=48, num_kv_heads=2)
    ids = np.array([[3, 4, 5]], "int32")
    model(ids, cache=model.new_cache(1, 8))  # the plan is made
    given = [keras.ops.zeros_like(v) + 0.01 for v in model.trainable_variables]
    stateless, _ = model.stateless_call(given, model.non_trainable_variables, ids, cache=model.new_cache(1, 8))
    for variable, value in zip(model.trainable_variables, given):
        variable.assign(value)
    np.testing.assert_array_equal(to_numpy(stateless), to_numpy(model(ids, cache=model.new_cache(1, 8))))


@pytest.mark.parametrize("tied", [True, False])
def test_quantizing_after_a_cached_call_reaches_the_cached_call_too(tied):
    """int8 quantization after a compiled cached call: the cached call must run the quantized layers
    (not a program traced before), and tied logits must use the dequantized embedding matrix."""
    lm = CausalLM(vocab_size=64, n=2, d_model=32, h=4, d_ff=48, num_kv_heads=2, tie_embeddings=tied)
    ids = np.array([[3, 4, 5, 6, 7], [9, 8, 7, 6, 5]], "int32")

    def cached():
        cache = lm.new_cache(2, 8)
        steps = [lm(ids[:, :3], cache=cache), lm(ids[:, 3:4], cache=cache), lm(ids[:, 4:], cache=cache)]
        return np.concatenate([to_numpy(s) for s in steps], axis=1)  # (2, 5, V)

    before = to_numpy(lm(ids))
    np.testing.assert_allclose(cached(), before, atol=1e-5)
    lm.quantize("int8")
    after = to_numpy(lm(ids))
    moved = np.abs(after - before).max()
    assert 0 < moved < 0.2 * np.abs(before).max(), (moved, np.abs(before).max())  # int8 rounding, not garbage
    np.testing.assert_allclose(cached(), after, atol=1e-5)



def test_predict_gives_the_call_or_is_refused_naming_the_shape():
    """tensorflow's predict retraces `call` for any batch size (None) once a second size comes, where
    the host bookkeeping of positions and masks failed with numpy's "'NoneType' object cannot be
    interpreted as an integer" (fit and evaluate trace so from the start). It is refused naming
    `token_ids` and the way out; compiled to run eagerly, predict gives the call's logits, as it does
    on torch and jax."""
    lm = CausalLM(vocab_size=30, n=1, d_model=16, h=4, d_ff=32, num_kv_heads=2)
    ids = np.array([[3, 4, 5, 6], [9, 8, 7, 6], [1, 2, 3, 4]], "int32")
    want = to_numpy(lm(ids))
    if BACKEND == "tensorflow":
        lm.predict(ids, verbose=0)  # traced for (3, 4)
        with pytest.raises(ValueError, match=r"known shape.*run_eagerly=True.*token_ids.shape=\(None, 4\)"):
            lm.predict(ids[:2], verbose=0)  # retraced for (None, 4)
        lm.compile(run_eagerly=True)
    for rows in (3, 2):
        np.testing.assert_allclose(lm.predict(ids[:rows], verbose=0), want[:rows], atol=1e-5)

def test_out_of_range_ids_are_refused_before_the_cache_moves(pair):
    _, lm = pair
    cache = lm.model.new_cache(1, 8)
    lm.model(np.array([[1, 2]], "int32"), cache=cache)
    for bad in ([[96]], [[-1]]):
        with pytest.raises(ValueError, match=r"token_ids.*\[0, vocab_size=96\)"):
            lm.model(np.array(bad, "int32"), cache=cache)
    assert cache.length == 2 and cache.seen.tolist() == [2]
    with pytest.raises(ValueError, match=r"token_ids.*vocab_size=96"):
        lm.model(np.array([[1, 200]], "int32"))


def test_sampling_is_reproducible_and_streams(pair):
    _, lm = pair
    seen = []
    a = lm.generate_ids([[1, 2, 3]], max_new_tokens=5, temperature=1.0, top_k=10, top_p=0.9, seed=7, on_token=lambda t: seen.append(int(t[0])), stop_tokens=[])
    b = lm.generate_ids([[1, 2, 3]], max_new_tokens=5, temperature=1.0, top_k=10, top_p=0.9, seed=7, stop_tokens=[])
    assert a == b and seen == a[0] and len(a[0]) == 5


def test_stop_tokens_end_a_row(pair):
    _, lm = pair
    first = lm.generate_ids([[1, 2, 3]], max_new_tokens=4, stop_tokens=[])[0]
    stopped = lm.generate_ids([[1, 2, 3]], max_new_tokens=4, stop_tokens=[first[1]])[0]
    assert stopped == first[: first.index(first[1]) + 1]


def test_choose_filters():
    logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05]]))
    assert choose(logits)[0] == 0
    rng = np.random.default_rng(0)
    picks = {int(choose(logits, 1.0, top_k=2, rng=rng)[0]) for _ in range(200)}
    assert picks == {0, 1}
    picks = {int(choose(logits, 1.0, top_p=0.7, rng=rng)[0]) for _ in range(200)}
    assert picks == {0, 1}  # 0.5 < 0.7, 0.5 + 0.3 reaches it
    with pytest.raises(ValueError, match="non-finite"):
        choose(np.array([[np.nan, 1.0]]))


def test_generation_refusals(pair):
    _, lm = pair
    with pytest.raises(ValueError, match="temperature"):
        generate(lm.model, [[1]], temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        generate(lm.model, [[1]], top_p=0)
    with pytest.raises(ValueError, match="at least one token"):
        generate(lm.model, [[]])
    with pytest.raises(ValueError, match=r"`prompts\[0\]` must hold token ids in \[0, vocab_size=96\)"):
        generate(lm.model, [[1000]])


def test_refuses_unimplemented_config(tmp_path_factory):
    import json

    _, path = _save(tmp_path_factory, "llama", rope_scaling={"rope_type": "linear", "factor": 2.0})
    config = json.load(open(f"{path}/config.json"))
    config["rope_scaling"] = {"rope_type": "linear", "factor": 2.0}
    config["rope_parameters"] = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    json.dump(config, open(f"{path}/config.json", "w"))
    with pytest.raises(ValueError, match="'linear' is not implemented"):
        load_causal_lm(path)
    config["model_type"] = "gpt2"
    json.dump(config, open(f"{path}/config.json", "w"))
    with pytest.raises(ValueError, match="'gpt2'"):
        load_causal_lm(path)


@pytest.mark.parametrize("key, value", [
    ("num_hidden_layers", None), ("hidden_size", "48"), ("vocab_size", True), ("num_attention_heads", 0),
    ("intermediate_size", 80.0), ("num_key_value_heads", -2), ("head_dim", "8"),
])
def test_a_missing_or_bad_size_in_config_json_is_refused_by_name(tmp_path_factory, key, value):
    import json
    import os

    _, path = _save(tmp_path_factory, "llama")
    file = os.path.join(path, "config.json")
    with open(file) as f:
        config = json.load(f)
    if value is None:
        del config[key]
    else:
        config[key] = value
    with open(file, "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match=rf"config\.json: `{key}` must be a positive integer\. Received: {key}="):
        load_causal_lm(path)


def test_a_shard_index_without_its_weight_map_is_refused_by_name(tmp_path_factory):
    import json
    import os

    _, path = _save(tmp_path_factory, "llama")
    os.remove(os.path.join(path, "model.safetensors"))  # beside it, the index is not read (transformers' order)
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}}, f)
    with pytest.raises(ValueError, match=r"model\.safetensors\.index\.json: `weight_map` must be an object"):
        load_causal_lm(path)


def test_a_tiny_temperature_samples_the_most_likely_token():
    # logits / 1e-320 overflowed to inf and gave NaN probabilities (an empty generation, numpy warnings).
    logits = np.array([[1.0, 3.0, 2.0], [5.0, -1.0, 4.0]])
    rng = np.random.default_rng(0)
    with np.errstate(all="raise"):
        for options in (dict(), dict(top_k=2), dict(top_p=0.5)):
            np.testing.assert_array_equal(choose(logits, 1e-320, rng=rng, **options), [1, 0])


def test_a_cache_that_grows_decodes_as_one_allocated_whole(pair, monkeypatch):
    """The cache starts with room for CACHE_ROOM new tokens and doubles when full: here 64 slots, then
    128, for 70 new tokens; greedy still matches transformers token for token."""
    from attnkit.models import generation

    ref, lm = pair
    monkeypatch.setattr(generation, "CACHE_ROOM", 1)
    prompt = [5, 6, 7, 8, 9]
    ours = lm.generate_ids([prompt], max_new_tokens=70, stop_tokens=[])[0]
    with torch.no_grad():
        expected = ref.generate(torch.tensor([prompt]), max_new_tokens=70, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert ours == expected[0, len(prompt):].tolist()


def test_max_new_tokens_far_beyond_the_stop_allocates_nothing_for_it():
    # The cache was allocated for prompt + max_new_tokens at once: 10**12 asked the allocator for 64 TB
    # (torch: "DefaultCPUAllocator: can't allocate memory"); transformers' cache grows as it goes.
    model = CausalLM(vocab_size=16, n=1, d_model=8, h=2, d_ff=16)
    assert generate(model, [[1, 2]], max_new_tokens=10**12, stop_tokens=range(16)) == [[generate(model, [[1, 2]], max_new_tokens=1)[0][0]]]


def test_seed_and_stop_tokens_are_checked_and_one_stop_id_is_taken(pair):
    _, lm = pair
    for seed in (-1, 2.5, True, "1"):
        with pytest.raises(ValueError, match=re.escape(f"`seed` must be None or an integer >= 0. Received: seed={seed!r}")):
            lm.generate_ids([[1, 2]], max_new_tokens=2, temperature=1.0, seed=seed)
    for stop in (None, "3", [3.0], [True]):
        with pytest.raises(TypeError, match=re.escape(f"`stop_tokens` must be a token id or a list of token ids. Received: stop_tokens={stop!r}")):
            lm.generate_ids([[1, 2]], max_new_tokens=2, stop_tokens=stop)
    first = lm.generate_ids([[1, 2, 3]], max_new_tokens=3, stop_tokens=[])[0]
    for stop in (first[0], np.int64(first[0])):  # one id, as transformers' eos_token_id takes it
        assert lm.generate_ids([[1, 2, 3]], max_new_tokens=3, stop_tokens=stop) == [first[:1]]


def _edit(path, file="config.json", **fields):
    """Rewrites fields of a saved checkpoint's JSON file (a value of ... removes the field)."""
    import json
    import os

    with open(os.path.join(path, file)) as f:
        config = json.load(f)
    for key, value in fields.items():
        if value is ...:
            config.pop(key, None)
        else:
            config[key] = value
    with open(os.path.join(path, file), "w") as f:
        json.dump(config, f)


@pytest.mark.parametrize("file, fields, match", [
    # float(None) was a TypeError naming no field; bool("false") is True (then a tied lm_head refused);
    # "yes" asked for bias tensors the checkpoint does not hold
    ("config.json", dict(rms_norm_eps=None), r"`rms_norm_eps` must be a number\. Received: rms_norm_eps=None"),
    ("config.json", dict(rms_norm_eps=True), r"`rms_norm_eps` must be a number\. Received: rms_norm_eps=True"),
    ("config.json", dict(tie_word_embeddings="false"),
     r"`tie_word_embeddings` must be a boolean \(true or false\)\. Received: tie_word_embeddings='false'"),
    ("config.json", dict(attention_bias="yes"), r"`attention_bias` must be a boolean \(true or false\)\. Received: attention_bias='yes'"),
    ("config.json", dict(mlp_bias=None), r"`mlp_bias` must be a boolean \(true or false\)\. Received: mlp_bias=None"),
    ("config.json", dict(hidden_act=None), r"`hidden_act` must be a string\. Received: hidden_act=None"),
    ("config.json", dict(rope_parameters={"rope_type": "default", "rope_theta": None}),
     r"`rope_parameters\.rope_theta` must be a number\. Received: rope_parameters\.rope_theta=None"),
    ("config.json", dict(rope_parameters=..., rope_theta="10000"), r"`rope_theta` must be a number\. Received: rope_theta='10000'"),
    ("config.json", dict(rope_parameters="default"), r"`rope_parameters` must be an object or null\. Received: rope_parameters='default'"),
    ("config.json", dict(pad_token_id="0"), r"`pad_token_id` must be an integer or null\. Received: pad_token_id='0'"),
    ("config.json", dict(eos_token_id=True), r"`eos_token_id` must be a token id \(an integer >= 0\) or a list of them or null"),
    ("generation_config.json", dict(eos_token_id=["2"]), r"`eos_token_id` must be a token id .* Received: eos_token_id=\['2'\]"),
])
def test_a_config_value_of_the_wrong_json_type_is_refused_by_name(tmp_path_factory, file, fields, match):
    _, path = _save(tmp_path_factory, "llama")
    _edit(path, file, **fields)
    with pytest.raises(ValueError, match=re.escape(file) + ": " + match):
        load_causal_lm(path)


@pytest.mark.parametrize("fields, match", [
    # Llama has no sliding window: these fields are read for mistral and qwen2 only
    (dict(sliding_window="4"), r"`sliding_window` must be an integer >= 0 or null\. Received: sliding_window='4'"),
    (dict(layer_types="full_attention"), r"`layer_types` must be a list of strings or null"),
    (dict(layer_types=["full_attention"]), r"`layer_types` must list 'full_attention' or 'sliding_attention' for each of the num_hidden_layers=2"),
])
def test_a_sliding_window_field_of_the_wrong_json_type_is_refused_by_name(tmp_path_factory, fields, match):
    _, path = _save(tmp_path_factory, "mistral")
    _edit(path, **fields)
    with pytest.raises(ValueError, match=r"config\.json: " + match):
        load_causal_lm(path)


@pytest.mark.parametrize("fields", [
    dict(hidden_act="swish"),  # transformers' ACT2FN: nn.SiLU
    dict(rope_parameters={"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": None}),  # null: all of it rotates
    dict(rope_parameters=..., rope_theta=500, sliding_window=None, pad_token_id=None),  # transformers 4's layout, an integer theta
    dict(pad_token_id=-1),  # early Llama conversions: transformers warns and loads
])
def test_values_transformers_reads_load_as_it_reads_them(tmp_path_factory, fields):
    _, path = _save(tmp_path_factory, "llama")
    _edit(path, **fields)
    ids = np.random.default_rng(0).integers(0, 96, (1, 7))
    ours = load_causal_lm(path).logits(ids)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        expected = ref(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(ours, expected, atol=1e-5)


def test_a_rope_refusal_names_config_json_and_the_field_it_has(tmp_path_factory):
    # transformers 5 writes rope_parameters: the error named rope_scaling, and no file
    _, path = _save(tmp_path_factory, "llama")
    _edit(path, rope_scaling=..., rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})
    with pytest.raises(ValueError, match=r"config\.json: RoPE scaling 'linear' is not implemented .* Received: rope_parameters=\{") as raised:
        load_causal_lm(path)
    assert "rope_scaling" not in str(raised.value)
    _edit(path, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
    with pytest.raises(ValueError, match=r"config\.json: `rope_parameters\.partial_rotary_factor` other than 1 is not implemented"):
        load_causal_lm(path)


def test_a_mistral_config_without_sliding_window_gets_mistrals_default():
    """transformers' MistralConfig defaults sliding_window to 4096 when config.json has no such key;
    attnkit read the missing key as full attention. null stays full attention."""
    transformers = pytest.importorskip("transformers")
    from attnkit.pipelines.causal_checkpoint import model_arguments

    config = {k: v for k, v in transformers.MistralConfig(num_hidden_layers=2).to_dict().items() if k != "sliding_window"}
    assert model_arguments(config)["sliding_windows"] == [transformers.MistralConfig().sliding_window] * 2 == [4096, 4096]
    assert model_arguments({**config, "sliding_window": None})["sliding_windows"] == [None, None]
    assert model_arguments({**config, "sliding_window": 7})["sliding_windows"] == [7, 7]


def _logits_match_transformers(path, T=12):
    """attnkit's logits of a directory against transformers' AutoModelForCausalLM (float32), on
    sequences longer than the sliding windows used here."""
    ids = np.random.default_rng(1).integers(0, 96, (1, T))
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = ref(torch.tensor(ids), use_cache=False).logits.numpy()
    np.testing.assert_allclose(load_causal_lm(path).logits(ids), expected, atol=2e-5)


@pytest.mark.parametrize("kind, fields", [
    # LlamaForCausalLM reads neither field: attnkit gave its second layer a window of 3 (2.9 apart)
    ("llama", dict(sliding_window=3, layer_types=["full_attention", "sliding_attention"])),
    # transformers 5 takes the RoPE object from rope_scaling when it is set, its rope_theta first:
    # attnkit read the base from rope_parameters or the top level (3.1 apart)
    ("llama", dict(rope_parameters=..., rope_scaling={"rope_type": "default", "rope_theta": 37.0}, rope_theta=500.0)),
    ("llama", dict(rope_scaling={"rope_type": "default"}, rope_parameters={"rope_type": "default", "rope_theta": 37.0})),
    ("mistral", dict(sliding_window=3, layer_types=["full_attention", "sliding_attention"])),  # AutoModel's Ministral
    ("qwen2", dict(use_sliding_window=True, sliding_window=3, max_window_layers=1, layer_types=...)),
])
def test_windows_and_rope_bases_are_read_as_transformers_reads_them(tmp_path_factory, kind, fields):
    _, path = _save(tmp_path_factory, kind)
    _edit(path, **fields)
    _logits_match_transformers(path)


@pytest.mark.parametrize("fields", [
    dict(use_sliding_window=False, sliding_window=3, layer_types=["sliding_attention", "full_attention"]),
    dict(use_sliding_window=True, sliding_window=None, layer_types=["sliding_attention", "full_attention"]),
])
def test_qwen2_sliding_layers_without_a_window_are_refused(tmp_path_factory, fields):
    # transformers' Qwen2 has no window unless use_sliding_window is true, and its forward then fails
    # ("Could not find a `sliding_window` argument"); attnkit applied sliding_window to those layers.
    _, path = _save(tmp_path_factory, "qwen2")
    _edit(path, **fields)
    with pytest.raises(ValueError, match=r"config\.json: `layer_types` names 'sliding_attention' layers but the config sets no window"):
        load_causal_lm(path)


def test_pytorch_model_bin_loads_as_transformers_loads_it(tmp_path_factory):
    # A directory with pytorch_model.bin only was refused ("No model.safetensors"); transformers and
    # attnkit's encoder loader read it.
    import os

    ref, path = _save(tmp_path_factory, "qwen2")
    bin_path = str(tmp_path_factory.mktemp("qwen2_bin"))
    ref.config.save_pretrained(bin_path)
    torch.save(ref.state_dict(), os.path.join(bin_path, "pytorch_model.bin"))
    _logits_match_transformers(bin_path)


def test_a_traced_attention_mask_is_refused_by_name():
    # The mask's values place positions and cache slots on the host: under jax.jit it failed with
    # "'str' object has no attribute '_error_repr'", under tf.function with a NotImplementedError from
    # NumPy's conversion. A concrete mask, and traced token ids alone, are what CausalLM takes.
    import keras

    model = CausalLM(vocab_size=32, n=1, d_model=16, h=2, d_ff=24)
    ids = np.random.default_rng(0).integers(0, 32, (2, 6)).astype("int32")
    mask = np.ones((2, 6), "int32")
    mask[1, :2] = 0
    expected = to_numpy(model(ids, attention_mask=mask))
    np.testing.assert_array_equal(to_numpy(model(ids, attention_mask=keras.ops.convert_to_tensor(mask))), expected)
    if BACKEND == "torch":
        return  # torch runs eagerly: nothing is traced
    if BACKEND == "jax":
        import jax

        traced, traced_ids_only = jax.jit(lambda i, m: model(i, attention_mask=m)), jax.jit(lambda i: model(i))
    else:
        import tensorflow as tf

        traced, traced_ids_only = tf.function(lambda i, m: model(i, attention_mask=m)), tf.function(lambda i: model(i))
    with pytest.raises(ValueError, match=r"`CausalLM` needs the values of `attention_mask` on the host.*Received: attention_mask, a traced tensor of shape \(2, 6\)"):
        traced(ids, mask)
    np.testing.assert_allclose(to_numpy(traced_ids_only(ids)), to_numpy(model(ids)), atol=1e-6)


@pytest.mark.skipif(BACKEND != "torch", reason="torch's bfloat16 attention kernel depends on autograd; jax and tensorflow have one")
def test_mixed_bfloat16_int8_predict_differs_from_eager_only_by_the_attention_kernel(monkeypatch):
    """Under mixed_bfloat16, an int8 model's eager call (autograd: torch's flash kernel) and `predict`
    (no graph: two batched GEMMs with float32 scores) differ by bfloat16 rounding that int8's
    activation rounding amplifies (0.013 here, 0.005 unquantized). With one attention kernel for both
    they agree bit for bit: no path of the quantized layers depends on autograd (docs/decisions.md item 93)."""
    import keras

    from attnkit.kernels import torch_attention

    keras.utils.set_random_seed(0)
    model = CausalLM(vocab_size=64, n=2, d_model=32, h=4, d_ff=64, num_kv_heads=2, dtype="mixed_bfloat16")
    model.build()
    model.quantize("int8")
    ids = np.random.default_rng(0).integers(0, 64, (4, 16)).astype("int32")
    monkeypatch.setattr(torch_attention, "bmm_takes", lambda *args: False)  # the flash kernel, with or without autograd
    eager = to_numpy(model(ids))
    np.testing.assert_array_equal(model.predict(ids, batch_size=4, verbose=0), eager)
    float_model = CausalLM.from_config({**model.get_config(), "dtype": "float32"})
    float_model.build()
    float_model.quantize("int8")
    float_model.set_weights(model.get_weights())  # the same integers and scales, computed in float32
    np.testing.assert_allclose(eager, to_numpy(float_model(ids)), atol=0.05 * np.abs(eager).max())

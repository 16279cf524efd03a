"""`load_pretrained(dtype="int8")` (docs/decisions.md item 141): every projection of the encoder in
dynamic int8, against sentence-transformers' float32 embeddings; a sentence's embedding independent
of its batch; dtypes refused by name; no Hugging Face directory written from rounded weights; the
CLI's --dtype."""

import json

import numpy as np
import pytest
from backend_utils import BACKEND
from pretrained_fixtures import MODEL_PATH

import attnkit
from attnkit import cli
from attnkit.layers.linear import Linear, holds_blocks
from attnkit.pipelines import encoder as pretrained

SENTENCES = [
    "A man is eating food.", "A man is riding a white horse on an enclosed ground.", "The new movie is awesome.",
    "A cheetah is running behind its prey.", "Two men pushed carts through the woods.", "The cat sits outside.",
    "A monkey is playing drums.", "Someone in a gorilla costume is playing a set of drums.",
    "The quarterly report shows that revenue grew by twelve percent while costs stayed flat.", "Hi!",
]


@pytest.fixture(scope="module")
def encoder_int8():
    return attnkit.load_pretrained(dtype="int8")


def _cosine(a, b):
    return (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)


def test_every_projection_holds_int8_weights_and_quantizes_its_input(encoder_int8):
    linears = [layer for layer in encoder_int8.model._flatten_layers(include_self=False) if isinstance(layer, Linear)]
    assert len(linears) == 6 * 6  # MiniLM: 6 layers of W_q, W_k, W_v, W_o and the two feed-forward products
    for layer in linears:
        assert holds_blocks(layer) and layer.block_format["activations"] == "int8" and layer.block_format["bits"] == 8
        assert str(layer.block_values.dtype) == "int8"
    others = [w for w in encoder_int8.model.weights if w.name not in ("block_values", "block_scale")]
    assert others and all(str(w.dtype) == "float32" for w in others)  # embeddings, norms, biases


def test_embeddings_stay_near_sentence_transformers_float32(encoder_int8):
    from sentence_transformers import SentenceTransformer

    reference = SentenceTransformer(MODEL_PATH, device="cpu").encode(SENTENCES, convert_to_numpy=True)
    ours = encoder_int8.encode(SENTENCES)
    cosine = _cosine(ours, reference)
    # measured: 0.978 for "Hi!", 0.992 at worst on 64 longer sentences (one scale per tensor, as
    # torch's quantize_dynamic: 0.964 on those)
    assert cosine.min() > 0.97 and cosine.mean() > 0.985, cosine
    assert np.abs(ours - reference).max() > 1e-4  # the products really were quantized: not the float32 model


def test_a_sentence_does_not_depend_on_its_batch(encoder_int8):
    together = encoder_int8.encode(SENTENCES)
    for i in (0, 8, 9):  # the shortest and longest of the batch
        alone = encoder_int8.encode(SENTENCES[i])
        if BACKEND == "torch":  # fbgemm's integer product and torch's float ops give each row the same bits in any batch
            np.testing.assert_allclose(alone, together[i], atol=2e-5)
        else:
            # XLA's float GEMMs round a row differently in another batch shape (1e-7), and a value on a
            # rounding boundary then takes the next integer: quantization noise, not a scale shared
            # with other rows (int8 against float32 is at cosine ~0.99)
            assert _cosine(alone, together[i]) > 0.999


@pytest.mark.parametrize("dtype", ["bfloat16", "int4", None, 8])
def test_other_dtypes_are_refused_by_name(dtype):
    with pytest.raises(ValueError, match=r"`dtype` of an encoder must be one of \('float32', 'int8'\). Received: dtype="):
        attnkit.load_pretrained(dtype=dtype)


def test_an_int8_encoder_is_not_saved_as_float_weights(encoder_int8, tmp_path):
    destination = tmp_path / "out"
    with pytest.raises(ValueError, match="An int8 encoder cannot be saved as a Hugging Face directory"):
        encoder_int8.save_pretrained(str(destination))
    assert not destination.exists()


def test_cli_embed_takes_dtype(encoder_int8, monkeypatch, capsys):
    monkeypatch.setattr(pretrained, "load_pretrained", lambda path=None, dtype="float32": encoder_int8 if dtype == "int8" else None)
    assert cli.main(["embed", "--dtype", "int8", SENTENCES[0], SENTENCES[1]]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    np.testing.assert_allclose(np.array([line["embedding"] for line in lines]), encoder_int8.encode(SENTENCES[:2]), atol=1e-6)


def test_cli_refuses_another_dtype_in_one_line(capsys):
    assert cli.main(["embed", "--dtype", "int4", "a"]) == 2
    err = capsys.readouterr().err
    assert "--dtype" in err and "int4" in err and err.count("\n") == 1 and "Traceback" not in err, err


@pytest.mark.skipif(BACKEND != "torch", reason="projections side by side are torch's path (kernels.fuses_projections)")
def test_queries_keys_and_values_side_by_side_equal_each_apart(encoder_int8, monkeypatch):
    """torch joins [W_q; W_k; W_v]'s int8 rows into one product, x quantized once; each row's
    quantization is its own, so the joined product is the three products."""
    from attnkit.kernels.quantized import dynamic_int8
    from attnkit.layers import multi_head_attention

    linear, widths = dynamic_int8.linear, []
    monkeypatch.setattr(multi_head_attention.dynamic_int8, "linear", lambda x, v, *a: widths.append(v.shape[0]) or linear(x, v, *a))
    together = encoder_int8.encode(SENTENCES[:4])
    assert widths.count(3 * 384) == 6 and len(widths) == 6 * 4  # a layer: [W_q; W_k; W_v], W_o, two feed-forward
    monkeypatch.setattr(multi_head_attention.dynamic_int8, "linear", linear)
    monkeypatch.setattr(multi_head_attention, "_dynamic_int8", lambda *projections: False)
    apart = encoder_int8.encode(SENTENCES[:4])
    np.testing.assert_allclose(together, apart, atol=2e-6)

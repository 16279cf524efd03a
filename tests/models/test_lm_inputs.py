"""The language model's inputs, checked at every entry: attention masks (bool or 0/1, docs/decisions.md
item 105), token ids (whole numbers in [0, V), item 106), prompt and message types; streamed text that
joins to the generated text (item 107); a warning for sampling options greedy decoding ignores (item
108); tokenizers and special ids past the vocabulary refused at load (item 109). On a tiny random llama."""

import json
import warnings

import keras
import numpy as np
import pytest
from backend_utils import BACKEND, to_numpy
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_lm import byte_id, save_tiny_llama

pytest.importorskip("torch")
pytest.importorskip("transformers")

from attnkit.pipelines.causal_checkpoint import load_causal_lm  # noqa: E402
from attnkit.models.generation import generate, generate_tokens  # noqa: E402
from attnkit.pipelines.text_stream import TextPieces  # noqa: E402


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    return load_causal_lm(save_tiny_llama(tmp_path_factory.mktemp("tiny") / "lm"))


IDS = np.array([[5, 9, 3, 7], [2, 4, 6, 8]], "int32")
KEEP = np.array([[1, 1, 1, 1], [0, 0, 1, 1]])


# ---- attention masks -------------------------------------------------------------------------------

FLOAT_MASKS = {
    "hf_additive": np.where(KEEP == 1, 0.0, -1e9).astype("float32"),  # HF's 4-D convention, read inverted before
    "keep_floats": KEEP.astype("float32"),
    "halves": np.full((2, 4), 0.5, "float64"),
}


@pytest.mark.parametrize("name", list(FLOAT_MASKS))
def test_float_masks_are_refused_eager_and_cached(lm, name):
    mask = FLOAT_MASKS[name]
    with pytest.raises(TypeError, match=r"`attention_mask` must be a boolean or integer mask, not float"):
        lm.model(IDS, attention_mask=mask)
    cache = lm.model.new_cache(2, 8)
    with pytest.raises(TypeError, match=r"`attention_mask` must be a boolean or integer mask"):
        lm.model(IDS, attention_mask=mask, cache=cache)
    assert cache.length == 0  # refused before the cache moved


@pytest.mark.skipif(BACKEND == "torch", reason="torch runs eagerly: nothing is traced")
def test_float_masks_are_refused_under_jit_and_tf_function(lm):
    mask = FLOAT_MASKS["hf_additive"]
    if BACKEND == "jax":
        import jax

        traced, constant = jax.jit(lambda i, m: lm.model(i, attention_mask=m)), jax.jit(lambda i: lm.model(i, attention_mask=mask))
    else:
        import tensorflow as tf

        traced, constant = tf.function(lambda i, m: lm.model(i, attention_mask=m)), tf.function(lambda i: lm.model(i, attention_mask=mask))
    # tf.function re-raises the TypeError as autograph's StagingError, message included (the CLI unwraps it)
    error = TypeError if BACKEND == "jax" else Exception
    with pytest.raises(error, match=r"`attention_mask` must be a boolean or integer mask, not float32"):
        traced(IDS, mask)  # the dtype is known while tracing: refused before "needs the values on the host"
    with pytest.raises(error, match=r"`attention_mask` must be a boolean or integer mask"):
        constant(IDS)


@pytest.mark.parametrize("values", [[[1, 1, 1, 2], [0, 0, 1, 1]], [[1, 1, 1, 1], [-1, -1, 1, 1]], [[1, 1, 1, 1], [0, 0, 3, 1]]])
def test_integers_other_than_0_and_1_are_refused(lm, values):
    with pytest.raises(ValueError, match=r"`attention_mask` must hold 1 for real tokens and 0 for \(left\) padding.*values such as"):
        lm.model(IDS, attention_mask=np.array(values, "int64"))


def test_bool_and_0_1_masks_of_every_integer_dtype_give_the_same_logits(lm):
    expected = to_numpy(lm.model(IDS, attention_mask=KEEP.astype(bool)))
    for dtype in ("int8", "uint8", "int32", "int64"):
        np.testing.assert_array_equal(to_numpy(lm.model(IDS, attention_mask=KEEP.astype(dtype))), expected)
    np.testing.assert_array_equal(to_numpy(lm.model(IDS, attention_mask=keras.ops.convert_to_tensor(KEEP.astype(bool)))), expected)


# ---- token ids -------------------------------------------------------------------------------------

BAD_PROMPTS = [
    ([[1.5, 2]], ValueError, r"`prompts\[0\]` must hold integer token ids; floats are accepted only when they are whole numbers.*\[1\.5\]"),
    ([[3, 2], [4, 0.25]], ValueError, r"`prompts\[1\]` must hold integer token ids; floats.*\[0\.25\]"),
    (np.array([[2.0, 7.5]], "float32"), ValueError, r"`prompts\[0\]`.*whole numbers.*\[7\.5\]"),
    ([[np.nan, 1]], ValueError, r"`prompts\[0\]`.*whole numbers.*nan"),
    ([[np.inf]], ValueError, r"`prompts\[0\]` must hold token ids in \[0, vocab_size=257\).*inf"),
    ([[4, -1]], ValueError, r"`prompts\[0\]` must hold token ids in \[0, vocab_size=257\).*-1"),
    ([[257]], ValueError, r"`prompts\[0\]` must hold token ids in \[0, vocab_size=257\).*257"),
    ([[1], []], ValueError, r"`prompts\[1\]` must hold at least one token id"),
    ([[1, True]], TypeError, r"`prompts\[0\]` must hold integer token ids, not bools"),
    (np.array([[True, False]]), TypeError, r"`prompts\[0\]` must hold integer token ids"),
    ([["3", "4"]], TypeError, r"`prompts\[0\]` must hold integer token ids.*string"),
    ([[1, None]], TypeError, r"`prompts\[0\]` must hold integer token ids.*object"),
    ([[1, [2, 3]]], ValueError, r"`prompts\[0\]` must be a flat list of token ids"),
    ([[[1, 2]]], ValueError, r"`prompts\[0\]` must be a flat list of token ids"),
    ([1, 2, 3], TypeError, r"`prompts` must be a list of token-id lists; for one prompt, give \[ids\]"),
    (None, TypeError, r"`prompts` must be a list of token-id lists. Received: prompts of type NoneType"),
    ("hello", TypeError, r"`prompts` must be a list of token-id lists. Received: prompts of type str"),
]


@pytest.mark.parametrize("prompts, error, message", BAD_PROMPTS)
def test_bad_token_ids_are_refused_by_every_generation_entry(lm, prompts, error, message):
    for run in (
        lambda: lm.generate_ids(prompts, max_new_tokens=2),
        lambda: generate(lm.model, prompts, max_new_tokens=2),
        lambda: next(generate_tokens(lm.model, prompts, max_new_tokens=2)),
        lambda: generate(lm.model, prompts, max_new_tokens=2, use_cache=False),
    ):
        with pytest.raises(error, match=message):
            run()


def test_whole_number_floats_and_tensors_are_the_ids_they_hold(lm):
    expected = lm.generate_ids([[5, 9, 3], [2, 4]], max_new_tokens=3)
    assert lm.generate_ids([[5.0, 9.0, 3.0], [np.float32(2), np.int16(4)]], max_new_tokens=3) == expected
    assert lm.generate_ids([keras.ops.convert_to_tensor([5, 9, 3]), np.array([2, 4])], max_new_tokens=3) == expected
    assert lm.generate_ids(keras.ops.convert_to_tensor([[5, 9, 3]]), max_new_tokens=3) == expected[:1]
    assert lm.generate_ids([], max_new_tokens=3) == [] and lm.generate([]) == [] and generate(lm.model, []) == []


def test_decode_and_logits_check_their_ids(lm):
    assert lm.decode([byte_id(ord("a")), float(byte_id(ord("b")))]) == "ab"
    with pytest.raises(ValueError, match=r"`ids` must hold integer token ids; floats.*\[1\.5\]"):
        lm.decode([1.5])
    with pytest.raises(ValueError, match=r"`ids` must hold token ids in \[0, vocab_size=257\)"):
        lm.decode([300])
    with pytest.raises(ValueError, match=r"`ids\[0\]` must hold integer token ids; floats"):
        lm.logits([[1.5, 2]])  # np.asarray(ids, "int32") truncated it to 1
    np.testing.assert_array_equal(lm.logits([5.0, 9.0]), lm.logits([[5, 9]]))


@pytest.mark.skipif(BACKEND == "torch", reason="torch runs eagerly: nothing is traced")
def test_fractional_ids_are_refused_inside_a_compiled_causal_lm_call(lm):
    ids = np.array([[5.0, 1.5]], "float32")
    if BACKEND == "jax":
        import jax

        with pytest.raises(Exception, match=r"`token_ids` must hold integer token ids; floats"):
            jax.block_until_ready(jax.jit(lambda i: lm.model(i))(ids))
            jax.effects_barrier()
    else:
        import tensorflow as tf

        with pytest.raises(tf.errors.InvalidArgumentError, match=r"`token_ids` must hold integer token ids; floats"):
            tf.function(lambda i: lm.model(i))(ids)


def test_fractional_ids_are_refused_by_an_eager_causal_lm_call(lm):
    with pytest.raises(ValueError, match=r"`token_ids` must hold integer token ids; floats.*\[1\.5\]"):
        lm.model(np.array([[5.0, 1.5]]))
    with pytest.raises(ValueError, match=r"`pad_id` must be a token id in \[0, vocab_size=257\). Received: pad_id=300"):
        lm.generate_ids([[1], [2, 3]], max_new_tokens=2, pad_id=300)


# ---- prompt and message types ----------------------------------------------------------------------

@pytest.mark.parametrize("call, message", [
    (lambda lm: lm.generate(None), r"`prompt` must be a str or a list of str. Received: prompt of type NoneType"),
    (lambda lm: lm.generate(b"hi"), r"`prompt` must be a str or a list of str. Received: prompt of type bytes"),
    (lambda lm: lm.generate(["hi", 3]), r"`prompt\[1\]` must be a str. Received: prompt\[1\] of type int"),
    (lambda lm: lm.stream(None), r"`prompt` must be a str. Received: prompt of type NoneType"),
    (lambda lm: lm.stream(["hi"]), r"`prompt` must be a str. Received: prompt of type list"),
    (lambda lm: lm.chat(None), r"`messages` must be a str \(one user message\) or a list of"),
    (lambda lm: lm.stream_chat(42), r"`messages` must be a str \(one user message\) or a list of.*int"),
    (lambda lm: lm.chat([{"role": "user", "content": "x"}, "y"]), r"`messages\[1\]` must be a \{'role'"),
    (lambda lm: lm.encode(None), r"`text` must be a str. Received: text of type NoneType"),
])
def test_wrong_types_for_prompts_and_messages_are_type_errors_naming_the_argument(lm, call, message):
    with pytest.raises(TypeError, match=message):
        call(lm)  # raised at the call, not at the first piece of a stream


def test_an_empty_text_prompt_is_refused_by_name(lm):
    with pytest.raises(ValueError, match=r"`prompt` has no tokens: the model needs at least one to continue. Received: prompt=''"):
        lm.generate("")
    with pytest.raises(ValueError, match=r"`prompt\[1\]` has no tokens"):
        lm.generate(["a", ""])


# ---- streaming -------------------------------------------------------------------------------------

@given(tokens=st.lists(st.integers(0, 256), max_size=12))
@settings(max_examples=60, deadline=None)
def test_pieces_join_to_the_decoded_tokens_whatever_they_are(lm, tokens):
    """Random byte tokens (lone continuation bytes, lead bytes at the end, "<s>" skipped): the pieces,
    then what `finish` releases, are the decoded text; no piece ends inside a character."""
    pieces = TextPieces(lm.decode)
    shown = [pieces.add(t) for t in tokens]
    assert "".join(shown) + pieces.finish() == lm.decode(tokens)
    assert not any(piece.endswith("\ufffd") for piece in shown)


@given(text=st.text(alphabet="ab\n é€", max_size=10), stops=st.lists(st.text(alphabet="ab\n é", min_size=1, max_size=3), max_size=3))
@settings(max_examples=300, deadline=None)
def test_pieces_end_before_the_first_stop_string_and_never_show_part_of_one(lm, text, stops):
    """Byte tokens of any text: the pieces end just before the first stop string to appear (the OpenAI
    rule), even one spread over several tokens, and no piece shows characters a stop string then takes back."""
    tokens = [byte_id(b) for b in text.encode()]
    pieces = TextPieces(lm.decode, stops)
    shown = ""
    for t in tokens:
        shown += pieces.add(t)
        if pieces.stopped:
            break
    shown += pieces.finish()
    assert (shown, pieces.stopped) == stopped_text(text, stops)


def stopped_text(text, stops):
    """(the text a generation of `text` returns, whether it stopped): it stops at the first character
    that completes a stop string, and ends where the earliest stop string in the text so far begins."""
    for end in range(1, len(text) + 1):
        found = [i for i in (text[:end].find(s) for s in stops) if i >= 0]
        if found:
            return text[: min(found)], True
    return text, False


def test_stop_strings_must_be_non_empty_strings():
    with pytest.raises(ValueError, match=r"`stop` must be non-empty strings. Received: stop=\['x', ''\]"):
        TextPieces(str, ["x", ""])
    with pytest.raises(TypeError, match=r"`stop` must be a list of strings, not one string. Received: stop='User:'"):
        TextPieces(str, "User:")  # not five one-character stop strings


def test_the_stream_joins_to_the_generated_text_at_the_last_token_and_at_a_stop(lm):
    """Sampled from nearly uniform logits, generations often end inside a character: the stream
    released nothing of it before (one character less than `generate`)."""
    ended_inside = 0
    ascii_ids = [byte_id(b) for b in range(0x20, 0x7f)]
    for seed in range(5):
        for stop in ([], ascii_ids):  # the max_new_tokens-th token, or a stop token (EOS)
            options = dict(max_new_tokens=4, temperature=50.0, seed=seed, stop_tokens=stop)
            text = lm.generate("hi", **options)
            assert "".join(lm.stream("hi", **options)) == text
            ended_inside += text.endswith("\ufffd")
    assert ended_inside >= 2  # the case under test came up
    options = dict(max_new_tokens=4, temperature=50.0, seed=0, stop_tokens=[])
    assert "".join(lm.stream_chat("hi", **options)) == lm.chat("hi", **options)


def test_should_stop_ends_the_stream_and_releases_what_was_held_back(lm):
    e_acute = [byte_id(0xC3), byte_id(0xA9)]  # "é": two tokens
    calls = []

    def stop_after_two():
        calls.append(1)
        return len(calls) == 2

    pieces = list(lm.stream("hi", max_new_tokens=50, temperature=50.0, seed=3, stop_tokens=[], should_stop=stop_after_two))
    ids = lm.generate_ids([lm.encode("hi")], max_new_tokens=2, temperature=50.0, seed=3, stop_tokens=[])[0]
    assert "".join(pieces) == lm.decode(ids) and len(calls) == 2
    held = TextPieces(lm.decode)
    assert held.add(e_acute[0]) == "" and held.finish() == "\ufffd"  # released as generate decodes it


# ---- sampling options of a greedy generation -------------------------------------------------------

def test_sampling_options_without_a_temperature_warn_on_a_greedy_model(lm):
    with pytest.warns(UserWarning, match=r"top_k=5, seed=1 have no effect: generation is greedy \(temperature 0\)"):
        greedy = lm.generate("hi", max_new_tokens=3, top_k=5, seed=1)
    with pytest.warns(UserWarning, match=r"top_p=0\.5 has no effect"):
        lm.generate_ids([[1, 2]], max_new_tokens=2, top_p=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        assert greedy == lm.generate("hi", max_new_tokens=3)
        lm.generate("hi", max_new_tokens=3, temperature=0.7, top_k=5, seed=1)


def test_a_sampling_models_filters_are_not_the_callers_when_it_asks_for_greedy(tmp_path):
    path = save_tiny_llama(tmp_path / "sampling", generation={"do_sample": True, "temperature": 0.7, "top_k": 20, "eos_token_id": 256})
    sampling = load_causal_lm(path)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # the file's top_k is not the caller's: no warning
        assert sampling.generate("hi", max_new_tokens=4, temperature=0) == load_causal_lm(_without_generation(path)).generate("hi", max_new_tokens=4)


def _without_generation(path):
    import os

    os.remove(os.path.join(path, "generation_config.json"))
    return path


# ---- the tokenizer and special ids against the vocabulary, at load ---------------------------------

def test_a_tokenizer_past_the_vocabulary_is_refused_at_load_naming_both_sizes(tmp_path):
    path = save_tiny_llama(tmp_path / "small", vocab_size=200, eos_token_id=199)
    with pytest.raises(ValueError, match=r"tokenizer\.json: the tokenizer has ids up to 256 \(257 tokens\), but .*config\.json has vocab_size=200"):
        load_causal_lm(path)


@pytest.mark.parametrize("file, field", [
    ("config.json", "pad_token_id"), ("config.json", "bos_token_id"), ("config.json", "eos_token_id"),
    ("generation_config.json", "pad_token_id"), ("generation_config.json", "eos_token_id"), ("generation_config.json", "bos_token_id"),
])
def test_a_special_id_past_the_vocabulary_is_a_bad_field_of_its_file(tmp_path, file, field):
    path = save_tiny_llama(tmp_path / "lm")
    settings = json.load(open(f"{path}/{file}"))
    settings[field] = 300 if field != "eos_token_id" else [256, 300]
    json.dump(settings, open(f"{path}/{file}", "w"))
    with pytest.raises(ValueError, match=rf"{file}: `{field}` must be a token id below the vocabulary's size, vocab_size=257"):
        load_causal_lm(path)


def test_a_gguf_special_id_past_its_tokens_is_named(tmp_path):
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "model.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for name, value in dict(block_count=1, context_length=64, embedding_length=32, feed_forward_length=64, head_count=4,
                            head_count_kv=2, eos_token_id=20).items():
        getattr(writer, f"add_{name}")(value)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(8)])
    writer.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"`tokenizer\.ggml\.eos_token_id` must be a token id below the 8 tokens.*Received: tokenizer\.ggml\.eos_token_id=20"):
        load_causal_lm(str(path))

"""GGUF metadata that changes a model's arithmetic and that attnkit does not apply is refused by name,
before any tensor is read (docs/decisions.md item 77): a sliding window, mixture-of-experts counts, an
attention temperature, RoPE scaling (llama.cpp scales linearly when only a factor is given), a value
head width other than the key's. Files written at test time with `gguf.GGUFWriter`."""

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from attnkit.checkpoints.formats.gguf import read_gguf  # noqa: E402


def _write(path, *, skip=(), arrays=None, **extra):
    """A two-layer llama GGUF's metadata and one tensor; `extra`: GGUFWriter.add_* calls over the
    sizes' (those named in `skip` left out); `arrays`: {key: list} written as arrays."""
    writer = gguf.GGUFWriter(str(path), "llama")
    sizes = dict(block_count=2, context_length=64, embedding_length=32, feed_forward_length=64, head_count=4,
                 head_count_kv=2, rope_freq_base=10000.0, layer_norm_rms_eps=1e-5)
    for name, value in {**sizes, **extra}.items():
        if name not in skip:
            getattr(writer, f"add_{name}")(value)
    writer.add_token_list([f"t{i}" for i in range(8)])
    for key, values in (arrays or {}).items():
        writer.add_array(key, values)
    writer.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("extra, message", [
    (dict(sliding_window=3), r"GGUF metadata attnkit does not implement: llama\.attention\.sliding_window=3"),
    (dict(expert_count=4), r"does not implement: llama\.expert_count=4"),
    (dict(rope_scaling_factor=4.0), r"RoPE scaling \(llama\.rope\.scaling\.factor=4\.0\) is not implemented"),
    (dict(rope_scaling_type=gguf.RopeScalingType.LINEAR), r"RoPE scaling 'linear' is not implemented"),
    (dict(key_length=8, value_length=16), r"A value head width other than the key's \(llama\.attention\.value_length=16\)"),
])
def test_metadata_attnkit_does_not_apply_is_refused_by_name(tmp_path, extra, message):
    with pytest.raises(ValueError, match=message):
        read_gguf(_write(tmp_path / "model.gguf", **extra))


def test_neutral_values_of_those_keys_are_read(tmp_path):
    # A scaling factor of 1 and equal key and value widths change nothing: the metadata is read.
    config, weights, _ = read_gguf(_write(tmp_path / "model.gguf", rope_scaling_factor=1.0, key_length=8, value_length=8))
    assert (config["head_dim"], config["num_attention_heads"], config["num_key_value_heads"]) == (8, 4, 2)
    assert config["rope_theta"] == 10000.0 and list(weights) == ["model.embed_tokens.weight"]


@pytest.mark.parametrize("kwargs, message", [
    (dict(skip=("block_count",)), r"`llama.block_count` must be a positive integer. Received: None"),
    (dict(skip=("embedding_length",)), r"`llama.embedding_length` must be a positive integer. Received: None"),
    (dict(skip=("feed_forward_length",)), r"`llama.feed_forward_length` must be a positive integer. Received: None"),
    (dict(head_count=0), r"`llama.attention.head_count` must be a positive integer. Received: 0"),
    # one value per layer (OpenELM-style files): attnkit's decoder has one head count
    (dict(skip=("head_count_kv",), arrays={"llama.attention.head_count_kv": [2, 1]}),
     r"`llama.attention.head_count_kv` must be a positive integer. Received: \[2, 1\]"),
])
def test_a_missing_or_per_layer_size_is_refused_by_name(tmp_path, kwargs, message):
    # These were TypeErrors and a ZeroDivisionError naming no key (docs/decisions.md item 85).
    with pytest.raises(ValueError, match=message):
        read_gguf(_write(tmp_path / "model.gguf", **kwargs))


def test_a_file_cut_anywhere_in_its_header_is_refused_as_a_gguf_file_by_name(tmp_path):
    """A cut inside a string of the header read past the end of gguf's arrays: a bare IndexError,
    naming no file (a probe found it at 52 of 180 cut points)."""
    whole = _write(tmp_path / "whole.gguf").read_bytes()
    cut = tmp_path / "cut.gguf"
    for end in range(4, min(len(whole), 1200), 7):
        cut.write_bytes(whole[:end])
        with pytest.raises(ValueError, match=r"cut\.gguf is not a readable GGUF file"):
            read_gguf(str(cut))


def test_an_empty_gguf_file_is_refused_as_one_not_as_a_missing_directory(tmp_path):
    from attnkit import load_pretrained

    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match=r"empty\.gguf is not a readable GGUF file"):
        load_pretrained(str(empty))  # it said "is not a directory"

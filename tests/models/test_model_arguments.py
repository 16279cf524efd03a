"""The models' constructor and call arguments: refused by their own names, or taken as Keras takes them
(docs/decisions.md item 84)."""

import keras
import numpy as np
import pytest

from attnkit.models.causal_lm import CausalLM
from attnkit.models.transformer import Transformer
from backend_utils import to_numpy

SIZES = dict(enc_vocab_size=10, dec_vocab_size=11, enc_seq_length=6, dec_seq_length=7, h=2, d_k=4, d_v=4, d_model=8,
             d_ff=16, n=1, rate=0.0)


@pytest.mark.parametrize("flag", ["attention_bias", "output_bias", "mlp_bias"])
@pytest.mark.parametrize("value", ["false", "yes", 2, 1.0])
def test_causal_lm_refuses_a_bias_flag_that_is_not_a_bool(flag, value):
    # bool("false") is True: the model was built with biases the caller turned off.
    with pytest.raises(TypeError, match=f"`{flag}` must be a bool. Received: {flag}={value!r}"):
        CausalLM(20, 2, 8, 2, 16, **{flag: value})


def test_causal_lm_takes_numpy_bools_and_windows():
    model = CausalLM(20, 2, 8, 2, 16, attention_bias=np.True_, mlp_bias=np.False_, sliding_windows=np.int64(3))
    assert (model.attention_bias, model.mlp_bias, model.sliding_windows) == (True, False, [3, 3])
    assert model.decoder_layers[0].attention.W_q.use_bias and not model.decoder_layers[0].feed_forward.W_up.use_bias
    assert keras.saving.serialize_keras_object(model)["config"]["sliding_windows"] == [3, 3]


@pytest.mark.parametrize("windows", [2.5, "4", [3]])
def test_causal_lm_refuses_windows_by_name(windows):
    with pytest.raises((TypeError, ValueError), match="`sliding_windows` must be"):
        CausalLM(20, 2, 8, 2, 16, sliding_windows=windows)


def test_causal_lm_names_d_model_and_h_when_the_head_width_would_be_zero():
    with pytest.raises(ValueError, match=r"`d_model` must be at least `h` when `d_k` is not given .* d_model=2, h=4"):
        CausalLM(20, 2, 2, 4, 16)


def test_causal_lm_last_only_is_a_bool():
    model = CausalLM(20, 1, 8, 2, 16)
    ids = np.array([[3, 4, 5]])
    assert tuple(model(ids, last_only=0).shape) == (1, 3, 20)
    assert tuple(model(ids, last_only=np.True_).shape) == (1, 1, 20)
    with pytest.raises(TypeError, match="`last_only` must be a bool. Received: last_only='false'"):
        model(ids, last_only="false")  # was truthy: the last position only


@pytest.mark.parametrize("name", ["enc_vocab_size", "dec_vocab_size", "enc_seq_length", "dec_seq_length"])
@pytest.mark.parametrize("value", [0, -3, 2.0, True])
def test_transformer_refuses_its_sizes_by_their_own_names(name, value):
    # The stacks named them `vocab_size` and `sequence_length`: which of the two was wrong?
    with pytest.raises(ValueError, match=f"`{name}` must be a positive integer. Received: {name}={value!r}"):
        Transformer(**{**SIZES, name: value})


def test_transformer_takes_numpy_integers_and_keeps_python_values_in_its_config():
    numpy_sizes = {name: np.int64(v) if isinstance(v, int) else np.float32(v) for name, v in SIZES.items()}
    model = Transformer(**numpy_sizes, pad_id=np.int64(0), epsilon=np.float32(0.5))  # dec_vocab_size was refused
    plain = Transformer(**SIZES, epsilon=float(np.float32(0.5)))
    config = model.get_config()
    assert {k: v for k, v in config.items() if k != "name"} == {k: v for k, v in plain.get_config().items() if k != "name"}
    assert all(type(v) in (int, float, bool, str) for k, v in config.items() if k not in ("name", "dtype"))
    src, tgt = np.array([[3, 4, 0]]), np.array([[1, 5]])
    clone = Transformer.from_config(config)
    clone(src, tgt)
    model(src, tgt)
    clone.set_weights(model.get_weights())
    np.testing.assert_array_equal(to_numpy(clone(src, tgt)), to_numpy(model(src, tgt)))

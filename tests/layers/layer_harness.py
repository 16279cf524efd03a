"""`run_layer_test`: the checks every attnkit layer passes, in one place (as keras-hub's `run_layer_test`).

One call runs a layer, made by a factory, on fixed inputs through:
- a config round-trip: `from_config(get_config())` gives the same config, and with the same weights
  exactly the same outputs;
- a `.keras` file: a functional model around the layer, saved and loaded, predicts exactly the same;
- symbolic shapes: the layer called on `keras.Input`s gives the eager outputs' shapes (batch unknown);
- masks: with `input_mask`, the output carries the Keras mask the caller expects;
- dtype policies: under "mixed_bfloat16", with the float32 layer's weights, the outputs are bfloat16,
  finite and close to the float32 ones, and the variables stay float32.
"""

import numpy as np

import attnkit  # noqa: F401  (chooses the Keras backend before Keras is imported)
import keras

from attnkit.layers._keras_mask import keras_mask_of, with_keras_mask
from backend_utils import to_numpy


def run_layer_test(
    make_layer, inputs, call_kwargs=None, *, tmp_path=None, input_mask=None, expected_output_mask=None,
    bf16_atol=None, symbolic=True,
):
    """Runs the shared checks on the layer `make_layer(**dtype)` builds; returns its eager outputs.

    Args:
        make_layer: a callable of keyword arguments (only `dtype` is passed) returning a new layer.
        inputs: the positional inputs, a tuple of NumPy arrays (batch first).
        call_kwargs: keyword arguments of every call (masks, flags); default none.
        tmp_path: a directory for the `.keras` file; None skips that check.
        input_mask: optional (B, T) boolean Keras mask attached to the first input.
        expected_output_mask: the Keras mask the (first) output must carry, with or without
            `input_mask`; default `input_mask`.
        bf16_atol: tolerance of the mixed_bfloat16 check against float32; None skips it.
        symbolic: whether to run the symbolic-shape and `.keras` checks (layers that take Python
            values positionally cannot be called on `keras.Input`s alone).

    Returns:
        The float32 layer's outputs on `inputs`, as a tuple of NumPy arrays.
    """
    call_kwargs = dict(call_kwargs or {})
    layer = make_layer()
    expected = _outputs(layer(*inputs, **call_kwargs))
    check_config_round_trip(layer, inputs, call_kwargs)
    if symbolic:
        _symbolic_shapes(layer, inputs, call_kwargs, expected)
        if tmp_path is not None:
            _keras_file(layer, inputs, call_kwargs, expected, tmp_path)
    if input_mask is not None or expected_output_mask is not None:
        _mask(layer, inputs, call_kwargs, input_mask, input_mask if expected_output_mask is None else expected_output_mask)
    if bf16_atol is not None:
        _mixed_bfloat16(layer, make_layer, inputs, call_kwargs, expected, bf16_atol)
    return expected


def _outputs(result):
    """A layer's output (a tensor, or a tuple or list of tensors and lists) as a flat tuple of arrays."""
    if isinstance(result, (tuple, list)):
        return tuple(array for part in result for array in _outputs(part))
    return (to_numpy(result),)


def check_config_round_trip(layer, inputs, call_kwargs=None):
    """`from_config(get_config())` has the same config and, with the same weights, identical outputs."""
    call_kwargs = dict(call_kwargs or {})
    expected = _outputs(layer(*inputs, **call_kwargs))
    config = layer.get_config()
    clone = type(layer).from_config(config)
    assert clone.get_config() == config
    clone(*inputs, **call_kwargs)
    clone.set_weights(layer.get_weights())
    for got, want in zip(_outputs(clone(*inputs, **call_kwargs)), expected, strict=True):
        np.testing.assert_array_equal(got, want)


def _symbolic_inputs(inputs):
    return [keras.Input(shape=np.shape(x)[1:], dtype=np.asarray(x).dtype.name) for x in inputs]


def _symbolic_shapes(layer, inputs, call_kwargs, expected):
    symbolic = _outputs_symbolic(layer(*_symbolic_inputs(inputs), **call_kwargs))
    assert len(symbolic) == len(expected)
    for spec, array in zip(symbolic, expected):
        assert tuple(spec.shape)[1:] == array.shape[1:], (spec.shape, array.shape)


def _outputs_symbolic(result):
    if isinstance(result, (tuple, list)):
        return tuple(spec for part in result for spec in _outputs_symbolic(part))
    return (result,)


def _keras_file(layer, inputs, call_kwargs, expected, tmp_path):
    symbolic = _symbolic_inputs(inputs)
    model = keras.Model(symbolic, layer(*symbolic, **call_kwargs))
    path = str(tmp_path / f"{layer.name}.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    feed = list(inputs) if len(inputs) > 1 else inputs[0]
    # `predict` against `predict`: compiled (jax, tensorflow) and eager results may differ in the last bit.
    saved = _outputs(model.predict(feed, verbose=0))
    for got, want, eager in zip(_outputs(loaded.predict(feed, verbose=0)), saved, expected, strict=True):
        np.testing.assert_array_equal(got, want)
        np.testing.assert_allclose(got, eager, atol=1e-5)


def _mask(layer, inputs, call_kwargs, input_mask, expected_mask):
    # The first input carries a Keras mask, as `Embedding(mask_zero=True)` leaves it.
    first = keras.ops.convert_to_tensor(inputs[0])
    if input_mask is not None:
        first = with_keras_mask(first, keras.ops.convert_to_tensor(input_mask))
    output = layer(first, *inputs[1:], **call_kwargs)
    output = output[0] if isinstance(output, (tuple, list)) else output
    got = keras_mask_of(output)
    if expected_mask is None:
        assert got is None
    else:
        np.testing.assert_array_equal(to_numpy(got), np.asarray(expected_mask))


def _mixed_bfloat16(layer, make_layer, inputs, call_kwargs, expected, atol):
    half = make_layer(dtype="mixed_bfloat16")
    half(*inputs, **call_kwargs)
    half.set_weights(layer.get_weights())
    assert all(keras.backend.standardize_dtype(v.dtype) == "float32" for v in half.weights)
    got = half(*inputs, **call_kwargs)
    first = got[0] if isinstance(got, (tuple, list)) else got
    assert keras.backend.standardize_dtype(first.dtype) == "bfloat16"
    for g, want in zip(_outputs(got), expected, strict=True):
        g = g.astype("float32")
        assert np.all(np.isfinite(g))
        np.testing.assert_allclose(g, want, atol=atol)

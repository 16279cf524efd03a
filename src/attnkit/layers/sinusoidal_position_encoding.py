"""`SinusoidalPositionEncoding`: adds the paper's fixed position encoding to embeddings (section 3.5).

Legend: B batch, T sequence length, d_model embedding width.
"""

import keras
from keras import ops

from attnkit._validation import positive_int
from attnkit.layers._call_checks import CheckedCall
from attnkit.ops.masks import shape_str
from attnkit.ops.position_encoding import sinusoidal_position_encoding


@keras.saving.register_keras_serializable(package="attnkit")
class SinusoidalPositionEncoding(CheckedCall, keras.layers.Layer):
    """Adds PE(pos, 2i) = sin(pos / 10000^(2i/d_model)), PE(pos, 2i+1) = cos(...) to its input.

    The layer has no weights: the table is a constant computed once in float64 (see
    `attnkit.ops.position_encoding.sinusoidal_position_encoding`) and rounded to the compute dtype.
    Calling the layer adds the first T rows to a (B, T, d_model) input; `table(T)` returns the rows
    themselves. A Keras mask on the input passes through unchanged.

    Args:
        sequence_length: the longest sequence the layer accepts.
        d_model: width of the embeddings.
        **kwargs: base `keras.layers.Layer` arguments (name, dtype, ...).

    Call arguments:
        inputs: (B, T, d_model) embeddings, T <= sequence_length.

    Returns:
        (B, T, d_model): `inputs` plus the encoding of positions 0 .. T - 1.

    Raises:
        ValueError: non-positive sizes; an input whose rank is not 3, whose width is not d_model,
            or which is longer than sequence_length.
        TypeError: non-integer sizes.

    Example:
    >>> layer = SinusoidalPositionEncoding(sequence_length=5, d_model=512)
    >>> layer(keras.ops.zeros((64, 5, 512))).shape  # (64, 5, 512), every row the table
    >>> layer.table(5).shape  # (5, 512)

    References:
        Vaswani et al., "Attention Is All You Need", 2017, section 3.5.
    """

    _call_checks = dict(floats=("inputs",))

    def __init__(self, sequence_length, d_model, **kwargs):
        super().__init__(**kwargs)
        self.sequence_length = positive_int("sequence_length", sequence_length)
        self.d_model = positive_int("d_model", d_model)
        self._table = sinusoidal_position_encoding(self.sequence_length, self.d_model, dtype="float64")
        self.supports_masking = True
        self.built = True

    def table(self, length=None):
        """The encodings of positions 0 .. length - 1 as a (length, d_model) tensor of the compute dtype."""
        length = self.sequence_length if length is None else length
        table = ops.convert_to_tensor(self._table, dtype=self.compute_dtype)  # (sequence_length, d_model)
        return ops.slice(table, (0, 0), (length, self.d_model))  # (length, d_model)

    def call(self, inputs):
        shape = tuple(inputs.shape)
        if len(shape) != 3 or shape[-1] != self.d_model:
            raise ValueError(
                f"`inputs` must have shape (batch, length, d_model={self.d_model}). "
                f"Received: inputs.shape={shape_str(shape)}"
            )
        if shape[1] is not None and shape[1] > self.sequence_length:
            raise ValueError(
                f"`inputs` must be at most sequence_length={self.sequence_length} positions long. "
                f"Received: inputs.shape={shape_str(shape)}"
            )
        positions = self.table(ops.shape(inputs)[1])  # (T, d_model)
        return inputs + ops.cast(positions, inputs.dtype)[None]  # (B, T, d_model)

    def compute_output_shape(self, input_shape):
        return tuple(input_shape)

    def get_config(self):
        return {**super().get_config(), "sequence_length": self.sequence_length, "d_model": self.d_model}

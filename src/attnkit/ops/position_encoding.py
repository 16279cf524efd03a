"""The fixed sinusoidal position encoding of the Transformer (Vaswani et al. 2017, section 3.5).

    PE(pos, 2i)     = sin(pos / 10000^(2i / d_model))
    PE(pos, 2i + 1) = cos(pos / 10000^(2i / d_model))

Legend: T sequence length (positions 0 .. T - 1), d_model the width of the embeddings.

The table is a constant, so it is computed once in float64 with NumPy and only then rounded to the
dtype it is used in: every entry is the correctly rounded value of the formula.
"""

import numpy as np

from attnkit._validation import positive_float, positive_int


def sinusoidal_position_encoding(sequence_length, d_model, *, base=10000.0, dtype="float32"):
    """The (sequence_length, d_model) table of sinusoidal position encodings.

    Even columns 2i hold sin(pos / base^(2i / d_model)), odd columns 2i + 1 the cosine of the same
    angle, so every pair of columns is one frequency, from 1 (column 0) down to about 1/base. An odd
    `d_model` ends with a sine column.

    Args:
        sequence_length: number of positions T, a positive integer.
        d_model: width of each encoding, a positive integer.
        base: the wavelength base, 10000 in the paper. Must be finite and > 0.
        dtype: NumPy dtype of the result. Default "float32".

    Returns:
        NumPy array (T, d_model) of `dtype`; row `pos` is the encoding of position `pos`.

    Raises:
        ValueError: a non-positive `sequence_length` or `d_model`, or a bad `base`.
        TypeError: non-integer sizes.

    Example:
    >>> table = sinusoidal_position_encoding(5, 512)  # (5, 512); table[0] is [0, 1, 0, 1, ...]
    """
    sequence_length = positive_int("sequence_length", sequence_length)
    d_model = positive_int("d_model", d_model)
    base = positive_float("base", base)
    positions = np.arange(sequence_length, dtype=np.float64)[:, None]  # (T, 1)
    two_i = np.arange(0, d_model, 2, dtype=np.float64)[None, :]  # (1, ceil(d_model / 2))
    angles = positions / base ** (two_i / d_model)  # (T, ceil(d_model / 2))
    table = np.empty((sequence_length, d_model), dtype=np.float64)
    table[:, 0::2] = np.sin(angles)
    table[:, 1::2] = np.cos(angles[:, : d_model // 2])
    return table.astype(dtype)

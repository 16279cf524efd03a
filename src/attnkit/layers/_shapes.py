"""Input widths: the (batch, length, d_model) check that the layers of the model width run in `build` and
`call`, and the check of an input against the width a built projection takes.

In `build` too: Keras builds a layer before its `call` checks the inputs, and a layer built for the
wrong width would keep that width, and fail every correct call after, deep in a matmul.
"""

import keras

from attnkit.ops.masks import shape_str


def check_model_width(name, shape, d_model):
    """Raises a ValueError unless `shape` is (batch, length, d_model)."""
    shape = tuple(shape)
    if len(shape) != 3 or shape[-1] != d_model:
        raise ValueError(
            f"`{name}` must have shape (batch, length, d_model={d_model}). Received: {name}.shape={shape_str(shape)}"
        )


def check_built_width(name, shape, projection):
    """Raises a ValueError when `projection` (a built Dense) takes another width than `shape`'s last.

    The composite layers call their projections without Keras's `__call__` (docs/decisions.md item 9),
    which would have checked the Dense's input spec."""
    spec = projection.input_spec if projection.built else None
    width = None if spec is None or not spec.axes else spec.axes.get(-1)
    if width is not None and shape[-1] is not None and shape[-1] != width:
        raise ValueError(
            f"`{name}` must have {width} features, the width this layer was built for. "
            f"Received: {name}.shape={shape_str(shape)}"
        )


def check_positive_widths(shapes):
    """Raises a ValueError for an input of width 0 ({name: shape}): attention over no features has no
    score (the ops refuse d_k = 0, docs/decisions.md item 114), and a projection built for width 0 would
    hold the layer to it."""
    for name, shape in shapes.items():
        if shape is not None and len(shape) and shape[-1] == 0:
            raise ValueError(f"`{name}` must have at least one feature. Received: {name}.shape={shape_str(shape)}")


def weights_spec(layer, batch, q_len, k_len):
    """The symbolic (B, h, T_q, T_k) attention weights of `layer` (its `h` heads, its compute dtype), for
    the `compute_output_spec` of a functional call with return_attention_weights=True."""
    return keras.KerasTensor((batch, layer.h, q_len, k_len), dtype=layer.compute_dtype)

"""`AddNormalization`: the residual connection and layer normalization (paper section 3.1, 5.4).

    AddNorm(x, sublayer_x) = LayerNorm(x + sublayer_x)

This is the "post-LN" arrangement of the paper and the seeds. `EncoderLayer(norm_first=True)` uses
the "pre-LN" arrangement x + sublayer(LayerNorm(x)) instead, which needs no layer of its own.

Legend: B batch, T sequence length, d_model model width.
"""

import keras

from attnkit._validation import positive_float
from attnkit.layers._call_checks import CheckedCall
from attnkit.layers._policies import SublayerPolicies
from attnkit.layers._sublayer import call_layer_norm
from attnkit.ops.masks import shape_str


@keras.saving.register_keras_serializable(package="attnkit")
class AddNormalization(CheckedCall, SublayerPolicies, keras.layers.Layer):
    """Adds a sub-layer's output to its input, then normalizes over the last axis.

    Args:
        epsilon: added to the variance in the layer norm. Default 1e-6 (torch's default is 1e-5,
            Keras's 1e-3: set it to match a checkpoint).
        **kwargs: base `keras.layers.Layer` arguments (name, dtype, ...).

    Call arguments:
        x: the sub-layer's input, (B, T, d_model).
        sublayer_x: the sub-layer's output, the same shape.

    Returns:
        (B, T, d_model): LayerNorm(x + sublayer_x), with a learned scale and offset.

    Raises:
        ValueError: a non-positive epsilon; `x` and `sublayer_x` of different shapes.

    Example:
    >>> x = keras.random.normal((64, 5, 512))
    >>> AddNormalization()(x, 0.5 * x).shape  # (64, 5, 512)

    References:
        Vaswani et al., "Attention Is All You Need", 2017, section 3.1; Ba et al., "Layer
        Normalization", 2016.
    """

    _call_checks = dict(floats=("x", "sublayer_x"))

    def __init__(self, *, epsilon=1e-6, **kwargs):
        super().__init__(**kwargs)
        self.epsilon = positive_float("epsilon", epsilon)
        self.supports_masking = True
        self.layer_norm = keras.layers.LayerNormalization(
            epsilon=self.epsilon, name="layer_norm", dtype=self.dtype_policy
        )

    def build(self, x_shape, sublayer_x_shape=None):
        self.layer_norm.build(x_shape)

    def call(self, x, sublayer_x):
        known = [(a, b) for a, b in zip(x.shape, sublayer_x.shape) if a is not None and b is not None]
        if len(x.shape) != len(sublayer_x.shape) or any(a != b for a, b in known):
            raise ValueError(
                "`x` and `sublayer_x` must have the same shape to be added. "
                f"Received: x.shape={shape_str(x.shape)}, sublayer_x.shape={shape_str(sublayer_x.shape)}"
            )
        return call_layer_norm(self.layer_norm, x + sublayer_x)  # (B, T, d_model)

    def compute_output_shape(self, x_shape, sublayer_x_shape=None):
        return tuple(x_shape)

    def get_config(self):
        return {**super().get_config(), "epsilon": self.epsilon}

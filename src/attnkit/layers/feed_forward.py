"""`FeedForward`: the position-wise feed-forward network of the Transformer (paper section 3.3).

    FFN(x) = max(0, x W_1 + b_1) W_2 + b_2

Legend: B batch, T sequence length, d_model model width, d_ff inner width.
"""

import keras
from keras import ops

from attnkit._validation import positive_int
from attnkit.layers._call_checks import CheckedCall
from attnkit.layers._policies import SublayerPolicies
from attnkit.layers._shapes import check_built_width
from attnkit.layers._sublayer import call_sublayer
from attnkit.layers.linear import Linear

ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "silu")


@keras.saving.register_keras_serializable(package="attnkit")
def gelu_tanh(x):
    """GELU's tanh approximation, 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))): transformers' gelu_new."""
    return ops.gelu(x, approximate=True)


# The Dense activation of each name: "gelu" is Keras's exact erf form (its default), not the tanh one.
_DENSE_ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "gelu_tanh": gelu_tanh, "silu": "silu"}


def check_activation(activation):
    """Returns `activation` if it is one of ACTIVATIONS, else raises a ValueError naming them."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"`activation` must be one of {ACTIVATIONS}. Received: activation={activation!r}")
    return activation


@keras.saving.register_keras_serializable(package="attnkit")
class FeedForward(CheckedCall, SublayerPolicies, keras.layers.Layer):
    """Two linear maps with an activation between them, applied to every position alike.

    Args:
        d_ff: width of the inner layer (2048 in the paper).
        d_model: width of the output (512 in the paper).
        activation: "relu" (default, the paper), "gelu" (the exact erf form, as torch's "gelu"),
            "gelu_tanh" (GELU's tanh approximation, transformers' gelu_new) or "silu" (x sigmoid(x)).
        **kwargs: base `keras.layers.Layer` arguments (name, dtype, ...).

    Call arguments:
        x: (B, T, d_in), usually d_in = d_model.

    Returns:
        (B, T, d_model).

    Raises:
        ValueError: non-positive sizes, an unknown activation.
        TypeError: non-integer sizes.

    Example:
    >>> FeedForward(d_ff=2048, d_model=512)(keras.random.normal((64, 5, 512))).shape  # (64, 5, 512)

    References:
        Vaswani et al., "Attention Is All You Need", 2017, section 3.3.
    """

    _call_checks = dict(floats=("x",))

    def __init__(self, d_ff, d_model, *, activation="relu", **kwargs):
        super().__init__(**kwargs)
        self.d_ff = positive_int("d_ff", d_ff)
        self.d_model = positive_int("d_model", d_model)
        self.activation = check_activation(activation)
        self.supports_masking = True
        # The activation belongs to the first map, so `linear` can fuse it (in place on torch).
        self.fully_connected1 = Linear(
            self.d_ff, activation=_DENSE_ACTIVATIONS[self.activation], name="fully_connected1", dtype=self.dtype_policy
        )
        self.fully_connected2 = Linear(self.d_model, name="fully_connected2", dtype=self.dtype_policy)

    def build(self, x_shape):
        self.fully_connected1.build(x_shape)
        self.fully_connected2.build(tuple(x_shape[:-1]) + (self.d_ff,))

    def call(self, x):
        check_built_width("x", x.shape, self.fully_connected1)
        hidden = call_sublayer(self.fully_connected1, x)  # (B, T, d_ff), after the activation
        return call_sublayer(self.fully_connected2, hidden)  # (B, T, d_model)

    def compute_output_shape(self, x_shape):
        return tuple(x_shape[:-1]) + (self.d_model,)

    def get_config(self):
        return {**super().get_config(), "d_ff": self.d_ff, "d_model": self.d_model, "activation": self.activation}

"""`SwiGLUFeedForward`: the gated feed-forward network of Llama (Shazeer, "GLU Variants Improve
Transformer", 2020).

    FFN_SwiGLU(x) = (SiLU(x W_gate) * (x W_up)) W_down
    FFN_GeGLU(x)  = (GELU_tanh(x W_gate) * (x W_up)) W_down      (Gemma: activation="gelu_tanh")

Legend: B batch, T length, d_model width, d_ff inner width.
"""

import keras
from keras import ops

from attnkit._validation import boolean, positive_int
from attnkit.layers._policies import SublayerPolicies
from attnkit.layers._shapes import check_built_width
from attnkit.layers._sublayer import call_sublayer, in_own_scope
from attnkit.layers.linear import Linear
from attnkit.layers.multi_head_attention import SIDE_BY_SIDE, project_side_by_side, projection_path

# The gate's activation by name: the one table the feed-forward and the decoder-only block read
# (docs/decisions.md item 100). "gelu_tanh" is transformers' gelu_pytorch_tanh (Gemma's GeGLU).
GATE_ACTIVATIONS = {"silu": ops.silu, "gelu_tanh": lambda x: ops.gelu(x, approximate=True)}


def gated(gate, up, activation):
    """act(gate) * up, (B, T, d_ff): the gated linear unit of the feed-forward's two projections."""
    return GATE_ACTIVATIONS[activation](gate) * up


def gate_activation(name, value):
    """A name of `GATE_ACTIVATIONS`, refused otherwise by name."""
    if value not in GATE_ACTIVATIONS:
        raise ValueError(f"`{name}` must be one of {sorted(GATE_ACTIVATIONS)}. Received: {name}={value!r}")
    return value


@keras.saving.register_keras_serializable(package="attnkit")
class SwiGLUFeedForward(SublayerPolicies, keras.layers.Layer):
    """Gate and up projections to d_ff, SiLU on the gate, their product projected back to d_model.

    Args:
        d_ff: inner width (Llama's intermediate_size).
        d_model: output width.
        use_bias: whether the three projections have biases. Default False (Llama).
        activation: the gate's activation, "silu" (SwiGLU, default) or "gelu_tanh" (GeGLU).
        **kwargs: base `keras.layers.Layer` arguments (name, dtype, ...).

    Call arguments:
        x: (B, T, d_in).

    Returns:
        (B, T, d_model).

    Raises:
        ValueError, TypeError: non-positive sizes; an input of another width than the built one.

    Example:
    >>> SwiGLUFeedForward(d_ff=1536, d_model=576)(keras.random.normal((2, 5, 576))).shape  # (2, 5, 576)
    """

    def __init__(self, d_ff, d_model, *, use_bias=False, activation="silu", **kwargs):
        super().__init__(**kwargs)
        self.d_ff = positive_int("d_ff", d_ff)
        self.d_model = positive_int("d_model", d_model)
        self.use_bias = bool(boolean("use_bias", use_bias))
        self.activation = gate_activation("activation", activation)
        self.supports_masking = True
        dense = dict(use_bias=self.use_bias, dtype=self.dtype_policy)
        self.W_gate = Linear(self.d_ff, name="W_gate", **dense)
        self.W_up = Linear(self.d_ff, name="W_up", **dense)
        self.W_down = Linear(self.d_model, name="W_down", **dense)

    def build(self, x_shape):
        self.W_gate.build(x_shape)
        self.W_up.build(x_shape)
        self.W_down.build(tuple(x_shape[:-1]) + (self.d_ff,))

    def call(self, x):
        check_built_width("x", x.shape, self.W_gate)
        gate, up = self.project_gate_up(x)  # (B, T, d_ff) each
        return call_sublayer(self.W_down, gated(gate, up, self.activation))  # (B, T, d_model)

    @in_own_scope
    def project_gate_up(self, x):
        """(x W_gate, x W_up), (B, T, d_ff) each: side by side in one matmul where the path allows."""
        if projection_path((self.W_gate, self.W_up), shared_input=True) == SIDE_BY_SIDE:
            return tuple(project_side_by_side(x, (self.W_gate, self.W_up), self.compute_dtype))
        return call_sublayer(self.W_gate, x), call_sublayer(self.W_up, x)

    def compute_output_shape(self, x_shape):
        return tuple(x_shape[:-1]) + (self.d_model,)

    def get_config(self):
        return {**super().get_config(), "d_ff": self.d_ff, "d_model": self.d_model, "use_bias": self.use_bias,
                "activation": self.activation}

"""`DecoderOnlyLayer`: one block of a Llama-style decoder-only stack.

    x = x + Attention(RMSNorm(x))   causal self-attention, RoPE on queries and keys, h_kv <= h heads
    x = x + SwiGLU(RMSNorm(x))      (GeGLU for Gemma)

Both halves are the shared `Residual` in its norm-first arrangement. Queries and keys are rotated
after projection and before the cache, so the cache holds rotated keys (positions never change).
The block's steps are `decoder_block`'s, the one definition CausalLM's torch decoding runs too; the
layer holds the family's options (activation, norm offset, q/k norms) and the sub-layers.

Legend: B batch, T new tokens, S keys so far (cache), h / h_kv heads, d_k per-head width, d_model width.
"""

import keras

from attnkit._validation import boolean, optional_positive_int, positive_float, positive_int
from attnkit.layers._policies import SublayerPolicies
from attnkit.layers._shapes import weights_spec
from attnkit.layers.decoder_block import LayerParts, decoder_block
from attnkit.layers.multi_head_attention import MultiHeadAttention
from attnkit.layers.residual import Residual
from attnkit.layers.rms_norm import RMSNorm, check_norm_offset
from attnkit.layers.swiglu import SwiGLUFeedForward, gate_activation


@keras.saving.register_keras_serializable(package="attnkit")
class DecoderOnlyLayer(SublayerPolicies, keras.layers.Layer):
    """Pre-norm causal self-attention and SwiGLU feed-forward, each with a residual connection.

    Args:
        h: query heads.
        d_k: per-head width (of queries, keys and values).
        d_model: model width.
        d_ff: the feed-forward's inner width.
        num_kv_heads: key/value heads h_kv, dividing h. Default h.
        epsilon: the RMSNorms' epsilon. Default 1e-6.
        attention_bias: biases on W_q, W_k, W_v (Qwen2: True). Default False.
        output_bias: a bias on W_o. Default False.
        mlp_bias: biases in the feed-forward. Default False.
        sliding_window: None, or the number of most recent keys each query sees (Mistral). Applied
            by the model's keep-mask; stored here so each layer can have its own.
        activation: the feed-forward gate's, "silu" (default) or "gelu_tanh" (Gemma's GeGLU).
        norm_offset: 0 (default), or 1 for RMSNorms scaling by 1 + gamma (Gemma).
        qk_norm: RMSNorms over each head's queries and keys before RoPE (Qwen3). Default False.
        **kwargs: base `keras.layers.Layer` arguments.

    Call arguments:
        x: (B, T, d_model).
        cos, sin: (B, 1, T, d_k), the rotary angles of the T new positions.
        keep: (B, 1, T, S) keep-mask, True = may attend; or None: every key.
        causal: also apply the bottom-right causal mask (query i sees keys up to S - T + i). Default False.
        cache: optional `KVCache`; its keys and values for this layer are updated at `start`.
        layer_index: this layer's index in the cache.
        start: the first cache slot of the T new tokens.
        return_attention_weights: also return the weights (B, h, T, S).

    Returns:
        (B, T, d_model), and the weights when asked for.
    """

    def __init__(
        self, h, d_k, d_model, d_ff, *, num_kv_heads=None, epsilon=1e-6, attention_bias=False, output_bias=False,
        mlp_bias=False, sliding_window=None, activation="silu", norm_offset=0.0, qk_norm=False, **kwargs,
    ):
        super().__init__(**kwargs)
        self.h, self.d_k = positive_int("h", h), positive_int("d_k", d_k)
        self.d_model, self.d_ff = positive_int("d_model", d_model), positive_int("d_ff", d_ff)
        self.num_kv_heads = self.h if num_kv_heads is None else positive_int("num_kv_heads", num_kv_heads)
        self.epsilon = positive_float("epsilon", epsilon)
        self.attention_bias = bool(boolean("attention_bias", attention_bias))
        self.output_bias = bool(boolean("output_bias", output_bias))
        self.mlp_bias = bool(boolean("mlp_bias", mlp_bias))
        self.sliding_window = optional_positive_int("sliding_window", sliding_window)
        self.activation = gate_activation("activation", activation)
        self.norm_offset = check_norm_offset("norm_offset", norm_offset)
        self.qk_norm = bool(boolean("qk_norm", qk_norm))
        policy = self.dtype_policy
        norm = dict(epsilon=self.epsilon, offset=self.norm_offset, dtype=policy)
        self.attention = MultiHeadAttention(
            self.h, self.d_k, self.d_k, self.d_model, num_kv_heads=self.num_kv_heads,
            use_bias=self.attention_bias or self.output_bias, name="attention", dtype=policy,
        )
        self.attention_block = Residual(
            RMSNorm(name="attention_norm", **norm), norm_first=True,
            name="attention_block", dtype=policy,
        )
        self.feed_forward = SwiGLUFeedForward(
            self.d_ff, self.d_model, use_bias=self.mlp_bias, activation=self.activation, name="feed_forward", dtype=policy
        )
        self.feed_forward_block = Residual(
            RMSNorm(name="feed_forward_norm", **norm), norm_first=True,
            name="feed_forward_block", dtype=policy,
        )
        if self.qk_norm:  # over d_k, shared by the heads
            self.q_norm, self.k_norm = RMSNorm(name="q_norm", **norm), RMSNorm(name="k_norm", **norm)

    def build(self, x_shape, *args, **kwargs):
        self.attention.build(x_shape)
        self.attention_block.build(x_shape)
        self.feed_forward.build(x_shape)
        self.feed_forward_block.build(x_shape)
        if self.qk_norm:
            self.q_norm.build((None, self.h, None, self.d_k))
            self.k_norm.build((None, self.num_kv_heads, None, self.d_k))

    def call(self, x, cos, sin, keep, causal=False, cache=None, layer_index=0, start=0, return_attention_weights=False):
        parts = LayerParts(self, keep, causal, return_attention_weights)
        x = decoder_block(x, parts, cos, sin, cache, layer_index, start)
        return (x, parts.weights) if return_attention_weights else x

    def compute_output_shape(self, x_shape, cos_shape=None, sin_shape=None, keep_shape=None):
        return tuple(x_shape)

    def compute_output_spec(self, x, cos=None, sin=None, keep=None, *args, return_attention_weights=False, **kwargs):
        # Symbolic calls (functional models) must see the weights too when they are asked for.
        output = keras.KerasTensor(tuple(x.shape), dtype=self.compute_dtype)
        if not return_attention_weights:
            return output
        return output, weights_spec(self, x.shape[0], x.shape[1], None if keep is None else keep.shape[-1])

    def get_config(self):
        return {
            **super().get_config(),
            "h": self.h, "d_k": self.d_k, "d_model": self.d_model, "d_ff": self.d_ff,
            "num_kv_heads": self.num_kv_heads, "epsilon": self.epsilon, "attention_bias": self.attention_bias,
            "output_bias": self.output_bias, "mlp_bias": self.mlp_bias, "sliding_window": self.sliding_window,
            "activation": self.activation, "norm_offset": self.norm_offset, "qk_norm": self.qk_norm,
        }

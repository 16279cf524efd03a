"""The decoder-only block, written once (docs/decisions.md item 100).

    x = x + W_o Attention(RoPE(Norm_q(q)), RoPE(Norm_k(k)), v),  q, k, v = Norm(x) [W_q | W_k | W_v]
    x = x + W_down(act(Norm(x) W_gate) * (Norm(x) W_up))

`decoder_block` is the block's one definition: the order of its steps, the q/k norms, the rotation,
the cache, the gate's activation and the residual additions. It reads a family's options (activation,
qk_norm) from the `DecoderOnlyLayer` and computes through a seam, `parts`, that says how a norm, a
projection, the rotation or the attention is computed, never what the block is:

    LayerParts    the layer's own Keras sub-layers (`DecoderOnlyLayer.call`: every backend, any policy)
    TorchParts    the same variables' torch tensors, kept between steps (CausalLM's cached torch
                  decoding, attnkit.models._torch_decoding)

Legend: B batch, T new tokens, S keys so far (cache), h / h_kv heads, d_k per-head width, d_ff inner width.
"""

from attnkit.layers._sublayer import call_sublayer
from attnkit.layers.multi_head_attention import SIDE_BY_SIDE, projection_path
from attnkit.layers.swiglu import gated
from attnkit import kernels
from attnkit.ops.rotary import apply_rotary


def decoder_block(x, parts, cos, sin, cache=None, layer_index=0, start=0):
    """One decoder-only block on x (B, T, d_model); cos, sin (B, 1, T, d_k); the cache's keys and
    values of `layer_index` updated at `start`. Returns (B, T, d_model)."""
    options = parts.options  # the DecoderOnlyLayer: the family's block options

    def attention(normed):
        q, k, v = parts.project_qkv(normed)  # (B, h, T, d_k), (B, h_kv, T, d_k) twice
        if options.qk_norm:  # Qwen3: an RMSNorm over each head's d_k, before the rotation
            q, k = parts.norm("q_norm", q), parts.norm("k_norm", k)
        q, k = parts.rotate(q, cos, sin), parts.rotate(k, cos, sin)  # RoPE
        if cache is not None:
            k, v = cache.update(layer_index, k, v, start)  # (B, h_kv, S, d_k): every key so far
        return parts.attend(normed, q, k, v)  # (B, T, d_model), W_o applied

    def feed_forward(normed):
        gate, up = parts.project_gate_up(normed)  # (B, T, d_ff) each
        return parts.project_down(gated(gate, up, options.activation))  # (B, T, d_model)

    x = parts.residual("attention", x, attention)
    return parts.residual("feed_forward", x, feed_forward)


class LayerParts:
    """The seam over a `DecoderOnlyLayer`'s Keras sub-layers, for one call.

    Args:
        layer: the `DecoderOnlyLayer`.
        keep, causal: its keep-mask (B, 1, T, S) or None, and the causal flag.
        with_weights: keep the attention weights (B, h, T, S) in `self.weights`.
    """

    def __init__(self, layer, keep, causal, with_weights):
        self.options, self.layer = layer, layer
        self.keep, self.causal, self.with_weights = keep, causal, with_weights
        self.weights = None

    def residual(self, name, x, sublayer):
        """x + sublayer(Norm(x)): the layer's `Residual` block named `<name>_block`."""
        return call_sublayer(getattr(self.layer, f"{name}_block"), x, sublayer=sublayer)

    def norm(self, name, x):
        return call_sublayer(getattr(self.layer, name), x)

    def project_qkv(self, normed):
        attention = self.layer.attention
        projections = (attention.W_q, attention.W_k, attention.W_v)
        if projection_path(projections, shared_input=True) == SIDE_BY_SIDE:
            # One GEMM against the kept [W_q | W_k | W_v]: a decoding step's products are too small
            # to keep the CPU busy one by one.
            return attention._project_together(normed, projections)
        h_kv, d_k = self.layer.num_kv_heads, self.layer.d_k
        q = attention.project_queries(normed)  # (B, h, T, d_k)
        k = kernels.split_heads(call_sublayer(attention.W_k, normed), h_kv, d_k)  # (B, h_kv, T, d_k)
        v = kernels.split_heads(call_sublayer(attention.W_v, normed), h_kv, d_k)  # (B, h_kv, T, d_k)
        return q, k, v

    rotate = staticmethod(apply_rotary)

    def attend(self, normed, q, k, v):
        out = self.layer.attention.attend_projected(
            normed, k, v, self.keep, causal=self.causal, return_attention_weights=self.with_weights, projected_queries=q
        )
        if self.with_weights:
            out, self.weights = out
        return out  # (B, T, d_model)

    def project_gate_up(self, normed):
        return self.layer.feed_forward.project_gate_up(normed)

    def project_down(self, y):
        return call_sublayer(self.layer.feed_forward.W_down, y)

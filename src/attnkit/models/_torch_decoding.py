"""A cached `CausalLM` call on torch as plain torch code: the layers' arithmetic without their Keras
calls (docs/decisions.md item 58).

jax and tensorflow compile a cached call into one program (`CausalLM._compiled_call`). torch runs
eagerly, and there a SmolLM2 decoding step made ~400 sub-layer calls, ~270 variable reads with their
scope checks and ~1900 Keras global-state look-ups: more Python time than transformers' whole step
(docs/performance.md). This module runs the same step as one loop over the layers' tensors, calling
the functions the layers call (`_fused.rms_norm`, `_fused.rotate`, `KVCache.update`,
`grouped_query_attention` / `fused_attention`, `_fused.concat_last`, `_fused.torch_linear`) in the same order, so its
logits and cache equal the layers' bit for bit (tests/models/test_causal_lm.py).

It runs only where the layers' own calls would add nothing: every layer plain (not quantized, no
LoRA, one dtype for variables and compute), no `keras.distribution` and no stateless scope (whose
variables stand for other values). Otherwise `forward` returns
None and the caller runs the layers. What it reads is looked up once into a `_Plan` and checked on
every call: a layer's dtype policy (`quantize` replaces it), its LoRA switch and every variable's
tensor; assignments write into those tensors in place, so they are seen.

Legend: B batch, T new tokens, S keys (cache), h / h_kv heads, d_k per-head width, d_model width.
"""

import types

import keras
from keras.src.backend.common.stateless_scope import in_stateless_scope  # no public name in Keras 3

from attnkit.layers._policies import own_policy
from attnkit import kernels as _fused
from attnkit.ops.attention import fused_attention
from attnkit.ops.grouped_attention import grouped_query_attention


def forward(model, token_ids, cos, sin, keeps, causals, cache, start, last_only):
    """`model._forward(...)`'s logits (B, T or 1, V) float32 for a cached call on torch, or None where
    the layers' Keras calls are needed (see the module docstring)."""
    import torch.nn.functional as F

    plan = _plan(model)
    if plan is None:
        return None
    linear, dtype = _fused.torch_linear, plan.dtype
    x = model.embedding.call(token_ids)  # (B, T, d_model)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)  # (B, 1, T, d_k): once, not twice per layer
    h, h_kv, d_k, epsilon = model.h, model.num_kv_heads, model.d_k, model.epsilon
    attend = grouped_query_attention if h_kv != h else fused_attention
    for i, layer in enumerate(plan.layers):
        # x = x + Attention(RMSNorm(x))
        normed = _fused.rms_norm(x, layer.attention_norm, epsilon)
        # [W_q | W_k | W_v] side by side, kept by `concat_last` as the layer's own call keeps it.
        qkv = linear(normed, _fused.concat_last(layer.W_qkv, dtype), _joined_bias(layer.W_qkv_bias, dtype))
        q, k, v = _fused.split_last(qkv, layer.qkv_widths)  # (B, T, h * d_k), (B, T, h_kv * d_k) twice
        q = _fused.rotate(_fused.split_heads(q, h, d_k), cos, sin)  # (B, h, T, d_k)
        k = _fused.rotate(_fused.split_heads(k, h_kv, d_k), cos, sin)  # (B, h_kv, T, d_k)
        v = _fused.split_heads(v, h_kv, d_k)  # (B, h_kv, T, d_k)
        k, v = cache.update(i, k, v, start)  # (B, h_kv, S, d_k)
        heads = attend(q, k, v, keeps[i], causal=causals[i], dropout=layer.dropout, training=False, seed=layer.seed)
        x = x + linear(_fused.merge_heads(heads), *layer.W_o)  # (B, T, d_model)
        # x = x + SwiGLU(RMSNorm(x))
        normed = _fused.rms_norm(x, layer.feed_forward_norm, epsilon)
        gate_up = linear(normed, _fused.concat_last(layer.W_gate_up, dtype), _joined_bias(layer.W_gate_up_bias, dtype))
        gate, up = _fused.split_last(gate_up, layer.gate_up_widths)  # (B, T, d_ff) each
        gated = F.silu(gate) * up  # (B, T, d_ff)
        x = x + linear(gated, *layer.W_down)
    if last_only:
        x = x[:, -1:]  # (B, 1, d_model)
    x = _fused.rms_norm(x, plan.final_norm, epsilon)
    if plan.lm_head is None:
        logits = _fused.times_transposed(x, plan.embeddings)  # (B, T, V)
    else:
        logits = linear(x, *plan.lm_head)
    return keras.ops.cast(logits, "float32")


def _joined_bias(biases, dtype):
    """The kept side-by-side bias of joined projections, or None where they have none."""
    return None if biases is None else _fused.concat_last(biases, dtype)


def _plan(model):
    """The model's `_Plan`, made anew when a layer or a variable changed; None when a layer is not plain."""
    if keras.distribution.distribution() is not None or in_stateless_scope():
        return None  # a stateless call (`stateless_call`, jax-style training) maps the variables to other values
    plan = model._torch_decoding_plan
    if plan is None or not plan.current():
        plan = model._torch_decoding_plan = _Plan(model)  # a plain object: Keras does not track it
    return plan if plan.plain else None


class _Plan:
    """The tensors a cached call reads, by layer and role, and what they were read from."""

    def __init__(self, model):
        # Every layer of the model: a dtype policy set on a block (mixed precision) reaches its sublayers' calls.
        self.leaves = [model, model.embedding, model.final_norm] + ([model.lm_head] if model.lm_head is not None else [])
        for block in model.decoder_layers:
            self.leaves += [block, block.attention, block.attention_block, block.attention_block.norm, block.feed_forward]
            self.leaves += [block.feed_forward_block, block.feed_forward_block.norm, block.attention.W_q, block.attention.W_k]
            self.leaves += [block.attention.W_v, block.attention.W_o, block.feed_forward.W_gate, block.feed_forward.W_up]
            self.leaves += [block.feed_forward.W_down]
        # Each layer's own policy: in a policy map (a reloaded quantized model's) its entry, which `quantize` replaces.
        self.policies = [own_policy(leaf) for leaf in self.leaves]
        self.lora = [getattr(leaf, "lora_enabled", False) for leaf in self.leaves]
        self.variables = []
        self.plain = all(
            policy.quantization_mode is None and policy.compute_dtype == policy.variable_dtype
            and policy.compute_dtype in ("float32", "bfloat16", "float16")  # those `_fused.rms_norm` takes
            for policy in self.policies
        ) and not any(self.lora)
        if not self.plain:
            return  # nothing is read: the layers run
        self.layers = []
        for block in model.decoder_layers:
            attention, feed_forward = block.attention, block.feed_forward
            qkv, gate_up = (attention.W_q, attention.W_k, attention.W_v), (feed_forward.W_gate, feed_forward.W_up)
            layer = types.SimpleNamespace(
                attention_norm=self._norm(block.attention_block.norm), feed_forward_norm=self._norm(block.feed_forward_block.norm),
                W_qkv=self._kernels(qkv), W_qkv_bias=self._biases(qkv), qkv_widths=[d.units for d in qkv],
                W_o=self._dense(attention.W_o), W_gate_up=self._kernels(gate_up), W_gate_up_bias=self._biases(gate_up),
                gate_up_widths=[d.units for d in gate_up], W_down=self._dense(feed_forward.W_down),
                dropout=attention.dropout, seed=attention.seed_generator,
            )
            self.layers.append(layer)
        self.final_norm = self._norm(model.final_norm)
        self.lm_head = None if model.lm_head is None else self._dense(model.lm_head)
        self.embeddings = None if model.lm_head is not None else self._tensor(model.embedding.embeddings)
        self.dtype = self.policies[0].compute_dtype  # one for all: `plain`

    def current(self):
        """Whether every layer and variable is still the one this plan read."""
        return (
            all(own_policy(leaf) is policy for leaf, policy in zip(self.leaves, self.policies))
            and all(getattr(leaf, "lora_enabled", False) == lora for leaf, lora in zip(self.leaves, self.lora))
            and all(variable._value is tensor for variable, tensor in self.variables)
        )

    def _tensor(self, variable):
        self.variables.append((variable, variable.value))
        return variable.value

    def _norm(self, norm):
        return self._tensor(norm.gamma)  # (d_model,)

    def _dense(self, dense):
        """(kernel (d_in, d_out), bias (d_out,) or None) of a plain `Linear` without activation."""
        return self._tensor(dense.kernel), None if dense.bias is None else self._tensor(dense.bias)

    def _kernels(self, denses):
        """The kernel variables of projections the step joins side by side (`concat_last` keeps the join
        and follows their changes)."""
        for dense in denses:
            self._tensor(dense.kernel)
        return [dense.kernel for dense in denses]

    def _biases(self, denses):
        """Their bias variables, or None where they have none."""
        if any(dense.bias is None for dense in denses):
            return None
        for dense in denses:
            self._tensor(dense.bias)
        return [dense.bias for dense in denses]

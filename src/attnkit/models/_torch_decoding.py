"""A cached `CausalLM` call on torch without the layers' Keras calls (docs/decisions.md items 58, 100).

jax and tensorflow compile a cached call into one program (`CausalLM._compiled_call`). torch runs
eagerly, and there a SmolLM2 decoding step made ~400 sub-layer calls, ~270 variable reads with their
scope checks and ~1900 Keras global-state look-ups: more Python time than transformers' whole step
(docs/performance.md). This module runs the same block definition as `DecoderOnlyLayer`
(`decoder_block`) through another seam, `TorchParts`: the layers' variables read once as torch
tensors and computed with the functions the layers call (`kernels.rms_norm`, `kernels.concat_last`,
`kernels.torch_linear`, `grouped_query_attention` / `fused_attention`), so its logits and cache equal
the layers' bit for bit (tests/models/test_causal_lm.py) and a family's maths lives in one place.

It runs only where the layers' own calls would add nothing: every layer plain (no LoRA, one dtype
for variables and compute, not quantized or holding GGUF blocks kept packed: item 136), no
`keras.distribution` and no stateless scope (whose variables stand for other values). A projection
holding blocks runs `kernels.quantized.block_linear` on its packed tensors, as its layer's call does. Otherwise `forward` returns
None and the caller runs the layers. What it reads is looked up once into a `_Plan` and checked on
every call: a layer's dtype policy (`quantize` replaces it), its LoRA switch and every variable's
tensor; assignments write into those tensors in place, so they are seen.

Legend: B batch, T new tokens, S keys (cache), h / h_kv heads, d_k per-head width, d_model width.
"""

import keras
from keras.dtype_policies import DTypePolicyMap
from keras.src.backend.common.stateless_scope import in_stateless_scope  # no public name in Keras 3

from attnkit.kernels.quantized import block_gemv, block_linear, decode_step
from attnkit.layers._policies import own_policy
from attnkit.layers.linear import holds_blocks
from attnkit.layers.decoder_block import decoder_block
from attnkit.layers.rms_norm import norm_scale
from attnkit import kernels
from attnkit.ops.attention import fused_attention
from attnkit.ops.grouped_attention import grouped_query_attention


def forward(model, token_ids, cos, sin, keeps, causals, cache, start, last_only):
    """`model._forward(...)`'s logits (B, T or 1, V) float32 for a cached call on torch, or None where
    the layers' Keras calls are needed (see the module docstring)."""
    plan = _plan(model)
    if plan is None:
        return None
    x = model.embed(model.embedding.call(token_ids))  # (B, T, d_model)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)  # (B, 1, T, d_k): once, not twice per layer
    if plan.fused is not None and plan.fused.takes(x, cache, start):
        x = plan.fused(x, cos, sin, keeps, cache, start)
    else:
        for i, parts in enumerate(plan.layers):
            parts.keep, parts.causal = keeps[i], causals[i]
            x = decoder_block(x, parts, cos, sin, cache, i, start)
    if last_only:
        x = x[:, -1:]  # (B, 1, d_model)
    x = kernels.rms_norm(x, plan.final_norm.scale(), model.epsilon)
    if plan.lm_head is None:
        logits = kernels.times_transposed(x, plan.embeddings)  # (B, T, V)
    else:
        logits = plan.lm_head(x)
    return keras.ops.cast(logits, "float32")


class TorchParts:
    """The seam of `decoder_block` over one `DecoderOnlyLayer`'s variables as torch tensors (see the
    module docstring); `keep` and `causal` are set before each call."""

    def __init__(self, plan, block):
        attention, feed_forward, dtype = block.attention, block.feed_forward, plan.dtype
        qkv, gate_up = (attention.W_q, attention.W_k, attention.W_v), (feed_forward.W_gate, feed_forward.W_up)
        self.options, self.dtype, self.keep, self.causal = block, dtype, None, False
        self.norms = {"attention": _Norm(plan, block.attention_block.norm), "feed_forward": _Norm(plan, block.feed_forward_block.norm)}
        if block.qk_norm:
            self.norms.update(q_norm=_Norm(plan, block.q_norm), k_norm=_Norm(plan, block.k_norm))
        self.epsilon, self.h, self.h_kv, self.d_k = block.epsilon, block.h, block.num_kv_heads, block.d_k
        self.attend_heads = grouped_query_attention if self.h_kv != self.h else fused_attention
        # float kernels joined side by side; blocks kept packed each as its own product
        self.blocks = any(holds_blocks(d) for d in (*qkv, *gate_up))
        if self.blocks:  # some hold blocks (a file may keep others float): each its own product
            self.W_qkv, self.W_gate_up = [plan.product(d) for d in qkv], [plan.product(d) for d in gate_up]
        else:
            self.W_qkv, self.W_qkv_bias = plan.kernels(qkv), plan.biases(qkv)
            self.W_gate_up, self.W_gate_up_bias = plan.kernels(gate_up), plan.biases(gate_up)
        self.qkv_widths, self.gate_up_widths = [d.units for d in qkv], [d.units for d in gate_up]
        self.W_o, self.W_down = plan.product(attention.W_o), plan.product(feed_forward.W_down)
        self.dropout, self.seed = attention.dropout, attention.seed_generator

    def residual(self, name, x, sublayer):
        return x + sublayer(self.norm(name, x))  # x + Sublayer(Norm(x)): `Residual`, norm first, no dropout

    def norm(self, name, x):
        return kernels.rms_norm(x, self.norms[name].scale(), self.epsilon)

    def project_qkv(self, normed):
        if self.blocks:
            q, k, v = (product(normed) for product in self.W_qkv)
            return kernels.split_heads(q, self.h, self.d_k), kernels.split_heads(k, self.h_kv, self.d_k), kernels.split_heads(v, self.h_kv, self.d_k)
        # [W_q | W_k | W_v] side by side, kept by `concat_last` as the layer's own call keeps it.
        qkv = kernels.torch_linear(normed, kernels.concat_last(self.W_qkv, self.dtype), _joined_bias(self.W_qkv_bias, self.dtype))
        q, k, v = kernels.split_last(qkv, self.qkv_widths)  # (B, T, h * d_k), (B, T, h_kv * d_k) twice
        # (B, h, T, d_k), (B, h_kv, T, d_k) twice
        return kernels.split_heads(q, self.h, self.d_k), kernels.split_heads(k, self.h_kv, self.d_k), kernels.split_heads(v, self.h_kv, self.d_k)

    # `apply_rotary`'s torch kernel without its checks: cos and sin are cast to x's dtype once per call
    rotate = staticmethod(kernels.rotate)

    def attend(self, normed, q, k, v):
        heads = self.attend_heads(q, k, v, self.keep, causal=self.causal, dropout=self.dropout, training=False, seed=self.seed)
        return self.W_o(kernels.merge_heads(heads))  # (B, T, d_model)

    def project_gate_up(self, normed):
        if self.blocks:
            return [product(normed) for product in self.W_gate_up]  # (B, T, d_ff) each
        gate_up = kernels.torch_linear(
            normed, kernels.concat_last(self.W_gate_up, self.dtype), _joined_bias(self.W_gate_up_bias, self.dtype)
        )
        return kernels.split_last(gate_up, self.gate_up_widths)  # (B, T, d_ff) each

    def project_down(self, y):
        return self.W_down(y)


class _Norm:
    """An RMSNorm's scale for `kernels.rms_norm`: its gamma tensor, kept; with an offset (Gemma), the
    layer's own `norm_scale` each call, as its call computes it."""

    def __init__(self, plan, norm):
        self.norm, self.gamma = norm, plan.tensor(norm.gamma)  # (d,)

    def scale(self):
        return self.gamma if self.norm.offset == 0 else norm_scale(self.norm)


def _joined_bias(biases, dtype):
    """The kept side-by-side bias of joined projections, or None where they have none."""
    return None if biases is None else kernels.concat_last(biases, dtype)


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
            self.leaves += [block.feed_forward.W_down] + ([block.q_norm, block.k_norm] if block.qk_norm else [])
        # Each layer's own policy: in a policy map (a reloaded quantized model's) its entry, which `quantize` replaces.
        self.policies = [own_policy(leaf) for leaf in self.leaves]
        self.lora = [getattr(leaf, "lora_enabled", False) for leaf in self.leaves]
        # what `current` compares each call: the policy objects the layers hold, their map entries, the
        # LoRA switches of the layers that have one
        self.held = [(leaf, leaf._dtype_policy) for leaf in self.leaves]
        self.mapped = [(leaf, policy) for leaf, policy in zip(self.leaves, self.policies) if isinstance(leaf._dtype_policy, DTypePolicyMap)]
        self.switches = [(leaf, lora) for leaf, lora in zip(self.leaves, self.lora) if hasattr(leaf, "lora_enabled")]
        self.variables, self._read = [], set()
        self.plain = all(
            (policy.quantization_mode is None or holds_blocks(leaf)) and policy.compute_dtype == policy.variable_dtype
            and policy.compute_dtype in ("float32", "bfloat16", "float16")  # those `kernels.rms_norm` takes
            for leaf, policy in zip(self.leaves, self.policies)
        ) and not any(self.lora)
        if not self.plain:
            return  # nothing is read: the layers run
        self.dtype = self.policies[0].compute_dtype  # one for all: `plain`
        self.layers = [TorchParts(self, block) for block in model.decoder_layers]
        self.final_norm = _Norm(self, model.final_norm)
        self.lm_head = None if model.lm_head is None else self.product(model.lm_head)
        self.embeddings = None if model.lm_head is not None else self.tensor(model.embedding.embeddings)
        self.fused = FusedBlocks.of(self, model)

    def current(self):
        """Whether every layer and variable is still the one this plan read."""
        # run before every call: identity checks only (a decoding step's budget is a few milliseconds)
        return (
            all(variable._value is tensor for variable, tensor in self.variables)
            and all(leaf._dtype_policy is policy for leaf, policy in self.held)
            and all(own_policy(leaf) is policy for leaf, policy in self.mapped)
            and all(leaf.lora_enabled == lora for leaf, lora in self.switches)
        )

    def tensor(self, variable):
        if id(variable) not in self._read:  # each variable checked once, however many parts read it
            self._read.add(id(variable))
            self.variables.append((variable, variable.value))
        return variable.value

    def product(self, dense):
        """x -> x W + b of a `Linear` without activation: a float kernel (d_in, d_out) or packed blocks."""
        if holds_blocks(dense):
            return self.blocks(dense)
        kernel, bias = self.tensor(dense.kernel), None if dense.bias is None else self.tensor(dense.bias)
        return lambda x: kernels.torch_linear(x, kernel, bias)

    def blocks(self, dense):
        """x -> x W^T + b of a `Linear` holding GGUF blocks (`layers.block_quantized`), as its
        `quantized_call` computes it."""
        values, scale = self.tensor(dense.block_values), self.tensor(dense.block_scale)
        offset = None if dense.block_offset is None else self.tensor(dense.block_offset)
        bias, layout = None if dense.bias is None else self.tensor(dense.bias), dense.block_format
        return lambda x: block_linear(x, values, scale, offset, bias, **layout)

    def kernels(self, denses):
        """The kernel variables of projections the step joins side by side (`concat_last` keeps the join
        and follows their changes)."""
        for dense in denses:
            self.tensor(dense.kernel)
        return [dense.kernel for dense in denses]

    def biases(self, denses):
        """Their bias variables, or None where they have none."""
        if any(dense.bias is None for dense in denses):
            return None
        for dense in denses:
            self.tensor(dense.bias)
        return [dense.bias for dense in denses]


class FusedBlocks:
    """Every block of a decoding step (one new token a sequence) in `decode_step.decode_layer`, one C
    call a block (docs/decisions.md item 143), for a model whose blocks it takes (`of`)."""

    def __init__(self, model, norms, weights, keep_alive):
        self.model, self.norms, self.weights, self._keep_alive = model, norms, weights, keep_alive

    @classmethod
    def of(cls, plan, model):
        """The fused blocks of `plan`'s model, or None where a block has something the kernel does not
        compute (then `decoder_block` runs): see `decode_step`."""
        import torch

        if plan.dtype != "float32" or not decode_step.available():
            return None
        norms, weights, keep_alive = [], [], []
        for block in model.decoder_layers:
            projections = [getattr(block.attention, r, None) or getattr(block.feed_forward, r) for r in decode_step.ROLES]
            block_norms = (block.attention_block.norm, block.feed_forward_block.norm)
            if block.qk_norm or block.activation != "silu" or any(n.offset != 0 for n in block_norms) or not all(
                holds_blocks(d) and decode_step.fusable_layout(d.block_format) for d in projections
            ):
                return None
            gammas = [plan.tensor(n.gamma) for n in block_norms]
            tensors = [
                (plan.tensor(d.block_values), plan.tensor(d.block_scale),
                 None if d.block_offset is None else plan.tensor(d.block_offset),
                 None if d.bias is None else plan.tensor(d.bias), d.block_format)
                for d in projections
            ]
            held = [t for entry in tensors for t in entry[:4] if t is not None] + gammas
            if not all(t.device.type == "cpu" and t.is_contiguous() for t in held):
                return None
            if any(t.dtype != torch.float32 for t in gammas) or any(
                entry[3] is not None and entry[3].dtype != torch.float32 for entry in tensors
            ) or not all(block_gemv.takes_scales(entry[1], entry[2]) for entry in tensors):
                return None  # biases float32; scales and offsets float32, or float16 both (GGUF's own)
            norms.append(gammas)
            weights.append(decode_step.projections(tensors))
            keep_alive.append(held)
        return cls(model, norms, weights, keep_alive)

    def takes(self, x, cache, start):
        """Whether this call is a decoding step the kernel runs: one new float32 token per sequence on
        the CPU, at most `block_gemv.MAX_ROWS` sequences, contiguous float32 cache buffers, and no
        autograd graph to record (the kernel has no gradient)."""
        import torch

        B, T, _ = x.shape
        return (
            cache is not None and T == 1 and 0 < B <= block_gemv.MAX_ROWS and x.dtype == torch.float32
            and x.device.type == "cpu" and not torch.is_grad_enabled() and cache.attended == start + 1
            and all(
                b.dtype == torch.float32 and b.device.type == "cpu" and b.is_contiguous()
                for b in (*cache.keys, *cache.values)
            )
        )

    def __call__(self, x, cos, sin, keeps, cache, start):
        """x (B, 1, d_model) through every block -> (B, 1, d_model); the cache written at slot `start`."""
        import torch

        model = self.model
        B = x.shape[0]
        x = x.reshape(B, model.d_model).clone()  # (B, d_model): written in place by the kernel
        cos, sin = cos.reshape(B, model.d_k).contiguous(), sin.reshape(B, model.d_k).contiguous()  # (B, d_k)
        masks = {}  # a keep-mask (B, 1, 1, S) as (B, S) bytes, once per distinct mask
        threads = torch.get_num_threads()
        for i, block in enumerate(model.decoder_layers):
            keep = keeps[i]
            if keep is not None and id(keep) not in masks:
                masks[id(keep)] = keep.reshape(B, -1).to(torch.uint8).contiguous()
            decode_step.decode_layer(
                x, self.norms[i], self.weights[i], (block.h, block.num_kv_heads, block.d_k), cos, sin,
                cache.keys[i], cache.values[i], start, None if keep is None else masks[id(keep)], block.epsilon, threads,
            )
        return x.reshape(B, 1, model.d_model)

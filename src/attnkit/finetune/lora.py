"""LoRA on a `CausalLM`'s projections with Keras's own `Dense.enable_lora`, and the adapter in PEFT's format.

    W x  ->  (W + (alpha / r) A B) x        Keras: A (d_in, r), B (r, d_out)
                                            PEFT:  lora_A.weight = A^T (r, d_in), lora_B.weight = B^T (d_out, r)

Only A and B train; every other variable (embeddings, norms, biases, the frozen kernels) is frozen.
A starts as PEFT's does (Kaiming-uniform, bound 1/sqrt(d_in)) and B at zero, so the model's outputs
are unchanged until the first step (docs/decisions.md item 121).

Legend: r rank, d_in / d_out a projection's input / output width.
"""

import keras
import numpy as np

# --lora-targets name -> (the layer's path inside a DecoderOnlyLayer, PEFT's / transformers' module name)
TARGETS = {
    "q": (("attention", "W_q"), "self_attn.q_proj"),
    "k": (("attention", "W_k"), "self_attn.k_proj"),
    "v": (("attention", "W_v"), "self_attn.v_proj"),
    "o": (("attention", "W_o"), "self_attn.o_proj"),
    "gate": (("feed_forward", "W_gate"), "mlp.gate_proj"),
    "up": (("feed_forward", "W_up"), "mlp.up_proj"),
    "down": (("feed_forward", "W_down"), "mlp.down_proj"),
}
PEFT_PREFIX = "base_model.model.model.layers"


def parse_targets(text):
    """"q,v" -> ["q", "v"] (in TARGETS' order); unknown or empty names refused."""
    names = [t.strip() for t in text.split(",")] if isinstance(text, str) else list(text)
    unknown = [t for t in names if t not in TARGETS]
    if unknown or not names:
        raise ValueError(f"--lora-targets must be a comma-separated subset of {','.join(TARGETS)}. Received: {text!r}")
    return [t for t in TARGETS if t in names]


def projections(model, targets):
    """[(layer index, target name, the Linear)] of `model` for `targets`."""
    found = []
    for i, layer in enumerate(model.decoder_layers):
        for name in targets:
            (block, attr), _ = TARGETS[name]
            found.append((i, name, getattr(getattr(layer, block), attr)))
    return found


def enable(model, targets, rank, alpha):
    """LoRA of rank `rank` and scale alpha / rank on `targets` of `model`; everything else frozen."""
    model.trainable = True
    for variable in model.variables:
        variable.trainable = False
    for _, _, dense in projections(model, targets):
        # PEFT's default A: kaiming_uniform_(a=sqrt(5)), i.e. U(-1/sqrt(d_in), 1/sqrt(d_in)); VarianceScaling's
        # uniform bound is sqrt(3 * scale / fan_in), fan_in = d_in for A's (d_in, r) shape.
        dense.enable_lora(rank, lora_alpha=alpha, a_initializer=keras.initializers.VarianceScaling(1 / 3, "fan_in", "uniform"))
    model._compiled = None  # a cached program of the old variables is remade (CausalLM._compiled_call)
    model._torch_decoding_plan = None


def peft_tensors(model, targets):
    """{PEFT tensor name: float32 array} of the adapter (adapter_model.safetensors)."""
    tensors = {}
    for i, name, dense in projections(model, targets):
        module = f"{PEFT_PREFIX}.{i}.{TARGETS[name][1]}"
        tensors[f"{module}.lora_A.weight"] = np.ascontiguousarray(keras.ops.convert_to_numpy(dense.lora_kernel_a).T)
        tensors[f"{module}.lora_B.weight"] = np.ascontiguousarray(keras.ops.convert_to_numpy(dense.lora_kernel_b).T)
    return tensors


def assign_peft_tensors(model, targets, tensors, source="the adapter"):
    """Sets the LoRA weights of `model` (LoRA enabled on `targets`) from PEFT's tensors; every tensor used."""
    tensors = dict(tensors)
    for i, name, dense in projections(model, targets):
        module = f"{PEFT_PREFIX}.{i}.{TARGETS[name][1]}"
        for suffix, variable in (("lora_A.weight", dense.lora_kernel_a), ("lora_B.weight", dense.lora_kernel_b)):
            key = f"{module}.{suffix}"
            if key not in tensors:
                raise ValueError(f"{source} has no tensor {key!r}")
            array = np.asarray(tensors.pop(key), "float32").T
            if array.shape != tuple(variable.shape):
                raise ValueError(f"{source}: {key!r} has shape {array.T.shape}; expected {tuple(variable.shape)[::-1]}")
            variable.assign(array)
    if tensors:
        raise ValueError(f"{source} has tensors the model does not use: {sorted(tensors)[:5]}")


def adapter_config(targets, rank, alpha, base):
    """adapter_config.json as PEFT writes it for a LoRA adapter of a causal LM (fields PEFT reads)."""
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base, "r": rank, "lora_alpha": alpha,
        "target_modules": sorted(TARGETS[t][1].split(".")[1] for t in targets), "lora_dropout": 0.0, "bias": "none",
        "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "init_lora_weights": True,
        "inference_mode": True, "modules_to_save": None, "layers_to_transform": None,
    }


def merged_weights(model):
    """{HF name: (out, in) float32 array} of `model` with every LoRA update merged into its kernel
    (`Dense.kernel` is the merged kernel while LoRA is enabled)."""
    def array(v):
        return np.asarray(keras.ops.convert_to_numpy(keras.ops.cast(v, "float32")))

    weights = {"model.embed_tokens.weight": array(model.embedding.embeddings), "model.norm.weight": array(model.final_norm.gamma)}
    for i, layer in enumerate(model.decoder_layers):
        prefix = f"model.layers.{i}."
        for name, ((block, attr), hf) in TARGETS.items():
            dense = getattr(getattr(layer, block), attr)
            weights[f"{prefix}{hf}.weight"] = np.ascontiguousarray(array(dense.kernel).T)
            if dense.use_bias and not (name == "o" and not layer.output_bias):
                weights[f"{prefix}{hf}.bias"] = array(dense.bias)
        weights[prefix + "input_layernorm.weight"] = array(layer.attention_block.norm.gamma)
        weights[prefix + "post_attention_layernorm.weight"] = array(layer.feed_forward_block.norm.gamma)
        if layer.qk_norm:  # Qwen3's RMSNorms over each head's queries and keys (d_k,)
            weights[prefix + "self_attn.q_norm.weight"] = array(layer.q_norm.gamma)
            weights[prefix + "self_attn.k_norm.weight"] = array(layer.k_norm.gamma)
    if model.lm_head is not None:
        weights["lm_head.weight"] = np.ascontiguousarray(array(model.lm_head.kernel).T)
    return weights

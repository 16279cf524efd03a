"""Sub-layer dtype policies: the one place where a layer's config records the policies of the layers it
owns, and the one way attnkit reads a layer's own policy (docs/decisions.md item 91).

A composite layer (`MultiHeadAttention`, `EncoderLayer`, ..., `Transformer`, `CausalLM`) makes its
sub-layers in its own dtype policy. `quantize` gives a sub-layer a policy of its own
("int8_from_float32", with int8 variables) that the parent's constructor arguments do not say: a
reloaded model made every sub-layer in float, and Keras refused the int8 variables by name.

Keras's documented way (`keras.dtype_policies.DTypePolicyMap`, as keras-hub's backbones use it): the
parent's config holds, as its `dtype`, a map from sub-layer paths to their policies whose default is the
parent's own. The parent passes its policy, the map, to its sub-layers as their `dtype`, and Keras's
`Layer` resolves each one's `compute_dtype`, `variable_dtype` and `quantization_mode` by its path, so a
sub-layer is rebuilt with its own variables. `SublayerPolicies` writes the map; `own_policy` reads a
layer's entry where attnkit reads a policy itself (`layer.dtype_policy` is the whole map, whose
`quantization_mode` is the default's).

The keys are the sub-layers' paths below the composite layer, after any prefix
("(?:.*/)?encoder_layer/multihead_attention/W_q"): a layer's path is the name scope it is built in,
and a `Sequential` model builds its layers under its own name ("sequential/encoder_layer/...") but
reloads them outside it ("encoder_layer/..."), where a key of the whole path would match nothing.
"""

import re

import keras
from keras.dtype_policies import DTypePolicyMap


def own_policy(layer):
    """The `DTypePolicy` `layer` computes in: its entry in a `DTypePolicyMap` (by its path, as Keras's
    `Layer.compute_dtype` and `quantization_mode` read it), or its policy."""
    policy = layer.dtype_policy
    if isinstance(policy, DTypePolicyMap) and layer.path:
        return policy[layer.path]
    return policy


class SublayerPolicies:
    """A mixin, before `keras.layers.Layer` (or `keras.Model`) in the bases of every attnkit layer that
    owns layers: `get_config`'s `dtype` is a `DTypePolicyMap` of the sub-layers (at any depth) whose
    policy is not the layer's own (quantized ones, or one given its own policy), defaulting to the
    layer's own policy. Where every sub-layer has the layer's policy, `dtype` is that policy as before,
    so a non-quantized layer's config is unchanged."""

    def get_config(self):
        config = super().get_config()
        policies = sublayer_policies(self)
        if policies is not None:
            config["dtype"] = keras.dtype_policies.serialize(policies)
        return config

    def save_own_variables(self, store):
        # Keras saves a quantized layer with LoRA as its kernel plus the LoRA update, quantized again, and
        # loads it without the update: the reloaded model would compute other numbers. Refused, naming it.
        for sublayer in self._flatten_layers(include_self=False, recursive=False):
            if getattr(sublayer, "quantization_mode", None) is not None and getattr(sublayer, "lora_enabled", False):
                raise ValueError(
                    f"Cannot save '{sublayer.path}': it is quantized ({sublayer.quantization_mode}) with LoRA "
                    "enabled, which Keras saves merged into the kernel and quantized again, so the reloaded "
                    "model would not compute what this one does. Save the float model with LoRA (its merge is "
                    "exact) and quantize after loading, or keep the LoRA factors (`lora_kernel_a`, "
                    "`lora_kernel_b`) yourself."
                )
        super().save_own_variables(store)


def sublayer_policies(layer):
    """The `DTypePolicyMap` of `layer`'s sub-layers whose policy differs from its own (keys as in the
    module docstring), or None where none does."""
    default = own_policy(layer)
    entries = {}
    for path, sublayer in _sublayer_paths(layer, layer.name):
        policy = own_policy(sublayer)
        if policy.name != default.name or type(policy) is not type(default):
            entries["(?:.*/)?" + re.escape(path)] = policy
    if not entries:
        return None
    return DTypePolicyMap(default_policy=default, policy_map=entries)


def _sublayer_paths(layer, path, seen=None):
    """(path, sub-layer) for every layer `layer` owns at any depth, each once, depth first in Keras's
    order. A path is the names from `layer` down, as building `layer` nests its sub-layers' name scopes."""
    seen = set() if seen is None else seen
    for sublayer in layer._flatten_layers(include_self=False, recursive=False):
        if id(sublayer) in seen:
            continue
        seen.add(id(sublayer))
        sublayer_path = f"{path}/{sublayer.name}"
        yield sublayer_path, sublayer
        yield from _sublayer_paths(sublayer, sublayer_path, seen)

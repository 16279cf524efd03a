"""The decoder-only families attnkit loads, one file each (docs/decisions.md item 101).

    family = family_of(config, source)     # DecoderFamily of config.json's model_type
    CausalLM(**family.arguments(source, config))

A new family is one file (its `DecoderFamily`) and one line in FAMILIES. (The encoder families
are in `families.__init__`.)
"""

from attnkit.checkpoints.families import gemma, llama, phi3, qwen3

FAMILIES = (llama.FAMILY, qwen3.FAMILY, gemma.FAMILY, phi3.FAMILY)

# Decoder model_types near a family that attnkit does not run exactly, and why: refused by name.
REFUSED = {
    "gemma2": "Gemma 2's attention and final-logit soft-capping, its alternating sliding windows and extra norms",
    "gemma3": "Gemma 3's extra norms, q/k norms with offset and alternating local/global RoPE",
    "gemma3_text": "Gemma 3's extra norms, q/k norms with offset and alternating local/global RoPE",
    "qwen3_moe": "mixture-of-experts feed-forward layers",
    "qwen2_moe": "mixture-of-experts feed-forward layers",
    "mixtral": "mixture-of-experts feed-forward layers",
    "phimoe": "mixture-of-experts feed-forward layers",
    "phi": "Phi-1/2's parallel block, LayerNorm and partial rotary embeddings",
}
GGUF_ARCHITECTURES = {arch: (family, layout) for family in FAMILIES for arch, layout in family.gguf.items()}


def model_types():
    return tuple(t for f in FAMILIES for t in f.model_types)


def family_named(model_type):
    """The `DecoderFamily` whose model_types hold `model_type`, or None."""
    return next((f for f in FAMILIES if model_type in f.model_types), None)


def family_of(config, source="config.json"):
    """config's family; a model_type attnkit does not load refused by name (with the reason where it is
    a near relative of a family it loads)."""
    model_type = config.get("model_type")
    family = family_named(model_type)
    if family is not None:
        return family
    why = f" ({REFUSED[model_type]} are not implemented)" if model_type in REFUSED else ""
    raise ValueError(f"{source}: model_type {model_type!r} is not a decoder attnkit loads{why} (supported: {model_types()})")

"""Reading a decoder config.json's fields: JSON types checked before conversion, every field attnkit
does not implement refused by name (docs/decisions.md items 35 and 101). The family files call these.

Legend: n layers.
"""

import numbers

from attnkit.ops.rotary import check_rope_scaling

# JSON types of config fields: bool("false") is True and float(None) a TypeError naming no field,
# so a value is checked against its type before it is converted.
JSON_TYPES = {
    "a boolean (true or false)": lambda v: isinstance(v, bool),
    "a number": lambda v: isinstance(v, numbers.Real) and not isinstance(v, bool),
    "an integer >= 0": lambda v: isinstance(v, numbers.Integral) and not isinstance(v, bool) and v >= 0,
    "an integer": lambda v: isinstance(v, numbers.Integral) and not isinstance(v, bool),
    "a string": lambda v: isinstance(v, str),
    "an object": lambda v: isinstance(v, dict),
    "a list of strings": lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
    "a token id (an integer >= 0) or a list of them": lambda v: all(
        isinstance(x, numbers.Integral) and not isinstance(x, bool) and x >= 0 for x in (v if isinstance(v, list) else [v])
    ),
}
BOOLEAN = "a boolean (true or false)"


def size(source, config, key, default=None):
    """config[key] as an integer >= 1, `default` when absent or null; anything else refused by name."""
    value = config.get(key)
    if value is None and default is not None:
        return default
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
        raise ValueError(f"{source}: `{key}` must be a positive integer. Received: {key}={value!r}")
    return int(value)


def field(source, config, key, expected, default, *, nullable=False, parent=None):
    """config[key] if it is of the JSON type `expected` (a key of JSON_TYPES), `default` when the
    key is absent, or null where transformers' config allows null (`nullable`); anything else is
    refused naming `source` and the field (`parent.key` inside an object field)."""
    if key not in config or (nullable and config[key] is None):
        return default
    value = config[key]
    if not JSON_TYPES[expected](value):
        name = f"{parent}.{key}" if parent else key
        null = " or null" if nullable else ""
        raise ValueError(f"{source}: `{name}` must be {expected}{null}. Received: {name}={value!r}")
    return value


def common_arguments(source, config, *, activations, head_dim=None, tie=False, epsilon=1e-6):
    """The `CausalLM` arguments every decoder family reads alike: sizes, RoPE, the norms' epsilon, tied
    embeddings and the gate's activation.

    Args:
        activations: {config's hidden_act: attnkit's activation}; its first key is the default.
        head_dim: the config class's default head_dim (None: d_model // h, as Llama's).
        tie, epsilon: the config class's defaults of tie_word_embeddings and rms_norm_eps.
    """
    default_act = next(iter(activations))
    act = field(source, config, "hidden_act", "a string", default_act)
    if act not in activations:
        raise ValueError(
            f"{source}: hidden_act {act!r} is not implemented in attnkit for model_type {config.get('model_type')!r} "
            f"(only {tuple(activations)})"
        )
    n, h, d_model = (size(source, config, key) for key in ("num_hidden_layers", "num_attention_heads", "hidden_size"))
    return dict(
        vocab_size=size(source, config, "vocab_size"), n=n, d_model=d_model, h=h,
        d_ff=size(source, config, "intermediate_size"), num_kv_heads=size(source, config, "num_key_value_heads", h),
        d_k=size(source, config, "head_dim", head_dim or d_model // h), rope_theta=float(rope_theta(config, source)),
        epsilon=float(field(source, config, "rms_norm_eps", "a number", epsilon)),
        tie_embeddings=field(source, config, "tie_word_embeddings", BOOLEAN, tie), activation=activations[act],
    )


def rope_theta(config, source):
    """RoPE's base, after refusing a scaling or partial rotation attnkit does not implement, named as
    the file names it.

    transformers 5 reads one RoPE object: `rope_scaling` (transformers 4's key) when it is set, else
    `rope_parameters`; the base and partial_rotary_factor in that object win over the top level's,
    and the base defaults to 10000."""
    scaling = field(source, config, "rope_scaling", "an object", None, nullable=True)
    check_rope_scaling(scaling, name="rope_scaling", source=source)
    parameters = field(source, config, "rope_parameters", "an object", None, nullable=True)
    check_rope_scaling(parameters, name="rope_parameters", source=source)
    parent = "rope_scaling" if scaling else "rope_parameters"
    rope = scaling or parameters or {}  # an empty object is none, as in transformers
    within = parent if "partial_rotary_factor" in rope else None
    partial = field(source, rope if within else config, "partial_rotary_factor", "a number", 1.0, nullable=True, parent=within)
    if partial != 1.0:
        name = f"{within}.partial_rotary_factor" if within else "partial_rotary_factor"
        raise ValueError(f"{source}: `{name}` other than 1 is not implemented in attnkit. Received: {name}={partial!r}")
    if "rope_theta" in rope:
        return field(source, rope, "rope_theta", "a number", None, parent=parent)
    return field(source, config, "rope_theta", "a number", 10000.0)


def window(source, config, default):
    """config's `sliding_window`: null is full attention (None); absent, the config class's `default`."""
    if "sliding_window" in config and config["sliding_window"] is None:
        return None
    return field(source, config, "sliding_window", "an integer >= 0", default, nullable=True)


def windows_by_layer_types(source, config, n, window, qwen=False):
    """Each layer's window by `layer_types` ("full_attention" / "sliding_attention"), or None when the
    config has none; a list of the wrong length or kinds, or sliding layers without a window, refused.
    `qwen`: the window is also off when `use_sliding_window` is false (named in the message)."""
    layer_types = field(source, config, "layer_types", "a list of strings", None, nullable=True)
    if layer_types is None:
        return None
    if len(layer_types) != n or not set(layer_types) <= {"full_attention", "sliding_attention"}:
        raise ValueError(
            f"{source}: `layer_types` must list 'full_attention' or 'sliding_attention' for each of the "
            f"num_hidden_layers={n} layers. Received: layer_types={layer_types!r}"
        )
    if window is None and "sliding_attention" in layer_types:  # transformers fails at the first call
        raise ValueError(
            f"{source}: `layer_types` names 'sliding_attention' layers but the config sets no window "
            f"(`sliding_window` null{', or `use_sliding_window` false' if qwen else ''}). "
            f"Received: layer_types={layer_types!r}, sliding_window={config.get('sliding_window')!r}"
            + (f", use_sliding_window={config.get('use_sliding_window')!r}" if qwen else "")
        )
    return [window if t == "sliding_attention" else None for t in layer_types]


def every_layer_windows(source, config, n, default):
    """Mistral's (and Phi-3's) windows: `layer_types` where given (Mistral's make it transformers'
    Ministral), else the one window on every layer; `default`: the config class's sliding_window."""
    w = window(source, config, default)
    by_type = windows_by_layer_types(source, config, n, w)
    return by_type if by_type is not None else [w] * n


def qwen_windows(source, config, n):
    """Qwen2's and Qwen3's windows: none unless `use_sliding_window` is true, whatever `layer_types`
    says; then `layer_types`, else the layers from `max_window_layers` on."""
    w = window(source, config, 4096)  # Qwen2Config's and Qwen3Config's default
    if not field(source, config, "use_sliding_window", BOOLEAN, False):
        w = None
    by_type = windows_by_layer_types(source, config, n, w, qwen=True)
    if by_type is not None:
        return by_type
    if w is None:
        return [None] * n
    first = field(source, config, "max_window_layers", "an integer >= 0", 28)  # the config classes' default
    return [w if i >= first else None for i in range(n)]


def refuse(source, config, key, allowed, why):
    """Refuses config[key] unless it is absent or in `allowed`, naming the field and `why`."""
    if key in config and config[key] not in allowed:
        raise ValueError(f"{source}: `{key}`={config[key]!r} is not implemented in attnkit ({why})")

"""Reading one field of a config.json: the type and range checks every family shares.

Every problem is a `ValueError` naming the file and the key.
"""


def positive_int(file, config, key, default=None):
    """config[key] as an integer >= 1 (`default` when absent and a default is given)."""
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{file}: `{key}` must be a positive integer. Received: {key}={value!r}")
    return value


def number(file, config, key, default):
    """config[key] as a float (`default` when absent); anything but a real number is refused."""
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:  # value != value: NaN
        raise ValueError(f"{file}: `{key}` must be a number. Received: {key}={value!r}")
    return float(value)


def dropout(file, config, key, default):
    rate = number(file, config, key, default)
    if not 0 <= rate < 1:
        raise ValueError(f"{file}: `{key}` must be in [0, 1). Received: {key}={rate!r}")
    return rate


def epsilon(file, config, key, default):
    value = number(file, config, key, default)
    if not value > 0:
        raise ValueError(f"{file}: `{key}` must be a positive number. Received: {key}={value!r}")
    return value


def pad_id(file, config, vocab_size, default):
    """pad_token_id: null pads with 0, which the padding mask hides (docs/decisions.md item 27)."""
    value = config.get("pad_token_id", default)
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < vocab_size:
        raise ValueError(
            f"{file}: `pad_token_id` must be null or an integer in [0, vocab_size={vocab_size}). "
            f"Received: pad_token_id={value!r}"
        )
    return value


# transformers' ACT2FN names and the FeedForward activation computing each exactly.
ACTIVATIONS = {
    "gelu": "gelu", "gelu_python": "gelu",  # the exact erf form
    "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh",  # tanh approximation
    "relu": "relu", "silu": "silu", "swish": "silu",
}


def activation(file, config, key, default):
    value = config.get(key, default)
    if not isinstance(value, str) or value not in ACTIVATIONS:  # a list or object is not hashable
        raise ValueError(
            f"{file}: `{key}` {value!r} is not supported; attnkit computes {sorted(ACTIVATIONS)}"
        )
    return ACTIVATIONS[value]


def refuse_true(file, config, key, meaning):
    """Refuses a flag attnkit's encoder does not implement, naming it."""
    if config.get(key):
        raise ValueError(f"{file}: `{key}`={config[key]!r} ({meaning}) is not supported by attnkit's encoder")


def heads_divide(file, d_model, h, width_key, heads_key):
    if d_model % h:
        raise ValueError(
            f"{file}: `{width_key}` must be a multiple of `{heads_key}`. "
            f"Received: {width_key}={d_model}, {heads_key}={h}"
        )
    return d_model // h

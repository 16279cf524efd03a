"""Reading one field of a config.json: the type and range checks every family shares.

The config holds every field read, absent ones at transformers' defaults (`defaults.with_defaults`).
Every problem is a `ValueError` naming the file and the key.
"""


def positive_int(file, config, key):
    """config[key] as an integer >= 1."""
    value = config.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{file}: `{key}` must be a positive integer. Received: {key}={value!r}")
    return value


def number(file, config, key):
    """config[key] as a float; anything but a real number is refused."""
    value = config.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:  # value != value: NaN
        raise ValueError(f"{file}: `{key}` must be a number. Received: {key}={value!r}")
    return float(value)


def dropout(file, config, key):
    rate = number(file, config, key)
    if not 0 <= rate < 1:
        raise ValueError(f"{file}: `{key}` must be in [0, 1). Received: {key}={rate!r}")
    return rate


def epsilon(file, config, key):
    value = number(file, config, key)
    if not value > 0:
        raise ValueError(f"{file}: `{key}` must be a positive number. Received: {key}={value!r}")
    return value


def pad_id(file, config, vocab_size):
    """pad_token_id as the encoder's pad_id.

    null pads with 0, which the padding mask hides (docs/decisions.md item 27). A negative id is
    accepted as torch's Embedding accepts its padding_idx, down to -vocab_size (counted from the end;
    transformers warns): it only keeps that row's gradient at zero in torch and never equals a token
    id, so no token is padding by its id: None (docs/decisions.md item 94).
    """
    value = config.get("pad_token_id")
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or not -vocab_size <= value < vocab_size:
        raise ValueError(
            f"{file}: `pad_token_id` must be null or an integer in [-vocab_size, vocab_size) = "
            f"[{-vocab_size}, {vocab_size}). Received: pad_token_id={value!r}"
        )
    return None if value < 0 else value


# transformers' ACT2FN names and the FeedForward activation computing each exactly.
ACTIVATIONS = {
    "gelu": "gelu", "gelu_python": "gelu",  # the exact erf form
    "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh",  # tanh approximation
    "relu": "relu", "silu": "silu", "swish": "silu",
}


def activation(file, config, key):
    value = config.get(key)
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

"""`StackConfig`: one place for a Transformer stack's sizes, their checks and their `get_config`.

The encoder and decoder layers, `Encoder`, `Decoder` and `BertEncoder` take the same sizes (the paper's
h, d_k, d_v, d_model, d_ff, n, the dropout rate, the norm position, the activation and the norm's
epsilon). Each names the fields it has in `_config_fields`, sets them through `set_sizes` (checked
here, with one message format) and gets a complete `get_config` from them (docs/decisions.md item 46).
"""

from attnkit._validation import boolean, positive_float, positive_int
from attnkit._validation import rate as dropout_rate
from attnkit.layers.feed_forward import check_activation

# The check of each size by name; every check returns the value as stored (int, float, bool, str).
SIZE_CHECKS = {
    "vocab_size": positive_int,
    "sequence_length": positive_int,
    "h": positive_int,
    "d_k": positive_int,
    "d_v": positive_int,
    "d_model": positive_int,
    "d_ff": positive_int,
    "n": positive_int,
    "rate": dropout_rate,
    "norm_first": lambda name, value: bool(boolean(name, value)),
    "activation": lambda name, value: check_activation(value),
    "epsilon": positive_float,
}


class StackConfig:
    """A mixin, before `keras.layers.Layer` in the bases: checked sizes as attributes, and `get_config`.

    `_config_fields` lists, in order, the constructor arguments `get_config` returns: the sizes
    (checked by `set_sizes`) and any other attribute of the same name (`pad_id`, `position`, ...).
    """

    _config_fields = ()

    def set_sizes(self, **sizes):
        """Checks each size (a `SIZE_CHECKS` name) and stores it as the attribute of that name.

        Raises:
            ValueError, TypeError: the size's check failed; the message names it.
        """
        for name, value in sizes.items():
            setattr(self, name, SIZE_CHECKS[name](name, value))

    def get_config(self):
        return {**super().get_config(), **{name: getattr(self, name) for name in self._config_fields}}


# The fields of one encoder or decoder layer, and of a stack of them with its embeddings.
LAYER_FIELDS = ("h", "d_k", "d_v", "d_model", "d_ff", "rate", "norm_first", "activation", "epsilon")
STACK_FIELDS = ("vocab_size", "sequence_length", "h", "d_k", "d_v", "d_model", "d_ff", "n", "rate", "pad_id",
                "norm_first", "activation", "epsilon", "position")

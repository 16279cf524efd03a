"""Models built from attnkit's layers, and loading pretrained checkpoints into them."""

from attnkit.models.bert import BertEncoder
from attnkit.models.pretrained import PretrainedEncoder, load_pretrained

__all__ = ["BertEncoder", "PretrainedEncoder", "load_pretrained"]

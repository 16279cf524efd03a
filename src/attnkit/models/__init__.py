"""Models built from attnkit's layers (Transformer, BertEncoder, CausalLM) and their runtime: decoding,
generation, inference functions. Checkpoint reading is in `attnkit.checkpoints`, loading in `attnkit.pipelines`."""

from attnkit.models.bert import BertEncoder

__all__ = ["BertEncoder"]

"""The explorer's source for pretrained encoders (`attnkit.load_pretrained`): every layer's self-attention."""

import os
import warnings

import numpy as np

from attnkit.explorer.contract import Attention, make_data
from attnkit.explorer.sources.checks import check_text
from attnkit.pipelines.encoder import load_pretrained

DEFAULT_NAME = "all-MiniLM-L6-v2"


class EncoderSource:
    """A `PretrainedEncoder` as an explorer source.

    Args:
        encoder: a `PretrainedEncoder`.
        name: the model's name in the page.
    """

    kind = "pretrained-encoder"

    def __init__(self, encoder, name):
        self.encoder, self.name = encoder, name
        self.max_tokens = encoder.max_length

    @classmethod
    def load(cls, path=None):
        """`load_pretrained(path)`; None is the embedded all-MiniLM-L6-v2."""
        encoder = load_pretrained(path)
        name = DEFAULT_NAME if path is None else os.path.basename(os.path.abspath(path))
        return cls(encoder, name)

    def describe(self):
        return {"model": self.name, "source": self.kind, "max_tokens": self.max_tokens, "generates": False}

    def attention(self, text, *, decimals=4):
        """The data contract of `text`: n layers of (h, T, T) self-attention, [CLS] and [SEP] included.

        A text past `max_tokens` is truncated as `PretrainedEncoder` truncates it, with a note.
        """
        check_text(text)
        encoder = self.encoder
        # The count before truncation, for the note. `tokenize` leaves truncation off when it returns.
        encoder.tokenizer.no_truncation()
        full = len(encoder.tokenizer.encode(text).ids)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # the truncation warning: a note here
            tokens = encoder.tokens(text)
            layers = encoder.attentions(text)  # n x (h, T, T)
        notes = []
        if full > self.max_tokens:
            notes.append(
                f"The text is {full} tokens long ([CLS] and [SEP] included); {self.name} reads at most "
                f"{self.max_tokens}, so it was truncated to its first {self.max_tokens} tokens."
            )
        weights = np.stack(layers)  # (n, h, T, T)
        return make_data(
            model=self.name, source=self.kind, text=text, tokens=tokens, notes=notes, decimals=decimals,
            attention=[Attention("self-attention", tokens, tokens, weights)],
        )

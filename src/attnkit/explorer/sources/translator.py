"""The explorer's source for the date translator (`attnkit demo` / `attnkit train`): encoder
self-attention, and the decoder's self- and cross-attention step by step as the output is decoded.

Greedy decoding (as `attnkit translate`) produces the output; one teacher-forced pass of the decoder
over the decoded prefix then gives every step's weights at once. The decoder's self-attention is
causal, so its row t is exactly the row step t computed when only t + 1 tokens existed (decoding
with or without a cache gives the same numbers, docs/decisions.md item 7); the tests compare the
rows with the cached decoding's cross-attention and with step-by-step decoder calls.

Legend: S source characters, T_out decoding steps (the generated tokens, the end token included),
n layers, h heads.
"""

import os

import numpy as np

from attnkit.explorer.contract import Attention, Steps, make_data
from attnkit.explorer.sources import check_text


def _numpy(x):
    if hasattr(x, "detach"):
        x = x.detach().cpu()
    from keras import ops

    return np.asarray(ops.convert_to_numpy(x), dtype=np.float32)


def _stack(weights):
    """n arrays (1, h, T_q, T_k) -> one (n, h, T_q, T_k)."""
    return np.stack([_numpy(w)[0] for w in weights])


class TranslatorSource:
    """A `DateTranslator` as an explorer source.

    Args:
        translator: a `DateTranslator`.
        name: the model's name in the page.
    """

    kind = "date-translator"

    def __init__(self, translator, name):
        self.translator, self.name = translator, name
        self.max_tokens = translator.source_length

    @classmethod
    def load(cls, path):
        from attnkit.translation import DateTranslator

        return cls(DateTranslator.load(path), os.path.basename(os.path.abspath(path)))

    def describe(self):
        return {"model": self.name, "source": self.kind, "max_tokens": self.max_tokens, "generates": True}

    def attention(self, text, *, decimals=4):
        """The data contract of `text`: 3 attentions (encoder self, decoder self, cross) and the steps.

        A text past the model's `source_length` characters is truncated, with a note.
        """
        from attnkit.models.decoding import greedy_decode

        check_text(text)
        translator, tok = self.translator, self.translator.tokenizer
        notes = []
        source_text = text
        if len(text) > self.max_tokens:
            source_text = text[: self.max_tokens]
            notes.append(
                f"The text is {len(text)} characters long; {self.name} reads at most {self.max_tokens}, so it "
                f"was truncated to {source_text!r}."
            )
        S = len(source_text)
        source = translator.encode_sources([source_text])  # (1, source_length), padded with PAD
        decoded = greedy_decode(translator.model, source, start_id=tok.START, end_id=tok.END)
        outputs = tok.display_tokens(decoded.ids[0])  # T_out labels, up to and including </s>
        T_out = len(outputs)
        prefix = np.concatenate([[tok.START], decoded.ids[0, : T_out - 1]]).astype(np.int32)[None]  # (1, T_out)
        encoder_self, decoder_self, cross = self._weights(source, prefix)
        inputs = [tok.SPECIALS[tok.START]] + outputs[:-1]  # the decoder's input at each step
        chars = list(source_text)
        attention = [
            Attention("encoder self-attention", chars, chars, encoder_self[:, :, :S, :S]),
            Attention("decoder self-attention", inputs, inputs, decoder_self, stepwise=True, causal=True),
            Attention("cross-attention", inputs, chars, cross[:, :, :, :S], stepwise=True),
        ]
        return make_data(
            model=self.name, source=self.kind, text=text, tokens=chars, attention=attention, notes=notes,
            decimals=decimals,
            steps=Steps(labels=outputs, query_rows=list(range(1, T_out + 1))), output=tok.decode(decoded.ids[0]),
        )

    def _weights(self, source, prefix):
        """(encoder self (n, h, S', S'), decoder self (n, h, T_out, T_out), cross (n, h, T_out, S'))
        for the padded `source` (1, S') and the decoder inputs `prefix` (1, T_out)."""
        model = self.translator.model
        source_mask = model.encoder.compute_mask(source)  # (1, S') True at the characters
        encoder_output, encoder_weights = model.encoder(
            source, source_mask, training=False, return_attention_weights=True
        )
        # Every prefix token is real, as in decoding, which hides none (docs/decisions.md item 7).
        every_token = np.ones(prefix.shape, dtype=bool)
        _, self_weights, cross_weights = model.decoder(
            prefix, encoder_output, every_token, source_mask, training=False, return_attention_weights=True
        )
        return _stack(encoder_weights), _stack(self_weights), _stack(cross_weights)

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

from attnkit.dates.markers import output_marker, refusal
from attnkit.dates.translator import DateTranslator
from attnkit.explorer.contract import Attention, make_data, Steps
from attnkit.explorer.sources.checks import BadInput, check_text
from attnkit.models.decoding import greedy_decode


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
        return cls(DateTranslator.load(path), os.path.basename(os.path.abspath(path)))

    def describe(self):
        return {"model": self.name, "source": self.kind, "max_tokens": self.max_tokens, "generates": True}

    def attention(self, text, *, decimals=4):
        """The data contract of `text`: 3 attentions (encoder self, decoder self, cross) and the steps.

        A text past the model's `source_length` characters is truncated, with a note. A text that
        `attnkit translate` refuses (unknown characters, no such date) or whose output it marks (not a
        date) is still decoded, with a note giving translate's marker.

        Raises:
            BadInput: an empty text, or one whose first `source_length` characters are blank.
        """
        check_text(text)
        translator, tok = self.translator, self.translator.tokenizer
        source_text, notes = self._truncated(text)
        S = len(source_text)
        source = translator.encode_sources([source_text])  # (1, source_length), padded with PAD
        decoded = greedy_decode(translator.model, source, start_id=tok.START, end_id=tok.END)
        output = tok.decode(decoded.ids[0])
        marker = refusal(translator, source_text)  # translate's own checks, on the characters the model reads
        if marker:
            notes.append(f"attnkit translate refuses this text: {marker}. The output is the model's guess regardless.")
        elif marker := output_marker(output):
            notes.append(f"attnkit translate marks this output {marker}.")
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
            steps=Steps(labels=outputs, query_rows=list(range(1, T_out + 1))), output=output,
        )

    def _truncated(self, text):
        """(the first `max_tokens` characters of `text`, [a note when that cut any off]); raises
        `BadInput` when they are blank, which the model cannot translate (translate marks it <empty>)."""
        if len(text) <= self.max_tokens:
            return text, []
        source_text = text[: self.max_tokens]
        if not source_text.strip():
            raise BadInput(
                f"The text's first {self.max_tokens} characters, all that {self.name} reads, are blank: put the "
                f"date within its first {self.max_tokens} characters."
            )
        note = (
            f"The text is {len(text)} characters long; {self.name} reads at most {self.max_tokens}, so it was "
            f"truncated to {source_text!r}."
        )
        return source_text, [note]

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

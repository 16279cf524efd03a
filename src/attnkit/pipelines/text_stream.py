"""Generated tokens as streamed text: each token's new characters as soon as they are whole, and
whatever is held back released when the generation ends (docs/decisions.md item 107).

A byte-level token can end inside a UTF-8 character ("€" is three bytes, often three tokens); its
text then ends with U+FFFD until the next byte comes, so the piece is held back. When the generation
ends (its last token, a stop token, `should_stop`), the held-back text is released as `decode` gives
it (U+FFFD for bytes that never completed), so the pieces joined equal the decoded tokens, which is
what `generate` returns.
"""


class TextPieces:
    """The text of a growing list of token ids, piece by piece.

    Args:
        decode: a function of a list of ids to their text (the tokenizer's, special tokens skipped).

    Example:
    >>> pieces = TextPieces(lm.decode)
    >>> "".join(pieces.add(t) for t in ids) + pieces.finish() == lm.decode(ids)
    """

    def __init__(self, decode):
        self.decode, self.ids, self.shown = decode, [], ""

    def add(self, token):
        """The new text after `token` ("" while it ends inside a character)."""
        self.ids.append(int(token))
        text = self.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""  # an incomplete UTF-8 character: wait for its next byte
        return self._after_shown(text)

    def finish(self):
        """The text held back so far ("" when none): the generation has ended."""
        return self._after_shown(self.decode(self.ids)) if self.ids else ""

    def _after_shown(self, text):
        # A longer list's text starts with the shorter list's once that ends on a whole character
        # (byte-level decoding, tested by hypothesis; Metaspace / ByteFallback + Fuse + Strip strip only
        # the first token's space): what was shown stands.
        piece, self.shown = text[len(self.shown):], text
        return piece

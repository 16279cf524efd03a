"""Generated tokens as streamed text: each token's new characters as soon as they are whole and no
stop string can still claim them, and whatever is held back released when the generation ends
(docs/decisions.md item 107). `CausalLMPipeline.stream` and the server's requests both use it.

A byte-level token can end inside a UTF-8 character ("€" is three bytes, often three tokens); its
text then ends with U+FFFD until the next byte comes, so that tail is held back. A stop string
("\\n\\n", "User:") may begin in one token's text and end in a later one's, so the last
len(longest stop string) - 1 characters are held back too; when a stop string appears, the text ends
just before it (the OpenAI API's rule: the stop string is not returned). When the generation ends
(its last token, a stop token, `should_stop`), `finish` releases the held-back text as `decode` gives
it (U+FFFD for bytes that never completed), so the pieces joined equal the decoded tokens, which is
what `generate` returns.
"""


class TextPieces:
    """The text of a growing list of token ids, piece by piece.

    Args:
        decode: a function of a list of ids to their text (the tokenizer's, special tokens skipped).
        stop: stop strings (each non-empty): the text ends before the first one found.

    Attributes:
        stopped: True once a stop string was found (`add` then returns the text before it; the
            caller ends the generation).

    Example:
    >>> pieces = TextPieces(lm.decode)
    >>> "".join(pieces.add(t) for t in ids) + pieces.finish() == lm.decode(ids)
    """

    def __init__(self, decode, stop=()):
        if isinstance(stop, str):
            raise TypeError(f"`stop` must be a list of strings, not one string. Received: stop={stop!r}")
        self.decode, self.stop = decode, list(stop)
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"`stop` must be non-empty strings. Received: stop={self.stop!r}")
        self.hold = max((len(s) for s in self.stop), default=1) - 1  # characters a stop string may still claim
        self.ids, self.text, self.shown, self.stopped = [], "", 0, False

    def add(self, token):
        """The new text after `token` ("" while it ends inside a character or may start a stop string)."""
        self.ids.append(int(token))
        # the whole text each time: a token's bytes may complete a character begun by earlier tokens
        text = self.decode(self.ids)
        whole = len(text)
        while whole > self.shown and text[whole - 1] == "\ufffd":
            whole -= 1  # an incomplete UTF-8 character: wait for its next byte
        # A stop string may end in this token's text but begin in the held-back tail of earlier ones. It
        # is sought in whole characters only: an incomplete one's U+FFFD is not text yet (a stop string
        # holding U+FFFD stopped "é" at its first byte).
        found = [i for i in (text.find(s, max(self.shown - len(s), 0), whole) for s in self.stop) if i >= 0]
        if found:
            self.text, self.stopped = text[: min(found)], True
            return self._upto(len(self.text))
        self.text = text
        safe = max(whole - self.hold, self.shown)  # held: whole characters (the incomplete one may end a stop string)
        # What was shown stands: a longer list's text starts with a shorter list's up to its last whole
        # character (byte-level decoding, tested by hypothesis; Metaspace / ByteFallback + Fuse + Strip
        # strip only the first token's space).
        return self._upto(safe)

    def finish(self):
        """The text held back so far ("" when none): the generation has ended."""
        return self._upto(len(self.text))

    def _upto(self, end):
        piece = self.text[self.shown:end]
        self.shown = max(end, self.shown)
        return piece

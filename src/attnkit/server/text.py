"""A request's generated text as the OpenAI API returns it: decoded from its tokens, cut before the
first stop string (the stop string itself left out), streamed in pieces that never show text a
stop string may still take back, nor half a UTF-8 character.

Legend: G generated tokens so far.
"""


class TextStream:
    """Turns generated token ids into text pieces.

    Args:
        decode: ids -> str (the tokenizer's, special tokens skipped).
        stop: the stop strings (each non-empty).
    """

    def __init__(self, decode, stop=()):
        self.decode, self.stop = decode, list(stop)
        self.hold = max((len(s) for s in self.stop), default=1) - 1  # characters a stop string may still claim
        self.ids, self.shown, self.text = [], 0, ""

    def push(self, token):
        """Adds one token; returns (piece, stopped): the new text safe to show, and whether a stop
        string was found (the piece then ends just before it)."""
        self.ids.append(int(token))
        text = self.decode(self.ids)  # the whole text: a token's bytes may complete an earlier character
        # A stop string may end in this token's text but begin in the held-back tail of earlier ones.
        first = min((i for i in (text.find(s, max(self.shown - len(s), 0)) for s in self.stop) if i >= 0), default=-1)
        if first >= 0:
            self.text = text[:first]
            return self._piece(first), True
        self.text = text
        safe = len(text) - self.hold
        while safe > self.shown and text[safe - 1] == "\ufffd":
            safe -= 1  # an incomplete UTF-8 character: wait for its next byte
        return self._piece(max(safe, self.shown)), False

    def flush(self):
        """The text still held back, at the end of a generation."""
        return self._piece(len(self.text))

    def _piece(self, end):
        piece, self.shown = self.text[self.shown:end], max(end, self.shown)
        return piece

"""One generation request as the engine runs it: its prompt, its own sampling state, and where its
events go (docs/decisions.md item 116).

Sampling is the request's own: `choose` over its row of the batch's logits with its own
`numpy.random.default_rng(seed)`, so its tokens do not depend on what else shares the batch.

Legend: V vocabulary.
"""

import dataclasses

import numpy as np

from attnkit.models.generation import choose, penalize_repetition
from attnkit.pipelines.text_stream import TextPieces


@dataclasses.dataclass
class Event:
    """What the engine tells a request's handler: a `piece` of text; or, last, `finish` ("stop" or
    "length") with the token counts; or `error` (the request failed, the message says why)."""

    piece: str = ""
    finish: str = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str = None


class Generation:
    """A request's state in the engine.

    Args:
        prompt: P >= 1 token ids.
        max_tokens: the most tokens to generate.
        emit: callable(Event), thread-safe: called from the engine's thread.
        decode: ids -> text.
        stop_ids: token ids that end the generation (left out of the text).
        stop: stop strings.
        temperature, top_k, top_p, repetition_penalty, seed: as `attnkit.models.generation.generate_tokens`.
        vocab_size: V (the repetition penalty's table).
    """

    def __init__(self, prompt, max_tokens, emit, decode, *, stop_ids=(), stop=(), temperature=0.0, top_k=None,
                 top_p=None, repetition_penalty=1.0, seed=None, vocab_size=None):
        self.prompt, self.max_tokens, self.emit = [int(t) for t in prompt], int(max_tokens), emit
        self.stop_ids = set(stop_ids)
        self.temperature, self.top_k, self.top_p, self.penalty = temperature, top_k, top_p, repetition_penalty
        self.rng = np.random.default_rng(seed) if temperature > 0 else None
        self.text = TextPieces(decode, stop)
        self.tokens = []
        self.last = None  # the token the next step feeds
        self.done = False
        self.cancelled = False  # set by the handler (a client gone): the engine drops the row before its next step
        self.seen = None
        if repetition_penalty != 1:
            self.seen = np.zeros((vocab_size,), bool)  # (V,)
            self.seen[self.prompt] = True

    def pick(self, logits):
        """The next token from this row's (V,) logits; feeds it to `accept`."""
        logits = np.asarray(logits)[None]  # (1, V)
        if self.seen is not None:
            logits = penalize_repetition(logits, self.seen[None], self.penalty)
        token = int(choose(logits, self.temperature, self.top_k, self.top_p, self.rng)[0])
        if self.seen is not None:
            self.seen[token] = True
        self.accept(token)

    def accept(self, token):
        """Records `token`, emits its text, and finishes on a stop token, a stop string or the length."""
        self.tokens.append(token)
        self.last = token
        if token in self.stop_ids:
            return self.finish("stop")
        piece = self.text.add(token)
        if piece:
            self.emit(Event(piece=piece))
        if self.text.stopped:
            return self.finish("stop")  # the text ends before the stop string
        if len(self.tokens) >= self.max_tokens:
            return self.finish("length")

    def finish(self, reason):
        piece = self.text.finish()  # the tail held back for a stop string that did not come ("" after one)
        self.done = True
        self.emit(Event(piece=piece, finish=reason, prompt_tokens=len(self.prompt), completion_tokens=len(self.tokens)))

    def fail(self, message):
        self.done = True
        self.emit(Event(error=message))

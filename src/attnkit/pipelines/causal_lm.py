"""`PretrainedCausalLM`: a loaded `CausalLM` with its tokenizer and chat template, for text in and
text out.

    lm = attnkit.load_causal_lm()
    lm.chat("What is the capital of France?")            # 'The capital of France is Paris.'
    for piece in lm.stream_chat("Tell me a joke."): print(piece, end="")
    lm.generate(["Once upon", "The sky is"], max_new_tokens=16)
    lm.generate("Once upon", temperature=0.7, top_p=0.9, repetition_penalty=1.2, seed=0)
    lm.generation_defaults                                # a directory's generation_config.json, e.g.
                                                          # {"temperature": 0.7, "top_k": 20, "top_p": 0.8}

Legend: B prompts, T tokens, h heads, V vocabulary.
"""

import numpy as np
from keras import ops

from attnkit.models.generation import check_stop_tokens, generate_tokens
from attnkit.models.generation import generate as generate_ids
from attnkit.models.prompt_ids import check_prompt, check_prompts
from attnkit.pipelines.chat_template import render_chat
from attnkit.pipelines.text_stream import TextPieces

_SAMPLING = ("top_k", "top_p")  # the defaults' sampling filters, dropped when a call asks for greedy decoding


def _text(value, name):
    """`value` if it is a str; else a TypeError naming `name` (None, bytes, a number, ...)."""
    if not isinstance(value, str):
        raise TypeError(f"`{name}` must be a str. Received: {name} of type {type(value).__name__}: {value!r}"[:300])
    return value


class PretrainedCausalLM:
    """A decoder-only model with its tokenizer, chat template and stop tokens.

    Attributes:
        model: the `CausalLM` (frozen).
        tokenizer: a `tokenizers.Tokenizer`, or None (then only token-id methods work).
        chat_template: the Jinja template, or None.
        special_tokens: {"bos_token", "eos_token", ...: str}, the special tokens set (one unset is left out,
            as in transformers' `special_tokens_map`: undefined in the chat template, not "None").
        stop_ids: ids that end a generation by default (the end-of-sequence token(s)).
        generation_defaults: {option: value} the generation methods use for options not given (a
            directory's generation_config.json: `attnkit.checkpoints.generation_config`); {} = greedy.
        pad_id: the id padding batched prompts (never attended to).
        path: where the model was read from.
    """

    def __init__(self, model, tokenizer, *, chat_template=None, special_tokens=None, stop_ids=(), pad_id=0, path=None,
                 generation_defaults=None):
        self.model, self.tokenizer, self.chat_template = model, tokenizer, chat_template
        self.generation_defaults = dict(generation_defaults or {})
        self.special_tokens = {key: value for key, value in (special_tokens or {}).items() if value is not None}
        self.stop_ids, self.pad_id, self.path = [int(i) for i in stop_ids], int(pad_id), path
        self.n, self.h, self.d_model = model.n, model.h, model.d_model

    def _need_tokenizer(self):
        if self.tokenizer is None:
            raise ValueError(f"The model at {self.path} has no tokenizer (tokenizer.json); pass token ids instead of text.")

    def encode(self, text, add_special_tokens=True):
        """Token ids of `text` (with the tokenizer's own special tokens, as transformers adds them)."""
        self._need_tokenizer()
        _text(text, "text")
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens=True):
        """The text of token ids (integers, or floats holding whole numbers, in [0, V)); [] is ""."""
        self._need_tokenizer()
        empty = not isinstance(ids, (str, bytes)) and hasattr(ids, "__len__") and len(ids) == 0
        ids = [] if empty else check_prompt(ids, self.model.vocab_size, "ids")
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def chat_prompt(self, messages, add_generation_prompt=True):
        """The chat template's text for `messages` (a str is one user message)."""
        if not isinstance(messages, (str, list, tuple)):
            raise TypeError(
                "`messages` must be a str (one user message) or a list of {'role': ..., 'content': ...} dicts. "
                f"Received: messages of type {type(messages).__name__}"
            )
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        return render_chat(self.chat_template, messages, add_generation_prompt=add_generation_prompt, special_tokens=self.special_tokens)

    def chat_ids(self, messages):
        """Token ids of the rendered chat, tokenized as transformers' apply_chat_template does (no added special tokens)."""
        return self.encode(self.chat_prompt(messages), add_special_tokens=False)

    def logits(self, ids):
        """float32 logits (B, T, V) of token ids (B, T) (or (T,)): integers, or floats holding whole numbers."""
        rows = check_prompts(ids if np.ndim(ids) == 2 else [ids], self.model.vocab_size, "ids")
        if len({len(row) for row in rows}) > 1:
            raise ValueError(f"`ids` must be (B, T): rows of one length. Received: rows of lengths {[len(r) for r in rows]}")
        return ops.convert_to_numpy(self.model(np.asarray(rows, "int32")))

    def _options(self, options):
        for key, value in self.generation_defaults.items():
            # a sampling default's filters are not the caller's: a call asking for temperature 0 drops them
            if not (key in _SAMPLING and options.get("temperature", 1) == 0):
                options.setdefault(key, value)
        options["stop_tokens"] = check_stop_tokens(options.get("stop_tokens", self.stop_ids))
        options.setdefault("pad_id", self.pad_id)
        return options

    def generate_ids(self, prompts, *, on_token=None, **options):
        """New token ids for a list of token-id prompts; options as `attnkit.models.generation.generate_tokens`."""
        return generate_ids(self.model, prompts, on_token=on_token, **self._options(options))

    def generate(self, prompt, **options):
        """Generated text for a prompt (str) or each of a list of prompts (the stop token left out).

        Options: max_new_tokens, temperature, top_k, top_p, repetition_penalty, seed, stop_tokens, use_cache;
        those not given come from `generation_defaults`.
        """
        single = isinstance(prompt, str)
        if not single and not isinstance(prompt, (list, tuple)):
            raise TypeError(f"`prompt` must be a str or a list of str. Received: prompt of type {type(prompt).__name__}")
        prompts = [prompt] if single else [_text(p, f"prompt[{i}]") for i, p in enumerate(prompt)]
        ids = [self._prompt_ids(p, "prompt" if single else f"prompt[{i}]") for i, p in enumerate(prompts)]
        outputs = self.generate_ids(ids, **options)
        stop = self._options(dict(options))["stop_tokens"]
        texts = [self.decode([t for t in out if t not in stop]) for out in outputs]
        return texts[0] if single else texts

    def _prompt_ids(self, text, name):
        """The token ids of a text prompt; an empty one is refused naming `name`."""
        ids = self.encode(text)
        if not ids:
            raise ValueError(f"`{name}` has no tokens: the model needs at least one to continue. Received: {name}={text!r}")
        return ids

    def chat(self, messages, **options):
        """The assistant's reply to `messages` (a str is one user message), or a list of replies for a list of chats."""
        if isinstance(messages, list) and messages and isinstance(messages[0], (list, str)):
            outputs = self.generate_ids([self.chat_ids(m) for m in messages], **options)
            stop = self._options(dict(options))["stop_tokens"]
            return [self.decode([t for t in out if t not in stop]) for out in outputs]
        return "".join(self.stream_chat(messages, **options))

    def stream(self, prompt, *, should_stop=None, **options):
        """Yields the text of `prompt`'s continuation piece by piece, as tokens are generated; joined, the
        pieces are `generate(prompt)`'s text (docs/decisions.md item 107).

        Args:
            prompt: a str.
            should_stop: optional function of no arguments, asked after each token: True ends the
                generation there (the command line's Ctrl-C in `attnkit chat`).
            **options: as `generate`.
        """
        return self._stream(self._prompt_ids(_text(prompt, "prompt"), "prompt"), options, should_stop)  # checked now

    def stream_chat(self, messages, *, should_stop=None, **options):
        """Yields the assistant's reply to `messages` piece by piece, as tokens are generated (see `stream`)."""
        return self._stream(self.chat_ids(messages), options, should_stop)

    def _stream(self, ids, options, should_stop=None):
        options = self._options(options)
        # the model's own ids: decoded by the tokenizer without `decode`'s check, each step
        stop, pieces = set(options["stop_tokens"]), TextPieces(lambda new: self.tokenizer.decode(new, skip_special_tokens=True))
        for token in generate_tokens(self.model, [ids], **options):
            t = int(token[0])
            if t in stop:
                break
            piece = pieces.add(t)
            if piece:
                yield piece
            if should_stop is not None and should_stop():
                break
        # whatever ends the generation (the last token, a stop token, should_stop), the text held back
        # inside an incomplete character is released as `generate` decodes it
        rest = pieces.finish()
        if rest:
            yield rest

    def attentions(self, text, layer=-1):
        """One layer's attention weights for `text`: ((h, T, T) array, the T token strings)."""
        ids = self.encode(text)
        layer = layer + self.n if isinstance(layer, int) and layer < 0 else layer
        if not isinstance(layer, int) or not 0 <= layer < self.n:
            raise ValueError(f"`layer` must be an int in [-{self.n}, {self.n}). Received: layer={layer!r}")
        _, weights = self.model(np.asarray([ids], "int32"), attention_layer=layer)
        tokens = [self.tokenizer.id_to_token(i) for i in ids]
        return ops.convert_to_numpy(ops.cast(weights, "float32"))[0], tokens


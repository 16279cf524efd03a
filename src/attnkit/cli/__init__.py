"""The `attnkit` command.

    attnkit demo        trains a small Transformer on dates, evaluates it, draws its cross-attention
    attnkit train       trains a Transformer on the date task and saves it
    attnkit translate   translates texts with a saved model
    attnkit embed       sentence embeddings of texts (arguments, a file, or stdin) to .npy or JSON lines
    attnkit similarity  the cosine similarity matrix of texts, as a table
    attnkit heads       a PNG of every head's attention in one layer, for one sentence

embed, similarity and heads use the embedded all-MiniLM-L6-v2 model, or `--model DIR`.

Errors are one line on stderr and a non-zero exit status, never a traceback.
"""

import sys

from attnkit.cli import pretrained, translation
from attnkit.cli.errors import CommandError, Parser

__all__ = ["CommandError", "build_parser", "main"]


def build_parser():
    parser = Parser(prog="attnkit", description="Attention and the Transformer, as Keras 3 layers.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    translation.add_commands(commands)  # demo, train, translate
    pretrained.add_commands(commands)  # embed, similarity, heads
    return parser


def main(argv=None):
    """Runs the command line `argv` (default sys.argv[1:]); returns the exit status."""
    try:
        args = build_parser().parse_args(argv)
        return args.run(args)
    except CommandError as e:
        print(f"attnkit: error: {e}", file=sys.stderr)
        return 2
    except (ValueError, TypeError, OSError) as e:
        print(f"attnkit: error: {e}", file=sys.stderr)
        return 1
    except ImportError as e:
        print(f"attnkit: error: {e}; install the extras: pip install 'attnkit[pretrained,viz]'", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("attnkit: interrupted", file=sys.stderr)
        return 130

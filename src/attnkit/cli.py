"""The `attnkit` command.

    attnkit demo    the seeds' multi-head attention test case with the paper's sizes

Errors are one line on stderr and a non-zero exit status, never a traceback.
"""

import argparse
import sys


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise CommandError(message)


class CommandError(Exception):
    """A user error: printed as one line, exit status 2."""


def _demo(args):
    import numpy as np

    import attnkit
    import keras

    h, d_k, d_v, d_model, batch_size, length = 8, 64, 64, 512, 64, 5  # the paper's sizes, seed 000's test
    rng = np.random.default_rng(args.seed)
    keras.utils.set_random_seed(args.seed)
    queries = rng.random((batch_size, length, d_k), dtype=np.float32)
    keys = rng.random((batch_size, length, d_k), dtype=np.float32)
    values = rng.random((batch_size, length, d_v), dtype=np.float32)
    layer = attnkit.MultiHeadAttention(h, d_k, d_v, d_model)
    output, weights = layer(queries, keys, values, causal=True, return_attention_weights=True)
    weights = np.asarray(keras.ops.convert_to_numpy(weights))
    print(f"backend: {keras.backend.backend()}")
    print(f"MultiHeadAttention(h={h}, d_k={d_k}, d_v={d_v}, d_model={d_model}), look-ahead mask")
    print(f"queries {queries.shape}, keys {keys.shape}, values {values.shape}")
    print(f"output  {tuple(output.shape)}")
    print(f"weights {tuple(weights.shape)}  (batch, heads, queries, keys)")
    print("head 0 of sequence 0 (rows: queries, columns: keys; zeros above the diagonal are the future):")
    with np.printoptions(precision=3, suppress=True):
        print(weights[0, 0])
    return 0


def build_parser():
    parser = _Parser(prog="attnkit", description="Attention and the Transformer, as Keras 3 layers.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    demo = commands.add_parser("demo", help="run the seeds' multi-head attention test case")
    demo.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    demo.set_defaults(run=_demo)
    return parser


def main(argv=None):
    try:
        args = build_parser().parse_args(argv)
        return args.run(args)
    except CommandError as e:
        print(f"attnkit: error: {e}", file=sys.stderr)
        return 2
    except (ValueError, TypeError, OSError) as e:
        print(f"attnkit: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("attnkit: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

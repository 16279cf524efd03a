"""`attnkit serve`: the OpenAI-compatible server (`attnkit.server`).

    attnkit serve [--model PATH] [--embedding-model PATH] [--host 127.0.0.1] [--port N] [--api-key KEY]
                  [--max-batch N] [--max-queue N]

Serves the language model (SmolLM2-135M-Instruct by default, or a GGUF file or llama / mistral /
qwen2 directory) at /v1/chat/completions and /v1/completions, the embedding model (all-MiniLM-L6-v2
by default, or a sentence-transformers directory) at /v1/embeddings, and the explorer at /explore.
The models are read before the server starts, so a model that cannot be read is one line on stderr.
The API key may come from ATTNKIT_API_KEY rather than the command line (which `ps` shows).
"""

import argparse
import ipaddress
import os
import sys

from attnkit._interrupts import raise_if_pressed, stopped_by_ctrl_c
from attnkit.cli.errors import CommandError, positive_int
from attnkit.explorer.sources.causal_lm import DEFAULT_NAME, CausalLMSource
from attnkit.cli.generation import add_activations_argument
from attnkit.pipelines.causal_checkpoint import DTYPES, load_causal_lm
from attnkit.pipelines.encoder import load_pretrained

try:  # the serve extra (FastAPI, uvicorn, sse-starlette): the other commands run without it
    from attnkit import server
except ImportError as missing:
    server, _MISSING = None, missing

API_KEY_VARIABLE = "ATTNKIT_API_KEY"


def add_commands(commands):
    serve = commands.add_parser("serve", help="an OpenAI-compatible HTTP server of the language and embedding models")
    serve.add_argument("--model", metavar="PATH", help="a GGUF file or a llama / mistral / qwen2 directory (default SmolLM2)")
    serve.add_argument("--dtype", choices=DTYPES, default="float32",
                       help="what the language model's weights are held in (as in `attnkit chat --dtype`)")
    add_activations_argument(serve)
    serve.add_argument("--embedding-model", metavar="PATH", help="a sentence-transformers directory (default all-MiniLM-L6-v2)")
    serve.add_argument("--host", default="127.0.0.1", help="the address to bind (default 127.0.0.1: this machine only)")
    serve.add_argument("--port", type=_port, default=8000, help="the port (default 8000; 0 picks a free one, printed)")
    serve.add_argument("--api-key", metavar="KEY", help=f"require `Authorization: Bearer KEY` (or set {API_KEY_VARIABLE})")
    serve.add_argument("--max-batch", type=positive_int, default=8, metavar="N", help="most sequences decoded together (default 8)")
    serve.add_argument("--max-queue", type=positive_int, default=64, metavar="N",
                       help="most requests waiting for a batch row; more are answered 429 (default 64)")
    serve.set_defaults(run=_serve)


def _port(text):
    if not (text.isascii() and text.isdigit()) or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"must be a port number from 0 to 65535, not {text!r}")
    return int(text)


def _loopback(host):
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def warn_if_open(host, api_key):
    """Warns on stderr when `host` is not a loopback address and no API key guards it."""
    if not _loopback(host) and api_key is None:
        print(f"attnkit: warning: serving on {host} without an API key: anyone who can reach it may use it "
              f"(set --api-key or {API_KEY_VARIABLE})", file=sys.stderr, flush=True)


def _serve(args):
    if server is None:
        raise CommandError(f"attnkit serve needs its extra: pip install 'attnkit[serve]' ({_MISSING})")

    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_VARIABLE) or None
    if api_key is not None and not api_key.strip():
        raise CommandError("--api-key is empty")
    lm = load_causal_lm(args.model, dtype=args.dtype, activations=args.activations)
    lm_name = DEFAULT_NAME if args.model is None else os.path.basename(os.path.abspath(args.model))
    encoder = load_pretrained(args.embedding_model)
    encoder_name = "all-MiniLM-L6-v2" if args.embedding_model is None else os.path.basename(os.path.abspath(args.embedding_model))
    if encoder_name == lm_name:
        encoder_name += "-embeddings"
    app, engine, state = server.build(
        lm, lm_name=lm_name, encoder=encoder, encoder_name=encoder_name, explorer=CausalLMSource(lm, lm_name),
        max_batch=args.max_batch, max_queue=args.max_queue, host=args.host, api_key=api_key,
    )
    warn_if_open(args.host, api_key)
    raise_if_pressed()
    running = server.Server(app, engine, host=args.host, port=args.port, state=state)
    _announce(running, args, lm_name, encoder_name)
    try:
        running.serve_and_close()
    except KeyboardInterrupt:
        pass
    except SystemExit:  # uvicorn's answer to a port it cannot bind, after logging why
        pass
    stopped_by_ctrl_c()  # the server's normal end
    if not running.started:
        raise CommandError(f"cannot serve on {args.host}:{args.port} (in use, or not an address of this machine)")
    print("attnkit serve: stopped", file=sys.stderr, flush=True)
    return 0


def _announce(server, args, lm_name, encoder_name):
    """Prints the URL once the server listens (port 0: the one picked)."""
    startup = server.startup

    async def started(*a, **k):
        await startup(*a, **k)
        if server.started:
            host = f"[{args.host}]" if ":" in args.host else args.host
            print(f"attnkit serve: http://{host}:{server.port}/v1 ({lm_name}, {encoder_name}); explorer at /explore; "
                  "Ctrl-C to stop", file=sys.stderr, flush=True)

    server.startup = started

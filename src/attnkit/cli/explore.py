"""`attnkit explore`: the attention explorer, served on 127.0.0.1 or exported to one HTML file.

    attnkit explore [--model PATH] [--lm] [--max-new-tokens N] [--port N] [--open] [--text TEXT]
    attnkit explore --export page.html --text "..." [--model PATH] [--lm] [--max-new-tokens N] [--force]

A language model (`--lm`: SmolLM2 by default; or `--model` a GGUF file or llama / mistral / qwen2
directory) shows the text as a prompt, the tokens it generates, and each step's attention.

The model is read before anything else, so a directory that cannot be read is one line on stderr
before any server starts.
"""

import argparse
import sys
import threading

from attnkit._interrupts import raise_if_pressed, stopped_by_ctrl_c
from attnkit.cli._output import check_output_file
from attnkit.cli.errors import CommandError, non_negative_int, positive_int, utf8_text
from attnkit.explorer import export, server as explorer_server, sources
from attnkit.explorer.sources.causal_lm import MAX_NEW_TOKENS


def add_commands(commands):
    """Adds explore to the `attnkit` subcommands."""
    explore = commands.add_parser(
        "explore", help="an interactive page of the attention heads (served locally, or exported to one HTML file)"
    )
    explore.add_argument(
        "--model", metavar="PATH",
        help="a BERT-architecture directory, a date translator written by train or demo, or a language model "
        "(a GGUF file or llama / mistral / qwen2 directory) (default: all-MiniLM-L6-v2)",
    )
    explore.add_argument(
        "--lm", action="store_true",
        help="explore the language model generating token by token (default SmolLM2-135M-Instruct, or --model)",
    )
    explore.add_argument(
        "--max-new-tokens", type=positive_int, default=None, metavar="N",
        help="a language model's most generated tokens per text, 1 to 64 (default 16)",
    )
    explore.add_argument("--text", type=utf8_text, help="the text to explore (served: shown when the page opens; needed by --export)")
    explore.add_argument("--port", type=_port, default=0, help="port on 127.0.0.1 (default: a free one, printed)")
    explore.add_argument("--open", action="store_true", help="open the page in the default web browser")
    explore.add_argument("--export", metavar="HTML", help="write one self-contained page to HTML instead of serving")
    explore.add_argument("--force", action="store_true", help="overwrite an existing --export file")
    explore.set_defaults(run=_explore)


def _port(text):
    value = non_negative_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"must be a port number from 0 to 65535, not {text!r}")
    return value


def _explore(args):
    if args.export is not None:
        _check_export(args)
    if args.max_new_tokens is not None and args.max_new_tokens > MAX_NEW_TOKENS:
        raise CommandError(f"--max-new-tokens must be from 1 to {MAX_NEW_TOKENS}. Received: {args.max_new_tokens}")
    # Only the options given: each is refused for a model it does not apply to.
    options = {"lm": True} if args.lm else {}
    if args.max_new_tokens is not None:
        options["max_new_tokens"] = args.max_new_tokens
    source = sources.open_model(args.model, **options)
    if args.export is not None:
        return _export(args, source)
    return _serve(args, source)


def _check_export(args):
    if args.port or args.open:
        raise CommandError("--port and --open are for the served page, not for --export")
    if not args.export.lower().endswith((".html", ".htm")):
        raise CommandError(f"--export must end in .html. Received: {args.export}")
    if args.text is None:
        raise CommandError('--export needs the text: --text "..."')
    if not args.text.strip():
        raise CommandError("--text is empty: nothing to explore")
    try:  # the checks `embed --output` makes, before the model loads: a symlink or a directory is refused
        check_output_file(args.export, args.force)
    except CommandError as e:
        raise CommandError(str(e).replace("--output", "--export")) from None


def _export(args, source):
    try:
        data = export.export_page(args.export, source, args.text, force=args.force)
    except FileExistsError as e:
        raise CommandError(str(e)) from None
    for note in data["notes"]:
        print(f"attnkit: warning: {note}", file=sys.stderr)
    first = data["attention"][0]
    print(
        f"wrote {args.export}: {data['model']}, {len(first['query_tokens'])} tokens, {len(data['attention'])} "
        f"attention kind(s), {first['layers']} layers x {first['heads']} heads"
        + (f", {len(data['steps']['labels'])} decoding steps" if data["steps"] else ""),
        file=sys.stderr,
    )
    return 0


def _open_browser(url):
    import webbrowser

    if not webbrowser.open(url):
        print(f"attnkit: warning: no web browser could be opened; open {url} yourself", file=sys.stderr, flush=True)


def _serve(args, source):
    raise_if_pressed()  # a Ctrl-C lost while the model loaded: interrupted, not a server's normal stop

    try:
        server = explorer_server.ExplorerServer(source, args.port, text=args.text)
    except OSError as e:
        raise CommandError(f"cannot serve on 127.0.0.1:{args.port}: {e.strerror or e}") from None
    try:
        print(f"attnkit explorer: {server.url} ({source.name}); Ctrl-C to stop", flush=True)
        if args.open:
            # In a thread: a console browser may not return until it quits.
            threading.Thread(target=_open_browser, args=(server.url,), daemon=True).start()
        server.serve_forever()
    except KeyboardInterrupt:
        stopped_by_ctrl_c()  # the server's normal end, not an interrupted command
        print("attnkit explorer: stopped", flush=True)
    finally:
        server.server_close()
    return 0

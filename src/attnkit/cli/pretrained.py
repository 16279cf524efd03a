"""`attnkit embed`, `similarity`, `heads` and `export`: the embedded all-MiniLM-L6-v2 model (or `--model DIR`)."""

import argparse
import contextlib
import json
import os
import sys
import warnings

from attnkit.checkpoints.export import check_destination
from attnkit._messages import field
from attnkit.cli._input import note_no_texts, read_texts
from attnkit.cli._output import check_output_file, write_output_file
from attnkit.cli.errors import CommandError, positive_int, utf8_text
from attnkit.cli.finetune import export_finetuned
from attnkit.cli.generation import require_tokenizer
from attnkit.pipelines import encoder as encoder_pipeline
from attnkit.pipelines.causal_checkpoint import load_causal_lm
from attnkit import viz

PROGRESS_FROM = 256  # `embed` shows a progress bar from this many texts (when writing to a file)


def _load(args):
    # looked up now: tests replace it
    return encoder_pipeline.load_pretrained(args.model, dtype=getattr(args, "dtype", "float32"))


@contextlib.contextmanager
def _warnings_as_lines():
    """Prints the UserWarnings raised inside (the truncation warning) as `attnkit: warning:` lines, each once."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UserWarning)
        yield
    for message in dict.fromkeys(str(w.message) for w in caught if issubclass(w.category, UserWarning)):
        print(f"attnkit: warning: {message}", file=sys.stderr)


def _encode(encoder, texts, **options):
    """`encoder.encode`, with its truncation warning printed as one line."""
    with _warnings_as_lines():
        return encoder.encode(texts, **options)


def _embed(args):
    import numpy as np

    if args.output == "":
        raise CommandError("--output must not be empty")  # an empty path is not stdout
    if args.output is not None and not args.output.lower().endswith((".npy", ".jsonl")):
        raise CommandError(f"--output must end in .npy or .jsonl. Received: {args.output}")
    if args.output is not None:
        check_output_file(args.output, args.force)
    texts = read_texts(args)
    encoder = _load(args)
    if not texts:
        note_no_texts(args)  # then an empty result: a (0, d_model) .npy, an empty .jsonl, no lines
    progress = args.output is not None and len(texts) >= PROGRESS_FROM
    embeddings = _encode(
        encoder, texts, batch_size=args.batch_size, progress=progress, normalize=args.normalize
    )  # (N, dimension)
    lines = (_json_line({"text": t, "embedding": e.tolist()}) for t, e in zip(texts, embeddings))
    if args.output is None:
        for line in lines:
            print(line)
        return 0

    def write(path):  # beside args.output, then renamed onto it
        if args.output.lower().endswith(".npy"):
            with open(path, "wb") as f:  # np.save(path) would append ".npy" to "X.NPY"
                np.save(f, embeddings)
        else:
            with open(path, "w", encoding="utf-8") as f:
                f.writelines(line + "\n" for line in lines)

    write_output_file(args.output, write)
    print(f"wrote {len(texts)} embeddings of size {encoder.dimension} to {args.output}", file=sys.stderr)
    return 0


def _json_line(record):
    r"""One JSON line, UTF-8 kept, but with the characters other line splitters (str.splitlines,
    JavaScript) break on escaped: json.dumps escapes the control characters and leaves \x85,
    \u2028 and \u2029 raw. They can only occur inside strings, where the escapes mean the same."""
    line = json.dumps(record, ensure_ascii=False)
    return line.replace("\x85", "\\u0085").replace("\u2028", "\\u2028").replace("\u2029", "\\u2029")


def _similarity(args):
    texts = read_texts(args)
    encoder = _load(args)
    if not texts:
        note_no_texts(args)
        return 0
    embeddings = _encode(encoder, texts, normalize=True)  # (N, dimension), unit vectors: cosines
    similarity = embeddings @ embeddings.T  # (N, N) cosines
    labels = [f"[{i}]" for i in range(len(texts))]
    width = max(6, max(map(len, labels)))
    print(" " * width + "".join(label.rjust(width + 1) for label in labels))
    for label, row in zip(labels, similarity):
        print(label.ljust(width) + "".join(f"{value:.3f}".rjust(width + 1) for value in row))
    print()
    for label, text in zip(labels, texts):
        print(f"{label} {field(text if len(text) <= 70 else text[:67] + '...')}")
    return 0


def _heads(args):
    if args.output == "":
        raise CommandError("--output must not be empty")
    if not args.output.lower().endswith(".png"):
        raise CommandError(f"--output must end in .png. Received: {args.output}")
    check_output_file(args.output, args.force)
    if args.lm:
        encoder = load_causal_lm(args.model)
    else:
        encoder = _load(args)  # a GGUF or llama / mistral / qwen2 --model is a language model too
    if hasattr(encoder, "stream_chat"):
        require_tokenizer(encoder)
    if not -encoder.n <= args.layer < encoder.n:
        raise CommandError(
            f"--layer must be in [{-encoder.n}, {encoder.n - 1}] (0 = first, -1 = last) for this {encoder.n}-layer "
            f"model. Received: {args.layer}"
        )
    with _warnings_as_lines():  # tokens and attentions both truncate: one warning line
        if hasattr(encoder, "stream_chat"):  # a language model: causal attention of one layer
            weights, tokens = encoder.attentions(args.sentence, args.layer)  # (h, T, T)
        else:
            tokens = encoder.tokens(args.sentence)
            weights = encoder.attentions(args.sentence)[args.layer]  # (h, T, T)
    layer = args.layer % encoder.n
    title = f"layer {layer}: attention of each head (rows attend to columns)"
    write_output_file(args.output, lambda path: viz.plot_attention(weights, tokens, tokens, title=title, path=path))
    print(f"wrote {encoder.h} heads of layer {layer} over {len(tokens)} tokens to {args.output}", file=sys.stderr)
    return 0


def _export(args):
    if args.out is not None:  # `attnkit export DIR OUT`: a fine-tuned language model (docs/decisions.md item 123)
        if args.model is not None:
            raise CommandError("export DIR OUT takes a fine-tuned directory and writes OUT; --model is for an encoder")
        return export_finetuned(args.output, args.out, args.force)
    if not args.output:
        raise CommandError("DIR must not be empty")
    if os.path.lexists(args.output) and not args.force:
        raise CommandError(f"{args.output} already exists; pass --force to replace it")
    try:  # before the model loads: the same checks `save_pretrained` makes
        check_destination(args.output, args.force)
    except (FileExistsError, ValueError) as e:
        raise CommandError(str(e)) from None
    encoder = _load(args)
    encoder.save_pretrained(args.output, overwrite=args.force)  # written aside, then renamed into place
    print(f"wrote the {encoder.family.name} model and its sentence-transformers modules to {args.output}",
          file=sys.stderr)
    return 0


def _add_model_option(parser):
    parser.add_argument("--model", metavar="DIR", help="a BERT, DistilBERT, RoBERTa, XLM-R or ELECTRA model directory (default: all-MiniLM-L6-v2)")


def _add_dtype_option(parser):
    parser.add_argument(
        "--dtype", choices=encoder_pipeline.ENCODER_DTYPES, default="float32",
        help="float32 (default), or int8: int8 weights with each product's input quantized per call, as "
        "ONNX Runtime's and torch's quantize_dynamic (faster, embeddings within a few percent)",
    )



def add_commands(commands):
    """Adds embed, similarity and heads to the `attnkit` subcommands."""
    embed = commands.add_parser("embed", help="sentence embeddings of texts, to .npy or JSON lines")
    embed.add_argument("texts", nargs="*", type=utf8_text, help="texts to embed (default: one per line from stdin)")
    embed.add_argument("--input", metavar="FILE", help="read texts one per line from FILE, or stdin with -")
    embed.add_argument("--output", metavar="PATH", help="X.npy (N, d_model) or X.jsonl; default JSON lines on stdout")
    embed.add_argument("--force", action="store_true", help="overwrite an existing output file")
    embed.add_argument("--batch-size", type=positive_int, default=64, help="texts per forward pass (default 64)")
    embed.add_argument(
        "--normalize", action=argparse.BooleanOptionalAction, default=None,
        help="L2-normalise the embeddings (default: as the model directory says, its Normalize module)",
    )
    _add_model_option(embed)
    _add_dtype_option(embed)
    embed.set_defaults(run=_embed)

    similarity = commands.add_parser("similarity", help="cosine similarities of texts, as a table")
    similarity.add_argument("texts", nargs="*", type=utf8_text, help="texts to compare (default: one per line from stdin)")
    similarity.add_argument("--input", metavar="FILE", help="read texts one per line from FILE, or stdin with -")
    _add_model_option(similarity)
    _add_dtype_option(similarity)
    similarity.set_defaults(run=_similarity)

    heads = commands.add_parser("heads", help="a PNG of each head's attention in one layer for a sentence")
    heads.add_argument("sentence", type=utf8_text, help="the sentence to look at")
    heads.add_argument("--layer", type=int, default=0, help="layer index, 0 = first, -1 = last (default 0)")
    heads.add_argument("--output", metavar="PNG", default="heads.png", help="the image to write (default heads.png)")
    heads.add_argument("--force", action="store_true", help="overwrite an existing output file")
    heads.add_argument("--lm", action="store_true", help="draw the language model's heads (default SmolLM2, or --model)")
    _add_model_option(heads)
    heads.set_defaults(run=_heads)

    export = commands.add_parser(
        "export", help="write the model as a Hugging Face directory (transformers, sentence-transformers)"
    )
    export.add_argument("output", metavar="DIR", help="the directory to write (or, with OUT, a fine-tuned directory)")
    export.add_argument("out", metavar="OUT", nargs="?", help="with a fine-tuned DIR (attnkit finetune): the Hugging Face "
                        "directory to write, with its adapter in PEFT's format in OUT/adapter")
    export.add_argument("--force", action="store_true", help="replace an existing directory")
    _add_model_option(export)
    export.set_defaults(run=_export)

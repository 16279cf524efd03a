"""The `attnkit demo`, `train` and `translate` commands: a Transformer on the embedded date task.

    attnkit demo                   train, report exact match, translate held-out dates, draw the cross-attention
    attnkit train --output-dir D   train and save a model into D (--data-parallel: over all devices)
    attnkit translate --model D    translate texts (arguments, a file, or stdin) with a saved model

User errors raise `CommandError`, printed as one line.
"""

import math
import os
import sys
import time

from attnkit._atomic_save import check_replaceable, probe_writable, remove_created, replace_files
from attnkit._interrupts import ctrl_c_between_batches
from attnkit.cli import train_processes
from attnkit._messages import field
from attnkit.cli._input import note_no_texts, read_texts
from attnkit.cli.errors import CommandError, non_negative_int, positive_int, seed, utf8_text
from attnkit.dates import translator as date_translator
from attnkit.dates.markers import output_marker, refusal
from attnkit.dates.training import CHECKPOINTS, latest_checkpoint
from attnkit.dates.translator import DateTranslator, META_FILE, MODEL_FILE, TrainConfig
from attnkit import viz

PLOT_FILE = "cross_attention.png"


def add_commands(commands):
    """Adds demo, train and translate to the `commands` subparsers of `attnkit.cli`."""
    demo = commands.add_parser("demo", help="train a small Transformer on dates, evaluate it, draw its attention")
    _training_options(demo, default_dir="runs/demo")
    demo.add_argument("--examples", type=positive_int, default=6, help="held-out inputs to translate (default 6)")
    demo.set_defaults(run=_demo)

    train = commands.add_parser("train", help="train a Transformer on the date task and save it")
    _training_options(train, default_dir=None)
    _process_options(train)
    train.set_defaults(run=_train, parser=train)

    translate = commands.add_parser("translate", help="translate texts with a model saved by train or demo")
    translate.add_argument("texts", nargs="*", type=utf8_text, help="texts to translate (default: one per line from stdin)")
    translate.add_argument("--model", metavar="DIR", required=True, help="directory written by train or demo")
    translate.add_argument("--input", metavar="FILE", help="read texts one per line from FILE, or stdin with -")
    translate.add_argument("--beam", type=positive_int, default=1, help="beam size; 1 = greedy (default)")
    translate.add_argument("--scores", action="store_true", help="a third column: the model's probability of its output")
    translate.set_defaults(run=_translate)


def _training_options(parser, default_dir):
    d = TrainConfig()
    parser.add_argument("--epochs", type=positive_int, default=d.epochs, help=f"default {d.epochs}")
    parser.add_argument("--batch-size", type=positive_int, default=d.batch_size, help=f"default {d.batch_size}")
    parser.add_argument("--train-size", type=positive_int, default=d.n_train, help=f"training examples (default {d.n_train})")
    parser.add_argument("--validation-size", type=positive_int, default=d.n_validation, help=f"held-out examples (default {d.n_validation})")
    parser.add_argument("--d-model", type=positive_int, default=d.d_model, help=f"default {d.d_model}")
    parser.add_argument("--heads", type=positive_int, default=d.h, help=f"default {d.h}")
    parser.add_argument("--layers", type=positive_int, default=d.n, help=f"encoder and decoder layers (default {d.n})")
    parser.add_argument("--d-ff", type=positive_int, default=d.d_ff, help=f"default {d.d_ff}")
    parser.add_argument("--dropout", type=float, default=d.rate, help=f"dropout rate in [0, 1) (default {d.rate})")
    parser.add_argument("--seed", type=seed, default=d.seed, help=f"data and initialisation seed (default {d.seed})")
    parser.add_argument(
        "--output-dir", metavar="DIR", default=default_dir, required=default_dir is None,
        help="where the model (and the demo's picture) go" + (f" (default {default_dir})" if default_dir else ""),
    )
    parser.add_argument("--force", action="store_true", help="overwrite files already in the output directory")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument(
        "--data-parallel", action="store_true",
        help="train over all local devices (jax or tensorflow backend; --batch-size stays the global batch)",
    )


def _process_options(parser):
    """Multi-process training (attnkit.distributed; docs/distributed.md)."""
    parser.add_argument("--processes", type=positive_int, help="train data-parallel in N processes (--batch-size stays the global batch)")
    parser.add_argument("--coordinator", metavar="HOST:PORT", help="process 0's address; with --process-id: run one worker of a multi-machine job")
    parser.add_argument("--process-id", type=non_negative_int, help="this worker's index, 0 .. N-1 (with --coordinator and --processes)")
    parser.add_argument("--resume", action="store_true", help="continue from the last complete checkpoint in --output-dir/checkpoints")
    parser.add_argument("--timeout", type=positive_int, default=60, help="seconds to wait for the other processes, and for one step (default 60)")


def _config(args):
    if args.d_model % args.heads:
        raise CommandError(f"--d-model ({args.d_model}) must be a multiple of --heads ({args.heads})")
    if not 0 <= args.dropout < 1:
        raise CommandError(f"--dropout must be in [0, 1). Received: --dropout={args.dropout}")
    return TrainConfig(
        epochs=args.epochs, batch_size=args.batch_size, n_train=args.train_size, n_validation=args.validation_size,
        d_model=args.d_model,
        h=args.heads, n=args.layers, d_ff=args.d_ff, seed=args.seed, rate=args.dropout,
    )


def _check_output_dir(directory, force, names):
    """Refuses, before any training, an output directory where the files could not be saved: one that
    cannot be created or written (proved by writing a file there), an existing output without --force,
    or one that is not a regular file even with --force. Returns the directories it created."""
    if not directory:
        raise CommandError("--output-dir must not be empty")
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise CommandError(f"--output-dir {directory} exists and is not a directory")
    existing = os.path.abspath(directory)  # the directory, or the nearest ancestor that exists
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise CommandError(f"--output-dir {directory} cannot be created: {existing} is not a directory")
    names = (MODEL_FILE, META_FILE, *names)
    try:
        check_replaceable(directory, names)
    except ValueError as e:
        raise CommandError(f"--output-dir: {e}") from None
    for name in names:
        path = os.path.join(directory, name)
        if os.path.lexists(path) and not force:
            raise CommandError(f"{path} already exists; pass --force to overwrite it")
    try:
        return probe_writable(directory)
    except OSError as e:
        raise CommandError(f"--output-dir {directory} cannot be written: {e.strerror or e}") from None


def _check_finished_model(directory, force):
    """Refuses to resume into a directory holding a finished run's model without --force."""
    for name in (MODEL_FILE, META_FILE):
        path = os.path.join(directory, name)
        if os.path.lexists(path) and not force:
            raise CommandError(f"{path} already exists (a finished run); pass --force to replace it when the resumed run ends")


def _check_no_checkpoints(directory, force):
    """Refuses to start a new run over an earlier run's checkpoints (it would delete them as it saves
    its own) without --resume or --force."""
    epoch = latest_checkpoint(os.path.join(directory, CHECKPOINTS))
    if epoch and not force:
        raise CommandError(
            f"{os.path.join(directory, CHECKPOINTS)} holds an earlier run's checkpoint (epoch {epoch}); "
            "pass --resume to continue that run, or --force to start a new one and replace it"
        )


def _with_output_dir(args, names, run):
    """`run(args)` after `_check_output_dir`; directories the check created are removed again (when
    still empty) if the run fails or is interrupted."""
    created = _check_output_dir(args.output_dir, args.force, names)
    try:
        return run(args)
    except BaseException:
        remove_created(created)
        raise


def _fit(args):
    start = time.perf_counter()
    with ctrl_c_between_batches() as stop:
        translator, validation, _ = date_translator.train_dates(
            _config(args), verbose=0 if args.quiet else 1, data_parallel=args.data_parallel,
            log=print if args.data_parallel else None, callbacks=[stop],
        )
    return translator, validation, time.perf_counter() - start


def _train(args):
    if args.processes or args.coordinator or args.process_id is not None or args.resume:
        if args.process_id:  # a worker other than 0: it writes nothing
            return train_processes.run(args, _config(args), args.parser)
        if args.resume:  # the checkpoints are the input; a finished run's model is replaced only with --force
            _check_finished_model(args.output_dir, args.force)
            return train_processes.run(args, _config(args), args.parser)
        # the launcher, or process 0 of a multi-machine run: directories the check made go again on failure
        created = _check_output_dir(args.output_dir, args.force, ())
        _check_no_checkpoints(args.output_dir, args.force)
        status = 1
        try:
            status = train_processes.run(args, _config(args), args.parser)
            return status
        finally:
            if status != 0:
                remove_created(created)
    return _with_output_dir(args, (), _run_train)


def _run_train(args):
    translator, validation, seconds = _fit(args)
    accuracy = translator.exact_match(validation)
    translator.save(args.output_dir, overwrite=args.force)
    print(f"trained in {seconds:.0f} s; validation exact match {accuracy:.2%} on {len(validation)} dates")
    print(f"saved to {args.output_dir}")
    return 0


def _demo(args):
    return _with_output_dir(args, (PLOT_FILE,), _run_demo)


def _run_demo(args):
    import keras


    print(f"attnkit demo: a Transformer learns to normalise dates (backend: {keras.backend.backend()})")
    translator, validation, seconds = _fit(args)
    accuracy = translator.exact_match(validation)
    print(f"\ntrained in {seconds:.0f} s; validation exact match: {accuracy:.2%} on {len(validation)} held-out dates\n")

    sources = [s for s, _ in validation[: args.examples]]
    outputs, results = translator.translate(sources, return_attention_weights=True)
    width = max(len(s) for s in sources)
    for (source, target), output in zip(validation, outputs):
        print(f"  {source:<{width}}  ->  {output}  {'ok' if output == target else 'expected ' + target}")

    cross = results[0].cross_attention[-1][0]  # last decoder layer, first example: (h, T_out, S)
    source_tokens = list(sources[0])
    output_tokens = translator.tokenizer.display_tokens(results[0].ids[0])  # one per decoding step
    cross = cross[:, : len(output_tokens), : len(source_tokens)]
    plot_path = os.path.join(args.output_dir, PLOT_FILE)

    def write_plot(path):
        viz.plot_attention(
            cross, source_tokens, output_tokens, path=path,
            title=f"cross-attention, last decoder layer: {sources[0]!r} -> {outputs[0]!r}",
        )

    replace_files(args.output_dir, {**translator.writers(), PLOT_FILE: write_plot})  # the three together
    print(f"\ncross-attention picture: {plot_path}")
    print(f"model saved in {args.output_dir}; try: attnkit translate --model {args.output_dir} \"july 4, 1976\"")
    return 0


def _translate(args):
    """One line per input, in order: the input (`field`-escaped), a tab, the ISO date or a <marker>, and
    with --scores a tab and the model's probability of its output ("-" where nothing was decoded). Exit
    status 1, with one summary line on stderr, when any line holds a marker (docs/decisions.md item 26)."""
    texts = read_texts(args)
    if not os.path.isdir(args.model):
        raise CommandError(f"model directory {args.model} does not exist")
    translator = DateTranslator.load(args.model)
    if not texts:
        note_no_texts(args)
        return 0
    markers = {i: marker for i, text in enumerate(texts) if (marker := refusal(translator, text))}
    todo = [i for i in range(len(texts)) if i not in markers]
    translated, scores = translator.translate([texts[i] for i in todo], beam_size=args.beam, return_scores=True)
    outputs, probabilities = dict(markers), ["-"] * len(texts)
    for i, output, score in zip(todo, translated, scores):
        if marker := output_marker(output):
            markers[i] = marker
        outputs[i] = markers.get(i, output)
        probabilities[i] = f"{math.exp(score):.4g}"
    for i, text in enumerate(texts):
        print(f"{field(text)}\t{outputs[i]}" + (f"\t{probabilities[i]}" if args.scores else ""))
    if markers:
        sys.stdout.flush()
        reasons = [f"{i + 1} {markers[i][1:-1].split(':')[0]}" for i in sorted(markers)]
        shown = ", ".join(reasons[:5]) + (", ..." if len(reasons) > 5 else "")
        print(f"attnkit: error: {len(markers)} of {len(texts)} inputs have no date (input {shown})", file=sys.stderr)
        return 1
    return 0

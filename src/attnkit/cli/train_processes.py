"""`attnkit train` with `--processes`, `--coordinator`, `--process-id` and `--resume`.

    --processes N                       launch N local workers (launcher.py), each of them ...
    --coordinator H:P --process-id I --processes N
                                        ... one worker: join the engine, train (training.py), and on
                                        process 0 save the model and report exact match

The first lines a run prints state the engine, the world size, the per-process and the global batch.
"""

import os
import time

import keras

from attnkit.cli import processes
from attnkit.cli.errors import CommandError
from attnkit.dates import training
from attnkit.dates.translator import DateTranslator

from attnkit.distributed.watchdog import FIRST_STEP_SECONDS, StepWatchdog

def run(args, config, parser):
    """The train command when any of --processes, --coordinator, --process-id, --resume is given.

    Options that do not go together are a usage error (`CommandError`: exit status 2, as argparse's
    own), raised before any process starts.
    """
    backend = keras.backend.backend()
    args.processes = args.processes or 1  # --resume alone: one process
    check_options(args, config)
    if args.process_id is None:
        return processes.launch(args, parser, "train", backend)
    return _worker(args, config, backend)


def check_options(args, config):
    """Raises `CommandError` naming the first option that does not fit the others."""
    if args.data_parallel:
        raise CommandError("--data-parallel (one process over its devices) cannot be combined with --processes, "
                           "--coordinator, --process-id or --resume (their runs are of processes)")
    processes.check_batch_size(config.batch_size, args.processes)
    if config.n_train < config.batch_size:  # epoch_order's refusal, here rather than in every worker
        raise CommandError(f"--train-size must be at least --batch-size. Received: train_size={config.n_train}, "
                           f"batch_size={config.batch_size}")
    processes.check_coordinator(args)


def _worker(args, config, backend):
    rank, world = args.process_id, args.processes
    who = f"worker {rank} of {world}"
    log = _printer if rank == 0 else (lambda line: None)
    start = time.perf_counter()
    engine = processes.join(args, backend)
    b = engine.local_batch(config.batch_size)
    log(f"engine: {engine.name}; world size {world} (processes); this is process {rank}")
    log(f"per-process batch {b}; global batch {config.batch_size}")
    watchdog = StepWatchdog(who, args.timeout, max(FIRST_STEP_SECONDS, args.timeout))
    checkpoints = os.path.join(args.output_dir, training.CHECKPOINTS)
    model, tokenizer, validation, losses = training.train(
        config, engine, checkpoint_dir=checkpoints, resume=args.resume, callbacks=[watchdog], log=log,
    )
    seconds = time.perf_counter() - start

    with engine.saving_directory(args.output_dir) as directory:
        # written aside and renamed into place (docs/decisions.md item 23)
        DateTranslator(model, tokenizer, config.source_length).save(directory, overwrite=True)
    engine.close()
    if rank == 0:
        accuracy = DateTranslator.load(args.output_dir).exact_match(validation)
        log(f"trained in {seconds:.0f} s; validation exact match {accuracy:.2%} on {len(validation)} dates")
        log(f"saved to {args.output_dir}")
    return 0


def _printer(line):
    print(line, flush=True)

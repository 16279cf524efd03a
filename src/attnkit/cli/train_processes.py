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

from attnkit._messages import one_line
from attnkit.cli.errors import CommandError
from attnkit.dates import training
from attnkit.dates.translator import DateTranslator
from attnkit.distributed import engines, launcher
from attnkit.distributed.watchdog import Deadline, FIRST_STEP_SECONDS, StepWatchdog

# The engine's own time-out (--timeout) ends a failed join; this deadline, later, ends one that hangs.
JOIN_GRACE_SECONDS = 10


def parse_coordinator(text):
    """"HOST:PORT" -> (host, port).

    Raises:
        ValueError: naming `--coordinator` and what was received.
    """
    host, _, port = (text or "").rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--coordinator must be HOST:PORT with a port in 1..65535. Received: --coordinator={text!r}")
    return host, int(port)


def worker_arguments(parser, args):
    """The options of `args` as a command line for `parser`, without the launcher's own."""
    skip = {"processes", "coordinator", "process_id", "help"}
    argv = []
    for action in parser._actions:
        if not action.option_strings or action.dest in skip:
            continue
        value = getattr(args, action.dest, action.default)
        if action.nargs == 0:  # a flag
            if value and value != action.default:
                argv.append(action.option_strings[0])
        elif value is not None and value != action.default:
            argv += [action.option_strings[0], str(value)]
    return argv


def run(args, config, parser):
    """The train command when any of --processes, --coordinator, --process-id, --resume is given.

    Options that do not go together are a usage error (`CommandError`: exit status 2, as argparse's
    own), raised before any process starts.
    """
    backend = keras.backend.backend()
    args.processes = args.processes or 1  # --resume alone: one process
    check_options(args, config)
    if args.process_id is None:
        if args.coordinator:
            _, port = parse_coordinator(args.coordinator)
            launcher.check_ports(launcher.LOCALHOST, engines.ports_needed(backend, port, args.processes))
        else:
            port = launcher.free_ports(len(engines.ports_needed(backend, 0, args.processes)))
        return launcher.launch(worker_arguments(parser, args), args.processes, port)
    return _worker(args, config, backend)


def check_options(args, config):
    """Raises `CommandError` naming the first option that does not fit the others."""
    if args.data_parallel:
        raise CommandError("--data-parallel (one process over its devices) cannot be combined with --processes, "
                           "--coordinator, --process-id or --resume (their runs are of processes)")
    if config.batch_size % args.processes:
        raise CommandError(f"--batch-size must be a multiple of --processes ({args.processes}) so that every process "
                           f"gets an equal share. Received: batch_size={config.batch_size}")
    if config.n_train < config.batch_size:  # epoch_order's refusal, here rather than in every worker
        raise CommandError(f"--train-size must be at least --batch-size. Received: train_size={config.n_train}, "
                           f"batch_size={config.batch_size}")
    if args.coordinator is not None:
        try:
            host, _ = parse_coordinator(args.coordinator)
        except ValueError as e:
            raise CommandError(str(e)) from None
        if args.process_id is None and host not in (launcher.LOCALHOST, "localhost"):
            raise CommandError(
                f"--processes without --process-id starts workers on this machine only, so --coordinator must be "
                f"{launcher.LOCALHOST}:PORT. Received: --coordinator={args.coordinator!r}; on several machines "
                f"start one worker per machine with --process-id (docs/distributed.md)"
            )
    if args.process_id is None:
        return
    if args.coordinator is None:
        raise CommandError("--process-id needs --coordinator HOST:PORT (process 0's address) and --processes N")
    if not 0 <= args.process_id < args.processes:
        raise CommandError(f"--process-id must be in 0..{args.processes - 1} for --processes {args.processes}. "
                           f"Received: --process-id={args.process_id}")


def _worker(args, config, backend):
    launcher.end_with_launcher()
    host, port = parse_coordinator(args.coordinator)
    rank, world = args.process_id, args.processes
    who = f"worker {rank} of {world}"
    listens = engines.ports_needed(backend, port, world)
    if backend == "tensorflow" and "TF_CONFIG" not in os.environ:
        launcher.check_ports(host, [listens[rank]])
    elif backend != "tensorflow" and rank == 0:
        launcher.check_ports(host, listens)

    log = _printer if rank == 0 else (lambda line: None)
    start = time.perf_counter()
    failed = f"{who}: could not join the run at {host}:{port} within {args.timeout} s"
    try:
        # The engine's own time-out ends the wait, or failing that the deadline (a few seconds later).
        with Deadline(f"{failed}: no answer", args.timeout + JOIN_GRACE_SECONDS):
            if rank != 0:  # process 0 is the coordinator
                launcher.wait_for_listener(host, port, args.timeout)
            engine = engines.start_engine(backend, rank, world, host, port, args.timeout)
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 - each engine has its own error types for "cannot connect"
        raise ConnectionError(f"{failed}: {one_line(e)}") from None
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

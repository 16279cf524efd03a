"""A command run over several processes (`train` and `finetune` with `--processes`, `--coordinator`,
`--process-id`): the launcher's side, which checks the options and ports and starts the local
workers (attnkit.distributed.launcher), and a worker's side, which joins its backend's engine
(attnkit.distributed.engines).
"""

import os

from attnkit._messages import one_line
from attnkit.cli.errors import CommandError
from attnkit.distributed import engines, launcher
from attnkit.distributed.watchdog import Deadline

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


def check_batch_size(batch_size, processes):
    """Refuses a global batch that does not split evenly over the processes, before any starts."""
    if batch_size % processes:
        raise CommandError(f"--batch-size must be a multiple of --processes ({processes}) so that every process "
                           f"gets an equal share. Received: batch_size={batch_size}")


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


def check_coordinator(args):
    """Raises `CommandError` naming the first of --coordinator, --process-id, --processes that does not
    fit the others."""
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


def launch(args, parser, command, backend):
    """Starts --processes local workers of `command` (`attnkit COMMAND` with the options of `args`) on
    the --coordinator's port or free ones; returns 0 when all of them succeed (launcher.launch)."""
    if args.coordinator:
        _, port = parse_coordinator(args.coordinator)
        launcher.check_ports(launcher.LOCALHOST, engines.ports_needed(backend, port, args.processes))
    else:
        port = launcher.free_ports(len(engines.ports_needed(backend, 0, args.processes)))
    return launcher.launch(worker_arguments(parser, args), args.processes, port, subcommand=command)


def join(args, backend):
    """This worker's engine (--process-id of --processes), joined to the run at --coordinator.

    Raises:
        ConnectionError: one line naming the worker and the cause, when it cannot join within --timeout.
    """
    launcher.end_with_launcher()
    host, port = parse_coordinator(args.coordinator)
    rank, world = args.process_id, args.processes
    listens = engines.ports_needed(backend, port, world)
    if backend == "tensorflow" and "TF_CONFIG" not in os.environ:
        launcher.check_ports(host, [listens[rank]])
    elif backend != "tensorflow" and rank == 0:
        launcher.check_ports(host, listens)
    failed = f"worker {rank} of {world}: could not join the run at {host}:{port} within {args.timeout} s"
    try:
        # The engine's own time-out ends the wait, or failing that the deadline (a few seconds later).
        with Deadline(f"{failed}: no answer", args.timeout + JOIN_GRACE_SECONDS):
            if rank != 0:  # process 0 is the coordinator
                launcher.wait_for_listener(host, port, args.timeout)
            return engines.start_engine(backend, rank, world, host, port, args.timeout)
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 - each engine has its own error types for "cannot connect"
        raise ConnectionError(f"{failed}: {one_line(e)}") from None

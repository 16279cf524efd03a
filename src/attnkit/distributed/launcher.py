"""`attnkit train --processes N` (and `finetune`): N worker processes on 127.0.0.1, each started with the flags a user
would give it on its own machine (`--coordinator 127.0.0.1:PORT --process-id I --processes N`).

The launcher checks the ports before it starts anything, passes worker 0's output through, keeps the
others' quiet, and watches them all: when one ends with a failure, it stops the others and raises one
line that names the worker and the cause (docs/decisions.md item 43). A launcher killed outright
(SIGKILL) cannot stop them: on Linux each worker asks for a SIGTERM when it dies (`end_with_launcher`).
"""

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

LOCALHOST = "127.0.0.1"
POLL_SECONDS = 0.1
STOP_GRACE_SECONDS = 5
CAUSE_SECONDS = 0.5
LAUNCHER_PID = "ATTNKIT_LAUNCHER_PID"  # set in the environment of the workers the launcher starts
PR_SET_PDEATHSIG = 1  # prctl(2)


class WorkerFailed(ChildProcessError):
    """A worker ended with a failure (the message names it and the cause)."""


def port_is_free(host, port):
    """Whether `port` on `host` can be listened on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def check_ports(host, ports):
    """Raises OSError naming the first port on `host` that is taken (or out of range)."""
    for port in ports:
        if not 0 < port < 65536:
            raise OSError(f"port {port} is out of range 1..65535; choose another with --coordinator {host}:PORT")
        if not port_is_free(host, port):
            raise OSError(f"port {port} on {host} is in use; choose another with --coordinator {host}:PORT")


def wait_for_listener(host, port, seconds):
    """Waits until something accepts connections at host:port.

    Some engines end the process from C++ when their coordinator does not answer (jax's client aborts
    with a stack dump), so the workers other than 0 wait here, in Python, first.

    Raises:
        ConnectionError: nothing answered within `seconds`, with the last reason.
    """
    deadline, reason = time.monotonic() + seconds, "no answer"
    while True:
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(2.0, deadline - time.monotonic()))):
                return
        except OSError as e:
            reason = e.strerror or type(e).__name__
        if time.monotonic() >= deadline:
            raise ConnectionError(reason)
        time.sleep(0.2)


def free_ports(count, attempts=50):
    """A first port p such that p .. p + count - 1 are free on 127.0.0.1."""
    for _ in range(attempts):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((LOCALHOST, 0))
            port = s.getsockname()[1]
        if port + count < 65536 and all(port_is_free(LOCALHOST, port + i) for i in range(1, count)):
            return port
    raise OSError(f"found no {count} consecutive free ports on {LOCALHOST}; give one with --coordinator {LOCALHOST}:PORT")


def worker_environment(processes):
    """The environment of a worker: the cores shared out (a variable the user set is kept)."""
    threads = str(max(1, (os.cpu_count() or 1) // processes))
    env = dict(os.environ)
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS"):
        env.setdefault(name, threads)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env[LAUNCHER_PID] = str(os.getpid())
    return env


def end_with_launcher():
    """In a worker the launcher started (Linux): a SIGTERM when the launcher dies, so that a launcher
    killed outright leaves no workers behind that train on and write the model (docs/decisions.md
    item 86). SIGTERM ends a worker as Ctrl-C does (item 78): saves are whole or absent. Elsewhere,
    and in a worker started by hand, nothing."""
    launcher = os.environ.pop(LAUNCHER_PID, None)
    if not launcher or not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):  # no prctl to ask: the launcher's own stop still applies
        return
    if os.getppid() != int(launcher):  # it died before the request was made
        os.kill(os.getpid(), signal.SIGTERM)


def launch(worker_arguments, processes, port, subcommand="train"):
    """Runs `processes` workers, `python -m attnkit.cli SUBCOMMAND *worker_arguments --coordinator ... --process-id I`.

    Args:
        worker_arguments: the command's own options, the same for every worker.
        processes: N.
        port: the coordinator's port on 127.0.0.1 (its ports must have been checked).
        subcommand: `train` or `finetune`.

    Returns:
        0 when every worker succeeded.

    Raises:
        WorkerFailed: the first worker that failed, with its exit status or signal and its last error line.
    """
    workers, logs = [], []
    try:
        for rank in range(processes):
            log = tempfile.TemporaryFile(mode="w+", prefix=f"attnkit-worker-{rank}-")
            command = [
                sys.executable, "-m", "attnkit.cli", subcommand, *worker_arguments,
                "--coordinator", f"{LOCALHOST}:{port}", "--process-id", str(rank), "--processes", str(processes),
            ]
            workers.append(subprocess.Popen(
                command, stdout=None if rank == 0 else subprocess.DEVNULL, stderr=log, env=worker_environment(processes),
            ))
            logs.append(log)
        return _watch(workers, logs)
    finally:
        _stop(workers)
        for log in logs:
            log.close()


def _watch(workers, logs):
    while True:
        statuses = [worker.poll() for worker in workers]
        if all(status == 0 for status in statuses):
            return 0
        if any(status not in (None, 0) for status in statuses):
            # A worker that dies takes its peers' collectives down with it, and they may exit first:
            # give them a moment, then name a worker killed by a signal before one that saw the error.
            time.sleep(CAUSE_SECONDS)
            statuses = [worker.poll() for worker in workers]
            failed = [rank for rank, status in enumerate(statuses) if status not in (None, 0)]
            rank = min(failed, key=lambda r: (statuses[r] > 0, r))
            raise WorkerFailed(
                f"worker {rank} of {len(workers)} (pid {workers[rank].pid}) {_cause(statuses[rank], logs[rank])}; "
                f"the other workers were stopped"
            )
        time.sleep(POLL_SECONDS)


def _cause(status, log):
    if status < 0:
        try:
            name = signal.Signals(-status).name
        except ValueError:
            name = f"signal {-status}"
        return f"was killed by {name}"
    log.seek(0)
    lines = [line.strip() for line in log.read().splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("attnkit: error:")]
    last = (errors or lines or ["no error message"])[-1].removeprefix("attnkit: error: ")
    return f"exited with status {status}: {last}"


def _stop(workers):
    """Ends the workers still running: SIGTERM, then SIGKILL after a grace period."""
    alive = [w for w in workers if w.poll() is None]
    for worker in alive:
        worker.terminate()
    deadline = time.monotonic() + STOP_GRACE_SECONDS
    for worker in alive:
        try:
            worker.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()

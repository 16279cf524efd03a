"""Data-parallel training over all local devices, on the backends' own distributed engines.

Nothing here reimplements gradient averaging: each backend's engine does it.

    jax         `keras.distribution.DataParallel` over `keras.distribution.list_devices()`: the batch is
                sharded along its first axis, the variables are replicated, and XLA's SPMD partitioner
                inserts the all-reduce. Several hosts: `keras.distribution.initialize()` (which calls
                `jax.distributed.initialize`) when the `KERAS_DISTRIBUTION_*` variables are set.
    tensorflow  `tf.distribute.MirroredStrategy` over the local GPUs (the CPUs' logical devices when
                there is no GPU); the model is built and compiled inside `strategy.scope()` and Keras's
                `fit` splits each batch over the replicas.
    torch       not supported: `data_parallel_plan` raises a ValueError that names the way out.

The batch size stays the user's *global* batch size: with D devices each one sees batch_size / D
examples per step, so a data-parallel run takes the same steps, on the same batches, as a one-device run.

Legend: B global batch, D devices (all hosts), P processes (hosts), N examples.
"""

import contextlib
import os

import keras

SUPPORTED_BACKENDS = ("jax", "tensorflow")
ENGINE_NAMES = {"DataParallel": "keras.distribution.DataParallel (jax)", "MirroredStrategy": "tf.distribute.MirroredStrategy"}
# XLA's CPU collectives abort the process (exit 134, a stack dump) when a rendezvous waits longer than
# their default; on a busy machine a slow device thread is enough. Raised so far that they never fire
# first: attnkit's step watchdog ends a truly stuck run with one line (docs/decisions.md item 43).
XLA_COLLECTIVE_FLAGS = (
    "--xla_cpu_collective_call_terminate_timeout_seconds=86400",
    "--xla_cpu_collective_timeout_seconds=86400",
    "--xla_cpu_collective_call_warn_stuck_timeout_seconds=86400",
)
MULTI_HOST_VARIABLES = (
    "KERAS_DISTRIBUTION_JOB_ADDRESSES", "KERAS_DISTRIBUTION_NUM_PROCESSES", "KERAS_DISTRIBUTION_PROCESS_ID",
)


class DataParallelPlan:
    """How one training run is split over devices: the engine's scope and this process's share.

    Args:
        engine: the backend's object that does the work: a `keras.distribution.DataParallel` (jax), a
            `tf.distribute.MirroredStrategy` (tensorflow), or None (one device).
        devices: the names of the devices of all processes that share the work (D of them).
        process_index: this process's index, 0 .. P - 1.
        process_count: P, the number of processes (hosts) taking part.
    """

    def __init__(self, engine, devices, *, process_index=0, process_count=1):
        self.engine, self.devices = engine, list(devices)
        self.process_index, self.process_count = process_index, process_count

    @property
    def num_devices(self):
        return len(self.devices)

    def describe(self):
        """One log line: the engine and the devices, e.g. "engine: keras.distribution.DataParallel (jax);
        2 devices: cpu:0, cpu:1"."""
        name = "none (one device)" if self.engine is None else ENGINE_NAMES.get(type(self.engine).__name__, type(self.engine).__name__)
        count = f"{self.num_devices} device{'s' if self.num_devices > 1 else ''}"
        hosts = f" on {self.process_count} processes" if self.process_count > 1 else ""
        return f"engine: {name}; {count}{hosts}: {', '.join(self.devices)}"

    def scope(self):
        """The context manager under which the model must be created, compiled and trained."""
        return self.engine.scope() if self.engine is not None else contextlib.nullcontext()

    def local_batch_size(self, batch_size):
        """The batch this process feeds to `fit` so that the global batch is `batch_size`.

        Raises:
            ValueError: if `batch_size` is not a multiple of the number of devices.
        """
        if batch_size % self.num_devices:
            raise ValueError(
                f"For data-parallel training the batch size must be a multiple of the number of devices "
                f"({self.num_devices}: {', '.join(self.devices)}). Received: batch_size={batch_size}"
            )
        return batch_size // self.process_count

    def local_examples(self, *arrays, name="examples"):
        """This process's share of the examples, a multiple of D in total so that every batch splits evenly.

        Each array has N examples along its first axis; the last N mod D are dropped (at most D - 1), and
        process p keeps examples p, p + P, p + 2P, ... `name` names the set in the error when N < D.
        """
        n = len(arrays[0]) - len(arrays[0]) % self.num_devices
        if n == 0:
            raise ValueError(f"Data-parallel training over {self.num_devices} devices needs at least "
                             f"{self.num_devices} examples in `{name}`. Received: {name}={len(arrays[0])}")
        return tuple(a[:n][self.process_index::self.process_count] for a in arrays)


def data_parallel_plan(backend=None):
    """A `DataParallelPlan` over all devices, on the engine of the current Keras backend.

    Call it before any model is created: on jax it may start the multi-host runtime.

    Args:
        backend: the Keras backend name; default `keras.backend.backend()`.

    Returns:
        A `DataParallelPlan`.

    Raises:
        ValueError: on a backend without a data-parallel engine here (torch), naming how to switch.

    Example:
        >>> plan = data_parallel_plan()
        >>> with plan.scope():
        ...     model = build_model(); model.compile(...)
        ...     model.fit(x, y, batch_size=plan.local_batch_size(64))
    """
    backend = backend or keras.backend.backend()
    if backend == "jax":
        return _jax_plan()
    if backend == "tensorflow":
        return _tensorflow_plan()
    raise ValueError(
        f"Data-parallel training is supported on the {' and '.join(SUPPORTED_BACKENDS)} backends, not on "
        f"{backend}. Switch the backend with the KERAS_BACKEND environment variable, e.g. "
        f"KERAS_BACKEND=jax attnkit train --data-parallel ...; or train in several processes, on every backend, "
        f"with attnkit train --processes N"
    )


def relax_xla_collective_timeouts():
    """Adds `XLA_COLLECTIVE_FLAGS` to XLA_FLAGS (those the user set are kept) if jax has not started yet.

    Returns:
        Whether XLA will read them (False once jax's backends are initialised: the flags are read once).
    """
    try:
        from jax._src import xla_bridge

        started = xla_bridge.backends_are_initialized()
    except (ImportError, AttributeError):  # a jax without this function: set them and hope
        started = False
    if started:
        return False
    flags = os.environ.get("XLA_FLAGS", "")
    extra = [f for f in XLA_COLLECTIVE_FLAGS if f.split("=")[0] not in flags]
    os.environ["XLA_FLAGS"] = " ".join([flags, *extra]).strip()
    return True


def _jax_plan():
    relax_xla_collective_timeouts()
    import jax

    if any(name in os.environ for name in MULTI_HOST_VARIABLES) and not jax.distributed.is_initialized():
        keras.distribution.initialize()  # jax.distributed.initialize with the coordinator from the env
    devices = keras.distribution.list_devices()
    # Each process feeds its own slice (`local_examples`): Keras must not shard it again, and refuses
    # arrays (not a tf.data.Dataset) on several hosts unless told so.
    distribution = keras.distribution.DataParallel(devices=devices, auto_shard_dataset=False)
    return DataParallelPlan(
        distribution, devices, process_index=jax.process_index(), process_count=jax.process_count(),
    )


def _tensorflow_plan():
    import tensorflow as tf

    # MirroredStrategy() alone takes the GPUs or else one CPU; name the CPUs' logical devices when there
    # is no GPU so that `tf.config.set_logical_device_configuration` can make a several-device CPU.
    devices = [d.name for d in tf.config.list_logical_devices("GPU")] or [
        d.name for d in tf.config.list_logical_devices("CPU")
    ]
    return DataParallelPlan(tf.distribute.MirroredStrategy(devices), devices)


def single_device_plan():
    """The trivial plan: the backend's default placement, no split."""
    return DataParallelPlan(None, ["default device"])

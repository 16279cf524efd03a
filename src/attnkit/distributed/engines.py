"""One worker of a multi-process run, on its backend's own engine.

    torch       `torch.distributed` (gloo): one all-reduce of the flattened gradients inside Keras's own
                train step, just before the optimizer applies them (docs/decisions.md item 41).
    jax         `jax.distributed.initialize` with gloo CPU collectives, then
                `keras.distribution.DataParallel` over the devices of all processes: XLA inserts the
                all-reduce.
    tensorflow  `tf.distribute.MultiWorkerMirroredStrategy`, configured by TF_CONFIG (worker i listens
                on the coordinator's port + i unless TF_CONFIG is already set).

Every process feeds its own share of each global batch (`Engine.local_batch`), so a run with P
processes takes the same steps, on the same global batches, as a run with one.

Legend: B global batch, P processes (world size), b = B / P the per-process batch.
"""

import contextlib
import datetime
import json
import os
import tempfile

import keras

from attnkit.distributed import exposure
from attnkit.distributed.local import relax_xla_collective_timeouts
from attnkit.distributed.watchdog import FIRST_STEP_SECONDS

SEED_STRIDE = 1_000_003  # between the dropout seeds of two torch processes


class Engine:
    """A backend's engine for one of P processes.

    Args:
        rank: this process's index, 0 .. P - 1.
        world: P.
    """

    name = "none"
    # How the P processes' gradients of a sum-reduced loss are joined. True: averaged (torch's
    # all-reduce, then / P). False: summed (tensorflow's optimizer sums its replicas' gradients, and
    # Keras scales only mean-reduced losses by 1 / P), or one loss over the global batch (jax).
    averages_gradients = True

    def __init__(self, rank, world):
        self.rank, self.world = rank, world

    def local_batch(self, batch_size):
        """b, this process's share of the global batch B.

        Raises:
            ValueError: if B is not a multiple of P.
        """
        if batch_size % self.world:
            raise ValueError(
                f"--batch-size must be a multiple of --processes ({self.world}) so that every process gets an "
                f"equal share. Received: batch_size={batch_size}"
            )
        return batch_size // self.world

    def scope(self):
        """The context under which the model is built, compiled and trained."""
        return contextlib.nullcontext()

    def prepare(self, model):
        """Called once the compiled model holds its starting weights (fresh or restored)."""

    def fit_arguments(self, x, y, sample_weight, batch_size):
        """`fit`'s data arguments for this process's examples (already in order), b per step."""
        return {"x": x, "y": y, "sample_weight": sample_weight, "batch_size": batch_size}

    @contextlib.contextmanager
    def saving_directory(self, directory):
        """Where this process writes a save of `directory`: the directory itself on process 0, a
        temporary directory, removed afterwards, on the others. Every process saves because reading a
        variable may be a collective (jax's multi-process arrays, tensorflow's MultiWorkerMirroredStrategy,
        whose guide asks the same of every worker)."""
        if self.rank == 0:
            yield directory
            return
        with tempfile.TemporaryDirectory(prefix=f"attnkit-worker-{self.rank}-") as scratch:
            yield scratch

    def mean(self, value):
        """The mean of a float over all processes (for the epoch loss that Keras logs per process)."""
        return float(value)

    def close(self):
        """Leaves the process group, where the engine has one."""


class TorchEngine(Engine):
    name = "torch.distributed (gloo)"

    def __init__(self, rank, world, host, port, timeout):
        super().__init__(rank, world)
        import torch.distributed as dist

        self.dist = dist
        # The timeout bounds both the wait for the other processes and every collective after it.
        timeout = datetime.timedelta(seconds=timeout)
        if exposure.is_loopback(host):
            # A local run binds 127.0.0.1 only (docs/decisions.md item 113): the store on a socket of
            # ours (TCPStore itself would listen on [::]), gloo's pairs on the loopback interface.
            if exposure.loopback_interface():
                os.environ.setdefault("GLOO_SOCKET_IFNAME", exposure.loopback_interface())
            self._listener = exposure.listening_socket(host, port) if rank == 0 else None
            store = dist.TCPStore(
                "127.0.0.1" if host == "localhost" else host, port, world, rank == 0, timeout,
                master_listen_fd=None if self._listener is None else self._listener.fileno(),
            )
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
            return
        if rank == 0:
            exposure.announce("torch.distributed's store (process 0)", port)
        dist.init_process_group("gloo", init_method=f"tcp://{host}:{port}", rank=rank, world_size=world, timeout=timeout)

    def prepare(self, model):
        import torch

        with torch.no_grad():  # the same starting point everywhere, as DistributedDataParallel does
            for v in model.variables:
                self.dist.broadcast(v.value.data, src=0)
            # Each process draws its own dropout masks (the seeds are equal after the broadcast, and
            # process 0's stream is the one checkpointed; docs/decisions.md item 41).
            for layer in model._flatten_layers():
                for generator in getattr(layer, "_seed_generators", []):
                    state = keras.ops.convert_to_numpy(generator.state.value).copy()
                    state[0] += self.rank * SEED_STRIDE
                    generator.state.assign(state)
        optimizer, apply = model.optimizer, model.optimizer.apply

        def apply_mean_gradients(gradients, trainable_variables=None):
            # Each process's loss is the mean over its b examples; the mean of the P gradients is the
            # gradient of the mean over all B. One flat tensor, one all-reduce per step.
            flat = torch.cat([g.reshape(-1) for g in gradients])
            self.dist.all_reduce(flat)
            flat /= self.world
            for g, part in zip(gradients, flat.split([g.numel() for g in gradients])):
                g.copy_(part.view_as(g))
            return apply(gradients, trainable_variables)

        optimizer.apply = apply_mean_gradients

    def mean(self, value):
        import torch

        total = torch.tensor([float(value)], dtype=torch.float64)
        self.dist.all_reduce(total)
        return float(total[0]) / self.world

    def close(self):
        if self.dist.is_initialized():
            self.dist.destroy_process_group()


class JaxEngine(Engine):
    name = "jax.distributed (gloo CPU collectives)"
    averages_gradients = False

    def __init__(self, rank, world, host, port, timeout):
        super().__init__(rank, world)

        relax_xla_collective_timeouts()
        import jax

        jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU devices of other processes
        local = exposure.is_loopback(host)
        if rank == 0 and not local:
            exposure.announce("jax's coordination service (process 0)", port)
        jax.distributed.initialize(
            f"{host}:{port}", num_processes=world, process_id=rank, initialization_timeout=timeout,
            heartbeat_timeout_seconds=2 * timeout,  # after attnkit's own step watchdog
            # A local run's service on 127.0.0.1 only; jax's default is [::] (docs/decisions.md item 113).
            coordinator_bind_address=f"{'127.0.0.1' if host == 'localhost' else host}:{port}" if local else None,
        )
        self.devices = jax.devices()  # of all processes
        # Each process feeds its own share: Keras must not shard it again (it refuses arrays on several
        # processes with auto-sharding on).
        self.distribution = keras.distribution.DataParallel(devices=self.devices, auto_shard_dataset=False)

    def scope(self):
        return self.distribution.scope()

    def close(self):
        import jax

        keras.distribution.set_distribution(None)
        jax.distributed.shutdown()


class TensorflowEngine(Engine):
    name = "tf.distribute.MultiWorkerMirroredStrategy"
    averages_gradients = False

    def __init__(self, rank, world, host, port, timeout):
        super().__init__(rank, world)
        import tensorflow as tf

        # tensorflow's gRPC server has no bind address setting: it listens on every interface, even in
        # a local run, and says so (docs/decisions.md item 113).
        exposure.announce(f"tensorflow's gRPC server (worker {rank})", port + rank if "TF_CONFIG" not in os.environ else None)
        if "TF_CONFIG" not in os.environ:
            os.environ["TF_CONFIG"] = json.dumps({
                "cluster": {"worker": [f"{host}:{port + i}" for i in range(world)]},
                "task": {"type": "worker", "index": rank},
            })
        self.tf = tf
        # Long enough for one worker compiling its first step while another waits; a collective stuck
        # later is ended sooner by the step watchdog (docs/decisions.md item 43).
        options = tf.distribute.experimental.CommunicationOptions(timeout_seconds=max(timeout, FIRST_STEP_SECONDS))
        self.strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
        found = self.strategy.cluster_resolver.task_id, self.strategy.num_replicas_in_sync
        if found != (rank, world):
            raise ValueError(
                f"TF_CONFIG describes worker {found[0]} of {found[1]} replicas, but --process-id {rank} "
                f"--processes {world} were given"
            )
        # The strategy connects lazily; one all-reduce now makes joining fail here, within the deadline.
        one = self.strategy.run(lambda: tf.constant(1.0))
        self.strategy.reduce(tf.distribute.ReduceOp.SUM, one, axis=None)

    def scope(self):
        return self.strategy.scope()

    def mean(self, value):
        # With one replica per worker, a value outside `fit` (`train_on_batch`'s loss) is the worker's own.
        # The float64 sum of P values, as torch's engine takes it.
        tf = self.tf
        mine = self.strategy.run(lambda: tf.constant(float(value), tf.float64))
        return float(self.strategy.reduce(tf.distribute.ReduceOp.SUM, mine, axis=None)) / self.world

    def prepare(self, model):
        self.model = model
        _mean_logs_over_workers(self.strategy)

    def fit_arguments(self, x, y, sample_weight, batch_size):
        tf = self.tf
        # Keras builds a model under a strategy from the first batch, averaged over the replicas with
        # strategy.reduce("MEAN"), which MultiWorkerMirroredStrategy refuses for integer token ids;
        # give it one local batch instead (the model's weights exist already).
        first = (tuple(part[:batch_size] for part in x), y[:batch_size], sample_weight[:batch_size])
        build = type(self.model)._maybe_symbolic_build.__get__(self.model)
        self.model._maybe_symbolic_build = lambda iterator=None, data_batch=None: build(data_batch=first)

        def dataset(_):
            # Already this worker's share, in order: no auto-sharding, no shuffling.
            data = tf.data.Dataset.from_tensor_slices((x, y, sample_weight)).batch(batch_size)
            options = tf.data.Options()
            options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
            return data.with_options(options)

        return {"x": self.strategy.distribute_datasets_from_function(dataset)}


def commit_state(model):
    """Places every variable of `model` (weights, optimizer, metrics) as its distribution lays it out.

    Keras keeps a value that is already where its layout wants it: on one device, a plain array
    rather than one on the distribution's mesh. A compiled step's outputs are on the mesh, and jax
    keys its programs on the mesh in an argument's type, so the train step compiled three times
    (first call, second call, after each epoch's reset of the metrics) instead of once. A no-op on
    the other backends and without a distribution. Call it once the optimizer is built: variables
    created after it are off the mesh again, and Keras then warns of a mixed placement.
    """
    distribution = keras.distribution.distribution()
    if keras.backend.backend() != "jax" or distribution is None:
        return
    import jax

    optimizer = getattr(model, "optimizer", None)
    for variable in [*model.variables, *(optimizer.variables if optimizer else []), *model.metrics_variables]:
        layout = distribution.get_variable_layout(variable)  # a TensorLayout, or a jax Sharding as given
        sharding = getattr(layout, "backend_layout", layout)
        if variable.value.sharding != sharding:
            variable.assign(jax.device_put(variable.value, sharding))


class CommittedState(keras.callbacks.Callback):
    """`commit_state` at each epoch's start, after `fit` has reset the metrics."""

    def on_epoch_begin(self, epoch, logs=None):
        commit_state(self.model)


class SingleEngine(Engine):
    """One process, no engine: the reference a P-process run must reproduce."""

    name = "single process"

    def __init__(self):
        super().__init__(0, 1)


ENGINES = {"torch": TorchEngine, "jax": JaxEngine, "tensorflow": TensorflowEngine}


def start_engine(backend, rank, world, host, port, timeout):
    """The engine of `backend` for process `rank` of `world`, joined to the coordinator at host:port.

    Raises:
        ValueError: a backend without an engine here.
        RuntimeError/OSError: from the engine, when the coordinator or a peer cannot be reached in time.
    """
    if backend not in ENGINES:
        raise ValueError(f"No multi-process engine for the {backend} backend. Expected one of {sorted(ENGINES)}")
    return ENGINES[backend](rank, world, host, port, timeout)


def ports_needed(backend, port, world):
    """The ports on the coordinator's host that a run of `world` processes listens on."""
    return [port + i for i in range(world)] if backend == "tensorflow" else [port]


def _mean_logs_over_workers(strategy):
    """Keras 3 reduces `fit`'s per-replica logs under MultiWorkerMirroredStrategy with
    strategy.reduce("MEAN", v, axis=0), which fails on the scalar loss ("Invalid reduction dimension 0");
    for this strategy, scalars are averaged over the replicas with axis=None instead, what "MEAN"
    means for them. Installed once; other strategies keep Keras's own reduction."""
    import tensorflow as tf
    from keras.src.backend.tensorflow import trainer

    original = getattr(trainer.reduce_per_replica, "__wrapped__", trainer.reduce_per_replica)

    def reduce_per_replica(values, reduce_strategy, reduction):
        if reduce_strategy is not strategy or reduction != "auto":
            return original(values, reduce_strategy, reduction)
        return tf.nest.map_structure(
            lambda v: reduce_strategy.reduce("MEAN", v, axis=None) if isinstance(v, tf.distribute.DistributedValues) else v,
            values,
        )

    reduce_per_replica.__wrapped__ = original
    trainer.reduce_per_replica = reduce_per_replica

"""Data-parallel training, on the backends' own distributed engines.

    local       one process over all its devices (`--data-parallel`): `keras.distribution.DataParallel`
                (jax), `tf.distribute.MirroredStrategy` (tensorflow).
    engines     one process of several (`--processes N`, `--coordinator`): torch.distributed with gloo,
                jax.distributed with gloo CPU collectives, tensorflow's MultiWorkerMirroredStrategy.
    training    the worker's loop: a deterministic data order, checkpoints, `--resume`.
    launcher    starts N local workers on 127.0.0.1 and ends them all when one fails.
    watchdog    turns a stuck collective into a one-line error.

Nothing here reimplements what an engine does, except the torch gradient all-reduce, which is one
`torch.distributed.all_reduce` call around Keras's own train step (docs/decisions.md item 41).
"""

from attnkit.distributed.local import DataParallelPlan, data_parallel_plan, single_device_plan

__all__ = ["DataParallelPlan", "data_parallel_plan", "single_device_plan"]

"""The two-device half of tests/test_distributed.py; runs in its own process so the device count is set first.

    python distributed_worker.py BACKEND OUT_DIR

BACKEND jax expects XLA_FLAGS=--xla_force_host_platform_device_count=2 in the environment; tensorflow
splits the CPU into two logical devices here, before anything else touches TensorFlow. Then, with the
same seed: one-device training, data-parallel training, how a batch lands on the devices, and the
data-parallel model saved to OUT_DIR/model with its translations and greedy step logits. Results: OUT_DIR/result.json.
"""

import json
import os
import sys

BACKEND, OUT = sys.argv[1], sys.argv[2]
os.environ["KERAS_BACKEND"] = BACKEND
if BACKEND == "tensorflow":
    import tensorflow as tf

    cpus = tf.config.list_physical_devices("CPU")
    tf.config.set_logical_device_configuration(cpus[0], [tf.config.LogicalDeviceConfiguration()] * 2)

from attnkit.distributed.local import relax_xla_collective_timeouts  # noqa: E402

# What `attnkit train --data-parallel` does before jax starts (here the one-device run comes first).
RELAXED = relax_xla_collective_timeouts() if BACKEND == "jax" else None
import attnkit  # noqa: E402,F401
import numpy as np  # noqa: E402

from attnkit.distributed import data_parallel_plan  # noqa: E402
from attnkit.dates.translator import TrainConfig, train_dates  # noqa: E402

# 8 steps of a global batch of 16 (8 per device), no dropout so both runs compute the same function.
CONFIG = TrainConfig(epochs=1, batch_size=16, n_train=128, n_validation=16, d_model=16, h=2, d_ff=32, n=1, rate=0.0)
TEXTS = ["March 3, 2021", "the 4th of july 1976", "12/25/99", "2001/9/11"]


def split_batch(plan, batch):
    """[(device, shape)] of each device's part of one global batch, as the engine places it for `fit`."""
    if BACKEND == "jax":
        import jax

        layout = plan.engine.get_data_layout(batch.shape)  # what DataParallel gives `fit` for this batch
        placed = jax.device_put(batch, layout.backend_layout)
        return [(str(s.device), list(s.data.shape)) for s in placed.addressable_shards]
    strategy = plan.engine
    dataset = strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices(batch).batch(len(batch)))
    per_replica = strategy.run(tf.shape, args=(next(iter(dataset)),))  # runs once on each replica
    return [(s.device, s.numpy().tolist()) for s in strategy.experimental_local_results(per_replica)]


def variable_devices(model):
    """How many devices hold each trainable variable's value."""
    if BACKEND == "jax":
        return sorted({len(v.value.sharding.device_set) for v in model.trainable_weights})
    return sorted({len(getattr(v.value, "values", [v.value])) for v in model.trainable_weights})


single_history = train_dates(CONFIG, verbose=0)[2].history
log = []
translator, _, history = train_dates(CONFIG, verbose=0, data_parallel=True, log=log.append)
plan = data_parallel_plan()

translator.save(os.path.join(OUT, "model"))
translations, (decoded,) = translator.translate(TEXTS, return_attention_weights=True)
np.save(os.path.join(OUT, "step_logits.npy"), decoded.step_logits)
result = {
    "devices": plan.devices,
    "single": {k: single_history[k] for k in ("loss", "val_loss")},
    "data_parallel": {k: history.history[k] for k in ("loss", "val_loss")},
    "split": split_batch(plan, np.tile(translator.encode_sources(TEXTS), (CONFIG.batch_size // len(TEXTS), 1))),
    "variable_devices": variable_devices(translator.model),
    "log": log,
    "xla_flags": os.environ.get("XLA_FLAGS", ""),
    "xla_flags_in_time": RELAXED,
    "texts": TEXTS,
    "translations": translations,
}
with open(os.path.join(OUT, "result.json"), "w") as f:
    json.dump(result, f)

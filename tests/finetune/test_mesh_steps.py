"""jax under a distribution on one device (`attnkit finetune --processes 1`): each batch shape's train
step compiles once (docs/decisions.md item 163), where the first step's weights, off the mesh, and the
later steps', on it, made two programs of every shape."""

import logging
import warnings

import keras
import pytest

from attnkit.finetune import data, lora, training
from attnkit.pipelines.causal_checkpoint import load_causal_lm

pytestmark = pytest.mark.skipif(keras.backend.backend() != "jax", reason="jax keys its compiled programs on the mesh in an argument's type")


def test_each_batch_shape_compiles_once_under_a_one_device_distribution(tiny_dir, caplog):
    import jax

    with keras.distribution.DataParallel(devices=jax.devices()).scope():
        lm = load_causal_lm(tiny_dir)
        optimizer = keras.optimizers.SGD(0.5)
        model = training.prepare(lm, targets=list(lora.TARGETS), rank=4, alpha=8, optimizer=optimizer, seed=1)
        optimizer.build(model.trainable_variables)  # as attnkit.finetune.run does
        examples = [data.encode(lm, {"text": t}, 64) for t in ("a" * 5, "bb" * 6, "ccc" * 7, "dddd" * 8)]
        with jax.log_compiles(), caplog.at_level(logging.WARNING), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            state = training.run(model, examples, epochs=2, batch_size=2, pad_id=lm.pad_id, seed=0,
                                 state={"epoch": 0, "step": 0}, log=lambda *_: None)
    # "Compiling jit(train_step) with global shapes and types (...). Argument mapping: (...)": the same
    # shapes compiled twice differ only in where their arguments lie.
    shapes = [r.getMessage().split(". Argument mapping")[0] for r in caplog.records
              if r.getMessage().startswith("Compiling jit(train_step)")]
    assert shapes, "no train step was compiled"
    assert len(set(shapes)) == len(shapes), f"{len(shapes)} compiles of {len(set(shapes))} batch shapes"
    assert [h["epoch"] for h in state["history"]] == [1, 2]
    assert not [str(w.message) for w in caught if "mix of local" in str(w.message)]  # Keras's warning of a mixed placement

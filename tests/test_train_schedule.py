"""`make_optimizer`: the demo's learning-rate schedule (docs/decisions.md item 53)."""

import keras
import numpy as np
import pytest

from attnkit.dates.translator import TrainConfig, make_optimizer


def rates(optimizer, steps):
    schedule = optimizer._learning_rate  # the schedule itself; `learning_rate` is its current value
    return np.array([float(keras.ops.convert_to_numpy(schedule(step))) for step in steps])


def test_the_cosine_schedule_warms_up_then_decays_to_zero():
    config = TrainConfig(epochs=2, learning_rate=4e-3, warmup=0.1)
    optimizer = make_optimizer(config, 50)  # 100 steps, 10 of warm-up
    steps = np.array([0, 5, 10, 55, 100])
    decay = 0.5 * (1 + np.cos(np.pi * np.clip(steps - 10, 0, 90) / 90))
    expected = np.where(steps < 10, 4e-3 * steps / 10, 4e-3 * decay)
    np.testing.assert_allclose(rates(optimizer, steps), expected, rtol=1e-5, atol=1e-9)
    assert optimizer.beta_2 == 0.98


def test_the_constant_schedule_keeps_the_rate():
    optimizer = make_optimizer(TrainConfig(learning_rate=3e-3, schedule="constant", warmup=0.0), 10)
    assert float(keras.ops.convert_to_numpy(optimizer.learning_rate)) == pytest.approx(3e-3)


@pytest.mark.parametrize("fields, message", [
    (dict(schedule="linear"), "`schedule` must be one of cosine, constant. Received: schedule='linear'"),
    (dict(warmup=1.0), r"`warmup` must be a fraction of the steps in \[0, 1\). Received: warmup=1.0"),
    (dict(schedule="constant", warmup=0.1), "`warmup` must be 0 with schedule='constant'"),
    (dict(learning_rate=0.0), "`learning_rate` must be a positive number. Received: learning_rate=0.0"),
])
def test_bad_schedules_are_refused_by_name(fields, message):
    with pytest.raises(ValueError, match=message):
        make_optimizer(TrainConfig(**fields), 10)

"""`training.schedule` (docs/decisions.md item 142): warm-up then cosine decay, every step learning, the
values against the formula in float64, and the schedule kept through Keras's serialization."""

import math

import keras
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from backend_utils import to_numpy

from attnkit.finetune import training


def expected(peak, total, warmup, step):
    t = step + 1
    if t <= warmup:
        return peak * t / warmup
    return peak * (1 + math.cos(math.pi * (t - warmup) / (total - warmup + 1))) / 2


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 400), st.floats(1e-6, 1.0))
def test_every_step_learns_and_follows_the_formula(total, peak):
    schedule = training.schedule(peak, total)
    warmup = schedule.warmup_steps
    assert warmup == max(1, round(0.03 * total))
    rates = np.array([float(to_numpy(schedule(step))) for step in range(total)])
    np.testing.assert_allclose(rates, [expected(peak, total, warmup, s) for s in range(total)], rtol=2e-6, atol=1e-7 * peak)
    assert np.all(rates > 0)  # no step is wasted: the first and the last move the weights
    assert rates.max() == pytest.approx(peak, rel=1e-6) and rates[warmup - 1] == pytest.approx(peak, rel=1e-6)
    assert np.all(np.diff(rates[warmup - 1 :]) <= 1e-12 * peak)  # decays after the warm-up


def test_a_single_step_run_takes_the_full_rate():
    assert float(to_numpy(training.schedule(2e-3, 1)(0))) == pytest.approx(2e-3)


def test_the_schedule_survives_keras_serialization():
    schedule = training.schedule(1e-3, 50)
    again = keras.optimizers.schedules.deserialize(keras.optimizers.schedules.serialize(schedule))
    assert isinstance(again, training.WarmupCosine)
    for step in (0, 1, 10, 49):
        assert float(to_numpy(again(step))) == float(to_numpy(schedule(step)))

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from turnrl.config import ConfigError, load_config
from turnrl.training.schedules import lr_factor
from turnrl.training.train_config import TrainConfig


def test_warm_up_rises_linearly_to_one():
    assert [lr_factor(s, 4, 10, "constant", 0.1) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert [lr_factor(s, 4, 10, "cosine", 0.1) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]


def test_cosine_falls_from_one_to_the_floor_at_the_last_step_and_stays():
    warmup, total, floor = 2, 12, 0.2
    for step in range(warmup, 20):
        progress = min(1.0, (step - warmup) / (total - warmup))
        expected = floor + (1 - floor) * (1 + math.cos(math.pi * progress)) / 2  # the plain half cosine
        assert lr_factor(step, warmup, total, "cosine", floor) == pytest.approx(expected)
    assert lr_factor(warmup, warmup, total, "cosine", floor) == pytest.approx(1.0)
    assert lr_factor(total, warmup, total, "cosine", floor) == pytest.approx(floor)


@given(st.integers(0, 500), st.integers(0, 50), st.integers(0, 500), st.floats(0, 1))
def test_the_factor_stays_between_the_floor_and_one(step, warmup, total, floor):
    for schedule in ("constant", "cosine"):
        factor = lr_factor(step, warmup, total, schedule, floor)
        assert 0 < factor <= 1 or (factor == 0 and floor == 0 and schedule == "cosine")
        if step >= warmup and schedule == "cosine":
            assert factor >= floor - 1e-12


@pytest.mark.parametrize("override", ["optim.lr_schedule=linear", "optim.min_lr_ratio=1.5"])
def test_a_bad_schedule_setting_is_one_line(override):
    with pytest.raises(ConfigError, match=override.split("=")[0]):
        load_config(TrainConfig, None, [override])

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from turnrl.config import ConfigError, load_config
from turnrl.training.schedules import kl_adaptive_scale, lr_factor
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


@pytest.mark.parametrize("override", ["optim.lr_schedule=linear", "optim.min_lr_ratio=1.5",
                                      "optim.kl_adaptive_target=-0.01", "optim.kl_adaptive_min=0",
                                      "optim.kl_adaptive_max=0.5"])
def test_a_bad_schedule_setting_is_one_line(override):
    with pytest.raises(ConfigError, match=override.split("=")[0]):
        load_config(TrainConfig, None, [override])


def rsl_rl_adaptive(lr: float, kl: float, desired_kl: float, min_lr: float, max_lr: float) -> float:
    """rsl_rl's PPO ``schedule: adaptive`` (``rsl_rl/algorithms/ppo.py``), on the rate itself."""
    if kl > desired_kl * 2.0:
        lr = max(min_lr, lr / 1.5)
    elif kl < desired_kl / 2.0 and kl > 0.0:
        lr = min(max_lr, lr * 1.5)
    return lr


@given(st.lists(st.floats(-0.01, 0.5), min_size=1, max_size=40), st.floats(1e-4, 0.1), st.floats(0.01, 1.0),
       st.floats(1.0, 4.0))
def test_the_kl_adaptive_scale_is_rsl_rls_rule_on_a_scale_of_the_rate(kls, target, low, high):
    base, scale, lr = 2e-4, 1.0, 2e-4
    for kl in kls:
        scale = kl_adaptive_scale(scale, kl, target, low, high)
        lr = rsl_rl_adaptive(lr, kl, target, low * base, high * base)
        assert base * scale == pytest.approx(lr, rel=1e-9)
        assert low <= scale <= high


def test_the_kl_adaptive_scale_falls_after_large_updates_and_rises_after_small_ones():
    scales = [1.0]
    for kl in (0.05, 0.05, 0.012, 0.001, 0.001, 0.0):
        scales.append(kl_adaptive_scale(scales[-1], kl, 0.01, 0.1, 1.0))
    assert scales == pytest.approx([1.0, 1 / 1.5, 1 / 2.25, 1 / 2.25, 1 / 1.5, 1.0, 1.0])

"""The seeds of a run: one per step."""

from __future__ import annotations

from turnrl.training.seeding import step_seed


def test_step_seeds_differ_per_step_and_repeat_per_seed():
    assert step_seed(0, 1) != step_seed(0, 2) and step_seed(3, 5) == step_seed(3, 5)
    assert 0 <= step_seed(2**40, 7) < 2**31

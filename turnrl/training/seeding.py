"""The seeds of a run: every random generator from ``seeds.seed``, and one seed per step.

A step's sampling and shuffling draw from a seed that is a function of the run's seed and the step
alone, so a resumed run draws what the uninterrupted run would have.
"""

from __future__ import annotations

import random

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def step_seed(seed: int, step: int) -> int:
    """The seed of one step's sampling and shuffling: a function of (seed, step), so resume is exact."""
    return (seed * 1_000_003 + step) % 2**31

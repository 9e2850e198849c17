"""The seeds of a run: every random generator from ``seeds.seed``, and one seed per step.

A step's sampling and shuffling draw from a seed that is a function of the run's seed and the step
alone, so a resumed run draws what the uninterrupted run would have. So do a step's levels (its groups'
env seeds, :meth:`~turnrl.rollout.groups.EnvGroups.train_slots`): step ``k`` plays the ``k``-th block of
``groups.n_groups`` training seeds, so a resume (or an asynchronous rollout that plays ahead and is
dropped at a stop) plays each step's levels again as they were planned, once the settings that lay the
blocks out (:func:`level_plan`) are the run's.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from turnrl.training.train_config import TrainConfig


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def step_seed(seed: int, step: int) -> int:
    """The seed of one step's sampling and shuffling: a function of (seed, step), so resume is exact."""
    return (seed * 1_000_003 + step) % 2**31


def level_plan(config: TrainConfig) -> dict[str, object]:
    """The settings that decide which training levels each step plays, by key: the first training seed and
    the size of each step's blocks of seeds (``groups.n_groups`` a round, the rounds of dynamic sampling).
    Keys that play no part (``seeds.seed`` unless ``seeds.levels_follow_seed``) are left out."""
    seeds, algo = config.seeds, config.algorithm
    plan: dict[str, object] = {"seeds.train_start": seeds.train_start,
                               "seeds.levels_follow_seed": seeds.levels_follow_seed,
                               "groups.n_groups": config.groups.n_groups,
                               "algorithm.dynamic_sampling": algo.dynamic_sampling}
    if seeds.levels_follow_seed:
        plan["seeds.seed"] = seeds.seed
    if algo.dynamic_sampling:
        plan["algorithm.dynamic_sampling_rounds"] = algo.dynamic_sampling_rounds
    return plan


def level_plan_change(run: TrainConfig, resumed: TrainConfig, steps_done: int) -> str | None:
    """Why ``resumed`` cannot continue ``run`` (its settings when its checkpoint after ``steps_done`` steps was
    saved) on the run's levels, and what to give instead; None when both lay the levels out alike.

    Step ``k`` plays seeds from block ``k`` of its layout: with fewer seeds a step (or another first seed) the
    steps after the checkpoint would play levels that earlier steps trained on again, with more they would
    never play some, and nothing would say so.
    """
    before, after = level_plan(run), level_plan(resumed)
    changed = [key for key in sorted(before.keys() | after.keys()) if before.get(key) != after.get(key)]
    if not changed:
        return None
    now = ", ".join(f"{key}={after.get(key, '(unused)')}" for key in changed)
    was = " ".join(f"{key}={before[key]}" for key in changed if key in before)
    return (f"resume={resumed.resume!r}: {now} would change which levels (env seeds) the steps after step "
            f"{steps_done} play, so that some would be played twice and others never; resume with the run's "
            f"{was}, or start a new run")

"""One check shared by the tests of envs that live elsewhere (env servers, Ray actors): the same episode."""

from __future__ import annotations

import numpy as np


def same_trajectory(a, b) -> None:
    """Two trajectories of the same seeded episode are equal: records, rewards, images (values and dtypes)."""
    assert (a.status, a.success, a.error, a.system_prompt, a.final_observation) == (
        b.status, b.success, b.error, b.system_prompt, b.final_observation)
    assert len(a.turns) == len(b.turns)
    for x, y in zip(a.turns, b.turns):
        assert (x.observation, x.response, x.actions, x.actions_valid, x.rewards, x.reward, x.state_key) == (
            y.observation, y.response, y.actions, y.actions_valid, y.rewards, y.reward, y.state_key)
    for mine, theirs in ((a.images, b.images), (a.final_images, b.final_images)):
        assert len(mine) == len(theirs)
        assert all(np.array_equal(i, j) and i.dtype == j.dtype for i, j in zip(mine, theirs))

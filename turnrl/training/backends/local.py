"""The local backend: episodes played in this process, on the policy that samples from the trainer's model."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from turnrl.config import SamplingConfig
from turnrl.rollout.runner import EpisodeSlot, RolloutTimings
from turnrl.rollout.trajectory import Trajectory
from turnrl.training.backends.backend import (
    EpisodeRunner,
    Played,
    PlayStep,
    RewardMetrics,
    StepRollout,
    WeightsVersion,
)


class LocalRollout:
    """A :class:`~turnrl.training.backends.backend.RolloutBackend` over a runner of this process.

    Its policy samples from the trainer's own model (or the parallel strategy's unsharded copy, which the
    strategy refreshes), so new weights need no transfer: :meth:`set_weights` does nothing.

    Args:
        runner: a :class:`~turnrl.rollout.runner.Rollout`, or the sharded one over it.
        precision: makes the autocast the episodes play under (the trainer's).
    """

    runs_ahead = False

    def __init__(self, runner: EpisodeRunner, precision: Callable[[], AbstractContextManager]) -> None:
        self.runner = runner
        self.precision = precision

    @property
    def timings(self) -> RolloutTimings:
        return self.runner.timings

    @property
    def rewards(self) -> RewardMetrics:
        return self.runner.rewards

    def run(self, slots: Sequence[EpisodeSlot], sampling: SamplingConfig) -> list[Trajectory]:
        return self.runner.run(slots, sampling)

    def roll_out(self, step: int, play: PlayStep[Played]) -> StepRollout[Played]:
        return StepRollout(play(self.runner, step, self.precision()))

    def set_weights(self, model: torch.nn.Module, version: WeightsVersion) -> dict[str, float]:
        return {}

    def exclusive(self) -> AbstractContextManager[Any]:
        return nullcontext()

    def close(self) -> None:
        pass

"""The local backend: episodes played in this process, on the policy that samples from the trainer's model."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from turnrl.config import SamplingConfig
from turnrl.rollout.runner import EpisodeSlot, Rollout, RolloutTimings
from turnrl.rollout.trajectory import Trajectory
from turnrl.training.backends.backend import (
    Played,
    PlayStep,
    RewardMetrics,
    StepRollout,
    WeightsVersion,
)
from turnrl.training.backends.weights_check import PolicyWeights


class LocalRollout:
    """A :class:`~turnrl.training.backends.backend.RolloutBackend` over a runner of this process.

    Its policy samples from the trainer's own model (or the parallel strategy's unsharded copy, which the
    strategy refreshes before each rollout), so new weights need no transfer: :meth:`set_weights` notes them, and
    the next rollout checks that its policy computes with them (the engine's merged and cast buffers refreshed;
    :mod:`~turnrl.training.backends.weights_check`) and stamps their version on its turns.

    Args:
        runner: a :class:`~turnrl.rollout.runner.Rollout`.
        precision: makes the autocast the episodes play under (the trainer's).
        image_features: hand the step the features of the images its rollout encoded, where the policy keeps
            them (:meth:`~turnrl.policy.interface.Policy.keep_image_features`: the engine on a VLM), in
            :attr:`~turnrl.training.backends.backend.StepRollout.image_features`.
    """

    runs_ahead = False
    plays_on_trainer_policy = True

    def __init__(self, runner: Rollout, precision: Callable[[], AbstractContextManager],
                 image_features: bool = False) -> None:
        self.runner = runner
        self.precision = precision
        self.weights = PolicyWeights(runner.policy, "local")
        self.keeps_image_features = image_features and runner.policy.keep_image_features()

    @property
    def timings(self) -> RolloutTimings:
        return self.runner.timings

    @property
    def rewards(self) -> RewardMetrics:
        return self.runner.rewards

    def run(self, slots: Sequence[EpisodeSlot], sampling: SamplingConfig) -> list[Trajectory]:
        self.weights.take()
        return self.runner.run(slots, sampling)

    def roll_out(self, step: int, play: PlayStep[Played]) -> StepRollout[Played]:
        self.weights.take()
        if not self.keeps_image_features:
            return StepRollout(play(self.runner, step, self.precision()), self.weights.metrics())
        policy = self.runner.policy
        policy.take_image_features()  # a validation's since the last step: not this step's images
        played = play(self.runner, step, self.precision())
        return StepRollout(played, self.weights.metrics(), policy.take_image_features())

    def set_weights(self, model: torch.nn.Module, version: WeightsVersion) -> dict[str, float]:
        self.weights.expect(model, version)
        return {}  # checked, and reported, by the rollout that plays with them

    def exclusive(self) -> AbstractContextManager[Any]:
        return nullcontext()

    def close(self) -> None:
        pass

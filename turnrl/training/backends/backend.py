"""What the RL step needs from a rollout, declared: :class:`RolloutBackend`.

    runner      run(slots, sampling) -> trajectories; its timings and its rewards' metrics (EpisodeRunner)
    roll_out    when a step's episodes are played: now, on this process (local, sharded, Ray), or ahead
                in a thread of its own (asynchronous); the trainer says how (PlayStep)
    set_weights the trainer's weights after a step (WeightsVersion): staged, noted to send with the next
                rollout or, where the policy samples from the trainer's own model, nothing to do
    exclusive   held for a whole validation: no episode of the backend plays meanwhile
    close       threads, actors

The implementations: :mod:`~turnrl.training.backends.local`, :mod:`~turnrl.training.backends.sharded`,
:mod:`~turnrl.training.backends.ray_rollout` and :mod:`~turnrl.training.backends.asynchronous`;
:mod:`turnrl.training.compose` picks one from the config.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

import torch

from turnrl.config import SamplingConfig
from turnrl.engine.weights import ImageFeatures
from turnrl.rollout.runner import EpisodeSlot, Rollout, RolloutTimings
from turnrl.rollout.trajectory import Trajectory
from turnrl.training.train_config import TrainConfig

Played = TypeVar("Played")


class RewardMetrics(Protocol):
    """What the reward functions report about the last batch (state rewards: match, judge calls, errors)."""

    def metrics(self) -> dict[str, float]: ...


class EpisodeRunner(Protocol):
    """Plays episodes: :class:`~turnrl.rollout.runner.Rollout` and what wraps it."""

    @property
    def timings(self) -> RolloutTimings:
        """The last :meth:`run`'s generation and env seconds, and the policies' work counters."""
        ...

    @property
    def rewards(self) -> RewardMetrics: ...

    def run(self, slots: Sequence[EpisodeSlot], sampling: SamplingConfig) -> list[Trajectory]:
        """Every slot's episode played to its end, in the slots' order."""
        ...


PlayStep = Callable[[EpisodeRunner, int, AbstractContextManager], Played]
"""``play(runner, step, precision)``: the trainer's rollout of ``step`` on ``runner`` (seeded by the step: rounds
of groups, the filter), under ``precision``; the same function whichever backend calls it and when."""


@dataclass(frozen=True)
class WeightsVersion:
    """Which weights the trainer holds after a step."""

    steps: int
    """Steps done: the rollout of step ``steps`` is the first that may sample with them (the staleness clock)."""
    updates: int
    """The actor's optimizer updates so far: the weights changed when this moved (a critic warm-up step or a
    skipped update leaves them as they were)."""


@dataclass
class StepRollout(Generic[Played]):
    """What :meth:`RolloutBackend.roll_out` hands the trainer: what ``play`` returned, and the backend's own
    metrics of it (``async/`` for the asynchronous one)."""

    played: Played
    metrics: dict[str, float] = field(default_factory=dict)
    image_features: dict[int, ImageFeatures] = field(default_factory=dict)
    """The features of the images the rollout's engine encoded, by digest, in host memory, for the step's passes
    to reuse (:mod:`~turnrl.training.image_features`): the local backend's, where its policy keeps them; empty
    elsewhere."""


class RolloutBackend(EpisodeRunner, Protocol):
    """Where and when a run's episodes are played (see the module's docstring)."""

    @property
    def runs_ahead(self) -> bool:
        """Whether episodes play while the trainer updates (then they share torch's random state, and an
        update that ran out of memory is not run again)."""
        ...

    @property
    def plays_on_trainer_policy(self) -> bool:
        """Whether the steps' episodes sample from the trainer's own policy (the actor, or the strategy's unsharded
        copy of it): then the trainer brings that policy's model up to the actor before each rollout; otherwise
        (a copy of its own, other processes, Ray workers) the policy only validates, and the trainer frees what
        it holds after each validation."""
        ...

    def roll_out(self, step: int, play: PlayStep[Played]) -> StepRollout[Played]:
        """The rollout of ``step``: ``play`` called on this backend's runner, now or (having run ahead) done."""
        ...

    def set_weights(self, model: torch.nn.Module, version: WeightsVersion) -> dict[str, float]:
        """``model``'s weights are ``version``: the episodes played from now on (within the backend's staleness)
        sample with them. Called once the trainer is built, and after every step; returns metrics of a transfer
        made now (empty where there is nothing to report). A backend may defer the transfer to the next
        :meth:`roll_out` (Ray: no weights sent after a run's last step), whose metrics then report it."""
        ...

    def exclusive(self) -> AbstractContextManager[Any]:
        """Held for a whole validation: no episode of this backend plays meanwhile (both seed torch's global
        generator and score with the same, possibly stateful, reward functions)."""
        ...

    def close(self) -> None:
        """Release threads and workers; safe to call twice."""
        ...


@dataclass
class RolloutParts:
    """What the trainer has built when its rollout backends are made (:class:`MakeRollouts`)."""

    config: TrainConfig
    actor: torch.nn.Module
    """The trainer's actor (what the asynchronous backend copies)."""
    train: Rollout
    """A runner on the policy that samples from the trainer's rollout model (the actor, or its unsharded copy)."""
    validation: Rollout
    """A runner on the validation policy (its own batch size), on the same model."""
    tokenizer: Any
    processor: Any
    device: torch.device
    """The trainer's device."""
    dtype: torch.dtype
    precision: Callable[[], AbstractContextManager]
    """The trainer's autocast (its device and dtype)."""
    start_path: Path
    """The model directory the run started from (its config, tokenizer and processor files)."""


@dataclass
class Rollouts:
    """A run's two backends: the steps' and validation's."""

    train: RolloutBackend
    validation: RolloutBackend


class MakeRollouts(Protocol):
    """Builds a run's backends from the trainer's parts (:func:`turnrl.training.compose.make_rollouts`)."""

    def __call__(self, parts: RolloutParts) -> Rollouts: ...

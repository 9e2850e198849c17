"""The Ray backend (``distributed.backend=ray``): a step's episodes played by rollout workers, Ray actors each
with a copy of the policy and envs of their own (:class:`~turnrl.rollout.ray_workers.RayRollout`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import torch

from turnrl.config import SamplingConfig
from turnrl.rollout.ray_workers import EnvSpec, RayRollout, WorkerSpec, model_files
from turnrl.rollout.runner import EpisodeSlot, RolloutTimings
from turnrl.rollout.trajectory import Trajectory
from turnrl.training.backends.backend import Played, PlayStep, RewardMetrics, StepRollout, WeightsVersion
from turnrl.training.train_config import TrainConfig


def ray_workers(config: TrainConfig, model_dir: Path, tokenizer: Any, batch_size: int) -> RayRollout:
    """Rollout workers as Ray actors, each with a copy of the policy built from ``model_dir``'s config (its
    weights arrive by :meth:`RayBackend.set_weights`) and envs of its own."""
    dist = config.distributed
    spec = WorkerSpec(
        model_files(model_dir),
        dataclasses.replace(config.model, device="auto"),  # inside an actor: the GPU Ray gave it, if any
        config.agent,
        EnvSpec(config.env.id, dict(config.env.settings), tuple(config.env.remote),
                env_workers=-(-dist.env_workers // dist.rollout_workers),  # each rollout worker its share
                timeout_s=dist.timeout_s),
        rewards=config.rewards, max_batch_size=batch_size, env_threads=config.groups.env_workers,
        torch_threads=config.run.threads)
    return RayRollout(spec, dist.rollout_workers, tokenizer, worker_gpus=dist.worker_gpus,
                      timeout_s=dist.timeout_s, address=dist.ray_address)


class RayBackend:
    """A :class:`~turnrl.training.backends.backend.RolloutBackend` on Ray rollout workers.

    New weights go to the workers only when the actor's updates moved (a critic warm-up step sends nothing).
    """

    runs_ahead = False

    def __init__(self, workers: RayRollout, precision: Callable[[], AbstractContextManager]) -> None:
        self.workers = workers
        self.precision = precision

    @property
    def timings(self) -> RolloutTimings:
        return self.workers.timings

    @property
    def rewards(self) -> RewardMetrics:
        return self.workers.rewards

    def run(self, slots: Sequence[EpisodeSlot], sampling: SamplingConfig) -> list[Trajectory]:
        return self.workers.run(slots, sampling)

    def roll_out(self, step: int, play: PlayStep[Played]) -> StepRollout[Played]:
        return StepRollout(play(self, step, self.precision()))

    def set_weights(self, model: torch.nn.Module, version: WeightsVersion) -> dict[str, float]:
        self.workers.set_weights(model, version=version.updates)
        return {}

    def exclusive(self) -> AbstractContextManager[Any]:
        return nullcontext()

    def close(self) -> None:
        self.workers.close()

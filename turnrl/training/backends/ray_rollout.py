"""The Ray backend (``distributed.backend=ray``): a step's episodes played by rollout workers, Ray actors each
with a copy of the policy and envs of their own (:class:`~turnrl.rollout.ray_workers.RayRollout`)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import torch

from turnrl.config import SamplingConfig
from turnrl.engine.weights import WeightsChecksum, model_checksum
from turnrl.rollout.ray_workers import EnvSpec, RayRollout, WorkerSpec, model_files
from turnrl.rollout.runner import EpisodeSlot, RolloutTimings
from turnrl.rollout.trajectory import Trajectory
from turnrl.training.backends.backend import Played, PlayStep, RewardMetrics, StepRollout, WeightsVersion
from turnrl.training.backends.weights_check import WeightsCheck
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

    :meth:`set_weights` only notes the trainer's weights; they are sent to every worker when the next episodes
    are played (:meth:`roll_out`, :meth:`run`), so that the last step of a run, or one after which the run
    stops, sends nothing. They go only when the actor's updates moved (a critic warm-up step sends nothing),
    and the step that sent them reports the transfer's seconds as ``ray/weights_sync_s``. Each worker answers with
    the checksum of the weights its policy computes with once it has loaded them, which is checked here against
    the trainer's actor (``timing/weights_check_s``).
    """

    runs_ahead = False
    plays_on_trainer_policy = False

    def __init__(self, workers: RayRollout, precision: Callable[[], AbstractContextManager]) -> None:
        self.workers = workers
        self.precision = precision
        self.pending: tuple[torch.nn.Module, WeightsVersion] | None = None
        """The trainer's model and its weights' version, noted by :meth:`set_weights` and not yet sent."""
        self.checks: dict[int, WeightsCheck] = {}
        """Each worker's check of the weights it took (:mod:`~turnrl.training.backends.weights_check`)."""

    @property
    def timings(self) -> RolloutTimings:
        return self.workers.timings

    @property
    def rewards(self) -> RewardMetrics:
        return self.workers.rewards

    def run(self, slots: Sequence[EpisodeSlot], sampling: SamplingConfig) -> list[Trajectory]:
        self.send_weights()
        return self.workers.run(slots, sampling)

    def roll_out(self, step: int, play: PlayStep[Played]) -> StepRollout[Played]:
        metrics = self.send_weights()
        return StepRollout(play(self, step, self.precision()), metrics)

    def set_weights(self, model: torch.nn.Module, version: WeightsVersion) -> dict[str, float]:
        self.pending = (model, version)
        return {}  # sent, and reported, by the step that plays with them

    def send_weights(self) -> dict[str, float]:
        """Send the noted weights to the workers unless they hold that version, and check what each worker's
        policy computes with against the trainer's actor (:class:`WeightsCheck`); the transfer's and the check's
        seconds."""
        if self.pending is None:
            return {}
        model, version = self.pending
        sent = self.workers.set_weights(model, version=version.updates)
        self.pending = None
        if not sent:
            return {}
        start = time.perf_counter()
        trainer: dict[torch.dtype, WeightsChecksum] = {}
        for k, rollout in enumerate(self.workers.checksums):
            if rollout is None:
                continue
            if rollout.dtype not in trainer:
                trainer[rollout.dtype] = model_checksum(model, rollout.dtype)
            check = self.checks.setdefault(k, WeightsCheck(f"ray (worker {k})"))
            check.verify(version, trainer[rollout.dtype], rollout)
        return {"ray/weights_sync_s": self.workers.last_sync_s, "timing/weights_check_s": time.perf_counter() - start}

    def exclusive(self) -> AbstractContextManager[Any]:
        return nullcontext()

    def close(self) -> None:
        self.workers.close()

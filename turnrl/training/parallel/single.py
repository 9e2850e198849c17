"""One process: the models on one device, whole; every reduction is the value itself."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from turnrl.training.checkpoint import prune_checkpoints, save_checkpoint
from turnrl.training.parallel.strategy import CheckpointFiles, Models, Optimizers
from turnrl.training.ppo import Shard


class SingleProcess:
    """A :class:`~turnrl.training.parallel.strategy.ParallelStrategy` of one process: the rollouts sample from
    the actor itself (its own weights, no copy), and the checkpoint's trainer state holds the optimizers."""

    rank = 0
    world_size = 1
    retries_out_of_memory = True
    shards_optimizers = False

    def __init__(self) -> None:
        self.startup: dict[str, float] = {}

    def load_device(self, device: torch.device) -> torch.device:
        return device

    def place(self, models: Models, device: torch.device, dtype: torch.dtype) -> Models:
        return models

    def rollout_model(self, actor: torch.nn.Module) -> torch.nn.Module:
        return actor

    def sync_rollout_model(self, actor: torch.nn.Module, updates: int) -> None:
        pass

    def release_rollout_model(self) -> None:
        pass

    def rows(self, n: int) -> torch.Tensor | None:
        return None

    def gather_rows(self, local: torch.Tensor, n: int) -> torch.Tensor:
        return local[:n]

    def most(self, count: int) -> int:
        return count

    def mean_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        return metrics

    def shard(self) -> Shard | None:
        return None

    def release_gathered(self, models: list[torch.nn.Module]) -> None:
        pass

    def restore_optimizers(self, checkpoint: Path, state: dict[str, Any], models: Models,
                           optimizers: Optimizers) -> None:
        optimizers.actor.load_state_dict(state["actor_optimizer"])
        if optimizers.critic is not None and state.get("critic_optimizer") is not None:
            optimizers.critic.load_state_dict(state["critic_optimizer"])

    def save(self, files: CheckpointFiles, models: Models, optimizers: Optimizers) -> Path:
        state = {"actor_optimizer": optimizers.actor.state_dict(),
                 "critic_optimizer": optimizers.critic.state_dict() if optimizers.critic is not None else None,
                 **files.state}
        path = save_checkpoint(files.run_dir, files.step, models.actor, files.processor, state, critic=models.critic,
                               config_yaml=files.config_yaml)
        prune_checkpoints(files.run_dir, files.keep)
        return path

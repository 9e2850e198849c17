"""How the trainer's models are spread over processes, declared: :class:`ParallelStrategy`.

    place       load the models where they go (one device; or rank 0's host memory, then sharded)
    rollout     the model the rollouts sample from (the actor, or an unsharded copy of its shards) and
                how it is kept current
    reductions  this process's rows of a batch, the whole batch's tensors gathered back, the metrics'
                mean over processes, the PPO epochs' share (:class:`~turnrl.training.ppo.Shard`)
    checkpoints the optimizers' states (in the trainer state, or sharded beside it) and the models' files

The random draws of a step are the trainer's, made once on every process from the same seed; a strategy only
says which rows each process works on. Implementations: :mod:`~turnrl.training.parallel.single` and
:mod:`~turnrl.training.parallel.fsdp2`; :mod:`turnrl.training.compose` picks one.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from turnrl.training.model_passes import ValueModel
from turnrl.training.ppo import Shard

OPTIMIZER_DIR = "optimizer"
"""A checkpoint's sharded optimizer states (``torch.distributed.checkpoint`` files), beside ``actor/``; a
checkpoint without it holds its optimizer states in ``trainer_state.pt``."""


def has_sharded_optimizers(checkpoint: Path) -> bool:
    """Whether ``checkpoint``'s optimizer states are shards (:data:`OPTIMIZER_DIR`), as FSDP2 processes save them."""
    return (checkpoint / OPTIMIZER_DIR).is_dir()


@dataclass
class Models:
    """The trainer's models."""

    actor: torch.nn.Module
    critic: ValueModel | None
    reference: torch.nn.Module | None

    def present(self) -> list[torch.nn.Module]:
        return [model for model in (self.actor, self.critic, self.reference) if model is not None]


@dataclass
class Optimizers:
    actor: torch.optim.Optimizer
    critic: torch.optim.Optimizer | None


@dataclass
class CheckpointFiles:
    """What a checkpoint holds beside the optimizers, as the trainer gives it to :meth:`ParallelStrategy.save`."""

    run_dir: Path
    step: int
    processor: Any
    """The tokenizer or processor saved with the actor."""
    state: dict[str, Any]
    """The trainer state (scheduler, summary, timings, elapsed seconds): ``trainer_state.pt``."""
    config_yaml: str
    keep: int
    """``run.keep_checkpoints``."""


class ParallelStrategy(Protocol):
    """One process, or several that train as one (see the module's docstring)."""

    @property
    def rank(self) -> int:
        """This process's rank; rank 0 writes the run's shared files (the trainer asks here, not the process)."""
        ...

    @property
    def world_size(self) -> int: ...

    @property
    def retries_out_of_memory(self) -> bool:
        """Whether an update that ran out of memory may run again (not where other processes wait for this one
        in a collective)."""
        ...

    @property
    def shards_optimizers(self) -> bool:
        """Whether the optimizer states are saved and restored as shards (:data:`OPTIMIZER_DIR`), else in the
        trainer state: a checkpoint resumes only with a strategy of its layout."""
        ...

    startup: dict[str, float]
    """Seconds of the strategy's part of the start (``startup/``): sharding, the rollout copy."""

    def load_device(self, device: torch.device) -> torch.device:
        """Where the models are loaded before :meth:`place` (``device``: the trainer's)."""
        ...

    def place(self, models: Models, device: torch.device, dtype: torch.dtype) -> Models:
        """The models as the trainer holds them (sharded, or as they are)."""
        ...

    def rollout_model(self, actor: torch.nn.Module) -> torch.nn.Module:
        """The model the rollouts sample from."""
        ...

    def sync_rollout_model(self, actor: torch.nn.Module, updates: int) -> None:
        """Before a rollout or a validation: the rollout model holds the actor's weights after ``updates``."""
        ...

    def release_rollout_model(self) -> None:
        """Free what the rollout model holds apart from the actor during the update
        (``model.engine.free_during_update``); :meth:`sync_rollout_model` gives it back."""
        ...

    def rows(self, n: int) -> torch.Tensor | None:
        """This process's rows of a batch of ``n`` (the same count on every process); None: all of them."""
        ...

    def gather_rows(self, local: torch.Tensor, n: int) -> torch.Tensor:
        """The whole batch's (n, ...) tensor from every process's :meth:`rows` of it."""
        ...

    def most(self, count: int) -> int:
        """The largest ``count`` of any process (forward passes: every process runs as many)."""
        ...

    def mean_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        """Each metric's mean over the processes."""
        ...

    def shard(self) -> Shard | None:
        """This process's share of the PPO epochs' mini-batches; None: all of them."""
        ...

    def release_gathered(self, models: list[torch.nn.Module]) -> None:
        """After forward passes without gradient: ``models``' weights back to their shards."""
        ...

    def restore_optimizers(self, checkpoint: Path, state: dict[str, Any], models: Models,
                           optimizers: Optimizers) -> None:
        """Load the optimizers' states of ``checkpoint`` (``state``: its trainer state)."""
        ...

    def save(self, files: CheckpointFiles, models: Models, optimizers: Optimizers) -> Path:
        """Write checkpoint ``checkpoints/step_{step}`` (pruning older ones); returns its path."""
        ...

"""The one place that picks a run's parallel strategy and rollout backends, from its config and its processes.

    torchrun, rollout_processes=k  -> the first n - k processes train (FSDP2 among themselves, or one process),
                                      the last k roll out (backends.pool); async_rollout: ahead, in a thread
    processes started by torchrun  -> FSDP2 strategy, sharded rollouts (and validation)
    distributed.backend=ray        -> one process, rollouts on Ray workers (validation here)
    distributed.async_rollout      -> one process, rollouts a batch ahead on a copy of the actor
    otherwise                      -> one process, rollouts here on the actor

:class:`~turnrl.training.trainer.Trainer` takes the two parts as values (:func:`parts` builds them); the
combinations a run cannot have are refused in :func:`turnrl.training.commands.train` before any is built.
"""

from __future__ import annotations

from dataclasses import dataclass

from turnrl.training import ranks
from turnrl.training.backends.asynchronous import async_rollouts
from turnrl.training.backends.backend import MakeRollouts, RolloutParts, Rollouts
from turnrl.training.backends.local import LocalRollout
from turnrl.training.backends.pool import pool_rollouts
from turnrl.training.backends.ray_rollout import RayBackend, ray_workers
from turnrl.training.backends.sharded import ShardedRollout
from turnrl.training.parallel.fsdp2 import FSDP2
from turnrl.training.parallel.single import SingleProcess
from turnrl.training.parallel.strategy import ParallelStrategy
from turnrl.training.train_config import TrainConfig


@dataclass
class Parts:
    """A trainer's two composed parts."""

    parallel: ParallelStrategy
    rollouts: MakeRollouts


def trains_with_fsdp(config: TrainConfig) -> bool:
    """Whether this process trains with FSDP2: torchrun started it, and it is not a lone trainer beside rollout
    processes (which trains as one process, on its rank's device)."""
    pool = config.distributed.rollout_processes
    lone_trainer = pool > 0 and ranks.launched_trainers(pool) == 1
    return ranks.launched_by_torchrun() and not lone_trainer


def parallel_strategy(config: TrainConfig) -> ParallelStrategy:
    """FSDP2 where :func:`trains_with_fsdp` (the process group initialized), else one process."""
    if trains_with_fsdp(config):
        return FSDP2(config.distributed.cpu_offload)
    return SingleProcess()


def local_rollouts(parts: RolloutParts) -> Rollouts:
    model = parts.config.model
    reuse_images = model.rollout_image_features and model.encode_images_once and not model.train_vision
    return Rollouts(LocalRollout(parts.train, parts.precision, image_features=reuse_images),
                    LocalRollout(parts.validation, parts.precision))


def sharded_rollouts(parts: RolloutParts) -> Rollouts:
    return Rollouts(ShardedRollout(parts.train, parts.tokenizer, parts.precision),
                    ShardedRollout(parts.validation, parts.tokenizer, parts.precision))


def ray_rollouts(parts: RolloutParts) -> Rollouts:
    config = parts.config
    batch_size = max(64, config.groups.n_groups * config.groups.group_size)
    workers = ray_workers(config, parts.start_path, parts.tokenizer, batch_size)
    return Rollouts(RayBackend(workers, parts.precision), LocalRollout(parts.validation, parts.precision))


def asynchronous_rollouts(parts: RolloutParts) -> Rollouts:
    train, validation = async_rollouts(parts)
    return Rollouts(train, LocalRollout(validation, parts.precision))


def make_rollouts(config: TrainConfig) -> MakeRollouts:
    """The backends' maker for ``config`` in this process (see the module's table)."""
    if ranks.launched_by_torchrun() and config.distributed.rollout_processes:
        return pool_rollouts
    if ranks.launched_by_torchrun():
        return sharded_rollouts
    if config.distributed.backend == "ray":
        return ray_rollouts
    if config.distributed.async_rollout:
        return asynchronous_rollouts
    return local_rollouts


def parts(config: TrainConfig) -> Parts:
    """The strategy and the rollout backends' maker for ``config`` in this process."""
    return Parts(parallel_strategy(config), make_rollouts(config))

"""From a step's kept episodes to what its update needs: the padded batch, and each token's scores (PPO's old
log-probs, the reference's, the critic's values) from passes without gradient.

    make_batch(trajectories, keep, ...) -> Batch
    score_batch(batch, actor, reference, critic, ...) -> TokenScores
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch

from turnrl.algorithms import aggregate
from turnrl.rollout.trajectory import Trajectory
from turnrl.training.algorithm_config import AlgorithmConfig
from turnrl.training.batch import Batch, collate, trajectory_samples, turn_samples
from turnrl.training.model_passes import ValueModel
from turnrl.training.ppo import DRIFT, MicroBatching, batched_logprobs, batched_values
from turnrl.training.train_config import TrainConfig


def make_batch(trajectories: list[Trajectory], keep: list[int], sample_mode: str, pad_id: int,
               device: torch.device) -> Batch:
    """The kept trajectories as padded training tensors (one sample per episode or per turn)."""
    make_samples = trajectory_samples if sample_mode == "trajectory" else turn_samples
    return collate(make_samples([trajectories[i] for i in keep], keep), pad_id).to(device)


def encodes_images_once(config: TrainConfig, batch: Batch) -> bool:
    """Whether a step's passes share one store of image features (:mod:`~turnrl.training.image_features`): a
    batch with images, a frozen tower and ``model.encode_images_once`` (under FSDP a frozen tower is held whole
    by every process, so a process that finds its images stored skips no collective:
    :func:`~turnrl.training.parallel.fsdp2.shard_model`)."""
    return (config.model.encode_images_once and not config.model.train_vision
            and "pixel_values" in batch.model_inputs)


@dataclass
class TokenScores:
    """The log-probs and values of a batch's tokens, from forward passes without gradient, all Shape (b, s)."""

    old_logprobs: torch.Tensor
    ref_logprobs: torch.Tensor | None
    values: torch.Tensor | None
    metrics: dict[str, float]


def score_batch(
    batch: Batch,
    actor: torch.nn.Module,
    reference: torch.nn.Module | None,
    critic: ValueModel | None,
    config: AlgorithmConfig,
    temperature: float,
    precision: AbstractContextManager,
    passes: Callable[[int], int] = lambda n: n,
) -> TokenScores:
    """PPO's old logprobs, the reference's logprobs (when there is a KL), the critic's values.

    ``reference`` None with a KL means LoRA: the reference is the actor with its adapters off. ``passes``: see
    :func:`~turnrl.training.ppo.batched_logprobs` (data parallel). With the sampler's log-probs as PPO's old ones
    nothing is recomputed here: the update's first mini-batch measures how far training's forward drifts from
    the sampler's (:data:`~turnrl.training.ppo.DRIFT`); recomputed old log-probs measure it over the batch.
    """
    metrics: dict[str, float] = {}
    start = time.time()
    micro = MicroBatching.scoring(config)
    with precision:
        if config.old_logprobs == "recompute":
            old_logprobs = batched_logprobs(actor, batch, micro, temperature, passes)
            metrics[DRIFT] = sampler_drift(old_logprobs, batch)
        else:
            old_logprobs = batch.sampler_logprobs
        metrics["timing/old_logprobs_s"] = seconds_until_computed(old_logprobs, start)
        ref_logprobs = None
        if config.kl_coef > 0:
            start = time.time()
            if reference is None:
                with actor.disable_adapter():  # type: ignore[operator]
                    ref_logprobs = batched_logprobs(actor, batch, micro, temperature, passes)
            else:
                ref_logprobs = batched_logprobs(reference, batch, micro, temperature, passes)
            metrics["timing/reference_s"] = seconds_until_computed(ref_logprobs, start)
        values = None
        if critic is not None:
            start = time.time()
            values = batched_values(critic, batch, micro, passes)
            metrics["timing/values_s"] = seconds_until_computed(values, start)
    return TokenScores(old_logprobs, ref_logprobs, values, metrics)


def sampler_drift(old_logprobs: torch.Tensor, batch: Batch) -> float:
    """:data:`~turnrl.training.ppo.DRIFT` of recomputed old log-probs, Shape (b, s): their mean absolute distance
    from the sampler's over ``batch``'s trained tokens."""
    return float(aggregate((old_logprobs - batch.sampler_logprobs).abs(), batch.loss_mask))


def seconds_until_computed(scores: torch.Tensor, start: float) -> float:
    """Seconds from ``start`` until the device has computed ``scores``. A pass returns once its kernels are
    queued; without the wait, the rest of its time would be charged to whatever reads the scores first (the
    advantages)."""
    if scores.is_cuda:
        torch.cuda.synchronize(scores.device)
    return time.time() - start


def keep_shuffles(n: int, config: AlgorithmConfig, generator: torch.Generator) -> None:
    """Draw from the step's generator, before the PPO epochs shuffle, the permutation of ``n`` rows that a pass
    of its own once drew to choose the rows whose sampler log-probs it recomputed (with
    ``algorithm.old_logprobs=sampler``). That check is part of the update now; the draw stays so that a seed's
    shuffles, and a run's numbers, are the ones its earlier runs (and the docs) show."""
    if config.old_logprobs == "sampler":
        torch.randperm(n, generator=generator)


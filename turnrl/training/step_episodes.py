"""The episodes of an RL step: played, and those its update trains on.

    play_step(runner, groups, step, config, precision) -> (StepOutput, keep)

One round of groups and RAGEN's StarPO-S filter (:func:`select_trajectories`), or DAPO's dynamic sampling: rounds
of groups until enough of them have rewards that differ (:func:`dynamic_sample`). Each is a function of values;
the trainer (:mod:`turnrl.training.trainer`) hands :func:`play_step` to its rollout backend, which plays it
here and now or a step ahead in its own thread.
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch

from turnrl.algorithms import group_stats, seeded_group_scores, select_groups
from turnrl.config import SamplingConfig
from turnrl.engine.weights import ImageFeatures
from turnrl.models.throughput import roofline_share
from turnrl.rollout.groups import EnvGroups
from turnrl.rollout.metrics import rollout_metrics
from turnrl.rollout.runner import EpisodeSlot
from turnrl.rollout.trajectory import Trajectory
from turnrl.training.algorithm_config import FilterConfig
from turnrl.training.backends.backend import EpisodeRunner
from turnrl.training.seeding import step_seed
from turnrl.training.train_config import TrainConfig


@dataclass
class StepOutput:
    """What one RL step (or one validation) produced."""

    metrics: dict[str, float]
    trajectories: list[Trajectory] = field(default_factory=list)
    token_advantages: list[dict[str, Any]] = field(default_factory=list)
    """Lines of ``trajectories/step_NNNNNN.advantages.jsonl`` (see :mod:`turnrl.viz.records`), on the steps
    whose trajectories are written."""
    image_features: dict[int, ImageFeatures] = field(default_factory=dict)
    """A rollout's: the features its engine computed for the episodes' images, by digest, which the update's
    passes reuse (:attr:`~turnrl.training.backends.backend.StepRollout.image_features`)."""


def collect(
    rollout: EpisodeRunner, slots: list[EpisodeSlot], sampling: SamplingConfig, precision: AbstractContextManager
) -> StepOutput:
    """Play the slots' episodes; metrics of the rollout, its timings and throughput."""
    start = time.time()
    with precision:
        trajectories = rollout.run(slots, sampling)
    metrics = {f"rollout/{k}": v for k, v in rollout_metrics(trajectories).items()}
    # What the reward functions report about this rollout (state rewards: match, judge calls and errors).
    metrics.update({f"rewards/{k}": v for k, v in rollout.rewards.metrics().items()})
    metrics["timing/rollout_s"] = time.time() - start
    metrics["timing/generate_s"] = rollout.timings.generate_s
    metrics["timing/env_s"] = rollout.timings.env_s
    for name, value in rollout.timings.policy_work.items():
        # Its device seconds are measurements of the machine, beside the rollout's other times; the rest counts work.
        metrics[f"timing/{name}" if name.endswith("_device_s") else f"generation/{name}"] = value
    generated = sum(len(turn.response_ids) for t in trajectories for turn in t.turns)
    metrics["throughput/generated_tokens_per_s"] = generated / max(rollout.timings.generate_s, 1e-9)
    return StepOutput(metrics, trajectories)


def rollout_roofline(metrics: dict[str, float], flops_peak: float | None, bandwidth: float | None
                     ) -> dict[str, float]:
    """Each engine phase's share of the hardware's limit over a rollout, from its metrics: prefill's model FLOPs
    (``generation/prefill_flops``) over its device seconds (``timing/prefill_device_s``) at ``flops_peak``
    (FLOP/s), decode's bytes to read over its device seconds at ``bandwidth`` (bytes/s). Empty for a policy that
    counts no device work, a phase that did none, or a device whose peaks are unknown (a CPU). Summed over a
    sharded run's processes, the work and the seconds give each device's mean share."""
    shares = {
        "throughput/prefill_roofline": roofline_share(metrics.get("generation/prefill_flops", 0.0),
                                                      metrics.get("timing/prefill_device_s", 0.0), flops_peak),
        "throughput/decode_roofline": roofline_share(metrics.get("generation/decode_bytes", 0.0),
                                                     metrics.get("timing/decode_device_s", 0.0), bandwidth),
    }
    return {name: share for name, share in shares.items() if share is not None}


def rewards_and_groups(trajectories: list[Trajectory]) -> tuple[torch.Tensor, torch.Tensor]:
    """Shapes (n,), (n,): each episode's total reward (float64) and its group."""
    return (torch.tensor([t.total_reward for t in trajectories], dtype=torch.float64),
            torch.tensor([t.group for t in trajectories]))


def with_outcomes(trajectories: list[Trajectory]) -> list[int]:
    """The indices of the episodes that have an outcome: the trainable ones, which every group statistic counts.

    An errored episode (an env that raised, a request the policy refused) stopped partway: its partial reward is
    no outcome of the group's task, and the update never trains on it. It is left out of its group as if never
    played, the same way everywhere: the StarPO-S scores and the spread metrics (:func:`select_trajectories`),
    dynamic sampling's varied groups (:func:`varied_groups`), and the advantages, whose group means and stds
    (GRPO, GiGPO) are taken over the kept episodes of the batch only. A group keeps its other episodes; one left
    with a single episode has no spread.
    """
    return [i for i, t in enumerate(trajectories) if t.trainable]


def group_spread_metrics(trajectories: list[Trajectory]) -> dict[str, float]:
    """How much the groups' rewards differ, over the episodes with outcomes (:func:`with_outcomes`): the mean
    in-group std and the share of groups whose episodes all score alike (no episode advantage; what holds a run
    that stops rising). Empty where no episode has an outcome."""
    played = [trajectories[i] for i in with_outcomes(trajectories)]
    if not played:
        return {}
    stats = group_stats(*rewards_and_groups(played))
    return {
        "rollout/in_group_reward_std": float(stats.std.mean()),
        "rollout/zero_variance_groups": float((stats.std == 0).float().mean()),
    }


def select_trajectories(trajectories: list[Trajectory], config: FilterConfig) -> tuple[list[int], dict[str, float]]:
    """StarPO-S: the indices of the trajectories to train on (kept groups, no errors), and the filter's metrics.

    Groups are scored and counted over their episodes with outcomes (:func:`with_outcomes`): an errored member
    moves neither its group's score nor the share of groups kept, and a group none of whose episodes has an
    outcome is not one of the groups. An empty list means: skip the update.
    """
    outcomes = with_outcomes(trajectories)
    metrics = group_spread_metrics(trajectories)
    if not outcomes:
        return [], {**metrics, "filter/kept_ratio": 0.0, "filter/skipped_step": 1.0}
    scored = [trajectories[i] for i in outcomes]
    rewards, groups = rewards_and_groups(scored)
    # FilterConfig.value above 1 is a count of groups, at most 1 a share.
    value: float | int = int(config.value) if config.method == "top_k" and config.value > 1 else config.value
    scores = None  # select_groups scores a group by its reward std unless given other scores
    if config.metric == "random":
        scores = seeded_group_scores(torch.tensor([t.seed for t in scored]), groups)
    elif config.metric != "reward_std":
        per_sample = rewards if config.metric == "reward_mean" else torch.tensor(
            [float(sum(len(turn.response_ids) for turn in t.turns)) for t in scored])
        scores = group_stats(per_sample, groups).mean
    selection = select_groups(groups, rewards=rewards, scores=scores, strategy=config.method, value=value,
                              weighting=config.weighting, drop_zero_variance=config.drop_zero_variance,
                              on_empty=config.on_empty)
    metrics["filter/kept_ratio"] = selection.kept_ratio
    keep = [] if selection.skip_step else [i for i, kept in zip(outcomes, selection.keep_mask.tolist()) if kept]
    metrics["filter/skipped_step"] = float(not keep)
    return keep, metrics


def varied_groups(trajectories: list[Trajectory]) -> list[int]:
    """The groups, in order, whose episodes with outcomes (:func:`with_outcomes`) differ in reward (dynamic
    sampling): an errored member neither makes nor breaks a group's spread."""
    played = [trajectories[i] for i in with_outcomes(trajectories)]
    if not played:
        return []
    stats = group_stats(*rewards_and_groups(played))
    return [int(g) for g, std in zip(stats.group_ids, stats.std) if std > 0]


def dynamic_sample(
    rollout: EpisodeRunner, groups: EnvGroups, step: int, config: TrainConfig, precision: AbstractContextManager
) -> tuple[StepOutput, list[int]]:
    """DAPO's dynamic sampling: roll out rounds of groups until ``n_groups`` of them have varied rewards,
    or the extra rounds run out; returns every trajectory played and the indices of those to train on
    (the episodes with outcomes of the first ``n_groups`` varied groups)."""
    algo, n_groups = config.algorithm, config.groups.n_groups
    rounds = 1 + algo.dynamic_sampling_rounds
    outputs = [collect(rollout, groups.train_slots(step, 0, rounds), config.sampling, precision)]
    trajectories = list(outputs[0].trajectories)
    while len(varied_groups(trajectories)) < n_groups and len(outputs) < rounds:
        slots = groups.train_slots(step, len(outputs), rounds, first_group=len(outputs) * n_groups)
        outputs.append(collect(rollout, slots, config.sampling, precision))
        trajectories += outputs[-1].trajectories
    chosen = set(varied_groups(trajectories)[:n_groups])
    keep = [i for i in with_outcomes(trajectories) if trajectories[i].group in chosen]
    metrics = {f"rollout/{k}": v for k, v in rollout_metrics(trajectories).items()}
    # Over every group played, so that the share alike reads as it does without dynamic sampling.
    metrics.update(group_spread_metrics(trajectories))
    for key in {key for output in outputs for key in output.metrics if key.startswith("rewards/")}:
        # Each round reported its own; their mean (counts too: per round) stands for the step.
        metrics[key] = sum(output.metrics.get(key, 0.0) for output in outputs) / len(outputs)
    for key in {key for output in outputs for key in output.metrics if key.startswith(("timing/", "generation/"))}:
        metrics[key] = sum(output.metrics.get(key, 0.0) for output in outputs)  # each round's
    generated = sum(len(turn.response_ids) for t in trajectories for turn in t.turns)
    metrics["throughput/generated_tokens_per_s"] = generated / max(metrics["timing/generate_s"], 1e-9)
    metrics["rollout/dynamic_extra_rounds"] = float(len(outputs) - 1)
    metrics["rollout/dynamic_kept_groups"] = float(len(chosen))
    metrics["filter/skipped_step"] = float(not keep)
    return StepOutput(metrics, trajectories), keep


def play_step(
    runner: EpisodeRunner, groups: EnvGroups, step: int, config: TrainConfig, precision: AbstractContextManager
) -> tuple[StepOutput, list[int]]:
    """1-2: the episodes of ``step`` and the indices of those to train on (empty: skip the update): rounds of
    groups until enough of them have varied rewards (DAPO), or one round and the StarPO-S filter. Seeded by
    the step, so that whichever backend plays it, and when, it draws the same numbers."""
    torch.manual_seed(step_seed(config.seeds.seed, step))
    algo = config.algorithm
    if algo.dynamic_sampling:
        return dynamic_sample(runner, groups, step, config, precision)
    rollout = collect(runner, groups.train_slots(step), config.sampling, precision)
    # 2. filter groups (StarPO-S), drop errored episodes
    keep, filter_metrics = select_trajectories(rollout.trajectories, algo.filter)
    rollout.metrics.update(filter_metrics)
    return rollout, keep


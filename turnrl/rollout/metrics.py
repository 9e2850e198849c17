"""Summary figures of a batch of trajectories (eval and training share them)."""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from collections.abc import Callable
from math import comb

import numpy as np

from turnrl.rollout.trajectory import DONE, ERROR, TRUNCATED, Trajectory, TurnRecord

MAX_ERRORS_SHOWN = 3
"""Distinct episode errors a summary quotes (the rest are counted in ``errors``)."""


def first_errors(trajectories: list[Trajectory], limit: int = MAX_ERRORS_SHOWN) -> list[str]:
    """The most common errors of errored episodes, at most ``limit``: each the first line of its first
    occurrence (300 characters at most) and how many episodes had it. Errors that differ only in numbers
    (token counts, ids) count as one."""
    counts: Counter[str] = Counter()
    example: dict[str, str] = {}
    for message in _error_lines(trajectories):
        key = error_kind(message)
        counts[key] += 1
        example.setdefault(key, message)
    return [f"{example[key]} ({count} episode{'s' if count > 1 else ''})" for key, count in counts.most_common(limit)]


def _error_lines(trajectories: list[Trajectory]) -> list[str]:
    """The first line of each errored episode's error (300 characters at most)."""
    lines = [(t.error or "").strip().splitlines() for t in trajectories if t.status == ERROR]
    return [first[0][:300] if first else "unknown error" for first in lines]


def error_kind(message: str) -> str:
    """An error's line with its numbers (token counts, ids, turns) as ``N``: what tells errors apart."""
    return re.sub(r"\d+", "N", message)


def error_kinds(trajectories: list[Trajectory]) -> set[str]:
    """The kinds (:func:`error_kind`) of the errored episodes' errors."""
    return {error_kind(message) for message in _error_lines(trajectories)}


def errored_note(trajectories: list[Trajectory], consequence: str, limit: int = 1) -> str | None:
    """``K of N episodes errored (<consequence>): <the commonest errors>``, or None when none did: where errored
    episodes count as failures, an env or server that fails reads otherwise as a policy that solves nothing."""
    errored = sum(t.status == ERROR for t in trajectories)
    if not errored:
        return None
    return (f"{errored} of {len(trajectories)} episodes errored ({consequence}): "
            f"{'; '.join(first_errors(trajectories, limit))}")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples with ``c`` successes: ``1 - C(n-c, k) / C(n, k)``."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def solved(trajectory: Trajectory) -> bool:
    """Whether an episode counts as a success: the env said so, and the episode did not end in an error. An env may
    report success before a later step (or the policy) fails; that episode is an error, never a success."""
    return trajectory.success and trajectory.status != ERROR


def pass_at_k_by_seed(trajectories: list[Trajectory]) -> dict[int, float]:
    """pass@k for every k up to the smallest number of samples per seed (successes as :func:`solved` counts)."""
    by_seed: dict[int, list[bool]] = defaultdict(list)
    for t in trajectories:
        by_seed[t.seed].append(solved(t))
    if not by_seed:
        return {}
    n_min = min(len(v) for v in by_seed.values())
    return {
        k: float(np.mean([pass_at_k(len(v), sum(v), k) for v in by_seed.values()]))
        for k in sorted({1, 2, 4, 8, 16, n_min} & set(range(1, n_min + 1)))
    }


def _mean(values: list[float]) -> float:
    return float(np.mean(values)) if values else 0.0


def _last_action_valid(turn: TurnRecord) -> float:
    return float(bool(turn.actions_valid) and turn.actions_valid[-1])


def _last_action_effective(turn: TurnRecord) -> float:
    return float(bool(turn.actions_effective) and turn.actions_effective[-1])


TURN_FIGURES: dict[str, Callable[[TurnRecord], float]] = {
    "format_ok": lambda turn: float(turn.parsed.format_ok),
    "action_valid": _last_action_valid,
    "action_effective": _last_action_effective,
    "turns_without_valid_action": lambda turn: float(not turn.has_valid_action),
}
"""The turn-level figures averaged per episode (:func:`episode_mean`), each a turn's value in [0, 1]. A turn of
several actions counts by its last stepped action, as RAGEN's turn ``info`` is its steps' infos merged in order
(the last one's values standing); a turn that stepped no action counts 0 for the action figures (RAGEN's empty
``info``)."""


def episode_mean(trajectories: list[Trajectory], figure: Callable[[TurnRecord], float]) -> float:
    """``figure`` averaged over each episode's turns, then over the episodes: RAGEN's reading of its turn-level
    figures (``es_manager.get_rollout_states``: the sum over an episode's turns divided by its turns;
    ``ctx_manager``: the sum over episodes divided by every env of the batch).

    An episode without turns (its env failed to reset) counts 0 and still counts as an episode, as an env whose
    turns reported nothing does in RAGEN. Each episode weighs the same however long it is, where the pooled
    figures of :func:`rollout_metrics` weigh each turn (or action) the same.
    """
    per_episode = [sum(figure(turn) for turn in t.turns) / len(t.turns) if t.turns else 0.0 for t in trajectories]
    return _mean(per_episode)


def rollout_metrics(trajectories: list[Trajectory]) -> dict[str, float]:
    """Success, rewards, turn counts, format, action validity and effect, and the env's own figures over a batch.

    Errored episodes count as failures in ``success`` and are also counted
    separately in ``errors`` so that a broken env is visible; failed reward
    functions are counted in ``reward_errors`` (one per turn and function).
    ``reward_<name>_mean`` is each named reward summed over an episode,
    averaged over episodes. ``action_effective`` is the share of accepted
    actions that changed the env's state (a push into a wall does not);
    ``env_<name>`` is each figure of the envs' ``info["metrics"]`` (as an
    episode's last step left it) averaged over the episodes that report it.

    ``format_ok``, ``action_valid``, ``action_effective`` and
    ``turns_without_valid_action`` pool the batch's turns (actions for the
    two action figures); ``<figure>_episode_mean`` is RAGEN's reading of the
    same figure, averaged within each episode first (:func:`episode_mean`,
    :data:`TURN_FIGURES`), so a long episode weighs as much as a short one.
    """
    turns = [turn for t in trajectories for turn in t.turns]
    actions_valid = [v for turn in turns for v in turn.actions_valid]
    metrics = {
        "success": _mean([float(solved(t)) for t in trajectories]),
        "reward_mean": _mean([t.total_reward for t in trajectories]),
        "reward_std": float(np.std([t.total_reward for t in trajectories])) if trajectories else 0.0,
        "turns_mean": _mean([len(t.turns) for t in trajectories]),
        "actions_mean": _mean([t.num_actions for t in trajectories]),
        "format_ok": _mean([float(turn.parsed.format_ok) for turn in turns]),
        "action_valid": _mean([float(v) for v in actions_valid]),
        "action_effective": _mean([float(effective) for turn in turns
                                   for valid, effective in zip(turn.actions_valid, turn.actions_effective) if valid]),
        "turns_without_valid_action": _mean([float(not turn.has_valid_action) for turn in turns]),
        "response_tokens_mean": _mean([len(turn.response_ids) for turn in turns]),
        "response_truncated": _mean([float(turn.finish_reason == "length") for turn in turns]),
        "done": _mean([float(t.status == DONE) for t in trajectories]),
        "truncated": _mean([float(t.status == TRUNCATED) for t in trajectories]),
        "errors": float(sum(t.status == ERROR for t in trajectories)),
        "reward_errors": float(sum(len(turn.reward_errors) for turn in turns)),
        "episodes": float(len(trajectories)),
    }
    for name, figure in TURN_FIGURES.items():
        metrics[f"{name}_episode_mean"] = episode_mean(trajectories, figure)
    # Each named reward (env, format, every added one), summed over an episode, averaged over episodes.
    per_episode = [t.named_rewards() for t in trajectories]
    for name in sorted({"env", "format"} | {name for totals in per_episode for name in totals}):
        metrics[f"reward_{name}_mean"] = _mean([totals.get(name, 0.0) for totals in per_episode])
    for name in sorted({name for t in trajectories for name in t.env_metrics}):
        metrics[f"env_{name}"] = _mean([t.env_metrics[name] for t in trajectories if name in t.env_metrics])
    return metrics

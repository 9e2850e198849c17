"""``turnrl eval``: play validation seeds with a policy and report how it did.

Writes ``summary.json`` (the figures printed) and ``trajectories.jsonl`` (every
turn: prompt, response, parsed fields, actions, rewards; images as PNG files in
``images/`` beside it).

The turn and action budgets are the agent section's, or, with
``budget_from_env``, what the env says a competent agent needs under its
settings (``env.action_budget()``): the expert finishes every built-in env with
them. The summary says where the budget came from (``env``, ``config``, or
``agent defaults`` for an env that names none), counts the episodes a budget
cut, and shows the first errors.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from turnrl.agent.formats import get_format
from turnrl.config import AgentConfig, EvalConfig, to_yaml
from turnrl.envs.seeds import SeedSplits
from turnrl.envservice.placement import env_factory
from turnrl.policy.factory import make_policy
from turnrl.rewards import Rewards
from turnrl.rollout.groups import EnvGroups
from turnrl.rollout.metrics import pass_at_k_by_seed, rollout_metrics
from turnrl.rollout.runner import Rollout
from turnrl.rollout.trajectory import ERROR, TRUNCATED, Trajectory, write_trajectories
from turnrl.training.logger import RunProgress
from turnrl.viz.report import write_report

console = Console()

MAX_ERRORS_SHOWN = 3
"""Distinct episode errors the summary quotes (the rest are counted in ``errors``)."""


def first_errors(trajectories: list[Trajectory], limit: int = MAX_ERRORS_SHOWN) -> list[str]:
    """The most common errors of errored episodes, at most ``limit``: each the first line of its first
    occurrence (300 characters at most) and how many episodes had it. Errors that differ only in numbers
    (token counts, ids) count as one."""
    counts: Counter[str] = Counter()
    example: dict[str, str] = {}
    for trajectory in trajectories:
        if trajectory.status != ERROR:
            continue
        lines = (trajectory.error or "").strip().splitlines()
        message = lines[0][:300] if lines else "unknown error"
        key = re.sub(r"\d+", "N", message)
        counts[key] += 1
        example.setdefault(key, message)
    return [f"{example[key]} ({count} episode{'s' if count > 1 else ''})" for key, count in counts.most_common(limit)]


def summarize(trajectories: list[Trajectory]) -> dict[str, Any]:
    metrics = rollout_metrics(trajectories)
    cut = Counter(t.truncation_reason or "unknown" for t in trajectories if t.status == TRUNCATED)
    summary: dict[str, Any] = {
        "episodes": len(trajectories),
        "success_rate": metrics["success"],
        "pass_at_k": {str(k): v for k, v in pass_at_k_by_seed(trajectories).items()},
        "mean_turns": metrics["turns_mean"],
        "format_valid_rate": metrics["format_ok"],
        "action_validity": metrics["action_valid"],
        "mean_reward": metrics["reward_mean"],
        "mean_env_reward": metrics["reward_env_mean"],
        "errors": int(metrics["errors"]),
        "truncated_rate": metrics["truncated"],
        "cut_by_budget": sum(cut.values()),
        "cut_by": dict(sorted(cut.items())),
        "first_errors": first_errors(trajectories),
    }
    return summary


def print_summary(summary: dict[str, Any], title: str) -> None:
    table = Table(title=title)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in summary.items():
        if key == "first_errors":
            continue
        if isinstance(value, dict):
            value = ", ".join(f"{k}: {v:.3f}" if isinstance(v, float) else f"{k}: {v}" for k, v in value.items()) or "-"
        elif isinstance(value, float):
            value = f"{value:.3f}"
        table.add_row(key, str(value))
    console.print(table)
    if summary.get("first_errors"):
        console.print(f"[bold red]{summary['errors']} episode(s) errored[/bold red]; first errors:")
        for message in summary["first_errors"]:
            console.print(f"  {message}", markup=False, highlight=False)


RUN_MODEL_FOLDERS = ("checkpoints", "sft")
"""Where a training run keeps its models: ``checkpoints/step_N/actor`` and the SFT stage's ``sft/model``."""


def run_config_of(policy: str) -> Path | None:
    """The ``config.yaml`` of the training run whose model ``policy`` is (a checkpoint's ``actor/`` or
    ``sft/model`` in a run directory), which holds the prompts, format and env settings it was trained
    with; None for any other policy."""
    path = Path(policy)
    if not path.is_dir():
        return None
    for run_dir in path.parents:
        inside = path.relative_to(run_dir).parts
        if inside[0] in RUN_MODEL_FOLDERS and (run_dir / "config.yaml").is_file():
            return run_dir / "config.yaml"
    return None


def env_budget(env: Any, agent: AgentConfig) -> AgentConfig | None:
    """``agent`` with the turn and action budgets the env asks for (``env.action_budget()``): one action a
    turn is enough to finish. None for an env that names no budget (no ``action_budget``, or one that
    answers None: a Gymnasium env without a step limit)."""
    budget = getattr(env, "action_budget", None)
    wanted = budget() if callable(budget) else None  # a remote env answers None for an env without one
    if wanted is None:
        return None
    actions = max(1, int(wanted))
    return replace(agent, max_turns=actions, max_actions_per_episode=actions)


def run_eval(config: EvalConfig, budget_from_env: bool = False) -> dict[str, Any]:
    """Evaluate ``config.policy`` on ``config.episodes`` validation seeds.

    Args:
        budget_from_env: take ``agent.max_turns`` and ``agent.max_actions_per_episode`` from the env's
            ``action_budget()`` (``turnrl eval`` does unless they are set).

    Raises:
        ConfigError: the env, its settings or the policy cannot be built.
    """
    settings = dict(config.env.val_settings if config.env.val_settings is not None else config.env.settings)
    where = "env.val_settings" if config.env.val_settings is not None else "env.settings"
    # Here or on the env servers of env.remote; an unknown env or a bad setting is a config error.
    make_env = env_factory(config.env.id, settings, config.env.remote, where=where)
    probe = make_env()
    budget_source = "config"
    if budget_from_env:
        budgeted = env_budget(probe, config.agent)
        budget_source = "env" if budgeted is not None else "agent defaults"  # the env names none: say so
        config = replace(config, agent=budgeted or config.agent)
    fmt = get_format(
        config.agent.format,
        action_separator=config.agent.action_separator,
        max_actions_per_turn=config.agent.max_actions_per_turn,
    )
    seeds = SeedSplits(config.seeds.train_start, config.seeds.val_start, config.seeds.val_size)
    groups = EnvGroups(make_env, 1, 1, seeds)
    slots = groups.val_slots(config.episodes, config.samples_per_seed)  # builds the envs before a model loads
    policy = make_policy(config, fmt)
    rollout = Rollout(policy, fmt, config.agent, env_id=config.env.id, rewards=Rewards(config.rewards))

    trajectories: list[Trajectory] = []
    with RunProgress(console, "eval", len(slots)) as progress:
        for start in range(0, len(slots), config.batch_size):
            batch = slots[start : start + config.batch_size]
            trajectories.extend(rollout.run(batch, config.sampling))
            progress.update(len(batch), f"{config.env.id} / {config.policy}")

    summary = summarize(trajectories)
    summary.update(env=config.env.id, policy=config.policy, format=config.agent.format,
                   budget={"max_turns": config.agent.max_turns,
                           "max_actions_per_episode": config.agent.max_actions_per_episode,
                           "from": budget_source})
    print_summary(summary, f"{config.env.id}: {config.policy}")
    if config.out:
        out_dir = Path(config.out)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        (out_dir / "config.yaml").write_text(to_yaml(config))
        write_trajectories(trajectories, out_dir)
        console.print(f"wrote {out_dir / 'summary.json'} and {out_dir / 'trajectories.jsonl'}", markup=False,
                      highlight=False, soft_wrap=True)  # whole paths, to copy
        try:
            report = write_report(out_dir)
            console.print(f"report: {report}  (turnrl view {out_dir} --serve to serve it)", markup=False,
                          highlight=False, soft_wrap=True)
        except (OSError, ValueError) as error:  # the evaluation itself succeeded
            console.print(f"no report: {error}", markup=False)
    else:
        console.print("nothing written (out is unset); pass --out DIR to keep the summary and trajectories")
    return summary

"""``turnrl eval``: play validation seeds with a policy and report how it did.

Writes ``summary.json`` (the figures printed) and ``trajectories.jsonl`` (every
turn: prompt, response, parsed fields, actions, rewards; images as PNG files in
``images/`` beside it).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from turnrl.agent.formats import get_format
from turnrl.config import ConfigError, EvalConfig, to_yaml
from turnrl.envs import make
from turnrl.envs.seeds import SeedSplits
from turnrl.policy.factory import make_policy
from turnrl.rewards import Rewards
from turnrl.rollout.groups import EnvGroups
from turnrl.rollout.metrics import pass_at_k_by_seed, rollout_metrics
from turnrl.rollout.runner import Rollout
from turnrl.rollout.trajectory import Trajectory, write_trajectories

console = Console()


def summarize(trajectories: list[Trajectory]) -> dict[str, Any]:
    metrics = rollout_metrics(trajectories)
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
    }
    return summary


def print_summary(summary: dict[str, Any], title: str) -> None:
    table = Table(title=title)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in summary.items():
        if isinstance(value, dict):
            value = ", ".join(f"@{k}: {v:.3f}" for k, v in value.items())
        elif isinstance(value, float):
            value = f"{value:.3f}"
        table.add_row(key, str(value))
    console.print(table)


def run_eval(config: EvalConfig) -> dict[str, Any]:
    """Evaluate ``config.policy`` on ``config.episodes`` validation seeds.

    Raises:
        ConfigError: the env, its settings or the policy cannot be built.
    """
    fmt = get_format(
        config.agent.format,
        action_separator=config.agent.action_separator,
        max_actions_per_turn=config.agent.max_actions_per_turn,
    )
    settings = dict(config.env.val_settings if config.env.val_settings is not None else config.env.settings)

    def make_env():
        try:
            return make(config.env.id, **settings)
        except (ValueError, TypeError) as error:  # unknown env or bad settings: a config problem
            raise ConfigError(f"env.id={config.env.id!r} with settings {settings}: {error}") from error

    seeds = SeedSplits(config.seeds.train_start, config.seeds.val_start, config.seeds.val_size)
    groups = EnvGroups(make_env, 1, 1, seeds)
    slots = groups.val_slots(config.episodes, config.samples_per_seed)  # builds the envs before a model loads
    policy = make_policy(config, fmt)
    rollout = Rollout(policy, fmt, config.agent, env_id=config.env.id, rewards=Rewards(config.rewards))

    trajectories: list[Trajectory] = []
    columns = [
        TextColumn("[bold]eval[/bold] {task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()
    ]
    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task(f"{config.env.id} / {config.policy}", total=len(slots))
        for start in range(0, len(slots), config.batch_size):
            batch = slots[start : start + config.batch_size]
            trajectories.extend(rollout.run(batch, config.sampling))
            progress.advance(task, len(batch))

    summary = summarize(trajectories)
    summary.update(env=config.env.id, policy=config.policy, format=config.agent.format)
    print_summary(summary, f"{config.env.id}: {config.policy}")
    if config.out:
        out_dir = Path(config.out)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        (out_dir / "config.yaml").write_text(to_yaml(config))
        write_trajectories(trajectories, out_dir)
        console.print(f"wrote {out_dir / 'summary.json'} and {out_dir / 'trajectories.jsonl'}")
    return summary

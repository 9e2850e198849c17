"""The trainer tests' short run on the tiny model (its settings, ``config()``) and readers of what a run wrote."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from turnrl.config import load_config
from turnrl.training.train_config import TrainConfig

# A short system prompt: the tiny model is trained from scratch and cannot read instructions.
COMMON = [
    "model.device=cpu", "model.dtype=float32", "run.tensorboard=false", "run.trajectories_every=1",
    "env.id=FrozenLake", "agent.format=no_think", "agent.env_instructions=false", "agent.format_instructions=false",
    "agent.system_prompt=FrozenLake. Reach G. Answer <answer>Left|Down|Right|Up</answer>.",
    "agent.max_turns=2", "sampling.max_new_tokens=8", "groups.n_groups=2", "groups.group_size=2",
    "validation.episodes=2", "run.steps=2", "algorithm.mini_batch_size=4", "algorithm.micro_batch_size=2",
    "optim.actor_lr=1e-3", "optim.critic_lr=1e-3",
]
VOLATILE = ("timing/", "throughput/", "startup/", "memory/")  # measurements of the machine, not of the run


def config(model_dir, out: Path, *overrides: str, name: str = "run") -> TrainConfig:
    model = [f"model.path={model_dir}"] if model_dir is not None else []
    return load_config(TrainConfig, None, [*COMMON, *model, f"run.output_dir={out}", f"run.name={name}", *overrides])


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def step_records(run_dir: Path) -> dict[int, dict]:
    """The RL step records by step (validation-only records left out)."""
    return {r["step"]: r for r in records(run_dir) if "rollout/success" in r}


def trajectories(run_dir: Path, step: int) -> list[dict]:
    path = run_dir / "trajectories" / f"step_{step:06d}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def actor_weights(run_dir: Path, name: str = "model.safetensors") -> dict[str, torch.Tensor]:
    return load_file(run_dir / "checkpoints" / "step_000002" / "actor" / name)


def base_weights(model_dir) -> dict[str, torch.Tensor]:
    return load_file(Path(model_dir) / "model.safetensors")


def assert_token_exact(steps: dict[int, dict]) -> None:
    """The recomputed log-probs of the trained tokens match the sampler's: the batch holds the sampled tokens."""
    assert all(r["actor/logprob_mismatch"] < 1e-4 for r in steps.values())


def comparable(record: dict) -> dict:
    return {k: v for k, v in record.items() if k != "time" and not k.startswith(VOLATILE)}

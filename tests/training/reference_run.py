"""The short run that the distributed, Ray and asynchronous tests compare with one process: its settings, how to
start it (a process of its own, or this one) and how to compare two runs' step records.

The one-process run itself is the ``single`` fixture of ``tests/training/conftest.py``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from turnrl.config import load_config
from turnrl.training.commands import train
from turnrl.training.train_config import TrainConfig

# A short PPO run with a critic (GAE), greedy rollouts: one process and two play the same episodes.
ARGS = [
    "model.device=cpu", "model.dtype=float32", "run.tensorboard=false", "run.trajectories_every=1", "run.threads=1",
    "env.id=FrozenLake", "agent.format=no_think", "agent.env_instructions=false", "agent.format_instructions=false",
    "agent.max_turns=2", "sampling.max_new_tokens=8", "sampling.temperature=0", "groups.n_groups=4",
    "groups.group_size=2", "validation.episodes=4", "algorithm.mini_batch_size=4", "algorithm.micro_batch_size=2",
    "optim.actor_lr=1e-3", "optim.critic_lr=1e-3",
]
COMPARED = ("losses/", "actor/", "critic/", "rollout/", "batch/", "filter/")
UNCOMPARED = ("actor/logprob_mismatch",)  # float noise of a check on a few rows, not part of the update


def run_train(model_dir: Path, out: Path, name: str, *extra: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """``turnrl train`` in a process of its own (how several processes, Ray or a kill are started)."""
    command = [sys.executable, "-m", "turnrl.cli", "train", f"model.path={model_dir}", f"run.output_dir={out}",
               f"run.name={name}", *ARGS, *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)


def failure_output(result: subprocess.CompletedProcess) -> str:
    """What a failed run of several processes said: its output's end, the lines that say why a process aborted
    (a native crash of one rank is cut from the end by the others' tracebacks), and its errors' end."""
    aborts = [line for line in result.stderr.splitlines()
              if any(word in line for word in ("terminate called", "Fatal Python error", "what():", "Aborted"))]
    return result.stdout[-2000:] + "\n".join(aborts[:20]) + "\n" + result.stderr[-3000:]


def run_config(model_dir: Path, out: Path, name: str, *extra: str) -> TrainConfig:
    return load_config(TrainConfig, None, [f"model.path={model_dir}", f"run.output_dir={out}", f"run.name={name}",
                                           *ARGS, *extra])


def train_in_process(model_dir: Path, out: Path, name: str, *extra: str) -> Path:
    """The one-process reference run, in this process (what ``turnrl train`` runs, without a new interpreter's
    start); returns its run directory."""
    train(run_config(model_dir, out, name, *extra))
    return out / name


def step_records(run_dir: Path) -> dict[int, dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines) if "rollout/success" in r}


def assert_same_metrics(one: dict, other: dict) -> None:
    keys = [k for k in one if k.startswith(COMPARED) and not k.startswith(UNCOMPARED)]
    assert keys
    for key in keys:
        assert other[key] == pytest.approx(one[key], rel=1e-4, abs=1e-6), key

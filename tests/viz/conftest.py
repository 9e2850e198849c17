"""Real folders for the viewer's tests: an evaluation with images and a short training run, made once."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from turnrl.viz.view_command import make_server

# The tiny run of tests/training/test_trainer.py, with validation before and after RL and every step's file.
RUN_OVERRIDES = [
    "model.device=cpu", "model.dtype=float32", "run.tensorboard=false", "run.trajectories_every=1",
    "env.id=FrozenLake", "agent.format=no_think", "agent.env_instructions=false", "agent.format_instructions=false",
    "agent.system_prompt=FrozenLake. Reach G. Answer <answer>Left|Down|Right|Up</answer>.",
    "agent.max_turns=2", "sampling.max_new_tokens=8", "groups.n_groups=2", "groups.group_size=2",
    "validation.episodes=4", "run.steps=2", "algorithm.mini_batch_size=4", "algorithm.micro_batch_size=2",
]
EVAL_EPISODES = 8


@pytest.fixture(scope="session")
def eval_dir(tmp_path_factory) -> Path:
    """``turnrl eval`` of the random policy on image FrozenLake: successes and failures, done and truncated."""
    from turnrl.cli import main

    out = tmp_path_factory.mktemp("viz_eval") / "eval"
    main(["eval", "--env", "FrozenLake", "--policy", "random", "--episodes", str(EVAL_EPISODES), "--out", str(out),
          "env.settings.mode=image"])
    return out


@pytest.fixture(scope="session")
def run_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """Two RL steps of the tiny model on text FrozenLake (metrics, validation before/after, step files)."""
    from turnrl.config import load_config
    from turnrl.training.commands import train
    from turnrl.training.train_config import TrainConfig

    out = tmp_path_factory.mktemp("viz_run")
    train(load_config(TrainConfig, None, [*RUN_OVERRIDES, f"model.path={tiny_model_dir}", f"run.output_dir={out}",
                                          "run.name=run"]))
    return out / "run"


def response_pieces(response: str) -> list[str]:
    """A response cut into tag and text pieces, standing in for its tokens."""
    import re

    return re.findall(r"<[^>]*>|[^<]{1,4}", response) or [response]


@pytest.fixture(scope="session")
def run_with_advantages(run_dir, tmp_path_factory) -> Path:
    """A copy of the run (no checkpoints) whose first step file has per-token advantages beside it, in the
    format the viewer reads (``step_000001.advantages.jsonl``): positive for even episodes, negative for odd
    ones, growing along each response, so that the heatmap has both colours and every strength."""
    import json
    import shutil

    from turnrl.viz.records import write_token_advantages

    copy = tmp_path_factory.mktemp("viz_adv") / "run"
    # The trainer's own advantage files are left out: here only the first step has (made-up) ones.
    shutil.copytree(run_dir, copy, ignore=shutil.ignore_patterns("checkpoints", "reference", "report.html", "plots",
                                                                 "*.advantages.jsonl"))
    step_file = copy / "trajectories" / "step_000001.jsonl"
    episodes = [json.loads(line) for line in step_file.read_text().splitlines()]
    records = []
    for index, episode in enumerate(episodes):
        sign = 1.0 if index % 2 == 0 else -1.0
        for turn in episode["turns"]:
            tokens = response_pieces(turn["response"])
            records.append({"episode": index, "turn": turn["index"], "tokens": tokens,
                            "advantages": [sign * (k + 1) / len(tokens) for k in range(len(tokens))]})
    write_token_advantages(step_file.with_name("step_000001.advantages.jsonl"), records)
    return copy


@pytest.fixture
def serve() -> Iterator[Callable[..., str]]:
    """``serve(folder, **make_server's keywords) -> base URL``: the folder over HTTP as ``turnrl view --serve``
    serves it, each server stopped after the test."""
    servers = []

    def start(folder: Path, **kwargs) -> str:
        server = make_server(folder, "127.0.0.1", 0, **kwargs)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()

"""The quickstart: ``make quickstart`` never deletes an earlier run, and the learning tests: the reduced
quickstarts (text, and images with the built-in VLM) must improve validation success with RL.

The learning tests are slow (several minutes each on two CPU cores): ``make test-slow`` or
``pytest -m slow tests/test_quickstart.py``.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from turnrl.config import load_config
from turnrl.training.commands import train
from turnrl.training.train_config import TrainConfig

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_quickstart_again_keeps_the_first_run_and_says_what_to_do(tmp_path):
    """The Makefile's own quickstart command, with a venv whose ``turnrl`` writes to a temporary folder where a
    run already is: the command stops with what to do, and the run is left as it was."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / ".installed").touch()  # newer than pyproject.toml: make builds no venv
    turnrl = venv / "bin" / "turnrl"
    # A run that goes ahead anyway is a short one (the test then fails on what it did, not on the time).
    short = "sft.enabled=false model.builtin_preset=tiny run.steps=1 validation.episodes=1"
    command = f'exec {sys.executable} -m turnrl.cli "$@" run.output_dir={tmp_path / "runs"} {short}'
    turnrl.write_text(f"#!/bin/sh\n{command}\n")
    turnrl.chmod(0o755)
    run = tmp_path / "runs" / "quickstart"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 1, "rollout/success": 0.5}\n')  # what a first run left
    result = subprocess.run(["make", "--no-print-directory", "quickstart", f"VENV={venv}"], cwd=ROOT,
                            capture_output=True, text=True, timeout=300,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert result.returncode != 0
    # A first run stopped before its first checkpoint: nothing to resume, so no resume is offered.
    assert "already holds a run (metrics.jsonl); it holds no checkpoint to continue from" in result.stderr
    assert "run.overwrite=true to delete it" in result.stderr
    assert sorted(p.name for p in run.iterdir()) == [".lock", "metrics.jsonl"]  # the lock's file only (empty)
    assert (run / "metrics.jsonl").read_text() == '{"step": 1, "rollout/success": 0.5}\n'


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["quickstart", "vlm_quickstart"])
def test_reduced_quickstart_learns(tmp_path, recipe):
    config = load_config(TrainConfig, CONFIGS / f"{recipe}.yaml", [
        f"run.output_dir={tmp_path}",
        "run.tensorboard=false",
        "run.trajectories_every=0",
        "run.steps=30",
        "validation.episodes=128",
    ])
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the suite pins one thread; this run is sized for two cores
    try:
        summary = train(config)
    finally:
        torch.set_num_threads(threads)
    saved = json.loads((tmp_path / recipe / "summary.json").read_text())
    assert saved["val_success_before_rl"] == summary["val_success_before_rl"]
    before, after = summary["val_success_before_rl"], summary["val_success_after_rl"]
    # SFT must have taught the task (random play succeeds far less often) ...
    assert before > 0.15, f"SFT did not learn: validation success {before:.3f}"
    # ... and RL must improve on it by a margin well above validation noise.
    assert after >= before + 0.05, f"RL did not improve validation success: {before:.3f} -> {after:.3f}"

"""The learning tests: the reduced quickstarts (text, and images with the built-in VLM) must improve
validation success with RL.

Slow (several minutes each on two CPU cores): ``make test-slow`` or
``pytest -m slow tests/test_quickstart.py``.
"""

import json
from pathlib import Path

import pytest
import torch

from turnrl.config import load_config
from turnrl.training.config import TrainConfig
from turnrl.training.commands import train

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


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

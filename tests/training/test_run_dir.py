"""A run's directory: a new run refuses one that holds another run, unless told to overwrite it."""

from __future__ import annotations

import pytest

from tests.training.test_trainer import config, records
from turnrl.config import ConfigError, load_config
from turnrl.training.commands import train
from turnrl.training.config import TrainConfig
from turnrl.training.run_dir import run_directory, start_run


def test_a_run_lives_in_its_resumed_directory_else_under_output_dir_and_name(tmp_path):
    fresh = load_config(TrainConfig, None, [f"run.output_dir={tmp_path}", "run.name=mine"])
    assert run_directory(fresh) == tmp_path / "mine"
    resumed = load_config(TrainConfig, None, [f"run.output_dir={tmp_path}", f"resume={tmp_path / 'old'}"])
    assert run_directory(resumed) == tmp_path / "old"


def test_a_new_run_refuses_a_directory_that_holds_a_run_unless_told_to_overwrite(tiny_model_dir, tmp_path):
    train(config(tiny_model_dir, tmp_path, "run.steps=1", "algorithm.advantage=grpo"))
    run = tmp_path / "run"
    first = records(run)
    with pytest.raises(ConfigError, match="already holds a run") as info:
        train(config(tiny_model_dir, tmp_path, "run.steps=1", "algorithm.advantage=grpo"))
    assert f"resume={run}" in str(info.value) and "run.overwrite=true" in str(info.value)
    assert records(run) == first
    (run / "checkpoints" / "step_000007").mkdir()  # a checkpoint of the old run, which must not survive
    train(config(tiny_model_dir, tmp_path, "run.steps=1", "algorithm.advantage=grpo", "run.overwrite=true"))
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step_000001"]
    assert [r["step"] for r in records(run)] == [r["step"] for r in first]


def test_overwrite_deletes_the_old_report_and_plots_before_the_new_run_starts(tmp_path):
    """A reader never sees the old run's report or curves as the new run's while it runs."""
    run = tmp_path / "mine"
    (run / "plots").mkdir(parents=True)
    (run / "plots" / "success.png").write_bytes(b"old")
    (run / "report.html").write_text("the old run")
    (run / "notes.txt").write_text("the user's own")
    start_run(load_config(TrainConfig, None, [f"run.output_dir={tmp_path}", "run.name=mine", "run.overwrite=true"]))
    assert sorted(p.name for p in run.iterdir()) == ["config.yaml", "notes.txt"]

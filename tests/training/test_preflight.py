"""The checks before a run writes or loads anything: one-line errors naming the key at fault."""

from __future__ import annotations

import importlib.util
import re

import pytest

from tests.training.test_trainer import config
from turnrl.config import ConfigError
from turnrl.training.commands import train


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["env.id=Chess"], "unknown env 'Chess'"),
        (["env.settings.sizee=4"], "no setting sizee"),
        (["env.settings.size=abc"], "size"),
        (["env.id=Sokoban", "env.settings.size=abc"], "env.settings.size='abc'"),
        (["env.val_settings={size: 1}"], "size"),
        (["sft.enabled=true", "sft.data=nowhere.jsonl"], "sft.data='nowhere.jsonl'"),
        (["sft.enabled=true", "sft.data=BROKEN"], "expected a JSON object"),
        (["run.wandb_project=x"], "pip install wandb"),
        (["model.path=./runs/old/sft/model"], "model.path='./runs/old/sft/model' does not exist"),
    ],
)
def test_a_run_that_cannot_work_stops_before_writing_or_loading_anything(overrides, needle, tmp_path, monkeypatch):
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"messages": [{"role": "user", "content": "hi"}]}\nnot json\n')
    overrides = [o.replace("BROKEN", str(broken)) for o in overrides]
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else
                        real_find_spec(name, *a))
    # No model of this name exists: a check that came after loading would fail there instead.
    with pytest.raises(ConfigError, match=re.escape(needle)) as info:
        train(config("nobody/no-model", tmp_path / "runs", *overrides))
    assert "\n" not in str(info.value)
    assert not (tmp_path / "runs").exists()


def test_a_resume_without_checkpoint_leaves_the_run_untouched(tmp_path):
    run = tmp_path / "runs" / "old"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text("run: {name: old}\n")
    with pytest.raises(ConfigError, match="holds no checkpoint"):
        train(config("nobody/no-model", tmp_path / "runs", f"resume={run}"))
    assert (run / "config.yaml").read_text() == "run: {name: old}\n"
    with pytest.raises(ConfigError, match="no such run directory"):
        train(config("nobody/no-model", tmp_path / "runs", f"resume={tmp_path / 'nothing'}"))

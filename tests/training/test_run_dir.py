"""A run's directory: a new run refuses one that holds another run, unless told to overwrite it."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

from tests.training.trainer_runs import config, records
from turnrl.config import ConfigError, load_config
from turnrl.training.commands import train
from turnrl.training.run_dir import LOCK_FILE, STOP_FILE, RunLock, run_directory, run_of_model, start_run
from turnrl.training.train_config import TrainConfig


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


def test_a_runs_models_are_found_with_the_run_that_saved_them(tmp_path):
    run = tmp_path / "ragen"
    for folder in ("checkpoints/step_000003/actor", "checkpoints/step_000007/actor", "sft/model"):
        (run / folder).mkdir(parents=True)
        (run / folder / "config.json").write_text("{}")  # a transformers model folder
    (run / "config.yaml").write_text("env: {id: Sokoban}\n")
    (run / "checkpoints" / "latest").write_text("step_000003\n")
    actor = run / "checkpoints" / "step_000003" / "actor"
    assert run_of_model(actor) == (actor, run)
    assert run_of_model(str(actor.parent)) == (actor, run)
    assert run_of_model(run / "sft" / "model") == (run / "sft" / "model", run)
    assert run_of_model(run) == (actor, run), "a run means its latest checkpoint"
    (run / "checkpoints" / "latest").unlink()
    assert run_of_model(run) == (run / "sft" / "model", run), "a run stopped after SFT means its SFT model"
    # Anything else is no run's model: a hub id, a model of its own, a run folder without its config.
    model = tmp_path / "my_model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "config.yaml").write_text("mine: 1\n")
    assert run_of_model("Qwen/Qwen2.5-0.5B-Instruct") is None and run_of_model(model) is None
    assert run_of_model(tmp_path / "absent") is None
    (run / "config.yaml").unlink()
    assert run_of_model(actor) is None and run_of_model(run) is None


def test_settings_of_a_config_are_lost_only_when_held_neither_as_they_are_nor_below():
    from turnrl.training.run_dir import flat_settings, settings_lost

    before = set(flat_settings({"env": {"id": "FrozenLake", "settings": {}}, "run": {"steps": 2}}))
    assert before == {"env.id", "env.settings", "run.steps"}
    filled = set(flat_settings({"env": {"id": "FrozenLake", "settings": {"is_slippery": False}}, "run": {"steps": 4}}))
    assert settings_lost(before, filled) == []
    assert settings_lost(before, set(flat_settings({"env": {"id": "FrozenLake"}}))) == ["env.settings", "run.steps"]


def test_a_writer_that_makes_the_directory_first_refuses_one_started_at_the_same_moment(tmp_path, monkeypatch):
    """Two runs of one run.name started together: both look, find no directory, and make it. The second to make
    it must be refused with the owner's line, not stop on the folder that the first made (``File exists``)."""
    run = tmp_path / "runs" / "same"
    first = RunLock(run)  # a writer of its own (the lock refuses a second one in this process as in another)
    looked, second_looks = pathlib.Path.is_dir, []

    def first_makes_it_meanwhile(path: pathlib.Path) -> bool:
        if path != run or second_looks:
            return looked(path)
        second_looks.append(path)
        first.__enter__()  # the second has looked and seen nothing; the first makes the directory and locks it
        return False

    monkeypatch.setattr(pathlib.Path, "is_dir", first_makes_it_meanwhile)
    try:
        with pytest.raises(ConfigError) as refused:
            RunLock(run).__enter__()
    finally:
        monkeypatch.undo()
        first.__exit__(None, None, None)
    assert str(refused.value).startswith(f"run directory {run} is in use by pid {os.getpid()} on host ")
    assert not (tmp_path / "runs").exists()  # the first writer's, made for the lock alone: removed at its end


def test_a_stop_file_left_by_a_killed_run_does_not_stop_the_resumed_one(tiny_model_dir, tmp_path, capsys):
    """``touch RUN_DIR/stop``, then the run is killed (its scheduler, a crash) before its step ends: the file is
    left. The resume is a new request to train; kept, the file would stop it after its first step."""
    train(config(tiny_model_dir, tmp_path, "run.steps=1", "algorithm.advantage=grpo"))
    run = tmp_path / "run"
    (run / STOP_FILE).touch()
    summary = train(config(tiny_model_dir, tmp_path, "run.steps=3", "algorithm.advantage=grpo", f"resume={run}"))
    assert "interrupted_at_step" not in summary and summary["steps"] == 3
    assert [r["step"] for r in records(run) if "rollout/success" in r] == [1, 2, 3]
    note = " ".join(capsys.readouterr().err.split())
    assert f"note: {run / STOP_FILE} asked an earlier run that ended without stopping on it; removed" in note



def test_a_checkpoint_left_half_written_by_a_killed_run_is_removed_when_the_next_writer_takes_the_run(
        tmp_path, capsys):
    """A run killed while it wrote its first checkpoint leaves only the unfinished folder: the resume that follows
    finds no checkpoint and refuses. Left there, the folder (the weights, gigabytes) would stay on the disk, and
    ``ls checkpoints`` would show a step where the refusal says there is none."""
    run = tmp_path / "run"
    unfinished = run / "checkpoints" / "step_000001.tmp-4242-deadbeef"
    (unfinished / "actor").mkdir(parents=True)
    (unfinished / "actor" / "model.safetensors").write_bytes(b"cut short")
    with RunLock(run, create=False):
        assert sorted(p.name for p in (run / "checkpoints").iterdir()) == []
    note = " ".join(capsys.readouterr().err.split())
    assert f"note: removed {unfinished.name}, a checkpoint an earlier run was killed while writing" in note


def test_a_resume_whose_reference_is_damaged_says_so_before_loading_anything(tiny_model_dir, tmp_path):
    """The KL term's reference is written at the run's start and read by every resume: one cut short (a disk that
    failed later, a copy interrupted) stops the resume with what is wrong and the two ways on, where it stopped
    deep in transformers' loading with its traceback; a whole one resumes."""
    settings = ("algorithm.advantage=grpo", "algorithm.kl_coef=0.05", "validation.every=0")
    train(config(tiny_model_dir, tmp_path, "run.steps=1", *settings))
    run = tmp_path / "run"
    weights = run / "reference" / "model.safetensors"
    whole = weights.read_bytes()
    weights.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(ConfigError) as refused:
        train(config(tiny_model_dir, tmp_path, "run.steps=2", *settings, f"resume={run}"))
    said = str(refused.value)
    assert said.startswith(f"{run / 'reference'}, the frozen model the KL term compares the actor with, is damaged "
                           "(reference/model.safetensors is damaged: ")
    assert said.endswith("or resume with algorithm.kl_coef=0") and "\n" not in said
    weights.write_bytes(whole)
    assert train(config(tiny_model_dir, tmp_path, "run.steps=2", *settings, f"resume={run}"))["steps"] == 2


FIRST_WRITER = """
import sys
from pathlib import Path
from filelock import FileLock
run = Path(sys.argv[1])
run.mkdir(parents=True)
lock = FileLock(str(run / ".lock"), timeout=0)
lock.acquire()
print("locked", flush=True)
sys.stdin.readline()  # its checks fail: it ends as RunLock ends in a folder it made, in two moves
(run / ".lock").unlink()
lock.release()
print("released", flush=True)
sys.stdin.readline()
run.rmdir()
run.parent.rmdir()
print("removed", flush=True)
"""


def test_a_writer_whose_folder_is_removed_while_it_locks_it_makes_it_again(tmp_path, monkeypatch):
    """Two runs of one run.name started together: the first (another process) makes the directory, fails its
    checks and removes it while the second opens the lock file in it. The second makes it again and runs (it
    stopped on a raw ``No such file or directory``, or on pathlib's ``File exists`` for a folder removed while it
    made it)."""
    run = tmp_path / "runs" / "same"
    first = subprocess.Popen([sys.executable, "-c", FIRST_WRITER, str(run)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert first.stdout.readline() == "locked\n"
        first.stdin.write("\n")
        first.stdin.flush()
        assert first.stdout.readline() == "released\n"  # the folder is there, its lock file gone
        opened, first_failed = os.open, []

        def first_fails_meanwhile(path, flags, *args, **kwargs):
            if pathlib.Path(path) == run / LOCK_FILE and not first_failed:  # the second makes the lock file...
                first.stdin.write("\n")  # ...as the first removes the folder
                first.stdin.flush()
                first_failed.append(first.stdout.readline())
            return opened(path, flags, *args, **kwargs)

        monkeypatch.setattr(os, "open", first_fails_meanwhile)
        with RunLock(run):
            monkeypatch.undo()
            assert first_failed == ["removed\n"] and (run / LOCK_FILE).is_file()
            with pytest.raises(ConfigError, match=f"run directory {run} is in use by pid {os.getpid()} on host "):
                RunLock(run).__enter__()
    finally:
        first.kill()
        first.wait()
    assert not (tmp_path / "runs").exists()  # made again by the second, which removes them at its end

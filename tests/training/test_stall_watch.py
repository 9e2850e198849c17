"""The stall watch: stacks written past a while without progress, again while nothing moves, and never after."""

from __future__ import annotations

import time

from tests.envs.toy_envs import Corridor
from tests.training.test_commands import config
from turnrl.training.commands import sft_only, train
from turnrl.training.stall_watch import StallWatch, stalls_path
from turnrl.training.trainer import Trainer


def stacks_in(path) -> int:
    return path.read_text().count("no progress for") if path.exists() else 0


def test_the_stacks_are_written_past_the_interval_again_while_nothing_moves_and_not_while_it_does(tmp_path,
                                                                                                  capsys):
    path = stalls_path(tmp_path, 0)
    with StallWatch(path, after_s=0.2):
        time.sleep(0.75)  # blocked in C, as a hung wait is
        written = path.read_text()
        assert "thread MainThread" in written and "test_the_stacks_are_written_past_the_interval" in written
        assert stacks_in(path) >= 2  # again each interval
        watch_moved = StallWatch(path, after_s=0.2)
    # The console says where they are, each time (its progress line has only stopped).
    notes = capsys.readouterr().err.splitlines()
    assert len(notes) == stacks_in(path) and all(
        note.startswith("note: no progress for ") and note.endswith(f"s; every thread's stack is in {path}")
        for note in notes)
    before = stacks_in(path)
    time.sleep(0.4)
    assert stacks_in(path) == before  # the watch stopped on exit
    with watch_moved as watch:
        for _ in range(12):  # progress every 0.05 s for 0.6 s
            time.sleep(0.05)
            watch.progressed()
    assert stacks_in(path) == before


def test_a_stacks_file_that_cannot_be_written_is_said_and_the_watch_goes_on(tmp_path, capsys):
    """A full disk (here: a folder that is not there yet) must not end the watch thread with a traceback."""
    path = tmp_path / "later" / "stalls.txt"
    with StallWatch(path, after_s=0.1, poll_s=0.02) as watch:
        time.sleep(0.3)
        path.parent.mkdir()
        time.sleep(0.3)
        assert watch._thread is not None and watch._thread.is_alive()
    assert "could not write stalled threads' stacks" in capsys.readouterr().err
    assert stacks_in(path) >= 1


def test_off_it_opens_nothing(tmp_path):
    with StallWatch(stalls_path(tmp_path, 3), after_s=0):
        time.sleep(0.1)
    assert list(tmp_path.iterdir()) == []
    assert stalls_path(tmp_path, 3).name == "stalls.rank3.txt"


def test_a_step_that_stalls_leaves_its_stack_in_the_run_directory_and_the_run_goes_on(tiny_model_dir, tmp_path,
                                                                                       monkeypatch):
    step = Trainer.step

    def stalled_step(self, index):
        if index == 0:
            time.sleep(1.5)
        return step(self, index)

    monkeypatch.setattr(Trainer, "step", stalled_step)
    summary = train(config(tiny_model_dir, tmp_path, "run.steps=2", "run.stall_dump_minutes=0.005"))  # 0.3 s
    assert summary["steps"] == 2
    assert "stalled_step" in (tmp_path / "run" / "stalls.txt").read_text()


class SlowFirstMove(Corridor):
    """An expert demo's env whose first move hangs a while (a simulator that stalls), then goes on."""

    hung = False

    def step(self, action):
        if not SlowFirstMove.hung:
            SlowFirstMove.hung = True
            time.sleep(1.5)
        return super().step(action)


def test_an_sft_stage_whose_demo_env_stalls_leaves_its_stack_and_goes_on(tiny_model_dir, tmp_path):
    """The watch ran only from RL's first validation: a hang in the demos said nothing and wrote nothing."""
    sft_only(config(tiny_model_dir, tmp_path, f"env.id={__name__}:SlowFirstMove", "sft.episodes=4", "sft.epochs=1",
                    "run.stall_dump_minutes=0.005"))
    assert (tmp_path / "run" / "sft" / "model").is_dir()
    assert "in step" in (tmp_path / "run" / "stalls.txt").read_text()

"""What an RL run writes and prints: metrics files, progress lines, and the summary of runs that save no checkpoint."""

from __future__ import annotations

import io
import json
import os

from hypothesis import example, given, settings
from hypothesis import strategies as st
from rich.console import Console

from tests.hostile_text import too_deep
from tests.training.trainer_runs import config, records
from turnrl.training.commands import train
from turnrl.training.logger import MetricsLogger, RunConsole, RunProgress


# --------------------------------------------------------------------------- metrics files
def test_metrics_logger_writes_json_lines_with_null_for_non_finite_values(tmp_path):
    logger = MetricsLogger(tmp_path, tensorboard=False)
    logger.log(1, {"a/x": 1.5, "a/nan": float("nan"), "a/inf": float("inf"), "a/int": 3})
    logger.close()
    (record,) = records(tmp_path)
    assert record["step"] == 1 and record["a/x"] == 1.5 and record["a/int"] == 3.0
    assert record["a/nan"] is None and record["a/inf"] is None
    assert not (tmp_path / "tensorboard").exists()


def test_metrics_logger_appends_on_resume_and_starts_afresh_otherwise(tmp_path):
    for resume_step, steps in ((None, [1, 2]), (2, [3])):
        logger = MetricsLogger(tmp_path, tensorboard=False, resume_step=resume_step)
        for step in steps:
            logger.log(step, {"a/x": float(step)})
        logger.close()
    assert [r["step"] for r in records(tmp_path)] == [1, 2, 3]
    MetricsLogger(tmp_path, tensorboard=False).close()
    assert records(tmp_path) == []


def test_metrics_logger_on_resume_drops_what_was_logged_after_the_checkpoint(tmp_path):
    """A run that stopped after logging steps 3-4 past its checkpoint at 2 logs them once when resumed."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = MetricsLogger(tmp_path, tensorboard=True)
    for step in range(5):
        logger.log(step, {"a/x": float(step)})
    logger.close()
    with (tmp_path / "metrics.jsonl").open("a") as torn:  # killed mid-write
        torn.write('{"step": 5, "a/')
    logger = MetricsLogger(tmp_path, tensorboard=True, resume_step=2)
    for step in (3, 4):
        logger.log(step, {"a/x": 10.0 + step})
    logger.close()
    assert [(r["step"], r["a/x"]) for r in records(tmp_path)] == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 13.0), (4, 14.0)]
    accumulator = EventAccumulator(str(tmp_path / "tensorboard"))
    accumulator.Reload()
    assert [(e.step, e.value) for e in accumulator.Scalars("a/x")] == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 13.0),
                                                                      (4, 14.0)]


@settings(max_examples=100, deadline=None)
@given(text=st.text(), step=st.integers(-3, 10))
@example(text='{"step": 0}\n{"step": 1, "a": ' + too_deep() + '\n{"step": 2}\n', step=1)
def test_resuming_over_any_metrics_file_never_raises(tmp_path_factory, text, step):
    """Any text, a line nested deeper than JSON's parser follows included (its RecursionError went through the
    log's reader)."""
    folder = tmp_path_factory.mktemp("any")
    (folder / "metrics.jsonl").write_text(text)
    MetricsLogger(folder, tensorboard=False, resume_step=step).close()
    for record in records(folder):
        assert not (isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] > step)


# --------------------------------------------------------------------------- progress
class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_progress_prints_plain_lines_every_interval_where_output_is_not_a_terminal():
    out = io.StringIO()
    console = Console(file=out, force_terminal=False, width=120)
    clock = Clock()
    with RunProgress(console, "rl", 10, completed=2, every_s=30.0, clock=clock) as progress:
        for _ in range(8):
            clock.now += 10.0
            progress.update(1, "success 0.50")
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("rl 2/10 (20%), 0:00:00 elapsed")
    # one line at the start, then one every 30 s (steps at 30 s, 60 s) and one at the end (80 s)
    assert [line.split(",")[0] for line in lines] == ["rl 2/10 (20%)", "rl 5/10 (50%)", "rl 8/10 (80%)",
                                                     "rl 10/10 (100%)"]
    assert "~0:00:50 left" in lines[1] and lines[-1].endswith("success 0.50")


def test_a_run_console_whose_reader_is_gone_goes_on_on_stderr(capsys):
    read, write = os.pipe()
    os.close(read)
    with os.fdopen(write, "w") as stream:
        console = RunConsole(file=stream)
        console.print("meets the broken pipe")  # rich's own console exits here
        console.print("on stderr")
    assert capsys.readouterr().err.endswith("on stderr\n")


def test_progress_in_a_terminal_draws_a_bar_and_nested_progress_stays_quiet():
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=100)
    with RunProgress(console, "rl", 3) as outer:
        with RunProgress(console, "validation", 4) as inner:  # rich allows one live display at a time
            inner.update(4)
        outer.update(3, "done")
    text = out.getvalue()
    assert "rl" in text and "3/3" in text and "validation 4/4" not in text


# --------------------------------------------------------------------------- a run's summary
def test_a_run_of_no_steps_validates_once(tiny_model_dir, tmp_path):
    """``run.steps=0`` (an SFT start and its validation): before and after RL are one validation."""
    run = tmp_path / "run"
    summary = train(config(tiny_model_dir, tmp_path, "run.steps=0"))
    assert [r["step"] for r in records(run) if "val/success" in r] == [0]
    assert summary["val_success_after_rl"] == summary["val_success_before_rl"]
    before, after = ((run / "trajectories" / f"val_{when}_rl.jsonl").read_text() for when in ("before", "after"))
    assert before and before == after


def test_a_run_that_keeps_no_weights_and_a_checkpoint_that_would_not_fit_end_with_their_summary(
        tiny_model_dir, tmp_path, monkeypatch):
    """``run.save_at_end=false`` ends without a checkpoint; a checkpoint the disk cannot hold is not written
    (no partial folder), and the run still ends with its summary, which says why."""
    summary = train(config(tiny_model_dir, tmp_path, "run.steps=1", "run.save_at_end=false", name="nosave"))
    assert summary["steps"] == 1 and not (tmp_path / "nosave" / "checkpoints").exists()
    assert (tmp_path / "nosave" / "summary.json").is_file()

    import shutil

    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9 - 1000, 1000))
    summary = train(config(tiny_model_dir, tmp_path, "run.steps=2", "run.save_every=1", name="full"))
    assert summary["steps"] == 2
    assert summary["checkpoint_not_written"]["step"] == 2  # the periodic save at step 1 was refused too
    assert "GB free" in summary["checkpoint_not_written"]["why"]
    assert not (tmp_path / "full" / "checkpoints").exists()
    assert json.loads((tmp_path / "full" / "summary.json").read_text())["checkpoint_not_written"]["step"] == 2

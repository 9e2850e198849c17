"""Metrics to ``metrics.jsonl``, TensorBoard and (when configured) Weights & Biases; progress on the console.

:class:`RunProgress` draws rich's progress bar in a terminal and, where the
output is a file or a pipe (a batch job's log), prints a plain line every
``every_s`` seconds instead: a bar redrawn in place is invisible there.
:class:`RunConsole` is the console a run prints on: one whose reader went away
never stops the run.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

from rich.console import Console
from rich.errors import LiveError
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from turnrl.files import atomic_write_text, fsync_path, parse_json


class RunConsole(Console):
    """rich's console for what a run prints, which a reader that went away never stops.

    rich exits on a broken pipe; a run must carry on to its checkpoint instead (``turnrl train ... | tee
    log``, where the Ctrl-C that asks the run to stop ends ``tee`` too). The broken stream is pointed at
    ``os.devnull``, so that later writes to it and the interpreter's flush at exit succeed, and what follows
    is printed on stderr, or nowhere when stderr is the stream that broke.
    """

    def on_broken_pipe(self) -> None:
        broken = self.file
        with contextlib.suppress(OSError, ValueError):  # a stream without a file descriptor (a StringIO)
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, broken.fileno())
            os.close(devnull)
        if broken is sys.stderr:
            self.quiet = True
        else:
            self.file = sys.stderr


class MetricsLogger:
    """Writes one JSON line per call of :meth:`log`, and the same scalars to TensorBoard.

    Metric names use namespaces (``rollout/success``, ``losses/policy``,
    ``timing/generate_s``); non-finite values are written as null in JSON.

    Each record is on the disk (``fsync``) when :meth:`log` returns, so a checkpoint saved after it never
    outlives it.

    On resume (``resume_step`` given), what the interrupted run logged after its checkpoint (records of
    later steps in ``metrics.jsonl``, TensorBoard events from ``resume_step + 1`` on) is dropped, since the
    resumed run logs those steps again: every step appears once.
    """

    def __init__(self, run_dir: Path, tensorboard: bool = True, wandb_project: str | None = None,
                 config: dict[str, Any] | None = None, resume_step: int | None = None) -> None:
        self.path = run_dir / "metrics.jsonl"
        run_dir.mkdir(parents=True, exist_ok=True)
        if resume_step is not None:
            lost, logged = _truncate_after(self.path, resume_step) if self.path.exists() else ([], set())
            note = Console(stderr=True)
            if lost:
                note.print(f"note: {self.path} was damaged: {', '.join(lost)} cut short, not text or not a record, "
                           "dropped (the steps are not run again)", markup=False, highlight=False, soft_wrap=True)
            missing = [step for step in range(1, resume_step + 1) if step not in logged]
            if missing:
                note.print(f"note: {self.path} holds no record of {step_ranges(missing)} (deleted or emptied since "
                           "they ran?): the resumed run goes on from its checkpoint without them", markup=False,
                           highlight=False, soft_wrap=True)
        self._file = self.path.open("a" if resume_step is not None else "w")
        fsync_path(run_dir)  # the file's name, made here, on the disk with the records fsynced into it
        self._writer = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            purge = None if resume_step is None else resume_step + 1  # events of steps >= purge are dropped
            self._writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"), purge_step=purge)
        self._wandb = None
        if wandb_project:
            import wandb

            self._wandb = wandb.init(project=wandb_project, name=run_dir.name, config=config, dir=str(run_dir))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        record: dict[str, Any] = {"step": step, "time": time.time()}
        for key, value in metrics.items():
            value = float(value)
            record[key] = value if math.isfinite(value) else None
            if self._writer is not None and math.isfinite(value):
                self._writer.add_scalar(key, value, step)
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        # On the disk before the step's checkpoint is: a power loss after it would otherwise lose the records
        # of the steps it covers (ext4 stores a file's bytes up to 30 s after they are written), which the
        # resumed run does not run again. A few milliseconds a step, whose rollout and update take seconds.
        os.fsync(self._file.fileno())
        if self._wandb is not None:
            self._wandb.log(metrics, step=step)

    def close(self) -> None:
        self._file.close()
        if self._writer is not None:
            self._writer.close()
        if self._wandb is not None:
            self._wandb.finish()


_RECORD_START = re.compile(rb'^\{"step": (\d+)')
"""How every record of :meth:`MetricsLogger.log` starts: the step of a line cut short is still read from it."""


def step_ranges(steps: list[int]) -> str:
    """Sorted steps in few words: ``steps 1-3, 7``; ``step 4``."""
    runs: list[list[int]] = []
    for step in steps:
        if runs and step == runs[-1][-1] + 1:
            runs[-1].append(step)
        else:
            runs.append([step])
    spans = [f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]) for run in runs]
    return ("step " if len(steps) == 1 else "steps ") + ", ".join(spans)


def _truncate_after(path: Path, step: int) -> tuple[list[str], set[int]]:
    """Drop the records of ``metrics.jsonl`` past ``step``, and lines cut short or garbled (a run killed while it
    wrote one, a disk that refused the rest). Returns a note for each damaged line of a step up to ``step``, whose
    record is then lost (the resumed run does not run that step again), or of no step that can be read; and the
    steps up to ``step`` that had a record, whole or damaged."""
    kept, lost, logged = [], [], set()
    for number, raw in enumerate(path.read_bytes().splitlines(), 1):
        try:
            record = parse_json(raw.decode("utf-8"))
        except ValueError:  # not JSON, or not text
            start = _RECORD_START.match(raw)
            if start is None and raw.strip():
                lost.append(f"line {number} (no record of a step)")
            elif start is not None and int(start.group(1)) <= step:
                lost.append(f"line {number} (the record of step {int(start.group(1))})")
                logged.add(int(start.group(1)))  # said as damaged, not as missing
            continue
        if not (isinstance(record, dict) and isinstance(record.get("step"), int)):
            # JSON, but no record (a list, a string, a step that is not a number): every reader of the log
            # takes each line for a record of a step, so such a line would break them all.
            if raw.strip():
                lost.append(f"line {number} (no record of a step)")
            continue
        if record["step"] <= step:
            kept.append(raw.decode("utf-8"))
            logged.add(record["step"])
    atomic_write_text(path, "".join(f"{line}\n" for line in kept))
    return lost, logged


def _clock(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class RunProgress:
    """A progress bar in a terminal; elsewhere a plain line at the start, every ``every_s`` seconds and at
    the end. Use as a context manager; :meth:`update` advances and sets the description.

    Args:
        console: where to draw or print.
        label: the phase (``rl``, ``eval``, ``validation``).
        total: units of work (steps, episodes).
        completed: units already done (a resumed run).
        every_s: seconds between plain lines.
        clock: seconds, monotonic (tests pass their own).
    """

    def __init__(self, console: Console, label: str, total: int, completed: int = 0, every_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.console, self.label, self.total, self.done = console, label, total, completed
        self.every_s, self.clock = every_s, clock
        self.description = ""
        self._first = completed
        self._start = self._last = clock()
        self._bar: Progress | None = None
        self._task: Any = None
        self._quiet = False

    def __enter__(self) -> RunProgress:
        if self.console.is_terminal:
            columns = [TextColumn(f"[bold]{self.label}[/bold] {{task.description}}"), BarColumn(),
                       MofNCompleteColumn(), TimeElapsedColumn(), TimeRemainingColumn()]
            bar = Progress(*columns, console=self.console)
            try:
                bar.__enter__()
            except LiveError:  # inside another bar (validation mid-training): that one shows progress
                self._quiet = True
                return self
            self._bar = bar
            self._task = bar.add_task("", total=self.total, completed=self.done)
        else:
            self._line()
        return self

    def update(self, advance: int = 1, description: str | None = None) -> None:
        self.done += advance
        if description is not None:
            self.description = description
        if self._bar is not None:
            self._bar.update(self._task, advance=advance, description=self.description)
        elif not self._quiet and self.clock() - self._last >= self.every_s or self.done >= self.total:
            self._line()

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        if self._bar is not None:
            self._bar.__exit__(kind, error, trace)

    def _line(self) -> None:
        now = self.clock()
        self._last = now
        elapsed = now - self._start
        rate = (self.done - self._first) / elapsed if elapsed > 0 else 0.0
        left = f", ~{_clock((self.total - self.done) / rate)} left" if rate > 0 and self.done < self.total else ""
        share = f" ({100 * self.done / self.total:.0f}%)" if self.total else ""
        text = f"{self.label} {self.done}/{self.total}{share}, {_clock(elapsed)} elapsed{left}"
        self.console.print(f"{text}  {self.description}".rstrip(), markup=False, highlight=False)

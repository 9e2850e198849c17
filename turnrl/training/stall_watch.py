"""Where a stuck run waits: every thread's Python stack written to the run directory when no step ends for a while.

A run that hangs says nothing: its progress line stops, and on a cluster nobody may be there to send it a
signal (``kill -USR1 PID`` prints the stacks on demand, see :mod:`turnrl.cli`). :class:`StallWatch` writes them
by itself, past ``run.stall_dump_minutes`` without progress, to ``RUN_DIR/stalls.txt`` (``stalls.rank{r}.txt``
for the other processes of a distributed run), and again each such interval while nothing moves.

Written by hand: torch's watchdogs cover NCCL collectives only, and faulthandler's timer
(``dump_traceback_later``) reads the other threads' frames without the GIL, which is safe in a process that has
stopped and not in one that runs on (a training run under it, dumping every 0.3 s, died of a segmentation fault
in a test). This watch is a Python thread: it reads the frames under the GIL, so it waits for a thread that holds
the GIL in C to let it go; waits on locks, futures, queues, sleeps, CUDA synchronizations and collectives do.
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
from pathlib import Path
from types import TracebackType


def stalls_path(run_dir: Path, rank: int) -> Path:
    """Where process ``rank`` writes its stacks: ``stalls.txt`` for rank 0, ``stalls.rank{r}.txt`` for the others."""
    return run_dir / ("stalls.txt" if rank == 0 else f"stalls.rank{rank}.txt")


def thread_stacks() -> str:
    """Every other thread's Python stack, the innermost call last, each headed by the thread's name."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        if ident == threading.get_ident():
            continue
        stack = "".join(traceback.format_stack(frame))
        parts.append(f"thread {names.get(ident, '?')} ({ident}), most recent call last:\n{stack}")
    return "\n".join(parts)


class StallWatch:
    """:meth:`progressed` starts the clock again; past ``after_s`` without it, every thread's stack is appended to
    ``path`` (headed by the time and how long nothing moved), and again every ``after_s`` until it is called.
    ``after_s`` 0: off (no thread, no file). Use as a context manager: the watch's thread ends on exit.

    Args:
        path: the file the stacks go to (:func:`stalls_path`).
        after_s: seconds without progress before the first stacks are written.
        poll_s: how often the watch looks (None: a tenth of ``after_s``, at most a minute).
    """

    def __init__(self, path: Path, after_s: float, poll_s: float | None = None) -> None:
        self.path, self.after_s = path, after_s
        self.poll_s = poll_s if poll_s is not None else min(after_s / 10, 60.0)
        self._last = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def progressed(self) -> None:
        self._last = time.monotonic()

    def _watch(self) -> None:
        written = self._last
        while not self._stop.wait(self.poll_s):
            now, last = time.monotonic(), self._last
            if now - last >= self.after_s and now - max(written, last) >= self.after_s:
                heading = f"{time.strftime('%Y-%m-%d %H:%M:%S')}: no progress for {now - last:.1f} s"
                try:
                    with self.path.open("a") as file:
                        file.write(f"{heading}\n{thread_stacks()}\n")
                except OSError as error:  # a full disk: the run goes on, and the watch tries again next time
                    print(f"warning: could not write stalled threads' stacks to {self.path}: {error}",
                          file=sys.stderr)
                else:  # the console's reader would see only a progress line that stopped
                    print(f"note: no progress for {now - last:.0f} s; every thread's stack is in {self.path}",
                          file=sys.stderr, flush=True)
                written = now

    def __enter__(self) -> StallWatch:
        if self.after_s > 0:
            self.progressed()
            self._thread = threading.Thread(target=self._watch, name="turnrl-stall-watch", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

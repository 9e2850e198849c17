"""The CUDA allocator's history over a run's first steps: what was live at the peak, by the line that made it.

The memory estimate (:mod:`turnrl.training.memory`) counts a recipe's parts from the model's config; where a
run's measured peak (``memory/*_peak_gib``) differs from it, the difference is in allocations the estimate
does not know of. ``run.memory_snapshot_steps=N`` records the allocator's history (torch's
``_record_memory_history``) over steps 1-N and writes, for each, ``memory/rank{R}_step{N}.pickle`` (for
pytorch.org/memory_viz) and ``memory/rank{R}_step{N}.txt``: the step's peak above where it began and the
allocations live at that peak, summed by their first frame in turnrl or transformers, then the same for the
peak within each of the step's phases (the rollout, the update), which need not be the step's. A step that runs out of
memory writes them too before the error goes on, so what led to it is kept.

The replay of the trace is written here: torch's own viewer draws a snapshot but gives no peak breakdown as text.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

GIB = 2**30
MAX_EVENTS = 4_000_000
"""Trace entries kept (the oldest dropped past it): a step of a 3B-8B recipe makes some hundreds of thousands."""


PHASES = ("roll_out", "update")
"""The trainer's methods whose peaks a report gives apart: a step's rollout and its update (scores included)."""


def live_at_peak(events: Sequence[dict[str, Any]],
                 within: tuple[int, int] | None = None) -> tuple[int, list[dict[str, Any]]]:
    """Replay an allocator trace (``torch.cuda.memory._snapshot()["device_traces"][device]``): the most bytes
    allocated at once above where the trace began, and the allocations the trace made that were live then,
    largest first. Blocks allocated before the trace and freed during it lower the count.

    Args:
        events: in order, each with ``action`` (``alloc``, ``free_completed``; others are ignored), ``addr``,
            ``size`` and ``frames``.
        within: the peak is looked for among events ``first .. last`` (inclusive) only; the ones before still
            count towards what is live.
    """
    first, last = within if within is not None else (0, len(events) - 1)
    live: dict[int, dict[str, Any]] = {}
    total = peak = 0
    at_peak: list[dict[str, Any]] = []
    for index, event in enumerate(events[:last + 1]):
        if event["action"] == "alloc":
            live[event["addr"]] = event
            total += event["size"]
            if total > peak and index >= first:
                peak, at_peak = total, list(live.values())
        elif event["action"] == "free_completed":
            live.pop(event["addr"], None)
            total -= event["size"]
    return peak, sorted(at_peak, key=lambda event: -event["size"])


def made_at(event: dict[str, Any]) -> str:
    """Where an allocation was made: its first frame in turnrl or transformers (``file:line function``)."""
    for frame in event.get("frames", []):
        name = frame["filename"]
        for package in ("turnrl/", "transformers/"):
            if package in name:
                return f"{package}{name.split(package, 1)[1]}:{frame['line']} {frame['name']}"
    return "(outside turnrl and transformers)"


def phase_spans(events: Sequence[dict[str, Any]], functions: Sequence[str]) -> dict[str, tuple[int, int]]:
    """Each of ``functions`` that the trace has events inside (a frame of that name in turnrl): its first and
    last event's indices."""
    spans: dict[str, tuple[int, int]] = {}
    for index, event in enumerate(events):
        for frame in event.get("frames", []):
            name = frame["name"]
            if name in functions and "turnrl/" in frame["filename"]:
                spans[name] = (spans[name][0] if name in spans else index, index)
    return spans


def _by_place(peak: int, live: Sequence[dict[str, Any]], heading: str, top: int) -> list[str]:
    by_place: dict[str, int] = {}
    for event in live:
        place = made_at(event)
        by_place[place] = by_place.get(place, 0) + event["size"]
    lines = [f"{heading}: peak {peak / GIB:.2f} GiB above the start of the trace; live then, by where it was made:"]
    lines += [f"  {size / GIB:8.3f} GiB  {place}"
              for place, size in sorted(by_place.items(), key=lambda item: -item[1])[:top]]
    return lines


def peak_report(events: Sequence[dict[str, Any]], top: int = 15, phases: Sequence[str] = PHASES) -> list[str]:
    """Lines: the peak above the trace's start and the ``top`` places by bytes live at that peak; then the same
    for the peak within each of ``phases`` (functions, :func:`phase_spans`) that the trace has events in."""
    lines = _by_place(*live_at_peak(events), "step", top)
    for function, span in phase_spans(events, phases).items():
        lines += _by_place(*live_at_peak(events, span), function, top)
    return lines


RECORDER_BUG = "returned NULL without setting an exception"
"""What torch 2.11 raises where its allocator's recorder meets a compiled part's autograd function under activation
checkpointing (pytorch/pytorch#179536, a regression from 2.10): a VisGym ``vlm-3b`` step with ``model.compile=true``
and checkpointing failed so in its first update while recorded (2026-12-07, one H100)."""


def explained(error: BaseException, path: Path) -> BaseException:
    """``error`` as the recorded step raised it, or where it is torch's recorder bug (:data:`RECORDER_BUG`), an
    error that says so and what to change, the snapshot up to it being at ``path``."""
    if not (isinstance(error, SystemError) and RECORDER_BUG in str(error)):
        return error
    return RuntimeError(
        f"recording the allocator's history (run.memory_snapshot_steps) broke a compiled part under activation "
        f"checkpointing, a bug of torch's recorder (pytorch/pytorch#179536; torch {torch.__version__}); what it "
        f"recorded up to there is in {path.with_suffix('.txt')}. Record the steps with model.compile=false, or "
        f"without model.gradient_checkpointing, or run without run.memory_snapshot_steps")


@contextmanager
def recorded(path: Path, device: torch.device) -> Iterator[None]:
    """Record ``device``'s allocator history while the body runs; then (also when it raises) save the snapshot
    to ``path`` and its :func:`peak_report` beside it (``.txt``). On a CPU nothing is recorded.

    Raises:
        RuntimeError: the body hit torch's recorder bug (:func:`explained`); any other error as it was.
    """
    if device.type != "cuda":
        yield
        return
    torch.cuda.memory._record_memory_history(max_entries=MAX_EVENTS, stacks="python", device=device)
    try:
        yield
    except SystemError as error:
        said = explained(error, path)
        if said is error:
            raise
        raise said from error
    finally:
        snapshot = torch.cuda.memory._snapshot(device)
        torch.cuda.memory._record_memory_history(enabled=None, device=device)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(pickle.dumps(snapshot))
        index = device.index if device.index is not None else torch.cuda.current_device()
        path.with_suffix(".txt").write_text("\n".join(peak_report(snapshot["device_traces"][index])) + "\n")

"""Where the GPU waits on the host: a profiler trace's idle stretches between kernels, charged to the Python frames
the host was in at that moment, and its costliest kernels.

A ``torch.profiler`` trace with ``with_stack=True`` (exported as Chrome's JSON) holds the device's kernels and the
host's Python frames on one clock. Wherever no kernel runs, the frames the launching thread was in say what kept
the device waiting: sampled every 50 us of each idle stretch (at most 20 samples a stretch, each weighing its
share of the stretch), and summed by the innermost frame of turnrl or transformers, with the built-in call below
it if any (SDPA's, a tensor copy's), by phase: the engine's prefill and decode (its ``engine.prefill`` and
``engine.decode`` ranges), else the trainer's part of a step (its rollout, the scores: old log-probs, the
reference and values, and the update's PPO epochs), else "between" (a rollout's environments and requests in a
benchmark). The profiler's own cost inflates Python-heavy frames: compare frames within one trace, not across.

``run.profile_steps=[N, ...]`` traces those RL steps of a run and writes, for each step and process,
``profile/rank{R}_step{N}.json.gz`` (for Perfetto or chrome://tracing) and ``.txt`` (this module's reading of
it); ``benchmarks/vlm_rollout.py --gaps N`` does the same for a VLM rollout alone. Any such trace:

    python -m turnrl.training.device_idle TRACE.json.gz [--top 25]

Written here because the profiler's own summaries (``key_averages``) total each operator's time and say nothing
of the time between kernels, which is what a host-bound phase loses.
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import shutil
import tempfile
from collections import Counter, defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

PROJECT_PATHS = ("turnrl/", "transformers/", "benchmarks/")
"""Frames of these packages are named; torch's own Python frames are looked through."""

SAMPLE_US = 50.0
MAX_SAMPLES = 20
ENGINE_PHASES = ("prefill", "decode")
TRAINER_PHASES = {"turnrl/training/trainer.py:roll_out": "rollout", "turnrl/training/trainer.py:score": "scores",
                  "turnrl/training/trainer.py:train_on": "update"}
"""A step's parts by the trainer's method the host is in (the engine's ranges within a rollout come first)."""
PHASES = (*ENGINE_PHASES, *TRAINER_PHASES.values(), "between")


def frame_name(name: str) -> str | None:
    """``.../turnrl/engine/forward.py(12): decode`` -> ``turnrl/engine/forward.py:decode`` (None: not a project
    frame)."""
    for package in PROJECT_PATHS:
        if package in name:
            path, _, function = name.rsplit(package, 1)[1].partition("): ")
            return f"{package}{path.split('(')[0]}:{function}"
    return None


def merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted intervals with the overlapping ones joined."""
    out: list[list[float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(start, end) for start, end in out]


def idle_samples(busy: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """(time, weight in us) samples of the stretches between ``busy`` intervals (merged, sorted)."""
    samples: list[tuple[float, float]] = []
    for (_, idle_from), (idle_to, _) in zip(busy, busy[1:]):
        gap = idle_to - idle_from
        count = max(1, min(MAX_SAMPLES, int(gap // SAMPLE_US)))
        samples.extend((idle_from + gap * (k + 0.5) / count, gap / count) for k in range(count))
    return samples


def largest(values: dict[str, float], top: int) -> list[tuple[str, float]]:
    return sorted(values.items(), key=lambda item: -item[1])[:top]


def within(ranges: list[tuple[float, float]], moment: float) -> bool:
    index = bisect.bisect_right(ranges, (moment, float("inf"))) - 1
    return index >= 0 and ranges[index][0] <= moment < ranges[index][1]


@dataclass
class DeviceIdle:
    """A trace's device time, busy and idle, the idle time by what the host was doing, and the kernels' time."""

    span_us: float
    busy_us: float
    launches: int
    """Kernels (and device copies) run."""
    kernels: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    """Device microseconds by kernel name."""
    by_frame: dict[str, dict[str, float]] = field(
        default_factory=lambda: {phase: defaultdict(float) for phase in PHASES})
    """Idle microseconds by phase and innermost project frame (with the built-in call below it, if any)."""

    @property
    def idle_us(self) -> float:
        return sum(sum(frames.values()) for frames in self.by_frame.values())

    def lines(self, top: int) -> list[str]:
        """The summary, the ``top`` frames of each phase with idle time, and the ``top`` costliest kernels."""
        lines = [f"device idle: {self.idle_us / 1e6:.2f} s of a {self.span_us / 1e6:.2f} s span "
                 f"({self.busy_us / 1e6:.2f} s of {self.launches:,} kernels)"]
        for phase in PHASES:
            frames = self.by_frame[phase]
            if frames:
                lines.append(f"while the host was in {phase}: {sum(frames.values()) / 1e6:.3f} s idle")
                lines.extend(f"  {us / 1e6:>7.3f} s  {name}" for name, us in largest(frames, top))
        if self.kernels:
            lines.append(f"the {min(top, len(self.kernels))} costliest kernels:")
            lines.extend(f"  {us / 1e6:>7.3f} s  {name[:110]}" for name, us in largest(self.kernels, top))
        return lines


def device_idle(events: list[dict]) -> DeviceIdle:
    """The idle time of a Chrome trace's ``traceEvents``, by what the launching thread's Python was doing."""
    complete = [event for event in events if event.get("ph") == "X"]
    kernel_events = [e for e in complete if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not kernel_events:
        return DeviceIdle(0.0, 0.0, 0)
    kernels: dict[str, float] = defaultdict(float)
    for event in kernel_events:
        kernels[event["name"]] += event.get("dur", 0)
    busy = merged([(e["ts"], e["ts"] + e.get("dur", 0)) for e in kernel_events])
    # The thread that launched the most kernels (without launch records: the one with the most Python frames).
    launches = Counter(e["tid"] for e in complete if e.get("cat") == "cuda_runtime" and "Launch" in e["name"])
    launches = launches or Counter(e["tid"] for e in complete if e.get("cat") == "python_function")
    thread = launches.most_common(1)[0][0] if launches else None
    frames = sorted(((e["ts"], e["ts"] + e.get("dur", 0), e["name"]) for e in complete
                     if e.get("cat") == "python_function" and e.get("tid") == thread),
                    key=lambda frame: (frame[0], -frame[1]))
    ranges = {name: sorted((e["ts"], e["ts"] + e.get("dur", 0)) for e in complete
                           if e.get("cat") == "user_annotation" and e["name"] == f"engine.{name}")
              for name in ENGINE_PHASES}
    idle = DeviceIdle(busy[-1][1] - busy[0][0], sum(end - start for start, end in busy), len(kernel_events), kernels)
    stack: list[tuple[float, float, str]] = []
    next_frame = 0
    for moment, weight in idle_samples(busy):  # in time order: frames open and close as the moment moves on
        while next_frame < len(frames) and frames[next_frame][0] <= moment:
            while stack and stack[-1][1] <= frames[next_frame][0]:
                stack.pop()
            stack.append(frames[next_frame])
            next_frame += 1
        while stack and stack[-1][1] <= moment:
            stack.pop()
        live = [frame for frame in stack if frame[1] > moment]
        named = [name for name in (frame_name(frame[2]) for frame in live) if name]
        where = named[-1] if named else "(no turnrl or transformers frame)"
        leaf = live[-1][2] if live else ""
        if leaf.startswith("<built-in"):
            where += f" > {leaf.removeprefix('<built-in ').split(' of ')[0].rstrip('>')}"
        phase = next((name for name, spans in ranges.items() if within(spans, moment)), None)
        if phase is None:
            phase = next((TRAINER_PHASES[name] for name in reversed(named) if name in TRAINER_PHASES), "between")
        idle.by_frame[phase][where] += weight
    return idle


def read_trace(path: Path) -> list[dict]:
    with (gzip.open(path, "rt") if path.suffix == ".gz" else path.open()) as file:
        return json.load(file)["traceEvents"]


READ_IN_RUN_BYTES = 32 * 2**20
"""The largest compressed trace a run reads itself for its ``.txt``: about half a gigabyte of JSON, 64 episodes
of a 4-turn VLM rollout. A larger one (a whole VisGym step's is gigabytes) would hold the run for minutes and
tens of gigabytes of memory while it is read: its ``.txt`` gives the command that reads it apart."""


def export_compressed(trace: torch.profiler.profile, path: Path) -> None:
    """Write ``trace`` to ``path`` as gzip-compressed Chrome JSON at gzip's fastest level. torch's own export of a
    ``.gz`` path compresses at the strongest level, several times slower for a file a third smaller, and the run
    waits on it (a GPU step's trace holds hundreds of megabytes of JSON)."""
    with tempfile.TemporaryDirectory(dir=path.parent) as scratch:
        plain = Path(scratch) / "trace.json"
        trace.export_chrome_trace(str(plain))
        with plain.open("rb") as source, gzip.open(path, "wb", compresslevel=1) as target:
            shutil.copyfileobj(source, target, 1 << 20)


@contextmanager
def profiled(stem: Path, device: torch.device, top: int = 25) -> Iterator[None]:
    """Trace the block (its kernels on a GPU, the host's Python frames) and write ``stem.json.gz`` and
    ``stem.txt`` (:meth:`DeviceIdle.lines`, or for a trace over :data:`READ_IN_RUN_BYTES` the command that reads
    it), also when the block fails: its trace up to the failure."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    trace = torch.profiler.profile(activities=activities, with_stack=True)
    try:
        with trace:
            yield
    finally:
        stem.parent.mkdir(parents=True, exist_ok=True)
        path = stem.with_name(f"{stem.name}.json.gz")
        export_compressed(trace, path)
        if path.stat().st_size > READ_IN_RUN_BYTES:
            summary = [f"the trace holds {path.stat().st_size / 2**20:.0f} MiB compressed, too much to read within "
                       f"the run; read it with: python -m turnrl.training.device_idle {path}"]
        else:
            summary = device_idle(read_trace(path)).lines(top)
        stem.with_name(f"{stem.name}.txt").write_text("\n".join(summary) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace", type=Path, help="a Chrome trace of torch.profiler (with_stack=True), .json or .gz")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    print("\n".join(device_idle(read_trace(args.trace)).lines(args.top)))


if __name__ == "__main__":
    main()

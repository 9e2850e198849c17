"""Where the GPU waits on the host: each idle stretch between kernels of a profiler trace, charged to the Python
frames the host was in at that moment.

A ``torch.profiler`` trace with ``with_stack=True`` (exported as Chrome's JSON) holds the device's kernels and the
host's Python frames on one clock. Wherever no kernel runs, the frames the launching thread was in say what kept
the device waiting: sampled every 50 us of each idle stretch (at most 20 samples a stretch, each weighing its
share of the stretch), and summed by the innermost frame of turnrl or transformers, with the frame below all of
them (a built-in call such as SDPA's), split by the engine's phase at that moment (its ``engine.prefill`` and
``engine.decode`` ranges; "between" is everything else: the environments, building requests). The profiler's
own cost inflates Python-heavy frames; compare frames within one trace, not across traces.

    python benchmarks/device_idle.py TRACE.json [--top 25]
    python benchmarks/vlm_rollout.py --profile --gaps 25 --device cuda --preset vlm-3b --episodes 64 --turns 5 \\
        --new 128 --context 4032                                        # traces a rollout and reads it so
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

PROJECT_PATHS = ("turnrl/", "transformers/", "benchmarks/")
"""Frames of these packages are named; torch's own Python frames are looked through."""

SAMPLE_US = 50.0
MAX_SAMPLES = 20
PHASES = ("prefill", "decode", "between")


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
    samples = []
    for (_, idle_from), (idle_to, _) in zip(busy, busy[1:]):
        gap = idle_to - idle_from
        count = max(1, min(MAX_SAMPLES, int(gap // SAMPLE_US)))
        samples.extend((idle_from + gap * (k + 0.5) / count, gap / count) for k in range(count))
    return samples


def within(ranges: list[tuple[float, float]], moment: float) -> bool:
    index = bisect.bisect_right(ranges, (moment, float("inf"))) - 1
    return index >= 0 and ranges[index][0] <= moment < ranges[index][1]


@dataclass
class DeviceIdle:
    """A trace's device time, busy and idle, and the idle time by what the host was doing."""

    span_us: float
    busy_us: float
    kernels: int
    by_frame: dict[str, Counter[str]] = field(default_factory=lambda: {phase: Counter() for phase in PHASES})
    """Idle microseconds by phase and innermost project frame (with the built-in call below it, if any)."""

    @property
    def idle_us(self) -> float:
        return sum(sum(frames.values()) for frames in self.by_frame.values())

    def lines(self, top: int) -> list[str]:
        lines = [f"device idle: {self.idle_us / 1e6:.2f} s of a {self.span_us / 1e6:.2f} s span "
                 f"({self.busy_us / 1e6:.2f} s of {self.kernels:,} kernels)"]
        for phase in PHASES:
            frames = self.by_frame[phase]
            lines.append(f"while the host was in {phase}: {sum(frames.values()) / 1e6:.3f} s idle")
            lines.extend(f"  {us / 1e6:>7.3f} s  {name}" for name, us in frames.most_common(top))
        return lines


def device_idle(events: list[dict]) -> DeviceIdle:
    """The idle time of a Chrome trace's ``traceEvents``, by what the launching thread's Python was doing."""
    complete = [event for event in events if event.get("ph") == "X"]
    kernels = [(e["ts"], e["ts"] + e.get("dur", 0)) for e in complete
               if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not kernels:
        return DeviceIdle(0.0, 0.0, 0)
    busy = merged(kernels)
    launches = Counter(e["tid"] for e in complete if e.get("cat") == "cuda_runtime" and "Launch" in e["name"])
    thread = launches.most_common(1)[0][0] if launches else None
    frames = sorted(((e["ts"], e["ts"] + e.get("dur", 0), e["name"]) for e in complete
                     if e.get("cat") == "python_function" and e.get("tid") == thread),
                    key=lambda frame: (frame[0], -frame[1]))
    ranges = {name: sorted((e["ts"], e["ts"] + e.get("dur", 0)) for e in complete
                           if e.get("cat") == "user_annotation" and e["name"] == f"engine.{name}")
              for name in ("prefill", "decode")}
    idle = DeviceIdle(busy[-1][1] - busy[0][0], sum(end - start for start, end in busy), len(kernels))
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
        phase = next((name for name, spans in ranges.items() if within(spans, moment)), "between")
        idle.by_frame[phase][where] += weight
    return idle


def read_trace(path: Path) -> list[dict]:
    with (gzip.open(path, "rt") if path.suffix == ".gz" else path.open()) as file:
        return json.load(file)["traceEvents"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace", type=Path, help="a Chrome trace of torch.profiler (with_stack=True), .json or .gz")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    print("\n".join(device_idle(read_trace(args.trace)).lines(args.top)))


if __name__ == "__main__":
    main()

"""Where a training step's time goes: its phases, then the update (scores and PPO epochs) under torch.profiler.

Builds the trainer of ``--config`` and its overrides (as ``turnrl train`` does), runs ``--steps`` steps
(the first ones warm up: compilation, graph capture, allocator), printing each step's phase timings, then
rolls out once more and profiles the update of that rollout: the operators by device time and by host time,
and the wall time against the device's busy time (a host-bound update shows a large gap). On a GPU it also
reads rank 0's kernel timeline: how long compute kernels ran (the union of their intervals), how long the
collectives ran, how much of that at once, and the gaps in which no compute kernel ran (waits on a
collective or on the host). ``--device-only`` records the kernels alone: the host then runs at its own speed
(recording every operator on the host slows it several times, and the timeline's gaps with it), at the cost
of the host table.

Under ``torchrun`` it profiles the trainer's sharded update (FSDP2), every process under its profiler (the
collectives included), and rank 0 prints its own tables.

    python benchmarks/update_profile.py --config configs/ragen_sokoban.yaml model.builtin_preset=0.5b \\
        validation.every=0 run.name=profile
    torchrun --nproc-per-node 4 benchmarks/update_profile.py --config configs/ragen_sokoban.yaml \\
        model.builtin_preset=7b model.engine.free_during_update=true model.engine.kv_cache_gb=12
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.timing import synchronize  # noqa: E402
from turnrl.config import load_config  # noqa: E402
from turnrl.models.loading import base_model_path  # noqa: E402
from turnrl.training import ranks  # noqa: E402
from turnrl.training.device_idle import merged  # noqa: E402
from turnrl.training.train_config import TrainConfig  # noqa: E402
from turnrl.training.allocator import set_allocator_settings  # noqa: E402
from turnrl.training.trainer import Trainer  # noqa: E402

PHASES = ("timing/rollout_s", "timing/old_logprobs_s", "timing/values_s", "timing/update_s", "timing/step_s",
          "throughput/update_mfu")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=None)
    parser.add_argument("--steps", type=int, default=3, help="steps before the profiled one")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--no-profile", dest="profile", action="store_false",
                        help="only the steps' phase timings")
    parser.add_argument("--trace", type=Path, default=None,
                        help="write rank 0's profile as a Chrome trace (gzipped when the name ends in .gz)")
    parser.add_argument("--device-only", action="store_true",
                        help="record the GPU's kernels alone (no host operators: the host is not slowed)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_intermixed_args()
    sharded = ranks.launched_by_torchrun()
    with tempfile.TemporaryDirectory() as runs:
        # No validation during the steps (a recipe's stop on low validation success is switched off with it).
        config = load_config(TrainConfig, args.config, [f"run.output_dir={runs}", "validation.every=0",
                                                         "collapse.stop_on_low_success=false", *args.overrides])
        allocator = set_allocator_settings(config)  # before CUDA starts, as `turnrl train` sets it
        if allocator is not None and ranks.is_main():
            print(allocator, flush=True)
        if sharded:
            ranks.init_process_group(config.model.device, config.distributed.timeout_s)
            if ranks.is_main():  # builds the built-in model once, as `turnrl train` does
                base_model_path(config.model)
            ranks.wait_for_main()
        try:
            profile_update(Trainer(config), args)  # under torchrun: FSDP2
        finally:
            if sharded:
                ranks.close_process_group()


def overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Length of the time both lists of :func:`merged` intervals cover."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def kernel_timeline(trace: dict[str, Any], gap_s: float = 1e-3) -> dict[str, float]:
    """Seconds of a Chrome trace's GPU kernels (torch.profiler's export; times in microseconds): ``span`` from
    the first kernel's start to the last one's end, ``compute`` in which some non-collective kernel ran,
    ``collectives`` in which an NCCL kernel ran, ``both`` at once, and the ``gaps`` of at least ``gap_s`` with
    no compute kernel (``gap_count``, ``gap_longest``)."""
    kernels = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and e.get("cat") == "kernel"]
    if not kernels:
        return {}
    compute, collectives = [], []
    for event in kernels:
        interval = (event["ts"] / 1e6, (event["ts"] + event["dur"]) / 1e6)
        (collectives if event["name"].lower().startswith("nccl") else compute).append(interval)
    compute_busy, collective_busy = merged(compute), merged(collectives)
    span = max(end for _, end in compute_busy + collective_busy) - min(start for start, _ in compute_busy
                                                                      + collective_busy)
    gaps = [b[0] - a[1] for a, b in zip(compute_busy, compute_busy[1:]) if b[0] - a[1] >= gap_s]
    return {"span": span, "compute": sum(e - s for s, e in compute_busy),
            "collectives": sum(e - s for s, e in collective_busy), "both": overlap(compute_busy, collective_busy),
            "gaps": sum(gaps), "gap_count": float(len(gaps)), "gap_longest": max(gaps, default=0.0)}


def timeline_line(times: dict[str, float]) -> str:
    span = times["span"]
    return (f"kernels over {span:.2f} s: compute {times['compute']:.2f} s ({times['compute'] / span:.0%}), "
            f"collectives {times['collectives']:.2f} s, both at once {times['both']:.2f} s; no compute kernel "
            f"for {span - times['compute']:.2f} s, {times['gap_count']:.0f} gaps of 1 ms or more "
            f"({times['gaps']:.2f} s, the longest {1000 * times['gap_longest']:.1f} ms)")


def read_trace(path: Path) -> dict[str, Any]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as file:
        trace: dict[str, Any] = json.load(file)
    return trace


def profile_update(trainer: Trainer, args: argparse.Namespace) -> None:
    """``args.steps`` steps, then the next step's update under the profiler; rank 0 prints."""
    def say(text: str) -> None:
        if ranks.is_main():
            print(text, flush=True)

    device = trainer.device
    for step in range(args.steps):
        metrics = trainer.step(step).metrics
        say(f"step {step}: " + ", ".join(f"{p.split('/')[1]} {metrics[p]:.2f}" for p in PHASES if p in metrics))
    if not args.profile:
        return
    rollout, keep = trainer.roll_out(args.steps)
    if not keep:  # the same on every process: the groups kept are chosen over the whole batch
        say("the profiled step kept no episodes: nothing to update")
        return
    from torch.profiler import ProfilerActivity, profile

    on_gpu = device.type == "cuda"
    activities = ([] if args.device_only and on_gpu else [ProfilerActivity.CPU]) + \
        ([ProfilerActivity.CUDA] if on_gpu else [])
    synchronize(device)
    start = time.perf_counter()
    with profile(activities=activities) as profiler:
        metrics = trainer.update(args.steps, rollout, keep).metrics
        synchronize(device)
    wall = time.perf_counter() - start
    say(f"profiled update (step {args.steps}): {wall:.2f} s wall under the profiler; "
        + ", ".join(f"{p.split('/')[1]} {metrics[p]:.2f}" for p in PHASES if p in metrics)
        + f"; {metrics.get('batch/samples', 0):.0f} samples, {metrics.get('batch/trained_tokens', 0):.0f} "
        f"trained tokens, mean length {metrics.get('batch/sequence_length_mean', 0):.0f}"
        + (f"; process 0 of {ranks.world_size()}" if ranks.world_size() > 1 else ""))
    events = profiler.key_averages()
    if device.type == "cuda":
        busy = sum(e.self_device_time_total for e in events) / 1e6
        kernels = sum(e.count for e in events if e.self_device_time_total > 0 and e.device_type.name == "CUDA")
        say(f"device busy {busy:.2f} s of {wall:.2f} s ({kernels} kernels)")
        say(events.table(sort_by="self_cuda_time_total", row_limit=args.top, max_name_column_width=70))
    if ProfilerActivity.CPU in activities:
        say(events.table(sort_by="self_cpu_time_total", row_limit=args.top, max_name_column_width=70))
    if not ranks.is_main() or not (on_gpu or args.trace is not None):
        return
    with tempfile.TemporaryDirectory() as folder:
        trace = args.trace if args.trace is not None else Path(folder) / "trace.json"
        profiler.export_chrome_trace(str(trace))
        times = kernel_timeline(read_trace(trace))
    if times:
        say(timeline_line(times))
    if args.trace is not None:
        say(f"trace: {args.trace}")


if __name__ == "__main__":
    main()

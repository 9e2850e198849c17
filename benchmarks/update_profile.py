"""Where a training step's time goes: its phases, then the update (scores and PPO epochs) under torch.profiler.

Builds the trainer of ``--config`` and its overrides (as ``turnrl train`` does), runs ``--steps`` steps
(the first ones warm up: compilation, graph capture, allocator), printing each step's phase timings, then
rolls out once more and profiles the update of that rollout: the operators by device time and by host time,
and the wall time against the device's busy time (a host-bound update shows a large gap).

Under ``torchrun`` it profiles the FSDP trainer's sharded update, every process under its profiler (the
collectives included), and rank 0 prints its own tables.

    python benchmarks/update_profile.py --config configs/ragen_sokoban.yaml model.builtin_preset=0.5b \\
        validation.every=0 run.name=profile
    torchrun --nproc-per-node 4 benchmarks/update_profile.py --config configs/ragen_sokoban.yaml \\
        model.builtin_preset=7b model.engine.free_during_update=true model.engine.kv_cache_gb=12
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from turnrl.config import load_config  # noqa: E402
from turnrl.models.loading import base_model_path  # noqa: E402
from turnrl.training import ranks  # noqa: E402
from turnrl.training.config import TrainConfig  # noqa: E402
from turnrl.training.distributed import FSDPTrainer  # noqa: E402
from turnrl.training.trainer import Trainer  # noqa: E402

PHASES = ("timing/rollout_s", "timing/old_logprobs_s", "timing/values_s", "timing/update_s", "timing/step_s",
          "throughput/update_mfu")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=None)
    parser.add_argument("--steps", type=int, default=3, help="steps before the profiled one")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--no-profile", dest="profile", action="store_false",
                        help="only the steps' phase timings")
    parser.add_argument("--trace", type=Path, default=None,
                        help="write rank 0's profile as a Chrome trace (gzipped when the name ends in .gz)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_intermixed_args()
    sharded = ranks.launched_by_torchrun()
    with tempfile.TemporaryDirectory() as runs:
        # No validation during the steps (a recipe's stop on low validation success is switched off with it).
        config = load_config(TrainConfig, args.config, [f"run.output_dir={runs}", "validation.every=0",
                                                         "collapse.stop_on_low_success=false", *args.overrides])
        if sharded:
            ranks.init_process_group(config.model.device, config.distributed.timeout_s)
            if ranks.is_main():  # builds the built-in model once, as `turnrl train` does
                base_model_path(config.model)
            ranks.wait_for_main()
        try:
            profile_update(FSDPTrainer(config) if sharded else Trainer(config), args)
        finally:
            if sharded:
                ranks.close_process_group()


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

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
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
    say(events.table(sort_by="self_cpu_time_total", row_limit=args.top, max_name_column_width=70))
    if args.trace is not None and ranks.is_main():
        profiler.export_chrome_trace(str(args.trace))
        say(f"trace: {args.trace}")


if __name__ == "__main__":
    main()

"""Step time and tokens/s of the same training run on 1, 2, ... processes (FSDP2, one GPU each).

Each row is ``turnrl train`` with ``distributed.nproc_per_node=N`` on the same config, seed and steps; the
first step (warm-up: CUDA graphs, allocator) is left out of the means. Printed per row: step time, its
rollout and update phases, generated tokens/s (all processes together) and trained tokens/s, and the
speed-up of the step over one process, measured in the same run of this script.

    python benchmarks/distributed.py --processes 1 2 --config configs/ragen_sokoban.yaml \\
        model.builtin_preset=0.5b run.steps=4                               # GPUs
    python benchmarks/distributed.py --quick                                 # CPU, the tiny model, gloo
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

QUICK = ["model.builtin_preset=tiny", "model.device=cpu", "model.dtype=float32", "env.id=FrozenLake",
         "agent.max_turns=2", "sampling.max_new_tokens=8", "groups.n_groups=4", "groups.group_size=2",
         "run.steps=3", "run.threads=1"]
COMMON = ["run.tensorboard=false", "run.trajectories_every=0", "validation.episodes=8", "validation.every=0",
          "run.overwrite=true", "sft.enabled=false"]


def run(processes: int, config: str | None, overrides: list[str], out: Path) -> dict[str, float]:
    name = f"p{processes}"
    command = [sys.executable, "-m", "turnrl.cli", "train", *(["--config", config] if config else []),
               *COMMON, *overrides, f"run.output_dir={out}", f"run.name={name}",
               f"distributed.nproc_per_node={processes}"]
    start = time.time()
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env={**os.environ})
    if result.returncode != 0:
        raise RuntimeError(f"{processes} processes failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    lines = (out / name / "metrics.jsonl").read_text().splitlines()
    steps = [r for r in map(json.loads, lines) if "timing/step_s" in r][1:]  # the first step warms up
    if not steps:
        raise RuntimeError("run.steps must be at least 2 (the first step is a warm-up)")
    mean = lambda key: statistics.mean(r.get(key, 0.0) for r in steps)  # noqa: E731
    generated = sum(r["rollout/response_tokens_mean"] * r["rollout/turns_mean"] * r["rollout/episodes"]
                    for r in steps)
    trained = sum(r.get("batch/trained_tokens", 0.0) for r in steps)
    total_step_s = sum(r["timing/step_s"] for r in steps)
    return {
        "step_s": mean("timing/step_s"), "rollout_s": mean("timing/rollout_s"), "update_s": mean("timing/update_s"),
        "generated_per_s": generated / total_step_s, "trained_per_s": trained / total_step_s,
        "peak_gib": mean("memory/peak_allocated_gib"), "wall_s": time.time() - start,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--config", default=None)
    parser.add_argument("--quick", action="store_true", help="the tiny model on CPU processes (gloo)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    overrides = (QUICK if args.quick else []) + args.overrides
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for processes in args.processes:
            rows[processes] = run(processes, args.config, overrides, Path(tmp))
            print(f"{processes} processes: {json.dumps({k: round(v, 3) for k, v in rows[processes].items()})}",
                  flush=True)
    base = rows[args.processes[0]]["step_s"]
    print("\n| processes | step | rollout | update | generated tokens/s | trained tokens/s | peak GiB | speed-up |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for processes, row in rows.items():
        print(f"| {processes} | {row['step_s']:.2f} s | {row['rollout_s']:.2f} s | {row['update_s']:.2f} s | "
              f"{row['generated_per_s']:,.0f} | {row['trained_per_s']:,.0f} | {row['peak_gib']:.1f} | "
              f"{base / row['step_s']:.2f}x |")


if __name__ == "__main__":
    main()

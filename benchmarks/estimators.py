"""Advantage estimators at equal budget, from one SFT start: the results table of docs/results.md.

Every row trains the same SFT model with the same recipe, steps, groups and
seeds and changes only the estimator (and what it needs: a critic, a filter,
turn rewards). Rows:

- ``PPO+GAE``: RAGEN's StarPO, a critic and GAE, no filter.
- ``StarPO-S``: the same with the StarPO-S filter (the half of the groups whose rewards vary most).
- ``StarPO-S 25%``: RAGEN's StarPO-S setting, the quarter of the groups whose rewards vary most.
- ``GRPO``: group-normalized episode rewards, no critic.
- ``GRPO+StarPO-S 25%``: GRPO on the quarter of the groups whose rewards vary most (RAGEN's filter without
  a critic: whether the filter, not the critic, keeps a run out of the Echo Trap).
- ``GiGPO``: GRPO's episode advantage plus step advantages among turns that start from the same state.
- ``bi-level GAE``: VAGEN's turn-level credit: per-turn rewards, a critic, bi-level GAE (gamma_turn 0.95).

The SFT start is made once (``--sft-model`` reuses one), then each row runs
``turnrl train`` as a subprocess with ``model.path`` set to it and SFT off. A
markdown table with validation success before and after RL (mean and spread
over seeds) and wall time is printed and written to ``--out``/table.md;
``--curves PATH`` also draws every row's runs with the collapse metrics
(success, in-group reward std, entropy, gradient norm, validation success;
``benchmarks/learning_curves.py``) into PATH.

    python benchmarks/estimators.py --seeds 0 1 2                         # the quickstart recipe (CPU)
    python benchmarks/estimators.py --config configs/ragen_sokoban.yaml model.builtin_preset=0.5b --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import json
import math
import os
import queue
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.learning_curves import draw, read_rows  # noqa: E402
from turnrl.viz.plots import COLLAPSE_METRICS  # noqa: E402

ROWS: dict[str, list[str]] = {
    "PPO+GAE": ["algorithm.advantage=gae", "algorithm.filter.method=none"],
    "StarPO-S": ["algorithm.advantage=gae", "algorithm.filter.method=top_k", "algorithm.filter.value=0.5"],
    "StarPO-S 25%": ["algorithm.advantage=gae", "algorithm.filter.method=top_k", "algorithm.filter.value=0.25"],
    "GRPO": ["algorithm.advantage=grpo", "algorithm.filter.method=none"],
    "GRPO+StarPO-S 25%": ["algorithm.advantage=grpo", "algorithm.filter.method=top_k", "algorithm.filter.value=0.25"],
    # Divided by the group std, as when the documented rows ran (the estimator's default is verl-agent's mean_norm).
    "GiGPO": ["algorithm.advantage=gigpo", "algorithm.estimator_params.gigpo.norm_by_std=true",
              "algorithm.filter.method=none"],
    "bi-level GAE": ["algorithm.advantage=bilevel_gae", "algorithm.reward_placement=per_turn",
                     "algorithm.gamma_turn=0.95", "algorithm.filter.method=none"],
}


def turnrl(*args: str) -> list[str]:
    return [sys.executable, "-m", "turnrl.cli", *args]


Job = TypeVar("Job")
Result = TypeVar("Result")


def card_env(gpu: str | None) -> dict[str, str]:
    """The environment of a run on ``gpu`` (all visible GPUs when None)."""
    return {**os.environ, "CUDA_VISIBLE_DEVICES": gpu} if gpu is not None else dict(os.environ)


def runs_per_card(parallel: int, gpus: Sequence[str]) -> int:
    """How many of ``parallel`` runs at once share one of ``gpus`` (all on one card when none are named)."""
    return math.ceil(parallel / len(gpus)) if gpus else parallel


def spread_over_cards(jobs: Sequence[Job], parallel: int, gpus: Sequence[str],
                      run: Callable[[Job, dict[str, str]], Result]) -> list[Result]:
    """``run(job, env)`` for every job, ``parallel`` at a time, results in the jobs' order.

    With ``gpus`` each job holds a slot of one card while it runs (``CUDA_VISIBLE_DEVICES`` in ``env``):
    a card has :func:`runs_per_card` slots, so it never plays more runs at once than its memory share
    (:func:`sharing_the_card`) was made for, whichever runs finish first.
    """
    slots: queue.Queue[str | None] = queue.Queue()
    for _ in range(runs_per_card(parallel, gpus)):
        for gpu in gpus or [None]:
            slots.put(gpu)

    def one(job: Job) -> Result:
        gpu = slots.get()
        try:
            return run(job, card_env(gpu))
        finally:
            slots.put(gpu)

    with ThreadPoolExecutor(max_workers=parallel) as pool:
        return list(pool.map(one, jobs))


def make_sft_start(config: str, overrides: list[str], out: Path, env: dict[str, str] | None = None) -> Path:
    """Run the recipe's SFT stage alone (zero RL steps) and return the SFT model's directory."""
    subprocess.run(turnrl("train", "--config", config, *overrides, "run.steps=0", f"run.output_dir={out}",
                          "run.name=sft_start", "run.tensorboard=false"), check=True, env=env)
    return out / "sft_start" / "sft" / "model"


def sharing_the_card(parallel: int, overrides: list[str], gpus: Sequence[str] = ()) -> list[str]:
    """The overrides of runs played ``parallel`` at once (dealt to ``gpus``, or all on one card): each may use
    its share of a card's memory, 1 / :func:`runs_per_card` (``run.gpu_share``: a run that cannot fit its share
    stops at its start, alone), and its share of the host's cores (``run.threads``: with torch's default each
    run takes every core, and the image processor's small operations, waiting on threads that other runs hold,
    took 17x longer); the caller's own settings come later and win."""
    if parallel <= 1:
        return list(overrides)
    threads = [f"run.threads={max(1, (os.cpu_count() or 1) // parallel)}"]
    sharing = runs_per_card(parallel, gpus)
    return [*([f"run.gpu_share={1 / sharing:.4g}"] if sharing > 1 else []), *threads, *overrides]


def sft_start(args: argparse.Namespace, out: Path) -> Path:
    """``--sft-model``, or the recipe's SFT start made under ``out`` on the first of ``--gpus``."""
    if args.sft_model:
        return Path(args.sft_model)
    return make_sft_start(args.config, args.overrides, out, card_env(args.gpus[0] if args.gpus else None))


def train_from(config: str, overrides: list[str], name: str, seed: int, sft_model: Path, out: Path,
               env: dict[str, str] | None = None) -> tuple[dict, float]:
    """One RL run of the recipe from the SFT start, as a subprocess (in ``env``) logged to ``out/name.log``:
    its summary and wall seconds."""
    start = time.time()
    with open(out / f"{name}.log", "w") as log:
        subprocess.run(turnrl("train", "--config", config, *overrides, f"model.path={sft_model}",
                              "sft.enabled=false", f"seeds.seed={seed}", f"run.output_dir={out}", f"run.name={name}",
                              "run.tensorboard=false"),
                       check=True, stdout=log, stderr=subprocess.STDOUT, env=env)
    return json.loads((out / name / "summary.json").read_text()), time.time() - start


def run_name(row: str, seed: int) -> str:
    """The run's folder under ``--out``: ``StarPO-S_25pct_seed0``, ``PPO_GAE_seed1``, ..."""
    return f"{row.replace(' ', '_').replace('+', '_').replace('%', 'pct')}_seed{seed}"


def run_row(config: str, overrides: list[str], row: str, seed: int, sft_model: Path, out: Path,
            env: dict[str, str] | None = None) -> dict:
    name = run_name(row, seed)
    summary, seconds = train_from(config, [*overrides, *ROWS[row]], name, seed, sft_model, out, env)
    return {"row": row, "seed": seed, "before": summary["val_success_before_rl"],
            "after": summary["val_success_after_rl"], "seconds": seconds}


def spread(values: list[float]) -> str:
    mean = statistics.fmean(values)
    return f"{mean:.3f}" if len(values) < 2 else f"{mean:.3f} ± {statistics.stdev(values):.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/quickstart.yaml")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    parser.add_argument("--sft-model", default=None, help="an SFT model to start every row from")
    parser.add_argument("--parallel", type=int, default=1,
                        help="runs at once (on a GPU several small runs share the card, each capped to its share of "
                             "its memory, run.gpu_share; wall times then overlap)")
    parser.add_argument("--gpus", nargs="+", default=[],
                        help="GPU numbers to deal the runs to (CUDA_VISIBLE_DEVICES, --parallel spread evenly; "
                             "the SFT start on the first); default: every run sees all GPUs")
    parser.add_argument("--out", default="runs/estimators")
    parser.add_argument("--curves", type=Path, help="also draw the rows' runs with the collapse metrics into this PNG")
    parser.add_argument("overrides", nargs="*", help="key=value for every run (e.g. run.steps=40)")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sft_model = sft_start(args, out)
    jobs = [(row, seed) for seed in args.seeds for row in args.rows]
    overrides = sharing_the_card(args.parallel, args.overrides, args.gpus)
    results: list[dict] = []

    def run(job: tuple[str, int], env: dict[str, str]) -> dict:
        result = run_row(args.config, overrides, job[0], job[1], sft_model, out, env)
        results.append(result)
        (out / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in results))
        return result

    spread_over_cards(jobs, args.parallel, args.gpus, run)
    lines = ["| estimator | after SFT | after RL | gain (points), per seed | wall time a run |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for row in args.rows:
        mine = sorted((r for r in results if r["row"] == row), key=lambda r: r["seed"])
        gains = ", ".join(f"{100 * (r['after'] - r['before']):+.0f}" for r in mine)
        lines.append(f"| {row} | {spread([r['before'] for r in mine])} | {spread([r['after'] for r in mine])} | "
                     f"{gains} | {statistics.fmean(r['seconds'] for r in mine) / 60:.1f} min |")
    table = "\n".join(lines)
    (out / "table.md").write_text(table + "\n")
    print(table)
    if args.curves:
        runs = {row: [out / run_name(row, seed) for seed in args.seeds] for row in args.rows}
        draw(args.curves, read_rows(runs), COLLAPSE_METRICS, "Estimators at equal budget")


if __name__ == "__main__":
    main()

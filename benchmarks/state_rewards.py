"""Do state rewards help? VAGEN-Full against VAGEN-Base at equal budget: the table of docs/results.md.

Both rows train the same SFT model with the same recipe, steps, groups and
seeds; VAGEN-Base keeps the grounding and world-model rewards at weight 0, so
they are still measured (how well ``<observation>`` and ``<prediction>`` match
the truth) but never rewarded. The SFT start is made once (``--sft-model``
reuses one); each run is ``turnrl train`` as a subprocess, ``--parallel`` at a
time (on a GPU several small runs share the card).

Printed and written to ``--out``/table.md: validation success before and after
RL, and the match of observations and predictions at the first and last steps,
mean and spread over seeds; ``--out``/curves.json holds every step's values.
``--curves PATH`` also draws both rows' runs (training and validation success,
observation and prediction match; ``benchmarks/learning_curves.py``) into PATH.
With both rows, ``--out``/paired.md holds their step-by-step differences seed
by seed (``learning_curves.py --paired``): seed S of both rows samples alike
and plays the same levels, so a pair's difference is free of the levels'
difficulty; ``--paired-from`` is the step from which the rows are compared.

    python benchmarks/state_rewards.py --seeds 0 1 2                       # text FrozenLake, built-in model
    python benchmarks/state_rewards.py --config configs/vagen_full_sokoban.yaml --seeds 0 1 2 --parallel 6
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.estimators import (  # noqa: E402
    sft_start,
    sharing_the_card,
    spread,
    spread_over_cards,
    train_from,
)
from benchmarks.learning_curves import draw, paired_table, read_rows  # noqa: E402
from turnrl.viz.plots import STATE_REWARD_METRICS, series  # noqa: E402
from turnrl.viz.records import read_metrics  # noqa: E402

STATE_REWARDS = ("grounding", "worldmodel")
ROWS: dict[str, list[str]] = {
    "VAGEN-Full": [],
    "VAGEN-Base": ["rewards.extra=[" + ", ".join(
        f"{{name: {name}, fn: {name}, weight: 0.0}}" for name in STATE_REWARDS) + "]"],
}


def match_curve(run_dir: Path, name: str) -> list[float]:
    """Per step: the mean score of the judged turns (``rewards/<name>/match_mean``)."""
    return series(read_metrics(run_dir / "metrics.jsonl"), f"rewards/{name}/match_mean")[1]


def run_name(row: str, seed: int) -> str:
    """The run's folder under ``--out``: ``vagen_full_seed0``, ..."""
    return f"{row.replace('-', '_').lower()}_seed{seed}"


def run_row(config: str, overrides: list[str], row: str, seed: int, sft_model: Path, out: Path,
            env: dict[str, str] | None = None) -> dict:
    name = run_name(row, seed)
    summary, seconds = train_from(config, [*overrides, *ROWS[row]], name, seed, sft_model, out, env)
    curves = {field: match_curve(out / name, field) for field in STATE_REWARDS}
    return {"row": row, "seed": seed, "before": summary["val_success_before_rl"],
            "after": summary["val_success_after_rl"], "seconds": seconds, "curves": curves}


def table(results: list[dict]) -> str:
    lines = ["| row | seeds | success before RL | success after RL | observation match first -> last | "
             "prediction match first -> last | minutes a run |",
             "|---|---|---|---|---|---|---|"]
    for row in ROWS:
        runs = [r for r in results if r["row"] == row]
        if not runs:
            continue
        cells = []
        for field in STATE_REWARDS:
            first = [r["curves"][field][0] for r in runs if r["curves"][field]]
            last = [r["curves"][field][-1] for r in runs if r["curves"][field]]
            cells.append(f"{spread(first)} -> {spread(last)}" if first else "n/a")
        lines.append(f"| {row} | {', '.join(str(r['seed']) for r in runs)} | {spread([r['before'] for r in runs])} "
                     f"| {spread([r['after'] for r in runs])} | {cells[0]} | {cells[1]} "
                     f"| {statistics.fmean(r['seconds'] for r in runs) / 60:.1f} |")
    return "\n".join(lines)


def paired(out: Path, seeds: list[int], split: int) -> str:
    """VAGEN-Full minus VAGEN-Base, seed by seed, on the state-reward metrics (see ``learning_curves.py --paired``):
    the runs under ``out`` as :func:`run_name` names them."""
    rows = {row: [out / run_name(row, seed) for seed in seeds] for row in ROWS}
    first, second = rows.items()
    return paired_table(first, second, read_rows(rows), STATE_REWARD_METRICS, split)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/vagen_full_frozenlake.yaml")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    parser.add_argument("--sft-model", help="reuse this SFT start instead of making one")
    parser.add_argument("--parallel", type=int, default=1,
                        help="runs at once, each capped to its share of the GPU's memory (run.gpu_share)")
    parser.add_argument("--gpus", nargs="+", default=[],
                        help="GPU numbers to deal the runs to (--parallel spread evenly; the SFT start on the first)")
    parser.add_argument("--out", default="runs/state_rewards")
    parser.add_argument("--curves", type=Path, help="also draw the rows' runs with the state-reward metrics here")
    parser.add_argument("--paired-from", type=int, default=4,
                        help="the step from which the paired table compares the rows (default 4)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides of the recipe, for every run")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sft_model = sft_start(args, out)
    jobs = [(row, seed) for seed in args.seeds for row in args.rows]
    overrides = sharing_the_card(args.parallel, args.overrides, args.gpus)
    results = spread_over_cards(jobs, args.parallel, args.gpus,
                                lambda job, env: run_row(args.config, overrides, job[0], job[1], sft_model, out, env))
    for result in results:
        print(f"{result['row']} seed {result['seed']}: success {result['before']:.3f} -> {result['after']:.3f}, "
              f"{result['seconds'] / 60:.1f} min")
    text = table(results)
    print(text)
    (out / "table.md").write_text(text + "\n")
    (out / "curves.json").write_text(json.dumps(results, indent=1))
    if set(args.rows) == set(ROWS):
        text = paired(out, args.seeds, args.paired_from)
        print(text)
        (out / "paired.md").write_text(text + "\n")
    if args.curves:
        runs = {row: [out / run_name(row, seed) for seed in args.seeds] for row in args.rows}
        draw(args.curves, read_rows(runs), STATE_REWARD_METRICS, "State rewards at equal budget")


if __name__ == "__main__":
    main()

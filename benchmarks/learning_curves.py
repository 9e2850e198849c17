"""Learning curves of several rows over seeds in one figure: the comparison figures of docs/results.md.

Each ``ROW=RUN_DIR[,RUN_DIR...]`` argument is a row (a recipe, an estimator)
and its runs (seeds): run folders holding a ``metrics.jsonl``, or globs of
them (a glob keeps only the run folders it matches, not the runs' logs). Every
metric of the chosen set that a run has gets a panel; each run is a thin line
and the row's mean over its runs a bold one (``turnrl.viz.plots.draw_comparison``).
Sets: ``collapse`` (RAGEN's Echo Trap: training success, in-group reward std,
entropy, the actor's gradient norm, validation success), ``state_rewards``
(VAGEN: training and validation success, observation and prediction match) and
``sokoban`` (where failures come from: boxes on targets, deadlocks, moves into
walls, from the env's figures).

``--table`` prints a markdown table per row: each run's first and last value
of every metric, the mean of its first 5 and of its last 5 logged values
(fewer when it logged under 10, so the two never overlap).

    python benchmarks/learning_curves.py --metrics collapse --out docs/figures/estimators_collapse.png \\
        "GRPO=runs/estimators/GRPO_seed*" "StarPO-S=runs/estimators/StarPO-S_seed*"
    python benchmarks/learning_curves.py --out docs/figures/sokoban_gigpo70_4gpu.png \\
        --reference "val/success=a policy ignoring the grid:0.265" "GiGPO=runs/sokoban_g16_70_alone/GiGPO_seed*"
    python benchmarks/learning_curves.py --metrics state_rewards --table \\
        "VAGEN-Full=runs/state_rewards/vagen_full_seed*" "VAGEN-Base=runs/state_rewards/vagen_base_seed*"
"""

from __future__ import annotations

import argparse
import glob
import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from turnrl.viz.plots import METRIC_SETS, Comparison, Metric, draw_comparison, series  # noqa: E402
from turnrl.viz.records import read_metrics  # noqa: E402

METRICS_FILE = "metrics.jsonl"
WINDOW = 5


def row_argument(text: str) -> tuple[str, list[Path]]:
    """``ROW=RUN_DIR[,RUN_DIR...]`` as the row's label and its run folders, in order (a glob's sorted)."""
    label, _, spec = text.partition("=")
    if not label or not spec:
        raise argparse.ArgumentTypeError(f"{text!r}: write a row as LABEL=RUN_DIR[,RUN_DIR...]")
    dirs: list[Path] = []
    for part in spec.split(","):
        found = sorted(path for path in map(Path, glob.glob(part)) if (path / METRICS_FILE).is_file())
        if not found:
            raise argparse.ArgumentTypeError(
                f"{part}: no run folder with a {METRICS_FILE} (pass run folders, run.output_dir/run.name, or a glob)")
        dirs += found
    return label, dirs


def read_rows(rows: dict[str, list[Path]]) -> dict[str, list[list[dict[str, float]]]]:
    """Each run's ``metrics.jsonl`` records, row by row; unreadable lines are reported and left out."""
    def read(run: Path) -> list[dict[str, float]]:
        warnings: list[str] = []
        records = read_metrics(run / METRICS_FILE, warnings)
        for warning in warnings:
            print(f"warning: {run}/{warning}")
        return records

    return {label: [read(run) for run in runs] for label, runs in rows.items()}


def reference_argument(text: str) -> tuple[str, str, float]:
    """``METRIC=LABEL:VALUE`` (``val/success=a random policy:0.265``) as (metric, label, value)."""
    metric, _, rest = text.partition("=")
    label, _, value = rest.rpartition(":")
    try:
        return metric, label, float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: write a reference as METRIC=LABEL:VALUE") from None


def draw(path: Path, rows: dict[str, list[list[dict[str, float]]]], metrics: Sequence[Metric], title: str = "",
         references: Sequence[tuple[str, str, float]] = ()) -> Comparison | None:
    """Draw the rows' runs (their records, see :func:`read_rows`) into ``path``, with the ``references`` as
    dashed levels on their metrics' panels, and print what each panel shows, or that nothing was drawn."""
    levels: dict[str, list[tuple[str, float]]] = {}
    for metric, label, value in references:
        levels.setdefault(metric, []).append((label, value))
    comparison = draw_comparison(rows, metrics, path, title, levels)
    if comparison is None:
        print(f"nothing drawn: no run has any of {', '.join(metric.name for metric in metrics)}")
        return None
    print(f"wrote {path}")
    for panel in comparison.panels:
        counts = ", ".join(f"{row} {count} run(s)" for row, count in panel.runs.items())
        print(f"  {panel.title}: {counts}")
    return comparison


def first_last(values: list[float], window: int = WINDOW) -> tuple[float, float]:
    """The mean of the first and of the last ``window`` values (fewer when they would overlap; 1 at least)."""
    size = max(1, min(window, len(values) // 2))
    return sum(values[:size]) / size, sum(values[-size:]) / size


def table(runs: list[Path], records: list[list[dict[str, float]]], metrics: Sequence[Metric]) -> str:
    """A markdown table: a line per run, ``first -> last`` of each metric any of the runs has."""
    values = [[series(run, metric.name)[1] for metric in metrics] for run in records]
    shown = [i for i, metric in enumerate(metrics) if any(run[i] for run in values)]
    lines = ["| run | " + " | ".join(metrics[i].title for i in shown) + " |",
             "| --- |" + " ---: |" * len(shown)]
    for run, per_metric in zip(runs, values):
        cells = ["{:.3f} -> {:.3f}".format(*first_last(per_metric[i])) if per_metric[i] else "-" for i in shown]
        lines.append(f"| {run.name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--metrics", default="collapse", choices=list(METRIC_SETS), help="the panels")
    parser.add_argument("--out", type=Path, help="the PNG to write")
    parser.add_argument("--title", default="", help="a title over the panels")
    parser.add_argument("--table", action="store_true", help="print each row's first and last values")
    parser.add_argument("--reference", action="append", default=[], type=reference_argument,
                        metavar="METRIC=LABEL:VALUE", help="a dashed level on a metric's panel (repeatable)")
    parser.add_argument("rows", nargs="+", type=row_argument, metavar="ROW=RUN_DIR[,RUN_DIR...]")
    args = parser.parse_args()
    if args.out is None and not args.table:
        parser.error("nothing to do: pass --out PATH.png, --table or both")
    rows = dict(args.rows)
    if len(rows) < len(args.rows):
        parser.error("a row label is given twice: give each row once, with all its runs")
    metrics = METRIC_SETS[args.metrics]
    records = read_rows(rows)
    if args.table:
        for label, runs in rows.items():
            print(f"\n**{label}** (first -> last: mean of the first and last {WINDOW} logged values)\n")
            print(table(runs, records[label], metrics))
    if args.out is not None and draw(args.out, records, metrics, args.title, args.reference) is None:
        sys.exit(1)


if __name__ == "__main__":
    main()

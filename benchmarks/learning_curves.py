"""Learning curves of several rows over seeds in one figure: the comparison figures of docs/results.md.

Each ``ROW=RUN_DIR[,RUN_DIR...]`` argument is a row (a recipe, an estimator)
and its runs (seeds): run folders holding a ``metrics.jsonl``, or globs of
them (a glob keeps only the run folders it matches, not the runs' logs). Every
metric of the chosen set that a run has gets a panel; each run is a thin line
and the row's mean over its runs a bold one (``turnrl.viz.plots.draw_comparison``).
Sets: ``collapse`` (RAGEN's Echo Trap: training success, in-group reward std,
entropy, the actor's gradient norm, validation success), ``state_rewards``
(VAGEN: training and validation success, observation and prediction match),
``sokoban`` (where failures come from: boxes on targets, deadlocks, moves into
walls, from the env's figures) and ``plateau`` (why a run that holds stops
rising: groups whose episodes all score alike, entropy, KL to the reference,
turns an episode) and ``format`` (how a format breaks: turns in the format,
responses cut at the token cap, their length, KL to the reference, the clipped
share of tokens, the gradient norm).

``--table`` prints a markdown table per row: each run's first and last value
of every metric, the mean of its first 5 and of its last 5 logged values
(fewer when it logged under 10, so the two never overlap).

``--gains`` prints what the results' learning tables report, a line per run
and the row's mean: validation success after SFT (step 0), the best and the
last validation with their steps, the mean of the last three and the gains
over the start at the best and over the last three. One validation of 128
levels has a standard error of about 4 points and the best of many is
biased upward, so the last three are the gain to quote.

``--paired FROM_STEP`` compares two rows whose runs pair up (the same seeds,
given in the same order: seed S of both rows samples alike and plays the same
levels each step), step by step: for each pair and metric, the mean of the
first row's value minus the second's over the steps both logged before
``FROM_STEP`` and from it on, and at how many of the later steps the first
row is ahead. The levels' difficulty, which moves both rows together, drops
out of a paired difference, so it finds an effect too small to see in the
rows' means. Steps of one run follow each other, so they are not independent
draws: count the pairs (seeds), not the steps, as the evidence. The pairs' mean
comes with its 95% t-interval over the pairs (one mean difference a pair), what
the seeds allow one to say: with three pairs it is wide.

    python benchmarks/learning_curves.py --metrics collapse --out docs/figures/estimators_collapse.png \\
        "GRPO=runs/estimators/GRPO_seed*" "StarPO-S=runs/estimators/StarPO-S_seed*"
    python benchmarks/learning_curves.py --out docs/figures/sokoban_gigpo70_4gpu.png \\
        --reference "val/success=a policy ignoring the grid:0.265" "GiGPO=runs/sokoban_g16_70_alone/GiGPO_seed*"
    python benchmarks/learning_curves.py --gains "lr 1e-5=runs/lr1e-5_s*" "lr 1e-4=runs/lr1e-4_s*"
    python benchmarks/learning_curves.py --metrics state_rewards --table \\
        "VAGEN-Full=runs/state_rewards/vagen_full_seed*" "VAGEN-Base=runs/state_rewards/vagen_base_seed*"
    python benchmarks/learning_curves.py --metrics state_rewards --paired 4 \\
        "VAGEN-Full=runs/state_rewards/vagen_full_seed*" "VAGEN-Base=runs/state_rewards/vagen_base_seed*"
"""

from __future__ import annotations

import argparse
import glob
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from math import sqrt
from statistics import fmean, stdev

from scipy import stats

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from turnrl.viz.plots import METRIC_SETS, Comparison, Metric, draw_comparison, series  # noqa: E402
from turnrl.viz.records import read_metrics  # noqa: E402

METRICS_FILE = "metrics.jsonl"
WINDOW = 5
LAST = 3
"""Validations averaged for the gain to quote."""


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


@dataclass(frozen=True)
class Gains:
    """A run's validation curve summed up as the learning tables report it (values in [0, 1])."""

    start: float
    best: float
    best_step: int
    last: float
    last_step: int
    last_mean: float
    """The mean of the last :data:`LAST` validations (all of them when fewer)."""

    @property
    def gain_at_best(self) -> float:
        return self.best - self.start

    @property
    def gain_over_last(self) -> float:
        return self.last_mean - self.start


def gains(records: list[dict[str, float]], metric: str = "val/success", last: int = LAST) -> Gains | None:
    """``metric``'s start (its first logged step), best and last (the earliest step of an equal best), and the
    mean of its last ``last`` values, one value a step (:func:`series`: a step logged twice counts once);
    None for a run that logged it under twice."""
    steps, values = series(records, metric)
    if len(values) < 2:
        return None
    best = max(range(len(values)), key=lambda i: (values[i], -steps[i]))
    tail = values[-last:]
    return Gains(values[0], values[best], steps[best], values[-1], steps[-1], fmean(tail))


def gains_table(runs: list[Path], records: list[list[dict[str, float]]], metric: str = "val/success") -> str:
    """A markdown table of :func:`gains`, a line per run and the mean over the runs that have two values; gains in
    points to a tenth (near a bar such as +30, +29.7 and +30.2 are different answers)."""
    header = ["| run | after SFT | best (step) | last (step) | last three | gain at best | gain over the last three |",
              "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    found = [(run.name, gains(run_records, metric)) for run, run_records in zip(runs, records)]
    lines = [f"| {name} | - | - | - | - | - | - |" if g is None else
             f"| {name} | {g.start:.3f} | {g.best:.3f} ({g.best_step}) | {g.last:.3f} ({g.last_step}) | "
             f"{g.last_mean:.3f} | {100 * g.gain_at_best:+.1f} | {100 * g.gain_over_last:+.1f} |"
             for name, g in found]
    complete = [g for _, g in found if g is not None]
    if complete:
        start, top, tail = (fmean(getattr(g, key) for g in complete) for key in ("start", "best", "last_mean"))
        lines.append(f"| mean of {len(complete)} | {start:.3f} | {top:.3f} | | {tail:.3f} | "
                     f"{100 * (top - start):+.1f} | {100 * (tail - start):+.1f} |")
    return "\n".join(header + lines)


@dataclass(frozen=True)
class PairedDifference:
    """One pair of runs' step-by-step difference in a metric (the first run's value minus the second's)."""

    before: float | None
    """The mean difference over the steps both runs logged before the split; None when there are none."""
    after: float | None
    """The same from the split on."""
    steps_after: int
    ahead_after: int
    """Steps from the split on where the first run's value is the larger."""


def paired_difference(first: list[dict[str, float]], second: list[dict[str, float]], metric: str,
                      split: int) -> PairedDifference:
    """``metric`` of two runs' records (:func:`series`), differenced at the steps both logged and averaged before
    and from step ``split`` on."""
    first_steps, first_values = series(first, metric)
    second_by_step = dict(zip(*series(second, metric)))
    shared = [(step, value - second_by_step[step]) for step, value in zip(first_steps, first_values)
              if step in second_by_step]
    before = [difference for step, difference in shared if step < split]
    after = [difference for step, difference in shared if step >= split]
    return PairedDifference(fmean(before) if before else None, fmean(after) if after else None, len(after),
                            sum(difference > 0 for difference in after))


def pairs_interval(values: Sequence[float], level: float = 0.95) -> tuple[float, float] | None:
    """The ``level`` two-sided t-interval of the mean of ``values``, one value a pair of runs (the pairs are the
    independent draws; a run's steps are not); None for fewer than two values."""
    if len(values) < 2:
        return None
    mean = fmean(values)
    half = float(stats.t.ppf((1 + level) / 2, len(values) - 1)) * stdev(values) / sqrt(len(values))
    return mean - half, mean + half


def seed_of(run: Path) -> int | None:
    """The seed a run folder's name ends in (``vagen_full_seed2``: 2), or None."""
    found = re.search(r"seed(\d+)$", run.name)
    return int(found.group(1)) if found else None


def unpaired(first: list[Path], second: list[Path]) -> str | None:
    """Why two rows' runs do not pair in the order given, or None: the counts differ, or two folders paired
    end in different seeds (``..._seed2`` against ``..._seed3``)."""
    if len(first) != len(second):
        return f"as many runs in each row, seed by seed in the same order ({len(first)} against {len(second)})"
    for a, b in zip(first, second):
        seed_a, seed_b = seed_of(a), seed_of(b)
        if seed_a is not None and seed_b is not None and seed_a != seed_b:
            return f"pairs of one seed: {a.name} is paired with {b.name}; give both rows the same seeds"
    return None


def paired_table(first: tuple[str, list[Path]], second: tuple[str, list[Path]],
                 records: dict[str, list[list[dict[str, float]]]], metrics: Sequence[Metric], split: int) -> str:
    """A markdown table of :func:`paired_difference`: a line per pair of runs (in the order given), a column per
    metric both rows have: ``before -> after (ahead/steps)``, differences in the metric's units; and the mean over
    the pairs, with its 95% t-interval over them (:func:`pairs_interval`) and how many pairs moved the first row
    ahead."""
    (first_label, first_runs), (second_label, second_runs) = first, second
    problem = unpaired(first_runs, second_runs)
    if problem is not None:
        raise ValueError(f"--paired needs {problem} ({first_label}, {second_label})")
    pairs = list(zip(records[first_label], records[second_label]))
    shown = [metric for metric in metrics
             if any(series(a, metric.name)[0] and series(b, metric.name)[0] for a, b in pairs)]

    def signed(value: float | None) -> str:
        return "-" if value is None else f"{value:+.3f}"

    lines = [f"| {first_label} minus {second_label} | " + " | ".join(metric.title for metric in shown) + " |",
             "| --- |" + " ---: |" * len(shown)]
    found = [[paired_difference(a, b, metric.name, split) for metric in shown] for a, b in pairs]
    for a, b, differences in zip(first_runs, second_runs, found):
        cells = [f"{signed(d.before)} -> {signed(d.after)} ({d.ahead_after}/{d.steps_after})" for d in differences]
        lines.append(f"| {a.name} - {b.name} | " + " | ".join(cells) + " |")
    cells = []
    for column in zip(*found):
        befores = [d.before for d in column if d.before is not None]
        afters = [d.after for d in column if d.after is not None]
        interval = pairs_interval(afters)
        spread = "" if interval is None else f" [{interval[0]:+.3f}, {interval[1]:+.3f}]"
        cells.append(f"{signed(fmean(befores) if befores else None)} -> {signed(fmean(afters) if afters else None)}"
                     f"{spread} ({sum(a > 0 for a in afters)}/{len(afters)} pairs ahead)")
    lines.append(f"| mean of {len(pairs)} pairs | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--metrics", default="collapse", choices=list(METRIC_SETS), help="the panels")
    parser.add_argument("--out", type=Path, help="the PNG to write")
    parser.add_argument("--title", default="", help="a title over the panels")
    parser.add_argument("--table", action="store_true", help="print each row's first and last values")
    parser.add_argument("--gains", action="store_true",
                        help="print each run's validation success: after SFT, best, last, the last three's mean")
    parser.add_argument("--paired", type=int, metavar="FROM_STEP",
                        help="print two rows' paired step-by-step differences before and from FROM_STEP on")
    parser.add_argument("--reference", action="append", default=[], type=reference_argument,
                        metavar="METRIC=LABEL:VALUE", help="a dashed level on a metric's panel (repeatable)")
    parser.add_argument("rows", nargs="+", type=row_argument, metavar="ROW=RUN_DIR[,RUN_DIR...]")
    args = parser.parse_args()
    if args.out is None and not args.table and not args.gains and args.paired is None:
        parser.error("nothing to do: pass --out PATH.png, --table, --gains, --paired FROM_STEP or several")
    if args.paired is not None and len(args.rows) != 2:
        parser.error(f"--paired compares two rows; {len(args.rows)} were given")
    if args.paired is not None and (problem := unpaired(args.rows[0][1], args.rows[1][1])) is not None:
        parser.error(f"--paired needs {problem}")
    rows = dict(args.rows)
    if len(rows) < len(args.rows):
        parser.error("a row label is given twice: give each row once, with all its runs")
    metrics = METRIC_SETS[args.metrics]
    records = read_rows(rows)
    if args.table:
        for label, runs in rows.items():
            print(f"\n**{label}** (first -> last: mean of the first and last {WINDOW} logged values)\n")
            print(table(runs, records[label], metrics))
    if args.gains:
        for label, runs in rows.items():
            print(f"\n**{label}** (validation success; the last three's mean is the gain to quote)\n")
            print(gains_table(runs, records[label]))
    if args.paired is not None:
        print(f"\n**{args.rows[0][0]} minus {args.rows[1][0]}, pair by pair** (the mean difference over the "
              f"steps before {args.paired} -> from {args.paired} on, and at how many of those the first is ahead)\n")
        print(paired_table(args.rows[0], args.rows[1], records, metrics, args.paired))
    if args.out is not None and draw(args.out, records, metrics, args.title, args.reference) is None:
        sys.exit(1)


if __name__ == "__main__":
    main()

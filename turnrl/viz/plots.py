"""Training curves as PNG files: success, reward, KL, entropy, response length, in-group reward std,
step time, the collapse diagnostics when the run measured them (and the SFT loss when the run had an SFT
stage); and comparison figures of several rows (recipes, estimators) over seeds, one panel per metric.

Drawn with matplotlib's object API (``Figure``), which needs no display and
no global state, from the records of ``metrics.jsonl``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

# matplotlib is imported by the functions that draw: every training process imports this module (through the run's
# report), and most never draw (the processes of a distributed run other than the first, a run stopped early), where
# matplotlib's import took 0.3 s of a core each.


@dataclass(frozen=True)
class Curve:
    """One plot: several metrics over training steps."""

    name: str
    """File name (without ``.png``)."""
    title: str
    series: tuple[tuple[str, str], ...]
    """``(metric, legend label)`` pairs, drawn in order."""
    ylabel: str = ""
    dashed: tuple[str, ...] = ()
    """Metrics drawn dashed in the colour of the series before them (a baseline such as chance)."""


CURVES = (
    Curve("success", "Success rate", (("rollout/success", "training rollouts"), ("val/success", "validation")),
          "share of episodes"),
    Curve("reward", "Episode reward", (("rollout/reward_mean", "training rollouts"), ("val/reward_mean", "validation")),
          "mean total reward"),
    Curve("kl", "KL divergence", (("actor/kl_ref", "to the reference"), ("actor/approx_kl", "old to new policy")),
          "per token"),
    Curve("entropy", "Policy entropy", (("actor/entropy", "sampled tokens"),), "nats per token"),
    Curve("response_length", "Response length",
          (("rollout/response_tokens_mean", "training rollouts"), ("val/response_tokens_mean", "validation")),
          "tokens per turn"),
    Curve("reward_std", "In-group reward std",
          (("rollout/in_group_reward_std", "mean over groups"),
           ("collapse/reward_spread_threshold", "early-stop threshold")), "std of episode rewards"),
    # RAGEN's collapse diagnostics (collapse.every): drawn when the run measured them.
    Curve("collapse_mi", "Mutual information of reasoning and prompt",
          (("collapse/first_turn/mi", "first turns"), ("collapse/multi_turn/mi", "all turns")), "nats per token"),
    Curve("collapse_mi_seq", "Mutual information per reasoning",
          (("collapse/first_turn/mi_seq", "first turns"), ("collapse/multi_turn/mi_seq", "all turns")),
          "nats per sequence"),
    Curve("collapse_entropy", "Conditional entropy of reasoning H(Z|X)",
          (("collapse/first_turn/conditional_entropy", "first turns"),
           ("collapse/multi_turn/conditional_entropy", "all turns")), "nats per token"),
    Curve("collapse_retrieval", "Prompt retrieval from reasoning",
          (("collapse/first_turn/retrieval_acc", "first turns"),
           ("collapse/first_turn/retrieval_chance", "first turns: chance"),
           ("collapse/multi_turn/retrieval_acc", "all turns"),
           ("collapse/multi_turn/retrieval_chance", "all turns: chance")),
          "top-1 accuracy", dashed=("collapse/first_turn/retrieval_chance", "collapse/multi_turn/retrieval_chance")),
    Curve("step_time", "Step time",
          (("timing/step_s", "whole step"), ("timing/rollout_s", "rollout"), ("timing/update_s", "update"),
           ("timing/collapse_s", "collapse diagnostics")),
          "seconds"),
)
SFT_CURVE = Curve("sft_loss", "SFT loss", (("sft/loss", "training loss"),), "cross-entropy per token")


@dataclass(frozen=True)
class Plot:
    """A PNG written for one curve."""

    curve: Curve
    path: Path
    points: int
    """Points drawn over all its series (finite values)."""
    gaps: int = 0
    """Steps whose value was not finite (NaN, or null in ``metrics.jsonl``), over all its series: gaps in the
    lines, counted in the legend."""


def series(records: list[dict[str, float]], metric: str) -> tuple[list[int], list[float]]:
    """``(steps, values)`` of ``metric``, sorted by step; a step logged twice (a resumed run) keeps its last value."""
    by_step: dict[int, float] = {}
    for record in records:
        if metric in record and "step" in record:
            by_step[int(record["step"])] = record[metric]
    steps = sorted(by_step)
    return steps, [by_step[s] for s in steps]


def draw_curve(curve: Curve, records: list[dict[str, float]], path: Path) -> Plot | None:
    """Write ``curve`` as a PNG at ``path``; None (and no file) when the records hold none of its metrics."""
    drawn = [(metric, label, *series(records, metric)) for metric, label in curve.series]
    drawn = [(metric, label, steps, values) for metric, label, steps, values in drawn if steps]
    if not drawn:
        return None
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    figure = Figure(figsize=(5.0, 3.2), dpi=100, layout="constrained")
    axes = figure.subplots()
    lines: list = []
    points = gaps = 0
    for metric, label, steps, values in drawn:
        # Sparse series (validation at the start and the end) need markers to be seen at all.
        marker = "o" if len(steps) <= 12 else None
        style = {"linestyle": "--", "color": lines[-1].get_color()} if metric in curve.dashed and lines else {}
        missing = sum(not math.isfinite(value) for value in values)
        if missing:  # NaN breaks the line; the legend says how often, since a gap of one step is hard to see
            label = f"{label} (not finite at {missing} step{'s' if missing > 1 else ''})"
        lines += axes.plot(steps, values, label=label, marker=marker, markersize=4, linewidth=1.5, **style)
        points, gaps = points + len(values) - missing, gaps + missing
    axes.set_title(curve.title)
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    axes.set_xlabel("step")
    axes.set_ylabel(curve.ylabel)
    axes.grid(alpha=0.3)
    if len(drawn) > 1 or gaps:
        axes.legend(fontsize="small")
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    return Plot(curve, path, points, gaps)


def draw_training_curves(
    records: list[dict[str, float]], out_dir: Path, sft_records: list[dict[str, float]] | None = None
) -> list[Plot]:
    """Every curve of :data:`CURVES` the records have (and the SFT loss), as ``out_dir/<name>.png``."""
    plots = [draw_curve(curve, records, out_dir / f"{curve.name}.png") for curve in CURVES]
    if sft_records:
        plots.append(draw_curve(SFT_CURVE, sft_records, out_dir / f"{SFT_CURVE.name}.png"))
    return [plot for plot in plots if plot is not None]


# --------------------------------------------------------------------------- comparison of rows over seeds
@dataclass(frozen=True)
class Metric:
    """One panel of a comparison figure."""

    name: str
    """Key in ``metrics.jsonl``."""
    title: str


# RAGEN's Echo Trap: success rises, then the in-group reward spread and the entropy fall and the gradient
# norm spikes before success drops.
COLLAPSE_METRICS = (
    Metric("rollout/success", "Training success"),
    Metric("rollout/in_group_reward_std", "In-group reward std"),
    Metric("actor/entropy", "Policy entropy (nats per token)"),
    Metric("actor/grad_norm", "Actor gradient norm (before clipping)"),
    Metric("val/success", "Validation success"),
)
# VAGEN: do rewards for <observation> and <prediction> make the model describe and predict states better?
STATE_REWARD_METRICS = (
    Metric("rollout/success", "Training success"),
    Metric("val/success", "Validation success"),
    Metric("rewards/grounding/match_mean", "Observation match"),
    Metric("rewards/worldmodel/match_mean", "Prediction match"),
)
# Where a Sokoban run's failures come from: boxes left off target, boxes pushed where no target can be reached,
# moves into walls (from the env's own figures, logged as env_<name>).
SOKOBAN_METRICS = (
    Metric("rollout/success", "Training success"),
    Metric("rollout/env_boxes_on_target", "Boxes on targets at the end"),
    Metric("rollout/env_deadlocked", "Episodes ended with a box on a dead cell"),
    Metric("rollout/action_effective", "Moves that changed the state"),
    Metric("val/success", "Validation success"),
    Metric("val/env_deadlocked", "Validation: ended deadlocked"),
)
# Why a run that holds stops rising: groups whose episodes all score alike carry no episode advantage (a
# sharpened policy wins or loses a level eight times in eight), the entropy that would make them differ, and how
# far the policy went from its start.
PLATEAU_METRICS = (
    Metric("rollout/success", "Training success"),
    Metric("rollout/zero_variance_groups", "Groups whose episodes all score alike"),
    Metric("actor/entropy", "Policy entropy (nats per token)"),
    Metric("actor/kl_ref", "KL to the reference"),
    Metric("rollout/turns_mean", "Turns an episode"),
    Metric("val/success", "Validation success"),
)
# How a run's format breaks: responses grow to the token cap, a cut response has no action to parse, and the
# updates that led there (KL to the reference, the share of clipped tokens, the gradient norm).
FORMAT_METRICS = (
    Metric("rollout/success", "Training success"),
    Metric("rollout/format_ok", "Turns in the format"),
    Metric("rollout/response_truncated", "Responses cut at the token cap"),
    Metric("rollout/response_tokens_mean", "Response tokens"),
    Metric("actor/kl_ref", "KL to the reference"),
    Metric("actor/clip_frac", "Clipped share of tokens"),
    Metric("actor/grad_norm", "Actor gradient norm (before clipping)"),
    Metric("val/success", "Validation success"),
)
METRIC_SETS = {"collapse": COLLAPSE_METRICS, "state_rewards": STATE_REWARD_METRICS, "sokoban": SOKOBAN_METRICS,
               "plateau": PLATEAU_METRICS, "format": FORMAT_METRICS}

Records = list[dict[str, float]]


@dataclass(frozen=True)
class Panel:
    """What one panel of a comparison figure shows."""

    title: str
    runs: dict[str, int]
    """Row label -> how many of its runs have the metric (a thin line each)."""
    means: dict[str, tuple[list[int], list[float]]]
    """Row label -> the ``(steps, values)`` of its bold mean line."""
    lines: int
    """Lines in the panel, thin and bold."""


@dataclass(frozen=True)
class Comparison:
    """A comparison figure written as a PNG."""

    path: Path
    panels: tuple[Panel, ...]


def runs_with(runs: list[Records], metric: str) -> list[tuple[list[int], list[float]]]:
    """``(steps, values)`` of ``metric`` for each run that has it."""
    return [(steps, values) for steps, values in (series(records, metric) for records in runs) if steps]


def mean_over_seeds(runs: list[tuple[list[int], list[float]]]) -> tuple[list[int], list[float]]:
    """The mean of several runs' ``(steps, values)`` at the steps every one of them has."""
    common = set.intersection(*(set(steps) for steps, _ in runs)) if runs else set()
    by_step = [dict(zip(steps, values)) for steps, values in runs]
    steps = sorted(common)
    return steps, [sum(run[s] for run in by_step) / len(by_step) for s in steps]


def draw_comparison(
    rows: dict[str, list[Records]], metrics: Sequence[Metric], path: Path, title: str = "",
    references: Mapping[str, Sequence[tuple[str, float]]] | None = None,
) -> Comparison | None:
    """Write one PNG at ``path`` with a panel per metric that any run has: each run of a row a thin line, the
    row's mean over its runs (those with the metric, at the steps all of them have) a bold line of the same
    colour. None (and no file) when no run has any of the metrics.

    ``rows`` maps a row label (a recipe, an estimator) to the records of each of its runs (seeds), in the
    order of the legend. ``references`` maps a metric to labelled levels drawn across its panel as dashed
    lines (what a random policy scores, a target).
    """
    drawn = [(metric, {row: runs_with(runs, metric.name) for row, runs in rows.items()}) for metric in metrics]
    drawn = [(metric, per_row) for metric, per_row in drawn if any(per_row.values())]
    if not drawn:
        return None
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.ticker import MaxNLocator

    columns = min(3, len(drawn))
    grid_rows = -(-len(drawn) // columns)
    figure = Figure(figsize=(4.2 * columns, 3.0 * grid_rows + 0.5), dpi=100, layout="constrained")
    colors = {row: f"C{i}" for i, row in enumerate(rows)}  # a row keeps its colour in every panel
    panels = []
    for index, (metric, per_row) in enumerate(drawn):
        axes = figure.add_subplot(grid_rows, columns, index + 1)
        # Validation is logged every few steps only: markers show where its points are.
        marker = "o" if metric.name.startswith("val/") else None
        means = {}
        for row, runs in per_row.items():
            for steps, values in runs:
                axes.plot(steps, values, color=colors[row], alpha=0.35, linewidth=0.8, marker=marker, markersize=3)
            steps, values = mean_over_seeds(runs)
            if steps:
                axes.plot(steps, values, color=colors[row], linewidth=2.2, marker=marker, markersize=5)
                means[row] = (steps, values)
        for label, level in (references or {}).get(metric.name, ()):
            axes.axhline(level, color="0.4", linestyle="--", linewidth=1.0)
            axes.annotate(label, (0.01, level), xycoords=("axes fraction", "data"), fontsize="x-small",
                          color="0.3", va="bottom")
        axes.set_title(metric.title, fontsize="medium")
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))
        axes.set_xlabel("step")
        axes.grid(alpha=0.3)
        panels.append(Panel(metric.title, {row: len(runs) for row, runs in per_row.items()}, means, len(axes.lines)))
    handles = [Line2D([], [], color=colors[row], linewidth=2.2, label=f"{row} ({len(runs)} runs)")
               for row, runs in rows.items()]
    figure.legend(handles=handles, loc="outside lower center", ncols=min(len(handles), 4), fontsize="small")
    if title:
        figure.suptitle(title)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    return Comparison(path, tuple(panels))

"""The HTML report of a run or an evaluation folder: ``write_report(folder) -> folder/report.html``.

The page is static: it links the folder's own image files (no copies) and
the training curves written beside it as ``plots/*.png``, so it opens from
disk (``file://``) or from ``turnrl view --serve``. It shows:

- the summary (``summary.json``) and, for runs, the training curves;
- for an evaluation on several env variants, their table (one row each);
- before/after RL validation episodes side by side, matched by seed;
- the episodes of every trajectories file (a long one's first and last turns), each turn with its image(s),
  observation, the response with its reasoning fields highlighted, the parsed
  actions (invalid ones struck through), the named rewards, and per-token
  advantages as a heatmap where the run saved them;
- filters by outcome, env, status and training step (the file it came from).
"""

from __future__ import annotations

import json
import math
import secrets
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import jinja2

from turnrl.files import parse_json
from turnrl.viz.highlight import FIELD_CLASSES, advantage_color, response_segments
from turnrl.viz.plots import draw_training_curves
from turnrl.viz.records import (
    DEFAULT_MAX_EPISODES,
    DEFAULT_MAX_HEATMAP_TOKENS,
    DEFAULT_MAX_STEP_FILES,
    DEFAULT_MAX_TURNS,
    VARIANT_COLUMNS,
    VARIANTS_DIR,
    EpisodeSource,
    EpisodeView,
    advantages_path,
    read_metrics,
    read_source,
    spread_step_files,
    trajectory_files,
)
from turnrl.viz.template import CSS, SCRIPT, TEMPLATE

REPORT_NAME = "report.html"
PLOTS_DIR = "plots"
_MAX_CONFIG_CHARS = 200_000


@dataclass(frozen=True)
class PlotLink:
    title: str
    url: str
    """Relative to the report."""


@dataclass(frozen=True)
class Pair:
    """The same validation episode (env, seed, sample) before and after RL."""

    before: EpisodeView
    after: EpisodeView

    @property
    def change(self) -> str:
        """``improved`` (failure to success), ``regressed`` (success to failure) or ``unchanged``."""
        if self.after.success and not self.before.success:
            return "improved"
        if self.before.success and not self.after.success:
            return "regressed"
        return "unchanged"


@dataclass(frozen=True)
class VariantRow:
    """One row of a variants evaluation's table, formatted for the page."""

    name: str
    env: str
    settings: str
    figures: tuple[str, ...]
    """The values of :data:`VARIANT_COLUMNS`, in order (``-`` where the row has none)."""


@dataclass
class ReportData:
    """Everything the page shows."""

    title: str
    kind: str
    """``training run`` or ``evaluation``."""
    folder: str
    summary: list[tuple[str, str]] = field(default_factory=list)
    """Flattened ``summary.json`` as (key, formatted value)."""
    headline: list[tuple[str, str]] = field(default_factory=list)
    """The few figures shown first (success before/after RL, success rate, ...)."""
    config_text: str = ""
    sources: list[EpisodeSource] = field(default_factory=list)
    plots: list[PlotLink] = field(default_factory=list)
    pairs: list[Pair] = field(default_factory=list)
    variants: list[VariantRow] = field(default_factory=list)
    """The table of an evaluation on several env variants (empty otherwise)."""
    warnings: list[str] = field(default_factory=list)

    @property
    def variant_columns(self) -> list[str]:
        return [title for _, title in VARIANT_COLUMNS]

    @property
    def episode_count(self) -> int:
        return sum(len(source.episodes) for source in self.sources)

    @property
    def envs(self) -> list[str]:
        return sorted({ep.env_id for source in self.sources for ep in source.episodes})

    @property
    def statuses(self) -> list[str]:
        return sorted({ep.status for source in self.sources for ep in source.episodes})

    @property
    def env_options(self) -> list[tuple[str, str]]:
        """(filter value, label) of each env."""
        return [(env, env) for env in self.envs]

    @property
    def status_options(self) -> list[tuple[str, str]]:
        return [(status, status) for status in self.statuses]

    @property
    def source_options(self) -> list[tuple[str, str]]:
        """(file stem, label) of each trajectories file: the training-step filter."""
        return [(source.name, source.label) for source in self.sources]

    @property
    def scales(self) -> dict[str, float]:
        return {source.name: source.advantage_scale for source in self.sources}

    @property
    def pair_counts(self) -> dict[str, int]:
        counts = {"improved": 0, "regressed": 0, "unchanged": 0}
        for pair in self.pairs:
            counts[pair.change] += 1
        return counts


# --------------------------------------------------------------------------- reading a folder
def folder_kind(folder: Path) -> str:
    """``evaluation`` or ``training run``.

    Raises:
        ValueError: ``folder`` is not a folder, or holds neither.
    """
    if not folder.is_dir():
        raise ValueError(f"{folder} is not a folder: pass the folder that `turnrl train` (run.output_dir/run.name) "
                         "or `turnrl eval --out` wrote")
    if (folder / "trajectories.jsonl").is_file() or (folder / VARIANTS_DIR).is_dir():
        return "evaluation"
    if (folder / "trajectories").is_dir():
        return "training run"
    if (folder / "demos_sample.jsonl").is_file() or (folder / "model").is_dir():
        # The page reads a run's SFT stage from sft/ and would find none of its files in sft/ itself.
        raise ValueError(f"{folder} looks like the SFT folder of a run: pass the run folder above it")
    # A run that is still in (or only had) its SFT stage has no metrics.jsonl or trajectories/ of RL yet.
    if (folder / "metrics.jsonl").is_file() or (folder / "sft" / "metrics.jsonl").is_file() or (
            folder / "sft" / "demos_sample.jsonl").is_file():
        return "training run"
    hint = " (this looks like the trajectories folder of a run: pass the run folder above it)" if any(
        folder.glob("step_*.jsonl")) or (folder / "val_before_rl.jsonl").is_file() else ""
    raise ValueError(f"{folder} holds neither a training run (metrics.jsonl, trajectories/, sft/) nor an evaluation "
                     f"(trajectories.jsonl, or variants/){hint}")


def flatten_summary(summary: Any, prefix: str = "") -> list[tuple[str, str]]:
    """``{"a": {"b": 0.5}}`` -> ``[("a / b", "0.5")]``; numbers to 4 significant digits."""
    if isinstance(summary, dict):
        rows = []
        for key, value in summary.items():
            rows += flatten_summary(value, f"{prefix} / {key}" if prefix else str(key))
        return rows
    if isinstance(summary, float):
        return [(prefix, f"{summary:.4g}")]
    if isinstance(summary, list):
        return [(prefix, ", ".join(str(item) for item in summary))]
    return [(prefix, str(summary))]


# summary.json keys shown first, with the page's name for them.
HEADLINE_KEYS = (
    ("val_success_before_rl", "validation success before RL"),
    ("val_success_after_rl", "validation success after RL"),
    ("steps", "RL steps"),
    ("success_rate", "success rate"),
    ("episodes", "episodes"),
    ("mean_reward", "mean reward"),
    ("mean_turns", "mean turns"),
    ("errors", "errors"),
    ("total_s", "total time (s)"),
)


def headline(summary: Any) -> list[tuple[str, str]]:
    """The :data:`HEADLINE_KEYS` that ``summary`` has, formatted."""
    if not isinstance(summary, dict):
        return []
    rows = [(label, flatten_summary(summary[key])[0][1]) for key, label in HEADLINE_KEYS
            if key in summary and isinstance(summary[key], (int, float, str))]
    early = summary.get("early_stop")  # why an early-stopped run ended (turnrl.training.collapse_watch)
    if isinstance(early, dict) and {"step", "reason"} <= set(early):
        rows.append(("stopped early", f"after step {early['step']}: {early['reason']}"))
    limit = summary.get("time_limit")  # a run ended by run.time_limit_minutes
    if isinstance(limit, dict) and {"step", "minutes"} <= set(limit):
        minutes = limit["minutes"]  # formatted as a number only where it is one: summary.json is read as it is
        minutes_text = f"{minutes:g}" if isinstance(minutes, (int, float)) else str(minutes)
        rows.append(("stopped at its time limit", f"after step {limit['step']}: {minutes_text} minutes"))
    return rows


def _figure(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return "-"
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def variant_rows(summary: Any, warnings: list[str]) -> list[VariantRow]:
    """The table of a variants evaluation (``summary["variants"]``: one dict per variant, see
    ``turnrl.evaluate.variant_row``), formatted; rows that are not dicts are skipped with a warning."""
    rows = summary.get("variants") if isinstance(summary, dict) else None
    if not isinstance(rows, list):
        return []
    table = []
    for index, row in enumerate(rows):
        if not isinstance(row, dict):
            warnings.append(f"summary.json: variants[{index}] is not a row of the table")
            continue
        settings = row.get("settings")
        settings_text = " ".join(f"{key}={value}" for key, value in settings.items()) if isinstance(
            settings, dict) else ""
        table.append(VariantRow(str(row.get("variant", f"#{index}")), str(row.get("env", "")), settings_text or "-",
                                tuple(_figure(row.get(key)) for key, _ in VARIANT_COLUMNS)))
    return table


def pair_validation(sources: Iterable[EpisodeSource]) -> list[Pair]:
    """Validation episodes before and after RL matched by (env, seed, sample), in seed order."""
    by_name = {source.name: source for source in sources}
    before, after = by_name.get("val_before_rl"), by_name.get("val_after_rl")
    if before is None or after is None:
        return []
    after_by_key = {(ep.env_id, ep.seed, ep.sample): ep for ep in after.episodes}
    pairs = [Pair(ep, after_by_key[(ep.env_id, ep.seed, ep.sample)]) for ep in before.episodes
             if (ep.env_id, ep.seed, ep.sample) in after_by_key]
    return sorted(pairs, key=lambda pair: (pair.before.env_id, pair.before.seed, pair.before.sample))


def _read_json(path: Path, warnings: list[str]) -> Any:
    if not path.is_file():
        return None
    try:
        return parse_json(path.read_text(encoding="utf-8", errors="replace"))
    except json.JSONDecodeError as error:
        warnings.append(f"{path.name} could not be read: {error}")
        return None


def load_report(folder: Path, max_episodes: int = DEFAULT_MAX_EPISODES, plots: bool = True,
                max_step_files: int = DEFAULT_MAX_STEP_FILES,
                max_heatmap_tokens: int = DEFAULT_MAX_HEATMAP_TOKENS,
                max_turns: int | None = DEFAULT_MAX_TURNS) -> ReportData:
    """Read ``folder`` (a run or an evaluation) and, with ``plots``, draw its curves into ``folder/plots``.

    The page shows the first ``max_episodes`` episodes of each trajectories file, at most ``max_turns`` turns
    of each (its first and last ones, see :func:`~turnrl.viz.records.split_turns`; None shows all), the files of
    at most ``max_step_files`` training steps spread over the run (see :func:`spread_step_files`), and advantage
    heatmaps of at most ``max_heatmap_tokens`` tokens, shared evenly by the files that have advantages (each
    draws those of its first episodes).

    Raises:
        ValueError: ``folder`` holds neither a run nor an evaluation, or ``max_step_files`` or ``max_turns`` is
            below 1.
    """
    folder = folder.resolve()
    data = ReportData(title=folder.name, kind=folder_kind(folder), folder=str(folder))
    summary = _read_json(folder / "summary.json", data.warnings)
    data.variants = variant_rows(summary, data.warnings)
    figures = {k: v for k, v in summary.items() if k != "variants"} if data.variants else summary
    data.summary = flatten_summary(figures) if summary is not None else []
    data.headline = headline(summary)
    config = folder / "config.yaml"
    if config.is_file():
        data.config_text = config.read_text(encoding="utf-8", errors="replace")[:_MAX_CONFIG_CHARS]
    files, left_out = spread_step_files(trajectory_files(folder, [row.name for row in data.variants]),
                                        max_step_files)
    per_file = max_heatmap_tokens // max(1, sum(advantages_path(path).is_file() for path in files))
    data.sources = [read_source(path, folder, max_episodes, data.warnings, per_file, max_turns) for path in files]
    data.pairs = pair_validation(data.sources)
    if left_out:
        shown = [str(source.step) for source in data.sources if source.name.startswith("step_")]
        data.warnings.append(f"trajectories: showing the episodes of {len(shown)} of the {len(shown) + left_out} "
                             f"training steps that kept them (steps {', '.join(shown)}), spread over the run to keep "
                             "the page light (turnrl view --max-step-files N shows more)")
    if plots:
        # Non-finite values kept as gaps: a line drawn across the steps where a loss was NaN would hide them.
        records = read_metrics(folder / "metrics.jsonl", data.warnings, keep_non_finite=True)
        sft_records = read_metrics(folder / "sft" / "metrics.jsonl", data.warnings, keep_non_finite=True)
        for plot in draw_training_curves(records, folder / PLOTS_DIR, sft_records):
            data.plots.append(PlotLink(plot.curve.title, quote(f"{PLOTS_DIR}/{plot.path.name}")))
    return data


# --------------------------------------------------------------------------- the page
def figure(value: float, spec: str = ".4g") -> str:
    """``value`` formatted by ``spec`` (``"+.3g"``); NaN as ``NaN`` and infinities as ``inf`` / ``-inf``, whatever
    the spec, so that no non-finite reward reads as a number (``"%+.3g" % nan`` is ``+nan``)."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return format(value, spec)


def _environment() -> jinja2.Environment:
    environment = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined)
    environment.globals.update(
        segments=lambda response, fields: response_segments(response, frozenset(fields)),
        color=advantage_color,
        field_classes=FIELD_CLASSES,
        figure=figure,
    )
    environment.tests["finite"] = math.isfinite
    return environment


def render_html(data: ReportData) -> str:
    """The page of ``data`` (every string escaped)."""
    template = _environment().from_string(TEMPLATE)
    return template.render(data=data, css=CSS, script=SCRIPT, nonce=secrets.token_urlsafe(16))


def write_report(path: Path, max_episodes: int = DEFAULT_MAX_EPISODES,
                 max_step_files: int = DEFAULT_MAX_STEP_FILES,
                 max_heatmap_tokens: int = DEFAULT_MAX_HEATMAP_TOKENS,
                 max_turns: int | None = DEFAULT_MAX_TURNS) -> Path:
    """Write ``report.html`` (and ``plots/*.png``) into the run or evaluation folder ``path``; returns the page.

    Raises:
        ValueError: ``path`` holds neither a run nor an evaluation, or ``max_step_files`` or ``max_turns`` is
            below 1.
    """
    folder = Path(path)
    data = load_report(folder, max_episodes, max_step_files=max_step_files, max_heatmap_tokens=max_heatmap_tokens,
                       max_turns=max_turns)
    out = folder / REPORT_NAME
    # A record's text can hold a lone surrogate (a JSON "\ud83d" from an endpoint that split an emoji), which
    # UTF-8 cannot encode: written as its escape, so that one character never costs the whole page.
    out.write_text(render_html(data), encoding="utf-8", errors="backslashreplace")
    return out

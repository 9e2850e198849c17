"""Training curves: the right series from metrics records, one PNG per curve that has data."""

from __future__ import annotations

import statistics

import numpy as np
import pytest
from PIL import Image

from turnrl.agent.formats import get_format
from turnrl.config import AgentConfig, SamplingConfig
from turnrl.envs import make
from turnrl.policy.scripted import ExpertPolicy
from turnrl.rollout.metrics import rollout_metrics
from turnrl.rollout.runner import EpisodeSlot, Rollout
from turnrl.viz.plots import (
    COLLAPSE_METRICS,
    CURVES,
    SOKOBAN_METRICS,
    Curve,
    Metric,
    draw_comparison,
    draw_curve,
    draw_training_curves,
    mean_over_seeds,
    series,
)
from turnrl.viz.records import read_metrics


def records() -> list[dict[str, float]]:
    out = [{"step": 0.0, "val/success": 0.25}]
    for step in range(1, 6):
        out.append({"step": float(step), "rollout/success": step / 10, "actor/entropy": 1.0 / step,
                    "timing/step_s": 2.0, "rollout/in_group_reward_std": 0.3})
    out.append({"step": 5.0, "val/success": 0.5})
    return out


def test_series_sorts_by_step_and_keeps_the_last_value_of_a_repeated_step():
    resumed = [{"step": 2.0, "a": 1.0}, {"step": 1.0, "a": 0.5}, {"step": 2.0, "a": 3.0}, {"step": 3.0, "b": 1.0}]
    assert series(resumed, "a") == ([1, 2], [0.5, 3.0])
    assert series(resumed, "missing") == ([], [])


def test_a_curve_without_data_writes_nothing(tmp_path):
    curve = Curve("kl", "KL", (("actor/kl_ref", "kl"),))
    assert draw_curve(curve, records(), tmp_path / "kl.png") is None
    assert not (tmp_path / "kl.png").exists()


def test_curves_are_written_as_png_files_for_the_metrics_a_run_has(tmp_path):
    sft = [{"step": float(s), "sft/loss": 3.0 - s} for s in range(3)]
    plots = draw_training_curves(records(), tmp_path, sft)
    names = [plot.path.name for plot in plots]
    assert names == ["success.png", "entropy.png", "reward_std.png", "step_time.png", "sft_loss.png"]
    success = plots[0]
    assert success.points == 5 + 2  # training rollouts and the two validations
    for plot in plots:
        with Image.open(plot.path) as image:
            assert image.format == "PNG" and image.size == (500, 320)
            assert len(np.unique(np.asarray(image.convert("L")))) > 10  # something was drawn


def test_every_issue_curve_is_defined():
    assert [c.name for c in CURVES] == ["success", "reward", "kl", "entropy", "response_length", "reward_std",
                                        "collapse_mi", "collapse_mi_seq", "collapse_entropy", "collapse_retrieval",
                                        "step_time"]


def test_collapse_curves_are_drawn_when_a_run_measured_them(tmp_path):
    measured = records()
    for record in measured[1:-1:2]:  # steps 1, 3, 5: every other step, as collapse.every does
        for kind in ("first_turn", "multi_turn"):
            record.update({f"collapse/{kind}/mi": 0.1 * record["step"], f"collapse/{kind}/mi_seq": record["step"],
                           f"collapse/{kind}/conditional_entropy": 0.5, f"collapse/{kind}/retrieval_acc": 0.6,
                           f"collapse/{kind}/retrieval_chance": 0.25})
        record["collapse/reward_spread_threshold"] = 0.03
    plots = {plot.curve.name: plot for plot in draw_training_curves(measured, tmp_path)}
    assert {"collapse_mi", "collapse_mi_seq", "collapse_entropy", "collapse_retrieval"} <= set(plots)
    assert plots["collapse_retrieval"].points == 4 * 3 and plots["reward_std"].points == 5 + 3
    assert not {"collapse_mi", "collapse_retrieval"} & {plot.curve.name for plot in draw_training_curves(
        records(), tmp_path / "plain")}


def test_non_finite_values_are_gaps_counted_in_the_legend(tmp_path):
    nan = float("nan")
    values = [1.0, 0.9, nan, 0.7, nan]
    diverged = [{"step": float(step), "actor/entropy": value} for step, value in enumerate(values, 1)]
    plot = draw_curve(Curve("entropy", "Entropy", (("actor/entropy", "sampled tokens"),)), diverged, tmp_path / "e.png")
    assert plot is not None and (plot.points, plot.gaps) == (3, 2)
    assert series(diverged, "actor/entropy")[0] == [1, 2, 3, 4, 5]  # the run went on: the axis reaches step 5
    # A metric that was never finite still gets its plot, which says so, rather than no plot at all.
    never = [{"step": float(step), "actor/kl_ref": nan} for step in range(1, 4)]
    kl = draw_curve(CURVES[2], never, tmp_path / "kl.png")
    assert kl is not None and (kl.points, kl.gaps) == (0, 3) and kl.path.is_file()


# --------------------------------------------------------------------------- comparison of rows over seeds
def seed_records(seed: int, steps: int, grad_norm: bool = True) -> list[dict[str, float]]:
    """A run with training metrics every step and validation at steps 0, 4, 8, ..."""
    out = []
    for step in range(1, steps + 1):
        record = {"step": float(step), "rollout/success": (step + seed) / 20, "actor/entropy": 2.0 - 0.1 * step - seed,
                  "rollout/in_group_reward_std": 0.1 * seed}
        if grad_norm:
            record["actor/grad_norm"] = float(step * (seed + 1))
        out.append(record)
    out += [{"step": float(step), "val/success": 0.1 * seed + step / 100} for step in range(0, steps + 1, 4)]
    return out


def test_mean_over_seeds_is_the_plain_mean_at_the_common_steps():
    assert mean_over_seeds([([1, 2, 3], [1.0, 2.0, 3.0]), ([2, 3, 4], [4.0, 6.0, 8.0])]) == ([2, 3], [3.0, 4.5])
    assert mean_over_seeds([([1], [1.0]), ([2], [2.0])]) == ([], [])
    assert mean_over_seeds([]) == ([], [])


def test_comparison_draws_a_panel_per_metric_a_run_has_with_every_seed_and_the_mean(tmp_path):
    rows = {"GRPO": [seed_records(seed, 12 - seed) for seed in range(3)],  # seeds of 12, 11 and 10 steps
            "PPO": [seed_records(seed, 12, grad_norm=False) for seed in range(3)]}
    metrics = [*COLLAPSE_METRICS, Metric("actor/kl_ref", "KL")]  # no run logs the KL
    comparison = draw_comparison(rows, metrics, tmp_path / "figs" / "collapse.png", title="Collapse")
    assert comparison is not None and comparison.path.is_file()
    with Image.open(comparison.path) as image:
        assert image.format == "PNG" and image.size == (1260, 650)  # 3 columns x 2 rows of panels and the legend
        assert len(np.unique(np.asarray(image.convert("L")))) > 10
    panels = {panel.title: panel for panel in comparison.panels}
    assert list(panels) == [metric.title for metric in COLLAPSE_METRICS]  # the KL panel is left out
    for title, panel in panels.items():
        if "gradient" not in title:
            assert panel.runs == {"GRPO": 3, "PPO": 3} and panel.lines == 6 + 2  # every seed and each row's mean
    grad = panels["Actor gradient norm (before clipping)"]
    assert grad.runs == {"GRPO": 3, "PPO": 0} and list(grad.means) == ["GRPO"]  # PPO's runs have no gradient norm
    assert grad.lines == 3 + 1
    steps, values = panels["Training success"].means["GRPO"]
    assert steps == list(range(1, 11))  # the steps all three seeds have
    assert values == pytest.approx([statistics.fmean((s + seed) / 20 for seed in range(3)) for s in steps])
    steps, values = panels["Validation success"].means["PPO"]
    assert steps == [0, 4, 8, 12]
    assert values == pytest.approx([statistics.fmean(0.1 * seed + s / 100 for seed in range(3)) for s in steps])


def test_reference_levels_go_on_their_metrics_panel_only(tmp_path):
    rows = {"GRPO": [seed_records(seed, 8) for seed in range(2)]}
    references = {"val/success": [("a random policy", 0.1), ("the target", 0.6)], "actor/kl_ref": [("unused", 1.0)]}
    comparison = draw_comparison(rows, COLLAPSE_METRICS, tmp_path / "levels.png", references=references)
    assert comparison is not None
    lines = {panel.title: panel.lines for panel in comparison.panels}
    assert lines["Validation success"] == 2 + 1 + 2  # the seeds, their mean and the two levels
    assert lines["Training success"] == 2 + 1


def test_comparison_without_any_of_the_metrics_writes_nothing(tmp_path):
    rows = {"GRPO": [seed_records(0, 5)], "empty": []}
    assert draw_comparison(rows, [Metric("actor/kl_ref", "KL")], tmp_path / "kl.png") is None
    assert draw_comparison({"empty": [[]]}, COLLAPSE_METRICS, tmp_path / "none.png") is None
    assert not list(tmp_path.iterdir())


def test_the_collapse_metrics_are_what_a_training_run_writes(run_dir, tmp_path):
    records = read_metrics(run_dir / "metrics.jsonl")
    comparison = draw_comparison({"run": [records]}, COLLAPSE_METRICS, tmp_path / "run.png")
    assert comparison is not None
    assert [panel.title for panel in comparison.panels] == [metric.title for metric in COLLAPSE_METRICS]
    assert comparison.panels[-1].means["run"][0] == [0, 2]  # validation before RL and after the last step


def test_the_sokoban_metrics_are_what_a_sokoban_rollout_reports():
    """The ``sokoban`` set's names, less their ``rollout/`` or ``val/`` prefix, are rollout metrics of Sokoban
    episodes (the trainer logs them under those prefixes)."""
    fmt = get_format("no_think")
    slots = [EpisodeSlot(env=make("Sokoban"), seed=seed, group=seed) for seed in range(4)]
    trajectories = Rollout(ExpertPolicy(fmt, random_action_share=0.5, seed=1), fmt, AgentConfig(format="no_think"),
                           "Sokoban").run(slots, SamplingConfig())
    reported = rollout_metrics(trajectories)
    assert {metric.name.split("/", 1)[1] for metric in SOKOBAN_METRICS} <= set(reported)

"""Training curves: the right series from metrics records, one PNG per curve that has data."""

from __future__ import annotations

import numpy as np
from PIL import Image

from turnrl.viz.plots import CURVES, Curve, draw_curve, draw_training_curves, series


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

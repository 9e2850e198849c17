"""The comparison-figure script: rows of run folders (globs too), the drawn figure and the first/last table."""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys

import pytest
import scipy.stats

from benchmarks.learning_curves import (
    first_last,
    gains,
    gains_table,
    main,
    paired_difference,
    paired_table,
    pairs_interval,
    reference_argument,
    row_argument,
    seed_of,
    table,
    unpaired,
)
from turnrl.viz.plots import COLLAPSE_METRICS, Metric


def write_run(folder, steps: int, seed: int) -> None:
    """A run folder as ``turnrl train`` leaves it: metrics every step, validation at the start and the end."""
    folder.mkdir(parents=True)
    lines = [{"step": 0, "val/success": 0.25}]
    lines += [{"step": s, "rollout/success": s / steps + seed / 100, "actor/grad_norm": 1.0 + seed}
              for s in range(1, steps + 1)]
    lines.append({"step": steps, "val/success": 0.5})
    (folder / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    (folder.parent / f"{folder.name}.log").write_text("the run's log\n")


@pytest.fixture
def runs(tmp_path):
    for row in ("GRPO", "PPO"):
        for seed in range(3):
            write_run(tmp_path / f"{row}_seed{seed}", 10, seed)
    (tmp_path / "empty_seed0").mkdir()
    return tmp_path


def test_a_row_is_its_run_folders_listed_or_globbed(runs):
    label, dirs = row_argument(f"GRPO={runs}/GRPO_seed*")
    assert label == "GRPO" and [d.name for d in dirs] == ["GRPO_seed0", "GRPO_seed1", "GRPO_seed2"]  # no logs
    _, dirs = row_argument(f"PPO={runs}/PPO_seed2,{runs}/PPO_seed0")
    assert [d.name for d in dirs] == ["PPO_seed2", "PPO_seed0"]
    for bad, message in [("GRPO", "LABEL=RUN_DIR"), (f"x={runs}/empty_seed0", "no run folder"),
                         (f"x={runs}/missing*", "no run folder"), (f"={runs}/GRPO_seed0", "LABEL=RUN_DIR")]:
        with pytest.raises(argparse.ArgumentTypeError, match=message):
            row_argument(bad)


def test_first_and_last_are_means_of_windows_that_never_overlap():
    assert first_last([float(v) for v in range(20)]) == (2.0, 17.0)  # 0..4 and 15..19
    assert first_last([1.0, 2.0, 3.0, 4.0, 5.0]) == (1.5, 4.5)  # 2 each side
    assert first_last([0.25, 0.5]) == (0.25, 0.5)  # validation before and after RL
    assert first_last([3.0]) == (3.0, 3.0)


def test_the_table_has_a_line_per_run_and_a_column_per_metric_a_run_has(runs):
    _, dirs = row_argument(f"GRPO={runs}/GRPO_seed0,{runs}/GRPO_seed1")
    records = [[json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()] for d in dirs]
    records[1] = [{k: v for k, v in r.items() if k != "actor/grad_norm"} for r in records[1]]
    metrics = [Metric("rollout/success", "Success"), Metric("actor/grad_norm", "Grad"), Metric("actor/kl", "KL"),
               Metric("val/success", "Validation")]
    assert table(dirs, records, metrics).splitlines() == [
        "| run | Success | Grad | Validation |",
        "| --- | ---: | ---: | ---: |",
        "| GRPO_seed0 | 0.300 -> 0.800 | 1.000 -> 1.000 | 0.250 -> 0.500 |",
        "| GRPO_seed1 | 0.310 -> 0.810 | - | 0.250 -> 0.500 |",
    ]


def test_the_script_draws_the_rows_and_prints_what_it_drew(runs, tmp_path, monkeypatch, capsys):
    out = tmp_path / "figures" / "collapse.png"
    monkeypatch.setattr(sys, "argv", ["learning_curves.py", "--metrics", "collapse", "--out", str(out), "--table",
                                      f"GRPO={runs}/GRPO_seed*", f"PPO={runs}/PPO_seed*"])
    main()
    printed = capsys.readouterr().out
    assert out.is_file()
    assert f"wrote {out}" in printed and "  Training success: GRPO 3 run(s), PPO 3 run(s)" in printed
    assert "In-group reward std" not in printed.split("wrote")[1]  # no run logged it: no panel
    assert printed.count("| PPO_seed") == 3 and "**GRPO**" in printed
    assert len([m for m in COLLAPSE_METRICS if f"  {m.title}:" in printed]) == 3


def test_the_script_exits_with_an_error_when_nothing_is_drawn(runs, tmp_path, monkeypatch, capsys):
    out = tmp_path / "state.png"
    (runs / "other").mkdir()
    (runs / "other" / "metrics.jsonl").write_text('{"step": 1, "timing/step_s": 2.0}\n')
    monkeypatch.setattr(sys, "argv", ["learning_curves.py", "--metrics", "state_rewards", "--out", str(out),
                                      f"other={runs}/other"])
    with pytest.raises(SystemExit) as exit_info:
        main()
    assert exit_info.value.code == 1 and not out.exists()
    assert "nothing drawn" in capsys.readouterr().out


def test_a_reference_level_is_read_as_metric_label_and_value():
    assert reference_argument("val/success=random: no grid:0.265") == ("val/success", "random: no grid", 0.265)
    with pytest.raises(argparse.ArgumentTypeError, match="METRIC=LABEL:VALUE"):
        reference_argument("val/success=random")


def validations(*pairs: tuple[int, float]) -> list[dict]:
    return [{"step": step, "val/success": value} for step, value in pairs]


def test_gains_are_the_start_the_best_the_last_and_the_mean_of_the_last_three():
    g = gains(validations((0, 0.4), (10, 0.6), (20, 0.7), (30, 0.6), (40, 0.65)))
    assert (g.start, g.best, g.best_step, g.last, g.last_step) == (0.4, 0.7, 20, 0.65, 40)
    assert g.last_mean == pytest.approx((0.7 + 0.6 + 0.65) / 3)
    assert g.gain_at_best == pytest.approx(0.3) and g.gain_over_last == pytest.approx(0.25)


def test_a_step_validated_twice_counts_once_and_an_equal_best_is_the_earliest():
    """A run stopped right after a validation once logged that step twice: the mean must not count it twice."""
    g = gains(validations((0, 0.4), (10, 0.7), (20, 0.5), (30, 0.7), (30, 0.7)))
    assert g.best_step == 10 and g.last_mean == pytest.approx((0.7 + 0.5 + 0.7) / 3)


def test_gains_need_two_validations_and_average_what_there_is():
    assert gains(validations((0, 0.4))) is None and gains([]) is None
    assert gains(validations((0, 0.4), (10, 0.6))).last_mean == pytest.approx(0.5)


def test_the_gains_table_has_a_line_per_run_and_the_rows_mean(tmp_path):
    runs = [tmp_path / "s0", tmp_path / "s1", tmp_path / "s2"]
    records = [validations((0, 0.4), (10, 0.6), (20, 0.7)), validations((0, 0.5), (10, 0.6), (20, 0.6)),
               validations((0, 0.5))]
    assert gains_table(runs, records).splitlines()[2:] == [
        "| s0 | 0.400 | 0.700 (20) | 0.700 (20) | 0.567 | +30.0 | +16.7 |",
        "| s1 | 0.500 | 0.600 (10) | 0.600 (20) | 0.567 | +10.0 | +6.7 |",
        "| s2 | - | - | - | - | - | - |",
        "| mean of 2 | 0.450 | 0.650 | | 0.567 | +20.0 | +11.7 |",
    ]


def test_the_script_prints_the_gains_without_drawing(runs, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["learning_curves.py", "--gains", f"GRPO={runs}/GRPO_seed*"])
    main()
    out = capsys.readouterr().out
    assert "**GRPO**" in out and "| GRPO_seed2 | 0.250 | 0.500 (10) | 0.500 (10) | 0.375 | +25.0 | +12.5 |" in out
    assert "| mean of 3 |" in out


def matched(*values: float, metric: str = "rollout/success", first_step: int = 1) -> list[dict]:
    return [{"step": first_step + i, metric: value} for i, value in enumerate(values)]


def test_a_paired_difference_is_the_mean_step_by_step_difference_before_and_from_the_split():
    first = matched(0.5, 0.4, 0.6, 0.7, 0.5)
    second = matched(0.5, 0.5, 0.5, 0.6, 0.6)
    d = paired_difference(first, second, "rollout/success", split=3)
    assert d.before == pytest.approx(((0.5 - 0.5) + (0.4 - 0.5)) / 2)  # steps 1, 2
    assert d.after == pytest.approx(((0.6 - 0.5) + (0.7 - 0.6) + (0.5 - 0.6)) / 3)  # steps 3, 4, 5
    assert (d.steps_after, d.ahead_after) == (3, 2)


def test_a_paired_difference_uses_only_the_steps_both_runs_logged():
    first = matched(0.5, 0.4, 0.6, 0.7) + [{"step": 9, "val/success": 1.0}]
    second = matched(0.2, 0.3, first_step=3)  # a run that logged steps 3 and 4 only
    d = paired_difference(first, second, "rollout/success", split=2)
    assert d.before is None and d.after == pytest.approx(((0.6 - 0.2) + (0.7 - 0.3)) / 2) and d.steps_after == 2
    assert paired_difference(first, [], "rollout/success", split=2) == paired_difference([], [], "x", 1)


def test_the_paired_table_has_a_line_per_pair_and_the_pairs_mean(tmp_path):
    metrics = [Metric("rollout/success", "Success"), Metric("actor/kl", "KL")]
    records = {"Full": [matched(0.5, 0.6, 0.8), matched(0.4, 0.5, 0.5)],
               "Base": [matched(0.5, 0.5, 0.5), matched(0.4, 0.6, 0.6)]}
    first = ("Full", [tmp_path / "full_seed0", tmp_path / "full_seed1"])
    second = ("Base", [tmp_path / "base_seed0", tmp_path / "base_seed1"])
    assert paired_table(first, second, records, metrics, split=2).splitlines() == [
        "| Full minus Base | Success |",
        "| --- | ---: |",
        "| full_seed0 - base_seed0 | +0.000 -> +0.200 (2/2) |",
        "| full_seed1 - base_seed1 | +0.000 -> -0.100 (0/2) |",
        "| mean of 2 pairs | +0.000 -> +0.050 [-1.856, +1.956] (1/2 pairs ahead) |",
    ]
    with pytest.raises(ValueError, match=r"as many runs in each row, .* \(2 against 1\) \(Full, Base\)"):
        paired_table(first, ("Base", second[1][:1]), {**records, "Base": records["Base"][:1]}, metrics, split=2)
    crossed = ("Base", [tmp_path / "base_seed0", tmp_path / "base_seed2"])
    with pytest.raises(ValueError, match="full_seed1 is paired with base_seed2"):
        paired_table(first, crossed, records, metrics, split=2)
    assert unpaired([tmp_path / "a_seed3", tmp_path / "mine"], [tmp_path / "b_seed3", tmp_path / "b_seed1"]) is None
    assert seed_of(tmp_path / "vagen_full_seed12") == 12 and seed_of(tmp_path / "seed1_run") is None


def test_the_pairs_interval_is_the_t_interval_of_the_pairs_mean():
    values = [-0.003, -0.022, 0.005]
    mean, sem = sum(values) / 3, statistics.stdev(values) / math.sqrt(3)
    expected = scipy.stats.t.interval(0.95, 2, loc=mean, scale=sem)
    assert pairs_interval(values) == pytest.approx(expected, abs=1e-12)
    assert pairs_interval([0.2, -0.1]) == pytest.approx((0.05 - 12.7062 * 0.15, 0.05 + 12.7062 * 0.15), abs=1e-3)
    assert pairs_interval([0.1]) is None and pairs_interval([]) is None


def test_the_script_pairs_two_rows_and_refuses_other_counts(runs, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["learning_curves.py", "--paired", "6", f"GRPO={runs}/GRPO_seed*",
                                      f"PPO={runs}/PPO_seed*"])
    main()
    out = capsys.readouterr().out
    assert "**GRPO minus PPO, pair by pair**" in out and "| GRPO_seed1 - PPO_seed1 | +0.000 -> +0.000 (0/5) |" in out
    for argv in (["--paired", "6", f"GRPO={runs}/GRPO_seed*"],
                 ["--paired", "6", f"GRPO={runs}/GRPO_seed*", f"PPO={runs}/PPO_seed0"]):
        monkeypatch.setattr(sys, "argv", ["learning_curves.py", *argv])
        with pytest.raises(SystemExit):
            main()
    err = capsys.readouterr().err
    assert "compares two rows; 1 were given" in err and "seed by seed in the same order (3 against 1)" in err


def test_the_state_rewards_script_pairs_its_rows_seed_by_seed(tmp_path):
    from benchmarks.state_rewards import paired, run_name

    for row, offset in (("VAGEN-Full", 0.1), ("VAGEN-Base", 0.0)):
        for seed in (0, 1):
            folder = tmp_path / run_name(row, seed)
            folder.mkdir()
            lines = [{"step": s, "rewards/grounding/match_mean": 0.4 + (offset if s >= 3 else 0.0) + seed / 10}
                     for s in range(1, 6)]
            (folder / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    text = paired(tmp_path, [0, 1], split=3).splitlines()
    assert text[0] == "| VAGEN-Full minus VAGEN-Base | Observation match |"
    assert text[2:] == ["| vagen_full_seed0 - vagen_base_seed0 | +0.000 -> +0.100 (3/3) |",
                        "| vagen_full_seed1 - vagen_base_seed1 | +0.000 -> +0.100 (3/3) |",
                        "| mean of 2 pairs | +0.000 -> +0.100 [+0.100, +0.100] (2/2 pairs ahead) |"]

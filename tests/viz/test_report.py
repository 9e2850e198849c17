"""The report of real folders (an evaluation with images, a short training run), and hostile records."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.viz.conftest import EVAL_EPISODES
from turnrl.viz.records import EpisodeView
from turnrl.viz.report import (
    Pair,
    flatten_summary,
    folder_kind,
    headline,
    load_report,
    render_html,
    variant_rows,
    write_report,
)


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def image_sources(html: str) -> list[str]:
    return re.findall(r'<img src="([^"]+)"', html)


def test_evaluation_report_shows_every_episode_with_its_images(eval_dir):
    path = write_report(eval_dir)
    html = path.read_text()
    assert path == eval_dir / "report.html"
    assert html.count('<details class="episode"') == EVAL_EPISODES
    episodes = lines(eval_dir / "trajectories.jsonl")
    shown = [src for src in image_sources(html)]
    assert len(shown) == sum(len(e["images"]) + len(e["final_images"]) for e in episodes) > 0
    assert all((eval_dir / src).is_file() for src in shown)
    # Every episode ends on its final frame (the hole it fell into, the goal), not on a caption alone.
    finals = re.findall(r'<img src="([^"]+)" alt="final observation"', html)
    assert finals == [e["final_images"][0] for e in episodes] and len(finals) == EVAL_EPISODES
    assert html.count("<think>") == 0 and "&lt;think&gt;" in html  # the response's tags are shown as text
    assert '<span class="f-think">Random choice' in html  # ... and its reasoning field highlighted
    successes = sum(e["success"] for e in episodes)
    assert html.count('data-success="1"') == successes
    assert "success rate" in html and "Training curves" not in html
    assert not (eval_dir / "plots").exists()  # an evaluation has no curves


def test_moves_that_changed_nothing_and_the_envs_figures_are_shown(tmp_path):
    from turnrl.cli import main

    out = tmp_path / "eval"
    main(["eval", "--env", "Sokoban", "--policy", "random", "--episodes", "6", "--out", str(out)])
    html = write_report(out, max_turns=None).read_text()  # every turn drawn: random episodes run long
    turns = [turn for e in lines(out / "trajectories.jsonl") for turn in e["turns"]]
    wasted = sum(valid and not effective for turn in turns
                 for valid, effective in zip(turn["actions_valid"], turn["actions_effective"]))
    assert wasted > 0 and html.count('class="chip no-effect"') == wasted
    assert html.count("deadlocked") >= 6 and html.count("boxes_on_target") >= 6  # in every episode's figures


def test_run_report_has_curves_steps_and_before_after_pairs(run_dir):
    data = load_report(run_dir)
    assert data.kind == "training run"
    assert [s.label for s in data.sources] == ["validation before RL", "step 1", "step 2", "validation after RL"]
    assert [s.step for s in data.sources] == [0, 1, 2, None]
    # The page's steps are those of metrics.jsonl (and of the checkpoints): one numbering.
    logged = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert logged == [0, 1, 2, 2] and (run_dir / "checkpoints" / "step_000002").is_dir()
    assert len(data.pairs) == 4 and all(p.before.seed == p.after.seed for p in data.pairs)
    plots = {p.url for p in data.plots}
    assert {"plots/success.png", "plots/reward.png", "plots/entropy.png", "plots/response_length.png",
            "plots/reward_std.png", "plots/step_time.png"} <= plots
    assert all((run_dir / url).is_file() for url in plots)
    html = render_html(data)
    assert html.count('<details class="pair"') == 4
    # Each side of a pair says what its numbers are: the episode's reward and its turns.
    result = r'<span class="badge (ok|bad)">(success|failure)</span> reward <strong>[-+.\de]+</strong> in \d+ turns?'
    assert len(re.findall(rf"before: {result} ·\s+after: {result} · <em>", html)) == 4
    assert html.count('<details class="episode"') == sum(len(s.episodes) for s in data.sources)
    for source in data.sources:
        assert f'<option value="{source.name}">{source.label}</option>' in html
    assert "validation success before RL" in html and "config.yaml" in html


def test_a_run_that_measured_collapse_shows_its_curves_and_why_it_stopped(run_dir, tmp_path):
    run = shutil.copytree(run_dir, tmp_path / "run")
    records = lines(run / "metrics.jsonl")
    for record in records:
        if "rollout/success" in record:  # the RL steps, as collapse.every=1 logs them
            for kind in ("first_turn", "multi_turn"):
                record.update({f"collapse/{kind}/mi": 0.2, f"collapse/{kind}/mi_seq": 3.0,
                               f"collapse/{kind}/conditional_entropy": 0.8, f"collapse/{kind}/retrieval_acc": 0.5,
                               f"collapse/{kind}/retrieval_chance": 0.25})
    (run / "metrics.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    summary = json.loads((run / "summary.json").read_text())
    summary.update({"stopped_by": "early_stop", "early_stop": {
        "rule": "low_validation_success", "step": 2, "reason": "validation success stayed below 0.01 for 5 "
                                                               "validations in a row"}})
    (run / "summary.json").write_text(json.dumps(summary))
    html = write_report(run).read_text()
    urls = set(image_sources(html))
    assert {f"plots/{name}.png" for name in ("collapse_mi", "collapse_mi_seq", "collapse_entropy",
                                             "collapse_retrieval")} <= urls
    assert all((run / url).is_file() for url in urls if url.startswith("plots/"))
    assert "Prompt retrieval from reasoning" in html
    assert "stopped early" in html and "after step 2: validation success stayed below 0.01" in html
    assert not {"plots/collapse_mi.png"} & set(image_sources(write_report(run_dir).read_text()))


def test_token_advantages_are_drawn_as_a_heatmap(run_with_advantages):
    data = load_report(run_with_advantages, plots=False)
    step = next(s for s in data.sources if s.name == "step_000001")
    assert step.advantage_scale > 0 and all(ep.has_advantages for ep in step.episodes)
    assert not any(ep.has_advantages for s in data.sources if s.name != "step_000001" for ep in s.episodes)
    html = render_html(data)
    expected = sum(len(t.advantages.tokens) for ep in step.episodes for t in ep.turns if t.advantages)
    assert html.count('<span class="tok"') == expected
    assert html.count("Per-token advantages</h4>") == sum(len(ep.turns) for ep in step.episodes)


def hostile(eval_dir: Path, out: Path) -> Path:
    """A copy of the evaluation whose first episode carries markup in every text field."""
    shutil.copytree(eval_dir, out, ignore=shutil.ignore_patterns("report.html"))
    episodes = lines(out / "trajectories.jsonl")
    bad = '</pre><script>alert("x")</script><img src=x onerror=alert(1)>'
    first = episodes[0]
    first.update(env_id=f'Frozen"Lake{bad}', system_prompt=bad, final_observation=bad, error=bad,
                 images=["javascript:alert(1)", "../../../etc/passwd", *first["images"][1:]])
    first["turns"][0].update(prompt=bad, response=f"<think>{bad}</think><answer>{bad}</answer>", actions=[bad],
                             rewards={bad: 1.0}, parse_errors=[bad], fields={'"><script>': "x", "think": bad})
    (out / "trajectories.jsonl").write_text("".join(json.dumps(e) + "\n" for e in episodes))
    (out / "config.yaml").write_text(bad)
    (out / "summary.json").write_text(json.dumps({bad: bad}))
    return out


def test_model_output_is_escaped_everywhere(eval_dir, tmp_path):
    folder = hostile(eval_dir, tmp_path / "hostile")
    html = write_report(folder).read_text()
    assert html.count("<script") == 1  # the page's own
    assert "<img src=x" not in html and "</pre><script>" not in html
    assert "&lt;/pre&gt;&lt;script&gt;alert(&#34;x&#34;)&lt;/script&gt;&lt;img src=x onerror=alert(1)&gt;" in html
    assert 'data-env="Frozen&#34;Lake&lt;/pre&gt;' in html  # no way out of an attribute
    # Image paths that leave the folder or are URLs are never linked, only reported.
    assert all((folder / src).is_file() for src in image_sources(html))
    assert "2 image(s) missing or outside the folder" in html


def test_a_bad_line_is_a_note_on_the_page_not_a_crash(eval_dir, tmp_path):
    folder = tmp_path / "eval"
    shutil.copytree(eval_dir, folder, ignore=shutil.ignore_patterns("report.html"))
    with (folder / "trajectories.jsonl").open("a") as handle:
        handle.write("{truncated\n[1, 2]\n")
    (folder / "summary.json").write_text("{not json")
    data = load_report(folder)
    assert data.episode_count == EVAL_EPISODES and data.summary == []
    assert any("2 line(s) could not be read" in w for w in data.warnings)
    assert any("summary.json could not be read" in w for w in data.warnings)
    assert "Notes on reading this folder" in render_html(data)


def test_max_episodes_caps_each_file(run_dir):
    data = load_report(run_dir, max_episodes=1, plots=False)
    assert [len(s.episodes) for s in data.sources] == [1, 1, 1, 1]
    assert sum("showing the first 1 of" in w for w in data.warnings) == 4


def test_folders_that_are_neither_say_what_to_pass(tmp_path, run_dir):
    with pytest.raises(ValueError, match="is not a folder"):
        folder_kind(tmp_path / "absent")
    with pytest.raises(ValueError, match="neither a training run"):
        folder_kind(tmp_path)
    with pytest.raises(ValueError, match="pass the run folder above it"):
        folder_kind(run_dir / "trajectories")


def test_a_long_run_shows_the_steps_spread_over_it_and_says_so(run_dir, tmp_path):
    from turnrl.viz.records import DEFAULT_MAX_STEP_FILES

    run = shutil.copytree(run_dir, tmp_path / "run", ignore=shutil.ignore_patterns("checkpoints", "reference",
                                                                                     "report.html", "plots"))
    step_file = (run / "trajectories" / "step_000001.jsonl").read_text()
    for step in range(3, 201):  # a run that kept its episodes every step for 200 steps
        (run / "trajectories" / f"step_{step:06d}.jsonl").write_text(step_file)
    data = load_report(run, plots=False)
    steps = [source.step for source in data.sources if source.name.startswith("step_")]
    assert len(steps) == DEFAULT_MAX_STEP_FILES and steps[0] == 1 and steps[-1] == 200
    assert [s.label for s in data.sources if not s.name.startswith("step_")] == [
        "validation before RL", "validation after RL"]
    assert any(f"{DEFAULT_MAX_STEP_FILES} of the 200 training steps" in w and "--max-step-files" in w
               for w in data.warnings)
    assert len(load_report(run, plots=False, max_step_files=200).sources) == 202
    assert not any("--max-step-files" in w for w in load_report(run_dir, plots=False).warnings)


@pytest.mark.parametrize("budget", [0, 40, 150, 10_000])
def test_advantage_heatmaps_share_the_pages_token_budget(run_dir, budget):
    data = load_report(run_dir, plots=False, max_heatmap_tokens=budget)
    steps = [source for source in data.sources if source.name.startswith("step_")]
    assert len(steps) == 2  # the run's two step files both have advantages
    for source in steps:
        drawn = [sum(len(t.advantages.tokens) for t in ep.turns if t.advantages) for ep in source.episodes]
        assert sum(drawn) <= budget // 2
        shown = [ep.has_advantages for ep in source.episodes]
        assert shown == sorted(shown, reverse=True)  # the first episodes
        assert (f"{source.name}.advantages.jsonl: per-token advantages drawn" in " ".join(data.warnings)) == (
            not all(shown))
    html = render_html(data)
    assert html.count('<span class="tok"') <= budget


def test_a_run_in_or_only_of_its_sft_stage_is_a_run(eval_dir, tmp_path):
    run = tmp_path / "run"
    (run / "sft").mkdir(parents=True)  # what `turnrl sft` leaves: no RL metrics or trajectories
    (run / "sft" / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "sft/loss": 3.0 - s}) + "\n"
                                                       for s in range(1, 4)))
    shutil.copy(eval_dir / "trajectories.jsonl", run / "sft" / "demos_sample.jsonl")
    shutil.copytree(eval_dir / "images", run / "sft" / "images")
    data = load_report(run)
    assert data.kind == "training run" and [p.url for p in data.plots] == ["plots/sft_loss.png"]
    assert [s.label for s in data.sources] == ["SFT demos"] and data.episode_count == EVAL_EPISODES
    assert data.warnings == []
    with pytest.raises(ValueError, match="SFT folder of a run: pass the run folder above it"):
        folder_kind(run / "sft")


def test_a_lone_surrogate_in_a_record_costs_that_character_only(eval_dir, tmp_path):
    folder = shutil.copytree(eval_dir, tmp_path / "eval", ignore=shutil.ignore_patterns("report.html"))
    episodes = lines(folder / "trajectories.jsonl")
    episodes[0]["turns"][0]["response"] = "half an emoji: \ud83d."  # a JSON escape of a lone surrogate
    (folder / "trajectories.jsonl").write_text("".join(json.dumps(e) + "\n" for e in episodes))
    html = write_report(folder).read_text(encoding="utf-8")
    assert html.count('<details class="episode"') == EVAL_EPISODES and "half an emoji: \\ud83d." in html


def test_non_finite_metrics_are_drawn_as_gaps_not_left_out(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("".join(
        json.dumps({"step": step, "actor/entropy": None if step == 3 else 1.0 / step, "actor/kl_ref": None}) + "\n"
        for step in range(1, 6)))  # the log writes a NaN as null
    urls = [plot.url for plot in load_report(tmp_path).plots]
    assert urls == ["plots/kl.png", "plots/entropy.png"]  # a KL that was NaN at every step is shown, not hidden


def test_summary_is_flattened_and_headlined():
    summary = {"success_rate": 0.5, "pass_at_k": {"1": 0.5}, "val_after_rl": {"val/success": 0.123456}, "env": "X",
               "tags": [1, 2]}
    assert flatten_summary(summary) == [("success_rate", "0.5"), ("pass_at_k / 1", "0.5"),
                                        ("val_after_rl / val/success", "0.1235"), ("env", "X"), ("tags", "1, 2")]
    assert headline(summary) == [("success rate", "0.5")]
    assert headline([1]) == []
    early = {"steps": 23, "stopped_by": "early_stop",
             "early_stop": {"rule": "empty_filter_steps", "reason": "nothing kept", "step": 23}}
    assert headline(early) == [("RL steps", "23"), ("stopped early", "after step 23: nothing kept")]
    timed = {"time_limit": {"minutes": 90.0, "step": 7}}
    assert headline(timed) == [("stopped at its time limit", "after step 7: 90 minutes")]
    for minutes in ("90", None, [90]):  # a summary.json written by hand or by another version is read as it is
        assert headline({"time_limit": {"minutes": minutes, "step": 7}})[0][1] == f"after step 7: {minutes} minutes"


def test_pairs_say_what_changed():
    def ep(success: bool) -> EpisodeView:
        return EpisodeView(source="s", index=0, success=success)

    assert Pair(ep(False), ep(True)).change == "improved"
    assert Pair(ep(True), ep(False)).change == "regressed"
    assert Pair(ep(True), ep(True)).change == Pair(ep(False), ep(False)).change == "unchanged"


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(JSON)
def test_any_summary_json_flattens_to_text_rows(summary):
    rows = flatten_summary(summary) + headline(summary)
    assert all(isinstance(key, str) and isinstance(value, str) for key, value in rows)


def test_a_training_run_writes_the_per_token_advantages_of_the_steps_it_keeps(run_dir):
    files = sorted(path.name for path in (run_dir / "trajectories").glob("step_*.advantages.jsonl"))
    assert files == ["step_000001.advantages.jsonl", "step_000002.advantages.jsonl"]
    data = load_report(run_dir, plots=False)
    for name in ("step_000001", "step_000002"):
        step = next(s for s in data.sources if s.name == name)
        assert step.advantage_scale > 0 and any(ep.has_advantages for ep in step.episodes)
    assert (run_dir / "report.html").is_file()  # written by train() at its end


# --------------------------------------------------------------------------- an evaluation on env variants
def test_a_variants_evaluation_shows_its_table_and_each_variants_episodes_with_images(tmp_path):
    from turnrl.config import load_config
    from turnrl.eval_config import EvalConfig
    from turnrl.evaluate import run_eval

    out = tmp_path / "variants_eval"
    # Table order, not folder-name order: "lake" comes before "box".
    run_eval(load_config(EvalConfig, None, [
        "policy=random", "episodes=3", f"out={out}", "agent.max_turns=3", "agent.max_actions_per_episode=3",
        "variants=[{name: lake, env: FrozenLake, settings: {mode: image}}, {name: box, env: Sokoban, settings: "
        "{mode: image, size: 5}}]"]))
    assert folder_kind(out) == "evaluation"
    data = load_report(out)
    assert [(row.name, row.env, row.settings) for row in data.variants] == [
        ("lake", "FrozenLake", "mode=image"), ("box", "Sokoban", "mode=image size=5")]
    summary = json.loads((out / "summary.json").read_text())
    for row, figures in zip(data.variants, summary["variants"]):
        assert row.figures == (str(figures["episodes"]), f"{figures['success_rate']:.3f}",
                               f"{figures['mean_reward']:.3f}", f"{figures['format_valid_rate']:.3f}",
                               f"{figures['mean_turns']:.3f}", str(figures["errors"]))
    assert [(source.name, source.label) for source in data.sources] == [
        ("variants/lake/trajectories", "variant lake"), ("variants/box/trajectories", "variant box")]
    assert {ep.env_id for ep in data.sources[1].episodes} == {"Sokoban"} and data.episode_count == 6
    assert not any(key.startswith("variants") for key, _ in data.summary), "the table is not repeated as figures"
    html = (out / "report.html").read_text()
    assert '<a href="#variants">Variants (2)</a>' in html
    assert html.index("<strong>lake</strong>") < html.index("<strong>box</strong>")
    sources = image_sources(html)
    assert any(src.startswith("variants/lake/images/") for src in sources)
    assert any(src.startswith("variants/box/images/") for src in sources)
    assert all((out / src).is_file() for src in sources)
    assert "line 1 of variants/box/trajectories.jsonl" in html


def test_a_bad_table_in_summary_json_is_a_note_and_its_values_are_escaped(tmp_path):
    (tmp_path / "variants").mkdir()
    bad = "<script>alert(1)</script>"
    (tmp_path / "summary.json").write_text(json.dumps({"variants": [
        {"variant": bad, "env": bad, "settings": {bad: bad}, "episodes": True, "success_rate": "high"}, [1], 3]}))
    data = load_report(tmp_path, plots=False)
    assert [row.name for row in data.variants] == [bad]
    assert data.variants[0].figures == ("-",) * 6
    assert sum("is not a row of the table" in warning for warning in data.warnings) == 2
    html = render_html(data)
    assert html.count("<script") == 1 and "&lt;script&gt;alert(1)&lt;/script&gt;" in html


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(JSON, max_size=4) | st.lists(st.dictionaries(st.sampled_from(
    ["variant", "env", "settings", "episodes", "success_rate", "mean_turns"]), JSON, max_size=6), max_size=4) | JSON)
def test_any_variants_table_reads_to_text_rows(rows):
    table = variant_rows({"variants": rows}, [])
    assert all(isinstance(value, str) for row in table for value in (row.name, row.env, row.settings, *row.figures))


def test_a_nan_reward_is_shown_as_nan_never_as_zero(tmp_path):
    """A reward function that returned NaN: the page marks NaN where the reward is shown (the turn, its named
    reward, the episode's total) and says so at the top, instead of a plausible +0."""
    from tests.viz.test_records import episode

    record = episode(2, total_reward=float("nan"))
    record["turns"][0].update(reward=float("nan"), rewards={"env": float("nan"), "format": 0.0})
    folder = tmp_path / "eval"
    folder.mkdir()
    (folder / "trajectories.jsonl").write_text(json.dumps(record) + "\n")  # NaN, as json.dumps writes it
    html = write_report(folder).read_text()
    nan = '<span class="badge bad" title="not a finite number">NaN</span>'
    assert f"reward <strong>{nan}</strong>" in html  # the episode's total, in its summary line
    assert f"· reward <strong>{nan}</strong>" in html and f"· env {nan}" in html  # the turn's
    assert "· reward <strong>+1</strong>" in html  # the finite turn as before
    assert "1 episode(s) have a NaN or infinite reward" in html
    assert "+0</strong>" not in html and "+nan" not in html and ">nan<" not in html


def trainer_episodes(n_episodes: int, n_turns: int, env_metrics: dict[str, float] | None = None) -> list:
    """Image episodes as the rollout records them (:class:`~turnrl.rollout.trajectory.Trajectory`), one image per
    observation and one of the final observation, each turn a real response with its parsed fields."""
    import numpy as np

    from turnrl.agent.formats import ParsedResponse
    from turnrl.rollout.trajectory import Trajectory, TurnRecord

    episodes = []
    for index in range(n_episodes):
        frames = [np.full((8, 8, 3), (index * 40 + k) % 256, dtype=np.uint8) for k in range(n_turns + 1)]
        turns = [TurnRecord(index=k, observation=f"Turn {k + 1}: the box is left of you. " * 4,
                            response=f"<think>step {k + 1}: push the box left</think><answer>Left</answer>",
                            response_ids=[1, 2, 3], response_logprobs=[-0.1] * 3, finish_reason="stop",
                            parsed=ParsedResponse(("Left",), {"think": f"step {k + 1}", "answer": "Left"}, True),
                            actions=["Left"], actions_valid=[True], actions_effective=[k % 2 == 0],
                            rewards={"env": -0.1, "format": 0.5}, reward=0.4)
                 for k in range(n_turns)]
        episodes.append(Trajectory("Sokoban", seed=index, group=index, sample=0, system_prompt="Sokoban.",
                                   turns=turns, final_observation="the end", status="truncated",
                                   truncation_reason="max_turns", images=frames[:-1], final_images=frames[-1:],
                                   env_metrics=dict(env_metrics or {"boxes_on_target": 0.0})))
    return episodes


def test_long_episodes_show_their_first_and_last_turns_and_say_how_many_are_left_out(tmp_path):
    """A 200-turn image episode drew every turn: an evaluation of 128 of them (random Sokoban, up to 200 turns)
    made a page of 12 MB, a run of 18 such files 244 MB. Each episode now draws its first and last
    ``max_turns / 2`` turns, with a note of the turns between."""
    from turnrl.rollout.trajectory import write_trajectories
    from turnrl.viz.records import DEFAULT_MAX_TURNS

    long, short = tmp_path / "long", tmp_path / "short"
    write_trajectories(trainer_episodes(3, 200), long)
    write_trajectories(trainer_episodes(3, DEFAULT_MAX_TURNS), short)
    html = write_report(long).read_text()
    assert html.count('<div class="turn">') == 3 * (DEFAULT_MAX_TURNS + 1)  # + the final observation
    half = DEFAULT_MAX_TURNS // 2
    assert html.count(f"{200 - DEFAULT_MAX_TURNS} more turns (turns {half + 1} to {200 - half} of 200) not shown") == 3
    shown = [int(n) for n in re.findall(r"<strong>Turn (\d+)</strong>", html)]
    assert shown == 3 * [*range(1, half + 1), *range(201 - half, 201)]
    assert "· 200 turns" in html  # the summary line counts every turn
    # images stay on their own turns, the final frame included
    images = image_sources(html)
    assert images[half] == f"images/trajectories_00000_{200 - half:03d}.png"
    assert images[2 * half] == "images/trajectories_00000_final0.png"
    assert "3 episode(s) have more than" in html and "--max-turns N" in html
    assert len(html) < 1.5 * len(write_report(short).read_text())  # bounded by the turns drawn, not the episode's
    assert "--max-turns" not in write_report(short).read_text()
    every = write_report(long, max_turns=200).read_text()
    assert every.count('<div class="turn">') == 3 * 201 and "more turns" not in every
    with pytest.raises(ValueError, match="at least 1"):
        write_report(long, max_turns=0)


def test_a_non_finite_env_figure_is_shown_as_such_never_as_zero(tmp_path):
    """An env figure that is NaN or infinite (as json.dumps writes it in the episode's ``env_metrics``) read 0,
    where rewards already showed NaN."""
    from turnrl.rollout.trajectory import write_trajectories

    folder = tmp_path / "eval"
    write_trajectories(trainer_episodes(1, 2, {"boxes_on_target": math.nan, "distance": math.inf, "moves": 2.0}),
                       folder)
    html = write_report(folder).read_text()
    bad = '<span class="badge bad" title="not a finite number">{}</span>'
    assert f'<span class="chip">boxes_on_target {bad.format("NaN")}</span>' in html
    assert f'<span class="chip">distance {bad.format("inf")}</span>' in html
    assert '<span class="chip">moves 2</span>' in html
    assert "boxes_on_target 0<" not in html and "distance 0<" not in html
    assert "1 episode(s) have a NaN or infinite env figure" in html

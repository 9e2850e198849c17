"""Reading run and evaluation files: typed records from good lines, warnings (never exceptions) from bad ones."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from turnrl.viz.records import (
    TokenAdvantages,
    TurnView,
    parse_episode,
    parse_episode_line,
    parse_metrics_line,
    parse_token_advantages,
    read_metrics,
    read_source,
    safe_relative_path,
    source_label,
    source_name,
    split_turns,
    spread_step_files,
    token_advantage_records,
    trajectory_files,
    write_token_advantages,
)

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)
# Records shaped like trajectory lines, with any value in any field.
RECORD_KEYS = ["env_id", "seed", "status", "success", "turns", "images", "total_reward", "error", "index", "prompt",
               "response", "fields", "actions", "actions_valid", "rewards", "reward", "num_response_tokens",
               "weights_version"]
RECORDS = st.recursive(
    JSON, lambda inner: st.dictionaries(st.sampled_from(RECORD_KEYS), inner, max_size=8) | st.lists(inner, max_size=3),
    max_leaves=30,
)


def no_images(value) -> list[str]:
    return []


def turn(index: int, response: str = "<answer>Up</answer>", **extra) -> dict:
    return {"index": index, "prompt": f"obs {index}", "response": response, "finish_reason": "stop",
            "format_ok": True, "fields": {"answer": "Up"}, "parse_errors": [], "actions": ["Up"],
            "actions_valid": [True], "rewards": {"env": 1.0, "format": 0.0}, "reward": 1.0, "reward_errors": [],
            "num_response_tokens": 3, **extra}


def episode(n_turns: int = 2, images: list[str] | None = None, **extra) -> dict:
    return {"env_id": "FrozenLake", "seed": 3, "group": 1, "sample": 0, "status": "done", "truncation_reason": None,
            "success": True, "error": None, "total_reward": float(n_turns), "system_prompt": "s",
            "final_observation": "end", "images": images or [], "turns": [turn(k) for k in range(n_turns)], **extra}


def write_png(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (4, 4), (200, 10, 10)).save(path)


# --------------------------------------------------------------------------- one line
def test_a_trajectory_line_becomes_typed_turns():
    view = parse_episode(episode(2), "step_000003", 7, no_images)
    assert (view.source, view.index, view.env_id, view.seed, view.success, view.status) == (
        "step_000003", 7, "FrozenLake", 3, True, "done")
    assert [t.index for t in view.turns] == [0, 1]
    assert view.turns[1].actions == ["Up"] and view.turns[1].actions_valid == [True]
    assert view.named_rewards == {"env": 2.0, "format": 0.0}
    assert not view.has_advantages


def test_the_envs_figures_and_which_moves_changed_nothing_are_read():
    record = episode(2, env_metrics={"boxes_on_target": 0.5, "deadlocked": 1, "bad": "x"})
    record["turns"][1]["actions_effective"] = [False]
    view = parse_episode(record, "trajectories", 0, no_images)
    assert view.env_metrics == {"boxes_on_target": 0.5, "deadlocked": 1.0}
    assert view.turns[1].actions_effective == [False] and view.turns[0].actions_effective == []


def test_each_turn_s_weights_version_is_read_and_older_files_have_none():
    record = episode(2)
    record["turns"][0]["weights_version"] = 3
    record["turns"][1]["weights_version"] = 4  # the weights changed between the turns (a partial rollout)
    assert [t.weights_version for t in parse_episode(record, "step_000005", 0, no_images).turns] == [3, 4]
    assert [t.weights_version for t in parse_episode(episode(2), "step_000005", 0, no_images).turns] == [None, None]
    record["turns"][0]["weights_version"] = "3"
    assert parse_episode(record, "step_000005", 0, no_images).turns[0].weights_version is None


def test_images_go_one_per_turn_then_to_the_final_observation_else_to_the_episode():
    urls = lambda value: list(value or [])  # noqa: E731 - the paths as they are
    one_each = parse_episode(episode(2, ["a.png", "b.png"]), "s", 0, urls)
    assert [t.images for t in one_each.turns] == [["a.png"], ["b.png"]] and not one_each.images
    with_final = parse_episode(episode(2, ["a.png", "b.png", "c.png"]), "s", 0, urls)
    assert with_final.final_images == ["c.png"]
    unknown = parse_episode(episode(2, ["a.png", "b.png", "c.png", "d.png"]), "s", 0, urls)
    assert unknown.images == ["a.png", "b.png", "c.png", "d.png"] and not any(t.images for t in unknown.turns)
    # A record that says which turn showed which image is taken at its word.
    record = episode(2, ["a.png", "b.png"])
    record["turns"][1]["images"] = ["b.png"]
    own = parse_episode(record, "s", 0, urls)
    assert [t.images for t in own.turns] == [[], ["b.png"]]


def test_the_records_final_images_are_the_final_observations():
    urls = lambda value: list(value or [])  # noqa: E731 - the paths as they are
    view = parse_episode(episode(2, ["a.png", "b.png"], final_images=["end.png"]), "s", 0, urls)
    assert [t.images for t in view.turns] == [["a.png"], ["b.png"]] and view.final_images == ["end.png"]
    # Truncated by the context budget: the last image was shown, for a turn that never came; the final one wins.
    cut = parse_episode(episode(2, ["a.png", "b.png", "c.png"], final_images=["c2.png"]), "s", 0, urls)
    assert cut.final_images == ["c2.png"]
    paths = lambda value: [v for v in value if isinstance(v, str)] if isinstance(value, list) else []  # noqa: E731
    assert parse_episode(episode(2, final_images="end.png"), "s", 0, paths).final_images == []  # not a list


def test_wrong_types_become_defaults():
    record = {"env_id": 5, "seed": "x", "success": "yes", "total_reward": "1.5", "turns": [
        {"index": "0", "actions": "Up", "rewards": {"env": "1", "format": True, "x": 2}, "actions_valid": [1, 0]}, 3]}
    view = parse_episode(record, "s", 0, no_images)
    assert (view.env_id, view.seed, view.success, view.total_reward) == ("?", 0, False, 0.0)
    assert view.turns[0].actions == [] and view.turns[0].rewards == {"x": 2.0}
    assert view.turns[0].actions_valid == [True, False]
    assert view.turns[1].parse_errors  # a turn that is not an object says so


def test_a_non_finite_reward_is_read_as_it_is_written_not_as_zero():
    """A reward function's NaN is written by json.dumps as NaN (and by strict writers as null): read as 0 it would
    pass for a plausible reward."""
    record = episode(3, total_reward=float("nan"))
    record["turns"][0].update(reward=float("nan"), rewards={"env": float("nan"), "judge": None, "format": 0.0})
    record["turns"][1].update(reward=float("-inf"))
    del record["turns"][2]["reward"]  # a record without it: the default
    view = parse_episode_line(json.dumps(record), "s", 0, no_images)
    first = view.turns[0]
    assert math.isnan(first.reward) and math.isnan(first.rewards["env"]) and math.isnan(first.rewards["judge"])
    assert first.rewards["format"] == 0.0 and view.turns[1].reward == -math.inf and view.turns[2].reward == 0.0
    assert math.isnan(view.total_reward) and view.has_non_finite_reward
    assert not parse_episode(episode(2), "s", 0, no_images).has_non_finite_reward
    without_total = episode(2)
    del without_total["total_reward"]
    without_total["turns"][1]["reward"] = float("inf")
    assert parse_episode(without_total, "s", 0, no_images).total_reward == math.inf  # the turns' sum


def test_a_non_finite_env_figure_is_read_as_it_is_written_not_as_zero():
    record = episode(2, env_metrics={"boxes_on_target": float("nan"), "distance": float("-inf"), "strict": None,
                                     "moves": 3, "bad": "x"})
    view = parse_episode_line(json.dumps(record), "s", 0, no_images)
    figures = view.env_metrics
    assert math.isnan(figures["boxes_on_target"]) and math.isnan(figures["strict"])
    assert figures["distance"] == -math.inf and figures["moves"] == 3.0 and "bad" not in figures
    assert view.has_non_finite_figure and not view.has_non_finite_reward
    assert not parse_episode(episode(2, env_metrics={"moves": 3}), "s", 0, no_images).has_non_finite_figure


@given(n_turns=st.integers(0, 60), limit=st.none() | st.integers(1, 70))
@FAST
def test_split_turns_keeps_the_first_and_last_within_the_limit(n_turns, limit):
    turns = [TurnView(index=k) for k in range(n_turns)]
    head, hidden, tail = split_turns(turns, limit)
    assert head + turns[len(head):len(head) + hidden] + tail == turns
    assert len(head) + len(tail) == (n_turns if limit is None else min(n_turns, limit))
    assert hidden == 0 or len(head) - len(tail) in (0, 1)  # how it began and how it ended, alike


def test_read_source_says_which_episodes_it_cut(tmp_path):
    path = tmp_path / "trajectories.jsonl"
    path.write_text("".join(json.dumps(episode(n)) + "\n" for n in (3, 9, 12)))
    warnings: list[str] = []
    source = read_source(path, tmp_path, 10, warnings, max_turns=4)
    assert [ep.turn_parts[1] for ep in source.episodes] == [0, 5, 8]
    assert [len(ep.turns) for ep in source.episodes] == [3, 9, 12]  # the turns are kept: sums and counts use them
    assert warnings == ["trajectories.jsonl: 2 episode(s) have more than 4 turns (the longest 12); each shows its "
                        "first 2 and last 2 (turnrl view --max-turns N shows more)"]


@pytest.mark.parametrize("line", ["", "not json", "[1, 2]", "3", "null", "{" * 5000 + "}" * 5000])
def test_a_line_that_is_not_an_object_is_a_value_error(line):
    with pytest.raises(ValueError):
        parse_episode_line(line, "s", 0, no_images)


@FAST
@given(st.text(max_size=200))
def test_any_text_line_parses_or_is_a_value_error(line):
    try:
        parse_episode_line(line, "s", 0, no_images)
    except ValueError:
        pass


@FAST
@given(RECORDS)
def test_any_json_record_parses_or_is_a_value_error(record):
    try:
        view = parse_episode(record, "s", 0, no_images)
    except ValueError:
        assert not isinstance(record, dict)
    else:
        assert isinstance(record, dict) and all(isinstance(t.response, str) for t in view.turns)


@pytest.mark.parametrize("text, ok", [
    ("images/a.png", True), ("a.png", True), ("../a.png", False), ("images/../../a.png", False), ("/etc/passwd", False),
    ("javascript:alert(1)", False), ("", False), ("C:\\x.png", False), ("a\x00.png", False),
])
def test_image_paths_must_stay_inside_the_folder(text, ok):
    assert (safe_relative_path(text) is not None) == ok


@FAST
@given(st.text(max_size=60))
def test_safe_relative_paths_never_climb(text):
    path = safe_relative_path(text)
    assert path is None or (not path.is_absolute() and ".." not in path.parts)


# --------------------------------------------------------------------------- files
def test_read_source_resolves_images_and_warns_about_bad_lines_and_missing_files(tmp_path):
    folder = tmp_path / "run"
    write_png(folder / "trajectories" / "images" / "a.png")
    lines = [json.dumps(episode(1, ["images/a.png"])), "garbage", json.dumps(episode(1, ["images/missing.png"])),
             json.dumps(episode(1, ["../../outside.png"]))]
    (folder / "trajectories" / "step_000004.jsonl").write_text("\n".join(lines) + "\n")
    warnings: list[str] = []
    source = read_source(folder / "trajectories" / "step_000004.jsonl", folder, 10, warnings)
    assert (source.name, source.label, source.step, source.total) == ("step_000004", "step 4", 4, 4)
    assert [ep.index for ep in source.episodes] == [0, 2, 3]
    assert source.episodes[0].turns[0].images == ["trajectories/images/a.png"]
    assert source.episodes[1].turns[0].images == [] and source.episodes[2].turns[0].images == []
    assert any("1 line(s) could not be read" in w and "line 2" in w for w in warnings)
    assert any("2 image(s) missing or outside" in w for w in warnings)


def test_a_missing_image_leaves_its_turn_without_one_and_the_others_in_their_places(tmp_path):
    """One image per turn and the final observation's: a missing one must not shift every later image onto the
    turn before it (the final frame shown as the last turn's)."""
    for name in ("t0.png", "t2.png", "final.png"):
        write_png(tmp_path / "images" / name)
    paths = [f"images/{name}" for name in ("t0.png", "t1.png", "t2.png", "final.png")]
    (tmp_path / "trajectories.jsonl").write_text(json.dumps(episode(3, paths)) + "\n")
    warnings: list[str] = []
    view = read_source(tmp_path / "trajectories.jsonl", tmp_path, 10, warnings).episodes[0]
    assert [t.images for t in view.turns] == [["images/t0.png"], [], ["images/t2.png"]]
    assert view.final_images == ["images/final.png"] and not view.images
    assert any("1 image(s) missing" in w and "t1.png" in w for w in warnings)


def test_a_non_finite_reward_is_a_note_of_the_file(tmp_path):
    record = episode(2)
    record["turns"][1]["reward"] = float("nan")
    (tmp_path / "trajectories.jsonl").write_text(json.dumps(episode(2)) + "\n" + json.dumps(record) + "\n")
    warnings: list[str] = []
    read_source(tmp_path / "trajectories.jsonl", tmp_path, 10, warnings)
    assert any("1 episode(s) have a NaN or infinite reward" in w for w in warnings)


def test_read_source_keeps_the_first_episodes_and_says_how_many_there_were(tmp_path):
    (tmp_path / "trajectories.jsonl").write_text("".join(json.dumps(episode(1)) + "\n" for _ in range(5)))
    warnings: list[str] = []
    source = read_source(tmp_path / "trajectories.jsonl", tmp_path, 2, warnings)
    assert len(source.episodes) == 2 and source.total == 5 and source.label == "evaluation"
    assert any("first 2 of 5" in w for w in warnings)


def test_a_last_line_the_run_is_still_writing_is_left_out_and_said_so(tmp_path):
    whole = json.dumps(episode(1)) + "\n"
    (tmp_path / "trajectories.jsonl").write_text(whole * 3 + whole[:40])  # as a reader sees a file mid-write
    warnings: list[str] = []
    source = read_source(tmp_path / "trajectories.jsonl", tmp_path, 10, warnings)
    assert (len(source.episodes), source.total) == (3, 3)
    assert warnings == ["trajectories.jsonl: line 4 is cut short and left out (the run is still writing this file, "
                        "or stopped while it wrote it)"]
    warnings.clear()
    assert read_source(tmp_path / "trajectories.jsonl", tmp_path, 2, warnings).total == 3
    assert any("showing the first 2 of 3 episodes" in w for w in warnings)
    (tmp_path / "trajectories.jsonl").write_text(whole * 2 + whole.strip())  # whole, without its newline
    assert read_source(tmp_path / "trajectories.jsonl", tmp_path, 10, []).total == 3


def test_token_advantages_attach_to_their_turns_and_set_the_file_scale(tmp_path):
    (tmp_path / "trajectories").mkdir()
    (tmp_path / "trajectories" / "step_000000.jsonl").write_text(json.dumps(episode(2)) + "\n")
    write_token_advantages(tmp_path / "trajectories" / "step_000000.advantages.jsonl", [
        {"episode": 0, "turn": 1, "tokens": ["<answer>", "Up", "</answer>"], "advantages": [0.5, -1.5, 0.25]},
        {"episode": 0, "turn": 9, "tokens": [], "advantages": []},  # no such turn
        {"episode": 5, "turn": 0, "tokens": ["x"], "advantages": [9.0]},  # an episode not shown
    ])
    with (tmp_path / "trajectories" / "step_000000.advantages.jsonl").open("a") as handle:
        handle.write('{"episode": 0, "turn": 0, "tokens": ["a"], "advantages": []}\n')
    warnings: list[str] = []
    source = read_source(tmp_path / "trajectories" / "step_000000.jsonl", tmp_path, 10, warnings)
    turns = source.episodes[0].turns
    assert turns[0].advantages is None
    assert turns[1].advantages == TokenAdvantages(("<answer>", "Up", "</answer>"), (0.5, -1.5, 0.25))
    assert source.advantage_scale == 1.5 and source.episodes[0].has_advantages
    assert any("2 line(s) skipped" in w and "no turn 9" in w and "1 tokens but 0" in w for w in warnings)


def test_a_nan_advantage_is_kept_and_the_scale_is_that_of_the_finite_ones(tmp_path):
    (tmp_path / "trajectories").mkdir()
    (tmp_path / "trajectories" / "step_000000.jsonl").write_text(json.dumps(episode(2)) + "\n")
    write_token_advantages(tmp_path / "trajectories" / "step_000000.advantages.jsonl", [
        {"episode": 0, "turn": 0, "tokens": ["a", "b"], "advantages": [float("nan"), -0.5]},
        {"episode": 0, "turn": 1, "tokens": ["c"], "advantages": [0.25]},
    ])
    source = read_source(tmp_path / "trajectories" / "step_000000.jsonl", tmp_path, 10, [])
    values = source.episodes[0].turns[0].advantages
    assert values is not None and math.isnan(values.advantages[0]) and values.advantages[1] == -0.5
    assert source.advantage_scale == 0.5


def test_heatmaps_are_drawn_for_the_first_whole_episodes_within_the_token_budget(tmp_path):
    (tmp_path / "trajectories").mkdir()
    (tmp_path / "trajectories" / "step_000001.jsonl").write_text("".join(json.dumps(episode(2)) + "\n"
                                                                         for _ in range(3)))
    write_token_advantages(tmp_path / "trajectories" / "step_000001.advantages.jsonl", [
        {"episode": e, "turn": k, "tokens": ["a", "b", "c"], "advantages": [0.1, -0.2, 0.5 * (e + 1)]}
        for e in range(3) for k in range(2)])  # 6 tokens an episode
    warnings: list[str] = []
    source = read_source(tmp_path / "trajectories" / "step_000001.jsonl", tmp_path, 10, warnings, 13)
    assert [ep.has_advantages for ep in source.episodes] == [True, True, False]
    assert all(turn.advantages is not None for ep in source.episodes[:2] for turn in ep.turns)  # never half of one
    assert source.advantage_scale == 1.5  # the colours mean the same whatever is drawn
    assert warnings == ["trajectories/step_000001.advantages.jsonl: per-token advantages drawn for the first 2 of 3 "
                        "episodes (12 tokens) to keep the page light (turnrl view --max-heatmap-tokens N draws more)"]
    assert [ep.has_advantages for ep in read_source(tmp_path / "trajectories" / "step_000001.jsonl", tmp_path, 10,
                                                    [], 5).episodes] == [False] * 3


@FAST
@given(st.text(max_size=200) | JSON.map(json.dumps))
def test_any_advantages_line_parses_or_is_a_value_error(line):
    try:
        episode_index, turn_index, values = parse_token_advantages(line)
    except ValueError:
        return
    assert episode_index >= 0 and len(values.tokens) == len(values.advantages)


def test_files_of_a_run_come_in_training_order(tmp_path):
    trajectories = tmp_path / "trajectories"
    trajectories.mkdir()
    for name in ("val_after_rl", "step_000010", "step_000002", "val_before_rl", "step_000002.advantages"):
        (trajectories / f"{name}.jsonl").write_text("")
    (tmp_path / "sft").mkdir()
    (tmp_path / "sft" / "demos_sample.jsonl").write_text("")
    assert [p.name for p in trajectory_files(tmp_path)] == [
        "demos_sample.jsonl", "val_before_rl.jsonl", "step_000002.jsonl", "step_000010.jsonl", "val_after_rl.jsonl"]
    assert source_label("val_after_rl") == ("validation after RL", None)
    assert source_label("something") == ("something", None)


def test_a_long_runs_step_files_are_spread_from_the_first_step_to_the_last():
    steps = [Path(f"run/trajectories/step_{step:06d}.jsonl") for step in range(1, 41)]
    others = [Path("run/sft/demos_sample.jsonl"), Path("run/trajectories/val_before_rl.jsonl")]
    after = Path("run/trajectories/val_after_rl.jsonl")
    files = [*others, *steps, after]
    kept, left_out = spread_step_files(files, 5)
    assert [p.name for p in kept] == ["demos_sample.jsonl", "val_before_rl.jsonl", "step_000001.jsonl",
                                      "step_000011.jsonl", "step_000021.jsonl", "step_000030.jsonl",
                                      "step_000040.jsonl", "val_after_rl.jsonl"]
    assert left_out == 35
    assert spread_step_files(files, 1) == ([*others, steps[-1], after], 39)  # the latest step
    assert spread_step_files(files, 40) == (files, 0) and spread_step_files(files[:3], 1) == (files[:3], 0)
    with pytest.raises(ValueError, match="at least 1"):
        spread_step_files(files, 0)


@FAST
@given(st.integers(1, 60), st.integers(1, 70))
def test_spread_step_files_keeps_exactly_the_limit_with_both_ends(n_steps, limit):
    steps = [Path(f"step_{step:06d}.jsonl") for step in range(1, n_steps + 1)]
    kept, left_out = spread_step_files(steps, limit)
    assert len(kept) == min(n_steps, limit) and left_out == n_steps - len(kept)
    assert kept == sorted(kept) and kept[-1] == steps[-1] and (limit == 1 or kept[0] == steps[0])


# --------------------------------------------------------------------------- metrics
def test_metrics_lines_keep_finite_numbers_with_their_step(tmp_path):
    assert parse_metrics_line('{"step": 3, "a": 1.5, "b": null, "c": "x", "d": true}') == {"a": 1.5, "step": 3.0}
    assert parse_metrics_line('{"a": 1}') is None and parse_metrics_line("[]") is None
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "a": 1}\noops\n\n{"step": 2, "a": 2}\n')
    warnings: list[str] = []
    assert [r["a"] for r in read_metrics(path, warnings)] == [1.0, 2.0]
    assert warnings == ["metrics.jsonl: 1 line(s) could not be read"]
    assert read_metrics(tmp_path / "absent.jsonl") == []


def test_non_finite_metrics_can_be_kept_as_nan_for_the_plots(tmp_path):
    line = '{"step": 3, "a": null, "b": NaN, "c": Infinity, "d": 2, "e": "x", "f": true}'
    assert parse_metrics_line(line) == {"d": 2.0, "step": 3.0}  # what the run's own readers take
    kept = parse_metrics_line(line, keep_non_finite=True)
    assert kept is not None and sorted(kept) == ["a", "b", "c", "d", "step"] and kept["d"] == 2.0
    assert all(kept[key] != kept[key] for key in "abc")  # NaN: a gap in a curve, not a line across it
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "a": 1}\n{"step": 2, "a": null}\n{"step": 3, "a": 3}\n')
    assert [len(r) for r in read_metrics(path)] == [2, 1, 2]
    assert [r["a"] == r["a"] for r in read_metrics(path, keep_non_finite=True)] == [True, False, True]


@FAST
@given(st.text(max_size=200) | JSON.map(json.dumps))
def test_any_metrics_line_parses_or_is_none(line):
    record = parse_metrics_line(line)
    assert record is None or "step" in record


# --------------------------------------------------------------------------- written by training
def test_token_advantage_records_of_one_turn_samples():
    """Turn mode: each row is one turn; the prompt's tokens (loss mask 0) are left out."""
    records = token_advantage_records(
        input_ids=[[1, 2, 10, 11, 0], [1, 12, 13, 14, 0]],
        loss_mask=[[0, 0, 1, 1, 0], [0, 1, 1, 1, 0]],
        advantages=[[9, 9, 0.5, 0.5, 9], [9, -1, -1, -1, 9]],
        turn_end_index=[[3], [3]],
        episode=[4, 4],
        turn=[0, 1],
        decode=lambda i: f"t{i}",
    )
    assert records == [
        {"episode": 4, "turn": 0, "tokens": ["t10", "t11"], "advantages": [0.5, 0.5]},
        {"episode": 4, "turn": 1, "tokens": ["t12", "t13", "t14"], "advantages": [-1.0, -1.0, -1.0]},
    ]


def test_token_advantage_records_of_whole_trajectories_split_at_turn_ends():
    """Trajectory mode: one row holds every turn; observation tokens between turns are left out."""
    records = token_advantage_records(
        input_ids=[[1, 10, 11, 2, 3, 12, 0]],
        loss_mask=[[0, 1, 1, 0, 0, 1, 0]],
        advantages=[[0, 0.25, 0.5, 0, 0, 0.75, 0]],
        turn_end_index=[[2, 5, -1]],
        episode=[0],
        turn=[-1],
        decode=str,
    )
    assert records == [
        {"episode": 0, "turn": 0, "tokens": ["10", "11"], "advantages": [0.25, 0.5]},
        {"episode": 0, "turn": 1, "tokens": ["12"], "advantages": [0.75]},
    ]


@pytest.mark.parametrize("mode", ["turn", "trajectory"])
def test_token_advantage_records_of_a_real_batch_give_each_turn_its_sampled_tokens(tiny_tokenizer, mode):
    """The trainer's batch (either sample mode) maps back to every turn's sampled ids, in order."""
    import torch

    from tests.training.test_batch import play
    from turnrl.training.batch import collate, trajectory_samples, turn_samples

    trajectories, _ = play(tiny_tokenizer)
    episode_ids = [4, 5, 6]  # lines of the step's trajectories file
    make = turn_samples if mode == "turn" else trajectory_samples
    batch = collate(make(trajectories, episode_ids), tiny_tokenizer.pad_token_id)
    advantages = torch.arange(batch.input_ids.numel(), dtype=torch.float).reshape(batch.input_ids.shape) / 64
    records = token_advantage_records(
        batch.input_ids.tolist(), batch.loss_mask.tolist(), advantages.tolist(), batch.turn_end_index.tolist(),
        batch.episode.tolist(), batch.turn.tolist(), decode=lambda i: tiny_tokenizer.decode([i]))
    by_turn = {(r["episode"], r["turn"]): r for r in records}
    assert len(by_turn) == len(records) == sum(len(t.turns) for t in trajectories)
    for episode, trajectory in zip(episode_ids, trajectories):
        for turn in trajectory.turns:
            record = by_turn[(episode, turn.index)]
            assert record["tokens"] == [tiny_tokenizer.decode([i]) for i in turn.response_ids]
            assert len(record["advantages"]) == len(turn.response_ids)
            assert record["advantages"] == sorted(record["advantages"])  # positions in order, none skipped twice


def test_each_variants_file_has_a_name_of_its_own_and_comes_in_table_order(tmp_path):
    for name in ("b-8x8", "a-lake", "c-extra"):
        (tmp_path / "variants" / name).mkdir(parents=True)
        (tmp_path / "variants" / name / "trajectories.jsonl").write_text("")
    (tmp_path / "variants" / "no-file").mkdir()
    files = trajectory_files(tmp_path, ["b-8x8", "a-lake", "gone"])
    assert [p.parent.name for p in files] == ["b-8x8", "a-lake", "c-extra"]
    assert [source_name(p, tmp_path) for p in files] == [
        "variants/b-8x8/trajectories", "variants/a-lake/trajectories", "variants/c-extra/trajectories"]
    assert source_label("variants/b-8x8/trajectories") == ("variant b-8x8", None)
    assert source_name(tmp_path / "trajectories" / "step_000002.jsonl", tmp_path) == "step_000002"

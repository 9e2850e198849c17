"""``run_eval`` end to end: scripted and model policies, summary.json, trajectories.jsonl, images."""

from __future__ import annotations

import inspect
import json
import os
import re
import signal
from dataclasses import fields
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image

from tests.envs.toy_envs import Corridor, CorridorWithExtras
from tests.envservice.env_helpers import env_server
from turnrl.config import AgentConfig, ConfigError, load_config
from turnrl.envs import make
from turnrl.envs.catalog import env_names
from turnrl.eval_config import VARIANT_SETS, EvalConfig
from turnrl.evaluate import default_eval_dir, env_budget, eval_envs, run_eval, variants_override
from turnrl.rollout.metrics import first_errors
from turnrl.rollout.runner import Rollout
from turnrl.rollout.trajectory import ERROR, Trajectory
from turnrl.training.logger import RunProgress
from turnrl.training.train_config import TrainConfig

# The expert plays one action per turn, so an episode needs as many turns as
# the solver's plan has steps. The default budget (5 turns, 10 actions) would
# truncate longer plans (a 6x6 Sokoban level or a maze can take 15+ moves) and
# count them as failures; 100 matches the envs' own max_steps, so only the
# policy decides the outcome.
RECIPES = Path(__file__).resolve().parents[1] / "configs"
TRAINING_SECTIONS = {f.name for f in fields(TrainConfig)} - {f.name for f in fields(EvalConfig)}
LONG_EPISODES = ["agent.max_turns=100", "agent.max_actions_per_episode=100"]

SUMMARY_KEYS = {
    "episodes", "success_rate", "pass_at_k", "mean_turns", "format_valid_rate", "action_validity", "action_effective",
    "env_metrics",
    "mean_reward", "mean_env_reward", "mean_rewards", "errors", "truncated_rate", "env", "policy", "format", "cut_by_budget",
    "cut_by", "first_errors", "budget",
}
TURN_KEYS = {
    "index", "prompt", "response", "finish_reason", "format_ok", "fields", "parse_errors", "actions",
    "actions_valid", "actions_effective", "rewards", "reward", "reward_errors", "num_response_tokens", "state_key",
    "response_prefix", "weights_version",
}


def evaluate(tmp_path, *overrides: str) -> tuple[dict, list[dict]]:
    out = tmp_path / "eval"
    summary = run_eval(load_config(EvalConfig, None, [*overrides, f"out={out}"]))
    assert json.loads((out / "summary.json").read_text()) == summary
    lines = (out / "trajectories.jsonl").read_text().splitlines()
    return summary, [json.loads(line) for line in lines]


def check_records(records: list[dict], expert: bool = False) -> None:
    """Every episode record holds every turn with its prompt, response, parse and rewards (and, where the expert
    played, the solver's actions)."""
    for record in records:
        turns = record["turns"]
        assert turns, "an episode that reset cleanly has at least one turn"
        assert [turn["index"] for turn in turns] == list(range(len(turns)))
        for turn in turns:
            assert set(turn) == TURN_KEYS | ({"expert_actions"} if expert else set())
            assert turn["prompt"].startswith(f"Turn {turn['index'] + 1}.")
            assert len(turn["actions"]) == len(turn["actions_valid"]) == len(turn["actions_effective"])
            assert set(turn["rewards"]) == {"env", "format"}
            assert turn["reward"] == pytest.approx(turn["rewards"]["env"] + turn["rewards"]["format"])
        assert record["total_reward"] == pytest.approx(sum(turn["reward"] for turn in turns))


@pytest.mark.parametrize("env", ["Sokoban", "FrozenLake"])
def test_expert_solves_every_episode(env, tmp_path):
    summary, records = evaluate(tmp_path, f"env.id={env}", "policy=expert", "episodes=24", *LONG_EPISODES)
    assert summary["success_rate"] == 1.0
    assert summary["pass_at_k"] == {"1": 1.0}
    assert summary["format_valid_rate"] == 1.0 and summary["action_validity"] == 1.0
    assert summary["errors"] == 0 and summary["truncated_rate"] == 0.0
    assert len(records) == 24
    assert all(r["status"] == "done" and r["success"] for r in records)
    assert [r["seed"] for r in records] == list(range(24)), "validation seeds from val_start"
    if env == "Sokoban":  # the solver's plans only push boxes onto targets and never waste a move
        assert summary["env_metrics"] == {"boxes_on_target": 1.0, "deadlocked": 0.0}
        assert summary["action_effective"] == 1.0
    check_records(records, expert=True)
    assert all(turn["expert_actions"] == turn["actions"] for record in records for turn in record["turns"]), \
        "an expert without random moves plays its solver's actions"
    # Each turn's actions are the solver's plan from that state: replaying them solves the level.
    replay = make(env)
    for record in records[:6]:
        replay.reset(seed=record["seed"])
        for action in (a for turn in record["turns"] for a in turn["actions"]):
            *_, info = replay.step(action)
        assert info["success"]


@pytest.mark.parametrize("env", ["Sokoban", "FrozenLake"])
def test_random_policy_does_worse_than_the_expert(env, tmp_path):
    summary, records = evaluate(tmp_path, f"env.id={env}", "policy=random", "episodes=24", *LONG_EPISODES)
    assert summary["success_rate"] < 0.75
    assert summary["success_rate"] == np.mean([r["success"] for r in records])
    assert summary["format_valid_rate"] == 1.0, "random actions are still well formatted"
    if env == "Sokoban":  # random moves walk into walls and push boxes where no target can be reached
        assert summary["action_effective"] < 1.0 and summary["env_metrics"]["deadlocked"] > 0.0


def test_samples_per_seed_give_pass_at_k_and_groups(tmp_path):
    summary, records = evaluate(
        tmp_path, "env.id=FrozenLake", "policy=random", "episodes=5", "samples_per_seed=4", "agent.max_turns=6",
        "agent.max_actions_per_episode=6",
    )
    assert summary["episodes"] == 20
    assert set(summary["pass_at_k"]) == {"1", "2", "4"}
    assert summary["pass_at_k"]["1"] <= summary["pass_at_k"]["2"] <= summary["pass_at_k"]["4"]
    assert summary["pass_at_k"]["1"] == pytest.approx(summary["success_rate"])
    assert [(r["seed"], r["sample"]) for r in records] == [(s, k) for s in range(5) for k in range(4)]


def test_builtin_tiny_model_runs_end_to_end(tmp_path, builtin_dir, tiny_model_dir):
    summary, records = evaluate(
        tmp_path,
        "env.id=FrozenLake",
        "policy=builtin",
        "model.builtin_preset=tiny",
        f"model.builtin_dir={builtin_dir}",
        "model.device=cpu",
        "episodes=3",
        "batch_size=2",  # two rollout batches
        "agent.max_turns=2",
        "sampling.max_new_tokens=12",
    )
    assert SUMMARY_KEYS <= set(summary)
    assert summary["episodes"] == 3 and summary["errors"] == 0
    for key in ("success_rate", "format_valid_rate", "action_validity", "truncated_rate"):
        assert 0.0 <= summary[key] <= 1.0
    assert 1 <= summary["mean_turns"] <= 2
    assert set(summary["pass_at_k"]) == {"1"}
    assert isinstance(summary["mean_reward"], float)
    assert len(records) == 3
    check_records(records)
    for record in records:
        for turn in record["turns"]:
            assert 1 <= turn["num_response_tokens"] <= 12
            assert turn["finish_reason"] in ("stop", "length")
    assert summary["mean_reward"] == pytest.approx(np.mean([r["total_reward"] for r in records]))
    assert summary["mean_turns"] == pytest.approx(np.mean([len(r["turns"]) for r in records]))


def test_a_models_evaluation_repeats_to_the_token_and_its_seed_decides_the_samples(tmp_path, tiny_model_dir):
    """Sampling at temperature 1 drew from wherever torch's generator stood: the same evaluation run twice gave
    other responses, and ``seeds.seed`` changed nothing."""
    def responses(name: str, *overrides: str) -> list[str]:
        _, records = evaluate(tmp_path / name, "env.id=FrozenLake", f"policy={tiny_model_dir}", "model.device=cpu",
                              "episodes=2", "agent.max_turns=1", "sampling.temperature=1.0",
                              "sampling.max_new_tokens=8", *overrides)
        return [turn["response"] for record in records for turn in record["turns"]]

    first = responses("first")
    assert responses("again") == first
    assert responses("other_seed", "seeds.seed=1") != first


def test_image_mode_eval_writes_pngs_beside_the_trajectories(tmp_path):
    summary, records = evaluate(
        tmp_path, "env.id=Maze2D", "env.settings.mode=image", "policy=expert", "episodes=3",
        "agent.format=no_think", "agent.max_actions_per_turn=4", *LONG_EPISODES,
    )
    assert summary["success_rate"] == 1.0
    out = tmp_path / "eval"
    written = sorted((out / "images").glob("*.png"))
    listed = [path for record in records for path in record["images"] + record["final_images"]]
    assert all(len(r["images"]) == len(r["turns"]) for r in records), "one image per observation shown"
    assert all(len(r["final_images"]) == 1 for r in records), "and the one the episode ended on"
    assert sorted(str(p.relative_to(out)) for p in written) == sorted(listed)
    first = make("Maze2D", mode="image").reset(seed=records[0]["seed"])[0]["image"]
    np.testing.assert_array_equal(np.asarray(Image.open(out / records[0]["images"][0]).convert("RGB")), first)


def test_text_mode_eval_writes_no_images(tmp_path):
    _, records = evaluate(tmp_path, "env.id=FrozenLake", "policy=expert", "episodes=2", *LONG_EPISODES)
    assert all(record["images"] == [] for record in records)
    assert not (tmp_path / "eval" / "images").exists()


def test_eval_without_out_writes_nothing_and_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    summary = run_eval(load_config(EvalConfig, None, ["env.id=Bandit", "policy=expert", "episodes=4"]))
    assert summary["success_rate"] == 1.0
    assert list(tmp_path.iterdir()) == []
    assert "nothing written" in capsys.readouterr().out


# --------------------------------------------------------------------------- budgets
SHORT_GAMES = {"Game2048": {"target_tile": 128}}
"""Settings that keep an env's expert episodes short here: a game of 2048 to the 2048 tile takes about 1000
expectimax moves (its own tests measure that)."""


@pytest.mark.parametrize("env", env_names())
def test_the_expert_finishes_every_env_within_the_env_budget(env, tmp_path):
    """The budget an env asks for lets a competent agent finish: the expert never gets cut."""
    settings = SHORT_GAMES.get(env, {})
    overrides = [f"env.settings.{key}={value}" for key, value in settings.items()]
    config = load_config(EvalConfig, None, [f"env.id={env}", "policy=expert", "episodes=16", f"out={tmp_path}",
                                            *overrides])
    summary = run_eval(config, budget_from_env=True)
    budget = make(env, **settings).action_budget()
    assert summary["budget"] == {"max_turns": budget, "max_actions_per_episode": budget, "from": "env"}
    assert summary["success_rate"] == 1.0 and summary["cut_by_budget"] == 0 and summary["cut_by"] == {}
    assert load_config(EvalConfig, tmp_path / "config.yaml").agent.max_turns == budget


def test_the_agent_defaults_cut_the_expert_and_the_summary_counts_the_cuts(tmp_path):
    """What a 5-turn budget did to Maze2D before budgets came from the env: every episode cut, and said so."""
    summary, records = evaluate(tmp_path, "env.id=Maze2D", "policy=expert", "episodes=8")
    assert summary["budget"] == {"max_turns": 5, "max_actions_per_episode": 10, "from": "config"}
    assert summary["success_rate"] == 0.0
    assert summary["cut_by_budget"] == 8 and summary["cut_by"] == {"max_turns": 8}
    assert all(r["truncation_reason"] == "max_turns" for r in records)


def test_an_env_without_a_budget_keeps_the_agent_budget_and_says_so(tmp_path):
    summary, _ = evaluate(tmp_path, "env.id=tests.envs.toy_envs:Corridor", "policy=random", "episodes=2")
    config = load_config(EvalConfig, None, ["env.id=tests.envs.toy_envs:Corridor", "policy=random", "episodes=2"])
    from_env = run_eval(config, budget_from_env=True)["budget"]
    assert from_env == {"max_turns": AgentConfig().max_turns,
                        "max_actions_per_episode": AgentConfig().max_actions_per_episode, "from": "agent defaults"}
    assert summary["budget"]["max_turns"] == AgentConfig().max_turns and summary["budget"]["from"] == "config"


def test_a_gymnasium_env_gets_its_own_step_limit(tmp_path):
    """gym:FrozenLake-v1 once got the agent's 5 turns, labelled as the env's: the expert (6 moves) always cut."""
    config = load_config(EvalConfig, None, ["env.id=gym:FrozenLake-v1", "env.settings.is_slippery=false",
                                            "policy=expert", "episodes=2", f"out={tmp_path}"])
    summary = run_eval(config, budget_from_env=True)
    assert summary["budget"] == {"max_turns": 100, "max_actions_per_episode": 100, "from": "env"}
    assert summary["success_rate"] == 1.0 and summary["cut_by_budget"] == 0
    cliff = load_config(EvalConfig, None, ["env.id=gym:CliffWalking-v1", "policy=random", "episodes=1"])
    assert run_eval(cliff, budget_from_env=True)["budget"]["from"] == "agent defaults"  # no step limit to take


def test_bad_env_fails_before_a_model_loads(tmp_path, builtin_dir):
    config = load_config(
        EvalConfig, None, ["env.id=FrozenLake", "env.settings.size=1", "policy=builtin", "model.builtin_preset=tiny",
                           f"model.builtin_dir={tmp_path / 'never_built'}"],
    )
    with pytest.raises(ConfigError, match="size"):
        run_eval(config)
    assert not (tmp_path / "never_built").exists()


def test_a_model_directory_is_a_policy(tmp_path, tiny_model_dir):
    summary, records = evaluate(
        tmp_path, "env.id=Bandit", f"policy={tiny_model_dir}", "model.device=cpu", "episodes=2",
        "sampling.max_new_tokens=6",
    )
    assert summary["episodes"] == 2 and summary["errors"] == 0
    assert all(1 <= turn["num_response_tokens"] <= 6 for r in records for turn in r["turns"])


def test_openai_policy_without_an_endpoint_is_a_config_error(monkeypatch):
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    with pytest.raises(ConfigError, match="base_url"):
        run_eval(load_config(EvalConfig, None, ["env.id=Bandit", "policy=openai:some-model", "episodes=1"]))


def test_eval_of_an_env_that_fails_every_reset_reports_errors(tmp_path, capsys):
    summary, records = evaluate(tmp_path, "env.id=tests.test_evaluate:ResetFails", "policy=random", "episodes=2")
    assert summary["errors"] == 2 and summary["success_rate"] == 0.0 and summary["mean_env_reward"] == 0.0
    assert all(r["status"] == "error" and "reset failed" in r["error"] for r in records)
    # Why they errored is in the summary, not only in trajectories.jsonl.
    line = inspect.getsourcelines(ResetFails.reset)[1] + 1  # its raise
    said = f"env reset failed in turn 1: RuntimeError: no level (raised in reset at test_evaluate.py:{line}) " \
           "(2 episodes)"
    assert summary["first_errors"] == [said]
    assert said in " ".join(capsys.readouterr().out.split())  # the console wraps it


def test_first_errors_count_errors_that_differ_only_in_numbers_as_one():
    def errored(message: str) -> Trajectory:
        return Trajectory(env_id="x", seed=0, group=0, sample=0, status=ERROR, error=message)

    trajectories = [errored("HTTP 400: context is 2048 tokens; asked 2100\ntrace"),
                    errored("HTTP 400: context is 2048 tokens; asked 2300"), errored("boom"), errored(""),
                    Trajectory(env_id="x", seed=0, group=0, sample=0)]
    assert first_errors(trajectories) == ["HTTP 400: context is 2048 tokens; asked 2100 (2 episodes)",
                                          "boom (1 episode)", "unknown error (1 episode)"]
    assert first_errors(trajectories, limit=1) == ["HTTP 400: context is 2048 tokens; asked 2100 (2 episodes)"]


class CountedCorridor(Corridor):
    """A corridor that counts how many of it were built."""

    built = 0

    def __init__(self, length: int = 5) -> None:
        super().__init__(length)
        type(self).built += 1


def test_the_batches_of_an_evaluation_share_one_batchs_envs(tmp_path):
    """Every episode of an evaluation had an env of its own, built before the first batch and kept to the end:
    512 seeds built 512 simulators, or held 512 sessions open on an env server (whose clients may hold 1024)."""
    CountedCorridor.built = 0
    summary, records = evaluate(tmp_path / "batched", "env.id=tests.test_evaluate:CountedCorridor", "policy=expert",
                                "episodes=5", "samples_per_seed=2", "batch_size=4")
    assert CountedCorridor.built == 4
    assert summary["episodes"] == 10 and summary["success_rate"] == 1.0 and summary["errors"] == 0
    assert [(r["seed"], r["sample"]) for r in records] == [(s, k) for s in range(5) for k in range(2)]
    _, whole = evaluate(tmp_path / "whole", "env.id=tests.test_evaluate:CountedCorridor", "policy=expert",
                        "episodes=5", "samples_per_seed=2", "batch_size=10")
    assert [r["turns"] for r in records] == [r["turns"] for r in whole], "a reused env plays its seed's episode"


def test_images_of_earlier_batches_stay_as_they_were_played_when_their_envs_play_on(tmp_path):
    _, records = evaluate(tmp_path, "env.id=Maze2D", "env.settings.mode=image", "policy=expert", "episodes=3",
                          "batch_size=1", "agent.format=no_think", "agent.max_actions_per_turn=4", *LONG_EPISODES)
    for record in records:
        first = make("Maze2D", mode="image").reset(seed=record["seed"])[0]["image"]
        shown = np.asarray(Image.open(tmp_path / "eval" / record["images"][0]).convert("RGB"))
        np.testing.assert_array_equal(shown, first)


class ResetFails:
    """An env whose every reset raises."""

    def reset(self, *, seed=None, options=None):
        raise RuntimeError("no level")

    def step(self, action):
        raise AssertionError("never stepped")

    def instructions(self):
        return "x"

    def action_names(self):
        return ["a"]

    def state_facts(self):
        raise AssertionError("never asked")

    def solve(self):
        return None


# --------------------------------------------------------------------------- env variants
def variant_rows(summary: dict) -> dict[str, dict]:
    return {row["variant"]: row for row in summary["variants"]}


def read_records(folder) -> list[dict]:
    return [json.loads(line) for line in (folder / "trajectories.jsonl").read_text().splitlines()]


def check_rows_against_trajectories(out, summary: dict) -> None:
    """Each row's figures are those of its variant's own summary and trajectories."""
    for row in summary["variants"]:
        folder = out / "variants" / row["variant"]
        assert row["folder"] == f"variants/{row['variant']}"
        own = json.loads((folder / "summary.json").read_text())
        assert {key: own[key] for key in ("episodes", "success_rate", "mean_reward", "format_valid_rate",
                                          "mean_turns", "errors", "budget")} == {
            key: row[key] for key in ("episodes", "success_rate", "mean_reward", "format_valid_rate", "mean_turns",
                                      "errors", "budget")}
        records = read_records(folder)
        assert len(records) == row["episodes"]
        assert {r["env_id"] for r in records} == {row["env"]}
        assert row["success_rate"] == pytest.approx(np.mean([r["success"] for r in records]))
        assert row["mean_reward"] == pytest.approx(np.mean([r["total_reward"] for r in records]))
        assert row["mean_turns"] == pytest.approx(np.mean([len(r["turns"]) for r in records]))
        turns = [t for r in records for t in r["turns"]]
        assert row["format_valid_rate"] == pytest.approx(np.mean([t["format_ok"] for t in turns]))


def test_the_expert_solves_every_sokoban_variant_of_ragens_set(tmp_path):
    out = tmp_path / "eval"
    config = load_config(EvalConfig, None, ["policy=expert", "episodes=6", f"out={out}"])
    config.variants = list(VARIANT_SETS["ragen"])
    summary = run_eval(config, budget_from_env=True)
    assert json.loads((out / "summary.json").read_text()) == summary
    assert [row["variant"] for row in summary["variants"]] == [
        "sokoban-6x6-1box", "sokoban-8x8-2boxes", "sokoban-alt-vocab", "frozenlake-4x4"]
    rows = variant_rows(summary)
    for name in ("sokoban-6x6-1box", "sokoban-8x8-2boxes", "sokoban-alt-vocab"):
        assert rows[name]["env"] == "Sokoban"
        assert rows[name]["success_rate"] == 1.0 and rows[name]["format_valid_rate"] == 1.0
        assert rows[name]["errors"] == 0 and rows[name]["budget"]["from"] == "env"
    assert rows["frozenlake-4x4"]["settings"] == {"size": 4, "p_frozen": 0.9, "is_slippery": True, "success_rate": 0.8}
    assert summary["episodes"] == 24 and summary["policy"] == "expert"
    check_rows_against_trajectories(out, summary)
    # Each variant plays its own env: 8x8 rooms, RAGEN's alternative symbols, FrozenLake's lake.
    first = {name: read_records(out / "variants" / name)[0]["turns"][0]["prompt"] for name in rows}
    assert len([line for line in first["sokoban-8x8-2boxes"].splitlines() if line.startswith("#")]) == 8
    assert "W" in first["sokoban-alt-vocab"] and "A" in first["sokoban-alt-vocab"]
    assert "#" not in first["sokoban-alt-vocab"]
    assert "#" not in first["frozenlake-4x4"]
    # A variant's folder holds the config that evaluates it alone.
    alone = load_config(EvalConfig, out / "variants" / "sokoban-alt-vocab" / "config.yaml")
    assert (alone.env.id, alone.env.settings, alone.variants) == (
        "Sokoban", {"size": 6, "num_boxes": 1, "symbols": "alt"}, [])
    page = (out / "report.html").read_text()
    assert '<section id="variants">' in page
    for name, row in rows.items():
        assert f"<strong>{name}</strong>" in page and f"variant {name}" in page
        assert f"{row['success_rate']:.3f}" in page


def test_variants_of_the_trained_env_keep_its_settings_and_other_envs_take_their_own():
    config = load_config(EvalConfig, None, [
        "env.id=Sokoban", "env.settings={size: 6, num_boxes: 1, max_steps: 50}", "variants=[{name: larger, settings: "
        "{size: 8, num_boxes: 2}}, {name: lake, env: FrozenLake, settings: {size: 5}}, {name: same}]"])
    larger, lake, same = eval_envs(config)
    assert (larger.env_id, larger.settings, larger.own_settings) == (
        "Sokoban", {"size": 8, "num_boxes": 2, "max_steps": 50}, {"size": 8, "num_boxes": 2})
    assert (lake.env_id, lake.settings) == ("FrozenLake", {"size": 5})
    assert (same.env_id, same.settings, same.own_settings) == ("Sokoban", {"size": 6, "num_boxes": 1, "max_steps": 50},
                                                               {})
    config.env.val_settings = {"size": 7}  # validation's settings are the ones a variant starts from
    assert eval_envs(config)[0].settings == {"size": 8, "num_boxes": 2}
    (alone,) = eval_envs(load_config(EvalConfig, None, ["env.id=Sokoban", "env.settings.size=7"]))
    assert (alone.name, alone.env_id, alone.settings) == ("", "Sokoban", {"size": 7})


@pytest.mark.parametrize(("variant", "needles"), [
    ("{name: big, settings: {num_boxs: 2}}", ["variant 'big'", "no setting num_boxs", "did you mean num_boxes"]),
    ("{name: big, settings: {symbols: klingon}}", ["variant 'big'", "symbols must be one of"]),
    ("{name: lake, env: FrozenLak}", ["variant 'lake'", "unknown env 'FrozenLak'", "did you mean FrozenLake"]),
])
def test_a_bad_variant_setting_is_a_config_error_naming_the_variant_before_a_model_loads(variant, needles, tmp_path):
    config = load_config(EvalConfig, None, [
        "env.id=Sokoban", "policy=builtin", "model.builtin_preset=tiny", f"model.builtin_dir={tmp_path / 'never'}",
        f"out={tmp_path / 'out'}", f"variants=[{{name: fine}}, {variant}]"])
    with pytest.raises(ConfigError) as info:
        run_eval(config)
    for needle in needles:
        assert needle in str(info.value)
    assert "\n" not in str(info.value)
    assert not (tmp_path / "never").exists() and not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def ragen_run(tiny_model_dir, tmp_path_factory):
    """A one-step run of RAGEN's Sokoban recipe from the tiny model: a real run folder with its checkpoint."""
    from turnrl.training.commands import train
    from turnrl.training.train_config import TrainConfig

    out = tmp_path_factory.mktemp("runs")
    train(load_config(TrainConfig, RECIPES / "ragen_sokoban.yaml", [
        f"model.path={tiny_model_dir}", "model.device=cpu", "model.gradient_checkpointing=false",
        f"run.output_dir={out}", "run.name=ragen", "run.steps=1", "run.tensorboard=false", "sft.enabled=false",
        "env.settings.max_steps=60", "groups.n_groups=2", "groups.group_size=2", "validation.episodes=1",
        "sampling.max_new_tokens=8", "algorithm.mini_batch_size=4", "algorithm.micro_batch_size=4"]))
    return out / "ragen"


def test_a_checkpoint_plays_every_variant_with_its_runs_agent_settings(ragen_run, tmp_path, capsys):
    from turnrl.cli import main

    out = tmp_path / "generalization"
    # The run folder names its latest checkpoint; its config.yaml gives the agent, prompt and sampling settings.
    assert main(["eval", "--policy", str(ragen_run), "--variants", "ragen", "--episodes", "2", "--out", str(out),
                 "sampling.max_new_tokens=8"]) == 0
    printed = capsys.readouterr().out
    actor = ragen_run / "checkpoints" / "step_000001" / "actor"
    assert f"with the run's config {ragen_run / 'config.yaml'}" in " ".join(printed.split())
    summary = json.loads((out / "summary.json").read_text())
    assert summary["policy"] == str(actor) and summary["format"] == "ragen"
    assert summary["temperature"] == 0.5, "the run's validation temperature, not its training one (1.0)"
    rows = variant_rows(summary)
    assert list(rows) == [variant.name for variant in VARIANT_SETS["ragen"]]
    for name, row in rows.items():
        assert row["episodes"] == 2 and row["errors"] == 0
        assert row["budget"] == {"max_turns": 5, "max_actions_per_episode": 10, "from": "config"}
        assert 0.0 <= row["success_rate"] <= 1.0 and 0.0 <= row["format_valid_rate"] <= 1.0
        assert 1 <= row["mean_turns"] <= 5
        assert name in printed
    check_rows_against_trajectories(out, summary)
    trained = load_config(EvalConfig, ragen_run / "config.yaml", skip_sections=TRAINING_SECTIONS)
    for name in rows:
        alone = load_config(EvalConfig, out / "variants" / name / "config.yaml")
        assert alone.agent == trained.agent, "only the env changes from variant to variant"
        assert alone.sampling.max_new_tokens == 8 and alone.sampling.temperature == 0.5
        assert alone.policy == str(actor)
        record = read_records(out / "variants" / name)[0]
        assert "<answer>" in record["system_prompt"], "RAGEN's response format is asked for in every variant"
    settings = {name: load_config(EvalConfig, out / "variants" / name / "config.yaml").env.settings for name in rows}
    assert settings["sokoban-8x8-2boxes"] == {"size": 8, "num_boxes": 2, "max_steps": 60, "search_depth": 10}, \
        "the run's other settings"
    assert settings["frozenlake-4x4"] == {"size": 4, "p_frozen": 0.9, "is_slippery": True, "success_rate": 0.8}
    page = (out / "report.html").read_text()
    assert all(f"<strong>{name}</strong>" in page for name in rows)


def test_a_checkpoint_evaluates_at_a_temperature_the_command_sets(ragen_run, tmp_path):
    from turnrl.cli import main

    out = tmp_path / "eval"
    actor = ragen_run / "checkpoints" / "step_000001" / "actor"
    assert main(["eval", "--policy", str(actor), "--episodes", "1", "--out", str(out), "sampling.temperature=0.9",
                 "sampling.max_new_tokens=4"]) == 0
    alone = load_config(EvalConfig, out / "config.yaml")
    assert (alone.env.id, alone.agent.format, alone.sampling.temperature) == ("Sokoban", "ragen", 0.9)


def test_a_lora_runs_checkpoint_plays_from_another_folder(tiny_model_dir, tmp_path, monkeypatch):
    """A LoRA run's checkpoint holds adapters only: it plays as the model under them with the adapters merged,
    found from any folder though the run was started with a relative ``model.path``."""
    from turnrl.cli import main
    from turnrl.training.commands import train

    monkeypatch.chdir(tmp_path)
    model = os.path.relpath(tiny_model_dir, tmp_path)  # as a user gives it: relative to where they are
    train(load_config(TrainConfig, RECIPES / "ragen_sokoban.yaml", [
        f"model.path={model}", "model.device=cpu", "model.gradient_checkpointing=false", "run.output_dir=runs",
        "run.name=lora", "run.steps=1", "run.tensorboard=false", "sft.enabled=false", "lora.enabled=true", "lora.r=4",
        "env.settings.max_steps=60", "groups.n_groups=2", "groups.group_size=2", "validation.episodes=1",
        "sampling.max_new_tokens=8", "algorithm.mini_batch_size=4",
        "algorithm.micro_batch_size=4"]))
    actor = tmp_path / "runs" / "lora" / "checkpoints" / "step_000001" / "actor"
    assert (actor / "adapter_config.json").is_file() and not (actor / "config.json").exists()
    assert Path(json.loads((actor / "adapter_config.json").read_text())["base_model_name_or_path"]).is_absolute()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert main(["eval", "--policy", str(tmp_path / "runs" / "lora"), "--episodes", "1", "--out", "eval",
                 "sampling.max_new_tokens=4"]) == 0
    summary = json.loads((elsewhere / "eval" / "summary.json").read_text())
    assert summary["policy"] == str(actor) and summary["episodes"] == 1 and summary["errors"] == 0


# --------------------------------------------------------------------------- envs on an env server
def open_sessions(url: str) -> int:
    """The server's own count of open sessions (its ``/health``)."""
    return httpx.get(url + "/health", timeout=10).json()["sessions"]


def test_an_eval_on_an_env_server_closes_its_sessions_when_it_returns(tmp_path):
    with env_server() as url:
        config = load_config(EvalConfig, None, [
            "env.id=Sokoban", f"env.remote=[{url}]", "policy=expert", "episodes=6", "batch_size=3",
            f"out={tmp_path / 'eval'}"])
        summary = run_eval(config, budget_from_env=True)  # the budget's query opens a session of its own
        assert summary["episodes"] == 6 and summary["success_rate"] == 1.0
        assert open_sessions(url) == 0


def test_an_eval_of_more_episodes_than_a_client_may_hold_sessions_plays_them_all(tmp_path):
    """Each episode held a session of its own to the end: past the server's sessions per client, resets failed."""
    from turnrl.envservice.options import ServerLimits

    with env_server(limits=ServerLimits(max_sessions_per_client=4)) as url:
        config = load_config(EvalConfig, None, [
            "env.id=Sokoban", f"env.remote=[{url}]", "policy=expert", "episodes=10", "batch_size=3",
            f"out={tmp_path / 'eval'}", *LONG_EPISODES])
        summary = run_eval(config)
        assert summary["errors"] == 0 and summary["first_errors"] == []
        assert summary["episodes"] == 10 and summary["success_rate"] == 1.0
        assert open_sessions(url) == 0


def test_an_eval_on_an_env_server_closes_its_sessions_when_it_fails(tmp_path):
    (tmp_path / "taken").write_text("a file where the output folder should go")
    with env_server() as url:
        config = load_config(EvalConfig, None, [
            "env.id=Sokoban", f"env.remote=[{url}]", "policy=expert", "episodes=4", f"out={tmp_path / 'taken'}"])
        with pytest.raises(FileExistsError):  # after every episode was played: their sessions are open
            run_eval(config, budget_from_env=True)
        assert open_sessions(url) == 0


def test_an_eval_on_an_env_server_interrupted_mid_way_closes_its_sessions(tmp_path, monkeypatch):
    def interrupt(self, advance=1, description=None):  # Ctrl-C once the first batch of episodes has been played
        raise KeyboardInterrupt

    monkeypatch.setattr(RunProgress, "update", interrupt)
    with env_server() as url:
        config = load_config(EvalConfig, None, [
            "env.id=Sokoban", f"env.remote=[{url}]", "policy=expert", "episodes=6", "batch_size=3",
            "variants=[{name: small, settings: {size: 6}}, {name: lake, env: FrozenLake}]"])
        summary = run_eval(config, budget_from_env=True)
        assert summary["stop_signal"] == "SIGINT" and [row["episodes"] for row in summary["variants"]] == [3]
        assert open_sessions(url) == 0


# --------------------------------------------------------------------------- Ctrl-C and SIGTERM
def signal_in_batch(monkeypatch, number: signal.Signals, batch: int) -> None:
    """``number`` arrives while the evaluation plays its ``batch``-th batch (from 1, counted over variants)."""
    run, calls = Rollout.run, []

    def run_signalled(self, slots, sampling):
        calls.append(len(slots))
        if len(calls) == batch:
            signal.raise_signal(number)
        return run(self, slots, sampling)

    monkeypatch.setattr(Rollout, "run", run_signalled)


@pytest.mark.parametrize("number, status", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_stop_mid_evaluation_writes_the_episodes_played_and_exits_with_the_signals_status(number, status,
                                                                                          tmp_path, monkeypatch):
    """A batch scheduler's SIGTERM (or Ctrl-C) in the second batch: the first batch's episodes are summarized and
    written as a whole evaluation's, the batch in progress dropped, and the command says so by its status."""
    from turnrl.cli import main

    signal_in_batch(monkeypatch, number, 2)
    out = tmp_path / "eval"
    handlers = [signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)]
    assert main(["eval", "--env", "FrozenLake", "--policy", "expert", "--episodes", "6", "--out", str(out),
                 "batch_size=2"]) == status
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stop_signal"] == number.name and summary["episodes_planned"] == 6
    assert summary["episodes"] == 2 and summary["success_rate"] == 1.0
    assert len((out / "trajectories.jsonl").read_text().splitlines()) == 2
    assert (out / "config.yaml").is_file()
    assert [signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)] == handlers  # the eval's are gone


def test_a_stop_in_the_second_variant_keeps_the_first_whole_and_the_second_in_part(tmp_path, monkeypatch):
    signal_in_batch(monkeypatch, signal.SIGTERM, 4)  # two batches a variant: the second variant's second batch
    out = tmp_path / "eval"
    summary = run_eval(load_config(EvalConfig, None, [
        "env.id=FrozenLake", "policy=expert", "episodes=4", "batch_size=2", f"out={out}",
        "variants=[{name: small}, {name: wide, settings: {size: 5}}, {name: big, settings: {size: 6}}]"]))
    assert summary["stop_signal"] == "SIGTERM" and summary["variants_planned"] == 3
    assert [(row["variant"], row["episodes"]) for row in summary["variants"]] == [("small", 4), ("wide", 2)]
    wide = json.loads((out / "variants" / "wide" / "summary.json").read_text())
    assert wide["episodes"] == 2 and wide["episodes_planned"] == 4 and wide["stop_signal"] == "SIGTERM"
    assert not (out / "variants" / "big").exists()
    assert json.loads((out / "summary.json").read_text()) == summary


@pytest.mark.parametrize("number, status", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_stop_before_any_episode_ends_the_evaluation_with_nothing_written(number, status, tmp_path, monkeypatch):
    from turnrl.cli import main

    signal_in_batch(monkeypatch, number, 1)
    out = tmp_path / "eval"
    try:
        code = main(["eval", "--env", "FrozenLake", "--policy", "expert", "--episodes", "4", "--out", str(out)])
    except SystemExit as exit:  # as the command's process ends
        code = exit.code
    assert code == status
    assert not (out / "summary.json").exists()


def fail_in_batch(monkeypatch, batch: int) -> None:
    """The rollout of the ``batch``-th batch (from 1, counted over variants) raises, as an engine that dies does."""
    run, calls = Rollout.run, []

    def run_failing(self, slots, sampling):
        calls.append(len(slots))
        if len(calls) == batch:
            raise RuntimeError("CUDA error: an illegal memory access was encountered\nmore lines")
        return run(self, slots, sampling)

    monkeypatch.setattr(Rollout, "run", run_failing)


def test_an_error_mid_evaluation_writes_the_episodes_played_then_is_raised(tmp_path, monkeypatch):
    """A batch whose rollout raised took every finished batch with it: nothing was written."""
    fail_in_batch(monkeypatch, 3)
    out = tmp_path / "eval"
    config = load_config(EvalConfig, None, ["env.id=FrozenLake", "policy=expert", "episodes=6", "batch_size=2",
                                            f"out={out}", *LONG_EPISODES])
    with pytest.raises(RuntimeError, match="illegal memory access"):
        run_eval(config)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["failed"] == "RuntimeError: CUDA error: an illegal memory access was encountered"
    assert summary["episodes"] == 4 and summary["episodes_planned"] == 6 and summary["success_rate"] == 1.0
    assert len((out / "trajectories.jsonl").read_text().splitlines()) == 4


def test_an_error_in_the_second_variant_keeps_the_first_in_the_table_then_is_raised(tmp_path, monkeypatch):
    fail_in_batch(monkeypatch, 3)  # two batches a variant: the second variant's first batch
    out = tmp_path / "eval"
    config = load_config(EvalConfig, None, [
        "env.id=FrozenLake", "policy=expert", "episodes=4", "batch_size=2", f"out={out}",
        "variants=[{name: small}, {name: wide, settings: {size: 5}}]"])
    with pytest.raises(RuntimeError, match="illegal memory access"):
        run_eval(config)
    summary = json.loads((out / "summary.json").read_text())
    assert [(row["variant"], row["episodes"]) for row in summary["variants"]] == [("small", 4)]
    assert summary["failed"].startswith("RuntimeError: CUDA error") and summary["variants_planned"] == 2
    assert (out / "variants" / "small" / "trajectories.jsonl").is_file()


def test_an_error_before_any_batch_ends_is_raised_with_nothing_written(tmp_path, monkeypatch):
    fail_in_batch(monkeypatch, 1)
    out = tmp_path / "eval"
    with pytest.raises(RuntimeError, match="illegal memory access"):
        run_eval(load_config(EvalConfig, None, ["env.id=FrozenLake", "policy=expert", "episodes=4", f"out={out}"]))
    assert not out.exists()


def test_an_eval_whose_second_variant_is_refused_closes_the_first_variants_sessions(tmp_path):
    with env_server() as url:
        config = load_config(EvalConfig, None, [
            "env.id=Sokoban", f"env.remote=[{url}]", "policy=expert",
            "variants=[{name: fine}, {name: big, settings: {num_boxs: 2}}]"])
        with pytest.raises(ConfigError, match="variant 'big'"):
            run_eval(config, budget_from_env=True)  # the first variant's budget query opened a session
        assert open_sessions(url) == 0


def test_the_env_budget_is_the_envs_own_action_budget_or_none():
    agent = AgentConfig(max_turns=3)
    assert env_budget(Corridor(), agent) is None  # no action_budget(): the agent's own budget stays
    budgeted = env_budget(CorridorWithExtras(length=7), agent)
    assert budgeted is not None and (budgeted.max_turns, budgeted.max_actions_per_episode) == (6, 6)


def test_default_eval_dir_is_a_safe_folder_name():
    path = default_eval_dir("gym:FrozenLake-v1", "runs/quickstart/checkpoints/step_000039/actor", now=0)
    assert path.parent == Path("runs/eval")
    assert re.fullmatch(r"gym_FrozenLake-v1-step_000039_actor-\d{8}-\d{6}", path.name)


def test_variants_override_names_what_it_takes(tmp_path):
    assert variants_override("ragen").startswith("variants=[")
    with pytest.raises(ConfigError, match="neither a named list"):
        variants_override(str(tmp_path / "missing.yaml"))
    empty = tmp_path / "empty.yaml"
    empty.write_text("variants: []\n")
    with pytest.raises(ConfigError, match="must hold a list of variants"):
        variants_override(str(empty))
    deep = tmp_path / "deep.yaml"
    deep.write_text("variants: " + "[" * 100_000)  # PyYAML's RecursionError was a traceback
    with pytest.raises(ConfigError, match="not a YAML file .nested deeper than Python can read"):
        variants_override(str(deep))


@pytest.mark.parametrize(("text", "needle"), [
    ("- just\n", "variant 1 ('just') is not a mapping; write each variant as {name: NAME, env: ENV, settings: "
                 "{KEY: VALUE}}"),
    ("- {name: a}\n- {nme: b, env: FrozenLake}\n", "variant 2 ({'nme': 'b', 'env': 'FrozenLake'}) has no key 'nme'; "
                                                   "did you mean name? a variant's keys are name, env, settings"),
    ("- {env: FrozenLake}\n", "has no name; give it name: NAME"),
    ("- {name: a, settings: [1]}\n", "has settings that are not a mapping; write them as settings: {KEY: VALUE}"),
])
def test_a_variant_that_is_not_one_is_named_with_the_fix(text, needle, tmp_path):
    # OmegaConf's words named no fix ("str is not a subclass of VariantConfig"), no close key ('nme'), or another
    # fault than the one made (list settings: "an override sets an item of a list by its index").
    listing = tmp_path / "variants.yaml"
    listing.write_text(text)
    with pytest.raises(ConfigError) as info:
        variants_override(str(listing))
    assert str(info.value).startswith(f"--variants {listing}: ") and needle in str(info.value)


def test_the_summary_holds_each_named_reward_a_state_reward_s_among_them(tmp_path):
    """Only the total and the env's were there: what the grounding reward added (how well a checkpoint sees) was
    in the trajectories alone."""
    from turnrl.cli import main

    out = tmp_path / "eval"
    assert main(["eval", "--env", "FrozenLake", "--policy", "expert", "--episodes", "4", "--out", str(out),
                 "agent.format=grounding", "rewards.extra=[{name: grounding, fn: grounding, weight: 0.5}]"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    named = summary["mean_rewards"]
    assert set(named) == {"env", "format", "grounding"} and named["grounding"] > 0
    assert named["env"] == summary["mean_env_reward"]
    # Each before its weight: the total weighs grounding's by its 0.5.
    assert named["env"] + named["format"] + 0.5 * named["grounding"] == pytest.approx(summary["mean_reward"])

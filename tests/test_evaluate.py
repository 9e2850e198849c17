"""``run_eval`` end to end: scripted and model policies, summary.json, trajectories.jsonl, images."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from turnrl.config import AgentConfig, ConfigError, EvalConfig, load_config
from turnrl.envs import make
from turnrl.envs.registry import env_names
from turnrl.evaluate import first_errors, run_eval
from turnrl.rollout.trajectory import ERROR, Trajectory

# The expert plays one action per turn, so an episode needs as many turns as
# the solver's plan has steps. The default budget (5 turns, 10 actions) would
# truncate longer plans (a 6x6 Sokoban level or a maze can take 15+ moves) and
# count them as failures; 100 matches the envs' own max_steps, so only the
# policy decides the outcome.
LONG_EPISODES = ["agent.max_turns=100", "agent.max_actions_per_episode=100"]

SUMMARY_KEYS = {
    "episodes", "success_rate", "pass_at_k", "mean_turns", "format_valid_rate", "action_validity",
    "mean_reward", "mean_env_reward", "errors", "truncated_rate", "env", "policy", "format", "cut_by_budget",
    "cut_by", "first_errors", "budget",
}
TURN_KEYS = {
    "index", "prompt", "response", "finish_reason", "format_ok", "fields", "parse_errors", "actions",
    "actions_valid", "rewards", "reward", "reward_errors", "num_response_tokens", "state_key",
}


def evaluate(tmp_path, *overrides: str) -> tuple[dict, list[dict]]:
    out = tmp_path / "eval"
    summary = run_eval(load_config(EvalConfig, None, [*overrides, f"out={out}"]))
    assert json.loads((out / "summary.json").read_text()) == summary
    lines = (out / "trajectories.jsonl").read_text().splitlines()
    return summary, [json.loads(line) for line in lines]


def check_records(records: list[dict]) -> None:
    """Every episode record holds every turn with its prompt, response, parse and rewards."""
    for record in records:
        turns = record["turns"]
        assert turns, "an episode that reset cleanly has at least one turn"
        assert [turn["index"] for turn in turns] == list(range(len(turns)))
        for turn in turns:
            assert set(turn) == TURN_KEYS
            assert turn["prompt"].startswith(f"Turn {turn['index'] + 1}.")
            assert len(turn["actions"]) == len(turn["actions_valid"])
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
    check_records(records)
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
    assert summary["first_errors"] == ["env reset failed: RuntimeError: no level (2 episodes)"]
    assert "env reset failed: RuntimeError: no level (2 episodes)" in capsys.readouterr().out


def test_first_errors_count_errors_that_differ_only_in_numbers_as_one():
    def errored(message: str) -> Trajectory:
        return Trajectory(env_id="x", seed=0, group=0, sample=0, status=ERROR, error=message)

    trajectories = [errored("HTTP 400: context is 2048 tokens; asked 2100\ntrace"),
                    errored("HTTP 400: context is 2048 tokens; asked 2300"), errored("boom"), errored(""),
                    Trajectory(env_id="x", seed=0, group=0, sample=0)]
    assert first_errors(trajectories) == ["HTTP 400: context is 2048 tokens; asked 2100 (2 episodes)",
                                          "boom (1 episode)", "unknown error (1 episode)"]
    assert first_errors(trajectories, limit=1) == ["HTTP 400: context is 2048 tokens; asked 2100 (2 episodes)"]


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

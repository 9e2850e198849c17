"""State rewards: the repetition penalty, per-env weights from settings, and grounding/world-model rewards in a
real rollout of the built-in envs (the matching they score with: tests/rewards/test_matching.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tests.rewards.test_matching import FACTS, TRUE_TEXT
from turnrl.agent.formats import ParsedResponse, get_format
from turnrl.config import AgentConfig, ConfigError, RewardsConfig, RewardSpec, SamplingConfig
from turnrl.envs import make
from turnrl.envs.contract import StateFacts, facts_from_positions
from turnrl.policy.scripted import ExpertPolicy
from turnrl.rewards import FinishedTurn, Rewards
from turnrl.rewards.matching import MatchItem
from turnrl.rewards.state import RepetitionPenalty, StateReward
from turnrl.rewards.turn_rewards import load_reward_fn
from turnrl.rollout.groups import EpisodeSlot
from turnrl.rollout.metrics import rollout_metrics
from turnrl.rollout.runner import Rollout


def test_object_weights_from_settings_replace_the_built_in_ones():
    reward = StateReward(object_weights={"FrozenLake": {"weights": {"goal": 1.0}, "aliases": {"prize": "goal"}}})
    item = MatchItem("The prize is directly above the player.", FACTS, "FrozenLake", "observation")
    assert reward.matcher.score([item]) == [1.0]
    with pytest.raises(ValueError, match="weights"):
        StateReward(object_weights={"FrozenLake": {"goal": 1.0}})


# --------------------------------------------------------------------------- repetition penalty
def test_repetition_penalty_hits_frequent_low_scoring_texts_only():
    penalty = RepetitionPenalty(window=4, top_k=1, threshold=0.7, penalty=-0.1)
    assert penalty("generic", 0.2) == 0.0  # first time: not yet frequent
    assert penalty("generic", 0.2) == -0.1  # now the most frequent of the window, and wrong
    assert penalty("generic", 0.9) == 0.0  # frequent but right
    assert penalty("rare", 0.0) == 0.0
    for text in ("a", "b", "c", "d"):  # the window forgets "generic"
        penalty(text, 0.0)
    assert penalty("generic", 0.2) == 0.0
    assert penalty.applied == 1


def test_repetition_penalty_defaults_are_vagens():
    """-0.1 when the text is among the 5 most frequent of the last 1000 and scores below 0.7."""
    penalty = RepetitionPenalty()
    assert (penalty.window, penalty.top_k, penalty.threshold, penalty.penalty) == (1000, 5, 0.7, -0.1)


@pytest.mark.parametrize("settings", [{"window": 0}, {"top_k": 0}, {"window": 0, "top_k": 0}])
def test_a_repetition_window_or_top_k_below_one_is_refused(settings):
    with pytest.raises(ValueError, match="window and top_k must be >= 1"):
        RepetitionPenalty(**settings)


def test_a_repetition_window_of_one_remembers_the_last_text():
    penalty = RepetitionPenalty(window=1, top_k=1)
    assert [penalty("a", 0.0), penalty("a", 0.0), penalty("b", 0.0), penalty("a", 0.0)] == [0.0, -0.1, 0.0, 0.0]


@pytest.mark.parametrize(("window", "top_k", "texts", "penalties"), [
    (3, 1, "aaabaa", [0.0, -0.1, -0.1, 0.0, -0.1, -0.1]),  # after "b" the window is a, a, b: "a" still leads
    (2, 2, "aaba", [0.0, -0.1, 0.0, -0.1]),  # one "a" of two left the window: the other still counts
    (1, 2, "aba", [0.0, 0.0, 0.0]),  # a text that left the window is not frequent, even among the top 2
])
def test_repetition_counts_each_text_in_the_window_and_forgets_the_oldest_one_at_a_time(window, top_k, texts,
                                                                                         penalties):
    penalty = RepetitionPenalty(window=window, top_k=top_k)
    assert [penalty(text, 0.0) for text in texts] == penalties


def test_a_frequent_text_that_scores_the_threshold_is_not_penalized():
    penalty = RepetitionPenalty(window=4, top_k=1, threshold=0.7)
    assert [penalty("generic", 0.7), penalty("generic", 0.7), penalty("generic", 0.69)] == [0.0, 0.0, -0.1]


@pytest.mark.parametrize(("settings", "match"), [
    ({"repetition": {"penalty": float("nan")}}, "penalty must be finite"),
    ({"repetition": {"threshold": float("inf")}}, "threshold and penalty must be finite"),
    ({"on_error": float("nan")}, "on_error"),
])
def test_non_finite_settings_are_refused(settings, match):
    """A NaN score made the whole round's reward call fail (every turn scored on_error), not just one turn."""
    with pytest.raises(ValueError, match=match):
        StateReward(**settings)


# --------------------------------------------------------------------------- the reward functions
def turn(text: str, *, format_ok: bool = True, field: str = "observation",
         before: StateFacts | None = FACTS, after: StateFacts | None = FACTS) -> FinishedTurn:
    return FinishedTurn(env_id="FrozenLake", seed=0, turn=0, observation="o", response=text, response_tokens=1,
                        finish_reason="stop", parsed=ParsedResponse(("Up",), {field: text}, format_ok),
                        actions=("Up",), actions_valid=(True,), env_reward=0.0, format_reward=0.0,
                        terminated=False, success=False, facts_before=before, facts_after=after)


def test_only_well_formed_turns_are_judged_and_fields_pick_their_state():
    moved = facts_from_positions((2, 0), [("goal", (1, 0)), ("hole", (0, 2)), ("hole", (3, 3))])
    grounding = StateReward("observation", repetition=False)
    world = StateReward("prediction", repetition=False)
    turns = [turn(TRUE_TEXT), turn(TRUE_TEXT, format_ok=False)]
    assert grounding(turns) == [1.0, 0.0]
    predicted = [turn("The goal is directly above the player.", field="prediction", after=moved)]
    assert world(predicted) == [pytest.approx(0.7)]  # goal right after the move; holes missing
    metrics = grounding.metrics()
    assert metrics["judged_share"] == 0.5 and metrics["match_mean"] == 1.0
    assert grounding.metrics()["judged_share"] == 0.0  # counters restart after each report


def test_the_repetition_penalty_is_added_to_the_score_and_counted_once_per_report():
    grounding = StateReward("observation", repetition={"window": 4, "top_k": 1})
    blind = turn("Nothing to see.")  # scores 0: below the threshold
    assert grounding([blind, blind]) == [0.0, pytest.approx(-0.1)]
    assert grounding.metrics()["repetition_penalties"] == 1.0
    assert grounding([blind]) == [pytest.approx(-0.1)]
    assert grounding.metrics()["repetition_penalties"] == 1.0


def test_with_valid_actions_required_a_turn_with_any_action_the_env_refused_is_not_judged():
    grounding = StateReward("observation", repetition=False, require_valid_actions=True)
    refused = replace(turn(TRUE_TEXT), actions=("Up", "Left"), actions_valid=(True, False))
    taken = replace(turn(TRUE_TEXT), actions=("Up", "Left"), actions_valid=(True, True))
    assert grounding([refused, taken]) == [0.0, 1.0]


def test_a_state_the_rule_cannot_check_scores_on_error_and_is_counted():
    """A PrimitiveSkill or SVG state (no objects, no player) earned the full grounding reward for any text."""
    blank = StateFacts(player=None, extra={"shapes": ["a red circle"]})
    grounding = StateReward("observation", repetition=False, on_error=-0.5)
    assert grounding([turn("Anything at all.", before=blank), turn(TRUE_TEXT)]) == [-0.5, 1.0]
    metrics = grounding.metrics()
    assert metrics["unscored"] == 1.0 and metrics["judged_share"] == 0.5


def test_built_in_names_load_with_settings_and_report_metrics_under_their_name():
    config = RewardsConfig(extra=[
        RewardSpec(name="grounding", fn="grounding", weight=0.5),
        RewardSpec(name="worldmodel", fn="worldmodel", weight=0.5, settings={"repetition": {"top_k": 3}}),
    ])
    rewards = Rewards(config)
    assert rewards.needs_state_facts
    rewards.score([turn(TRUE_TEXT)])
    metrics = rewards.metrics()
    assert metrics["grounding/match_mean"] == 1.0 and "worldmodel/repetition_penalties" in metrics


@pytest.mark.parametrize("env_id, settings", [("FrozenLake", {"size": 4, "p_frozen": 0.8}), ("Sokoban", {}),
                                               ("Maze2D", {})])
def test_the_expert_describes_and_predicts_the_state_exactly_in_a_real_rollout(env_id, settings):
    fmt = get_format("grounding_worldmodeling", max_actions_per_turn=2)
    agent = AgentConfig(format="grounding_worldmodeling", max_turns=4, max_actions_per_turn=2,
                        max_actions_per_episode=8)
    rewards = Rewards(RewardsConfig(extra=[RewardSpec(name="grounding", fn="grounding", weight=0.5),
                                           RewardSpec(name="worldmodel", fn="worldmodel", weight=0.5)]))
    rollout = Rollout(ExpertPolicy(fmt, max_actions_per_turn=2), fmt, agent, env_id, rewards=rewards)
    slots = [EpisodeSlot(env=make(env_id, **settings), seed=seed, group=seed) for seed in range(6)]
    trajectories = rollout.run(slots, SamplingConfig())
    turns = [t for trajectory in trajectories for t in trajectory.turns]
    assert turns and all(t.rewards["grounding"] == 1.0 and t.rewards["worldmodel"] == 1.0 for t in turns)
    metrics = rewards.metrics()
    assert metrics["grounding/judged_share"] == 1.0 and metrics["worldmodel/match_mean"] == 1.0
    per_episode = rollout_metrics(trajectories)
    assert per_episode["reward_grounding_mean"] == pytest.approx(per_episode["turns_mean"])


def test_a_training_run_logs_what_the_state_rewards_report(tiny_model_dir, tmp_path):
    import json

    from turnrl.config import load_config
    from turnrl.training.commands import train
    from turnrl.training.train_config import TrainConfig

    config = load_config(TrainConfig, "configs/vagen_full_frozenlake.yaml", [
        f"model.path={tiny_model_dir}", "model.device=cpu", "model.dtype=float32", f"run.output_dir={tmp_path}",
        "run.steps=1", "run.tensorboard=false", "agent.max_turns=2", "sampling.max_new_tokens=12",
        "groups.n_groups=2", "groups.group_size=2", "validation.episodes=2", "sft.enabled=false",
        "algorithm.mini_batch_size=4", "algorithm.micro_batch_size=4"])
    train(config)
    records = [json.loads(line) for line in (tmp_path / config.run.name / "metrics.jsonl").read_text().splitlines()]
    step = next(r for r in records if "rollout/success" in r)
    for name in ("grounding", "worldmodel"):
        assert 0.0 <= step[f"rewards/{name}/judged_share"] <= 1.0
        assert f"rollout/reward_{name}_mean" in step
        # VAGEN's FrozenLake has no repetition penalty, and the recipe turns it off (Sokoban's keeps it).
        assert f"rewards/{name}/repetition_penalties" not in step


@pytest.mark.parametrize("fn", ["grounding", "worldmodel"])
def test_a_misspelt_setting_of_a_state_reward_names_the_settings_it_takes(fn):
    """It was Python's "__init__() got an unexpected keyword argument 'matchr'"."""
    with pytest.raises(ConfigError) as info:
        load_reward_fn(RewardSpec(name=fn, fn=fn, weight=0.5, settings={"matchr": "judge"}))
    assert str(info.value) == (f"rewards.extra {fn!r} ({fn}) has no setting matchr; did you mean matcher? allowed: "
                               "matcher='rule', judge=None, object_weights=None, repetition=True, on_error=0.0, "
                               "require_valid_actions=False")
    assert load_reward_fn(RewardSpec(name=fn, fn=fn, weight=0.5, settings={"repetition": False})).field == \
        {"grounding": "observation", "worldmodel": "prediction"}[fn]


@pytest.mark.parametrize(("fn", "tag", "writers"), [
    ("grounding", "observation", "grounding or grounding_worldmodeling"),
    ("worldmodel", "prediction", "worldmodeling or grounding_worldmodeling"),
])
def test_a_state_reward_whose_tag_the_format_does_not_write_is_refused_before_anything_plays(fn, tag, writers):
    """Every turn scored 0 under free_think, silently: the reward trained nothing and read as a blind model."""
    rewards = Rewards(RewardsConfig(extra=[RewardSpec(name=fn, fn=fn, weight=0.5)]))
    with pytest.raises(ConfigError) as info:
        Rollout(ExpertPolicy(get_format("free_think")), get_format("free_think"), AgentConfig(), env_id="Sokoban",
                rewards=rewards)
    assert str(info.value) == (f"rewards.extra {fn!r} scores each turn's <{tag}>, which agent.format=free_think does "
                               f"not write (its tags: think, answer): choose a format that does ({writers}), or drop "
                               "the reward")
    Rollout(ExpertPolicy(get_format("grounding_worldmodeling")), get_format("grounding_worldmodeling"), AgentConfig(),
            env_id="Sokoban", rewards=rewards)  # a format that writes both


def test_the_train_command_refuses_it_before_the_model_loads(tmp_path):
    from turnrl.cli import main

    with pytest.raises(SystemExit) as stopped:
        main(["train", "--config", "configs/vagen_full_sokoban_visual.yaml", "agent.format=free_think",
              "model.builtin_preset=vlm-tiny", f"run.output_dir={tmp_path}"])
    assert str(stopped.value).startswith("error: rewards.extra 'grounding' scores each turn's <observation>")
    assert not any(tmp_path.iterdir())

"""State rewards: the description parser, the weighted F1 against a brute-force reference, the repetition
penalty, and grounding/world-model rewards in a real rollout of the built-in envs."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from turnrl.agent.formats import ParsedResponse, get_format
from turnrl.config import AgentConfig, RewardsConfig, RewardSpec, SamplingConfig
from turnrl.envs import make
from turnrl.envs.base import StateFacts, facts_from_positions
from turnrl.envs.games.frozenlake import FrozenLakeEnv
from turnrl.envs.games.sokoban import SokobanEnv
from turnrl.policy.scripted import ExpertPolicy
from turnrl.rewards import FinishedTurn, Rewards
from turnrl.rewards.state import (
    Claim,
    MatchItem,
    RepetitionPenalty,
    RuleMatcher,
    StateReward,
    claim_similarity,
    parse_description,
    parse_relation,
    profile_for,
    weighted_f1,
)
from turnrl.rollout.groups import EpisodeSlot
from turnrl.rollout.metrics import rollout_metrics
from turnrl.rollout.runner import Rollout

LAKE = FrozenLakeEnv.state_reward_profile
# Player at (3, 0); goal straight above at (1, 0); holes at (0, 2) (above right) and (3, 3) (right).
FACTS = facts_from_positions((3, 0), [("goal", (1, 0)), ("hole", (0, 2)), ("hole", (3, 3))])
TRUE_TEXT = ("The goal is directly above the player. The hole is above and to the right of the player. "
             "The hole is directly to the right of the player.")


def score(text: str, facts: StateFacts = FACTS, env_id: str = "FrozenLake") -> float:
    return RuleMatcher().score_one(MatchItem(text, facts, env_id, "observation"))


# --------------------------------------------------------------------------- parsing
@pytest.mark.parametrize("phrase, relation", [
    ("above and to the left of the player", ("above", "left")),
    ("directly above the player", ("above", "same")),
    ("straight to the right", ("same", "right")),
    ("up and left", ("above", "left")),
    ("north-east of you", ("above", "right")),
    ("below, in the same column", ("below", "same")),
    ("in the same row, to the west", ("same", "left")),
    ("at the player's position", ("same", "same")),
    ("somewhere", (None, None)),
])
def test_relations_and_their_synonyms(phrase, relation):
    assert parse_relation(phrase) == relation


def test_prose_with_counts_aliases_plurals_and_cells():
    claims = parse_description(
        "The player is at row 3, column 0. The gift is up; two holes are to the right, and the goal is at (1, 0).",
        ["goal", "hole"], LAKE.aliases)
    assert claims == [
        Claim("player", position=(3, 0)),
        Claim("goal", "above", None),
        Claim("hole", None, "right"), Claim("hole", None, "right"),
        Claim("goal", position=(1, 0)),
    ]


@pytest.mark.parametrize("text", [
    json.dumps([{"name": "goal", "vertical": "above", "horizontal": "same"},
                {"name": "hole", "vertical": "above", "horizontal": "right"},
                {"name": "hole", "vertical": "same", "horizontal": "right"}]),
    json.dumps({"goal": "directly above", "holes": ["above right", {"vertical": "same", "horizontal": "right"}]}),
    "Here you go: " + json.dumps({"objects": [{"object": "target", "position": [1, 0]},
                                               {"type": "hole", "row": 0, "col": 2},
                                               {"kind": "hole", "relation": "directly right"}]}),
    json.dumps({"goal": [1, 0], "hole": [[0, 2], [3, 3]]}),
])
def test_json_descriptions_in_every_accepted_shape_score_like_the_truth(text):
    assert score(text) == pytest.approx(1.0)


@given(st.text(max_size=400))
@settings(max_examples=300, deadline=None)
def test_any_string_parses_and_scores_without_raising(text):
    claims = parse_description(text, ["goal", "hole"], LAKE.aliases)
    assert all(isinstance(claim, Claim) for claim in claims)
    assert 0.0 <= score(text) <= 1.0


@given(st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
                        st.sampled_from(["goal", "hole", "name", "objects", "position", "row", "col", "vertical",
                                         "horizontal", "relation", "player", "x"]), inner, max_size=4),
                    max_leaves=20))
@settings(max_examples=300, deadline=None)
def test_any_json_parses_and_scores_without_raising(value):
    assert 0.0 <= score(json.dumps(value)) <= 1.0


def test_deeply_nested_json_and_huge_texts_are_bounded():
    assert score("[" * 100_000 + "]" * 100_000) == 0.0
    assert score(TRUE_TEXT + " x" * 1_000_000) == pytest.approx(1.0)
    assert len(parse_description("9999999 holes are left", ["hole"])) == 10  # a count is capped


# --------------------------------------------------------------------------- scoring
@pytest.mark.parametrize("text, expected", [
    (TRUE_TEXT, 1.0),  # exact
    ("The hole is directly to the right of the player. The goal is directly above the player. "
     "The hole is above and to the right of the player.", 1.0),  # permuted
    # partial: goal fully right (F1 1), one of two holes right (P 1, R 1/2, F1 2/3)
    ("The goal is directly above the player. The hole is directly to the right of the player.", 0.7 + 0.3 * 2 / 3),
    # missing: no holes at all
    ("The goal is directly above the player.", 0.7),
    # hallucinated: a third hole (P 2/3, R 1 -> F1 0.8)
    (TRUE_TEXT + " The hole is directly below the player.", 0.7 + 0.3 * 0.8),
    # half-right relations: goal said above-left (one axis of two)
    ("The goal is above and to the left of the player. The hole is above and to the right of the player. "
     "The hole is directly to the right of the player.", 0.7 * 0.5 + 0.3),
    ("", 0.0),
    ("The dragon is directly above the player. " + TRUE_TEXT, 1.0),  # kinds the env does not score are ignored
])
def test_frozenlake_scores_by_hand(text, expected):
    assert score(text) == pytest.approx(expected)


def test_sokoban_weighs_boxes_and_targets_equally():
    facts = facts_from_positions((2, 2), [("box", (2, 1)), ("target", (0, 1))])
    assert score("The crate is directly to the left of the player. The goal is up and left.", facts,
                 "Sokoban") == pytest.approx(1.0)
    assert score("The box is directly to the left of the player.", facts, "Sokoban") == pytest.approx(0.5)


def test_other_envs_weigh_every_kind_of_their_facts_equally():
    facts = facts_from_positions((0, 0), [("key", (1, 0)), ("door", (0, 3))])
    assert score("The key is directly below the player.", facts, "my.module:DoorEnv") == pytest.approx(0.5)


def reference_f1(claims, facts, weights):
    """Plain reference: every assignment of claims to true objects tried, per kind."""
    total, weight_sum = 0.0, 0.0
    for kind, weight in weights.items():
        claimed = [c for c in claims if c.name == kind]
        true = [f for f in facts.objects if f.name == kind]
        if not claimed and not true:
            continue
        weight_sum += weight
        if not claimed or not true:
            continue
        best = 0.0
        small, large = (claimed, true) if len(claimed) <= len(true) else (true, claimed)
        for chosen in itertools.permutations(range(len(large)), len(small)):
            pairs = [(small[i], large[j]) for i, j in enumerate(chosen)]
            if small is claimed:
                value = sum(claim_similarity(c, t, facts.player) for c, t in pairs)
            else:
                value = sum(claim_similarity(c, t, facts.player) for t, c in pairs)
            best = max(best, value)
        p, r = best / len(claimed), best / len(true)
        total += weight * (0.0 if best == 0 else 2 * p * r / (p + r))
    return 1.0 if weight_sum == 0 else total / weight_sum


cells = st.tuples(st.integers(0, 4), st.integers(0, 4))


@given(player=cells, goals=st.lists(cells, max_size=2), holes=st.lists(cells, max_size=4),
       claims=st.lists(st.tuples(st.sampled_from(["goal", "hole"]),
                                 st.sampled_from(["above", "below", "same", None]),
                                 st.sampled_from(["left", "right", "same", None]),
                                 st.none() | cells), max_size=5))
@settings(max_examples=300, deadline=None)
def test_hungarian_weighted_f1_equals_the_brute_force_reference(player, goals, holes, claims):
    facts = facts_from_positions(player, [("goal", g) for g in goals] + [("hole", h) for h in holes])
    claims = [Claim(name, v, h, position) for name, v, h, position in claims]
    got = weighted_f1(claims, facts, LAKE.weights).score
    assert got == pytest.approx(reference_f1(claims, facts, LAKE.weights))


def test_a_built_in_envs_profile_is_what_its_class_declares():
    assert profile_for("frozenlake", FACTS) is FrozenLakeEnv.state_reward_profile
    assert profile_for("turnrl/Sokoban-v0", FACTS) is SokobanEnv.state_reward_profile
    assert profile_for("Bandit", FACTS).weights == {"goal": 1.0, "hole": 1.0}  # none declared: equal weights


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
    from turnrl.training.config import TrainConfig
    from turnrl.training.commands import train

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
        assert f"rewards/{name}/repetition_penalties" in step and f"rollout/reward_{name}_mean" in step

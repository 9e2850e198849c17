"""Matching descriptions against the truth: the description parser, and the weighted F1 against a brute-force
reference (the reward functions that use them: tests/rewards/test_state.py)."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from turnrl.envs.contract import ObjectFact, StateFacts, StateRewardProfile, facts_from_positions
from turnrl.envs.games.frozenlake import FrozenLakeEnv
from turnrl.envs.games.sokoban import SokobanEnv
from turnrl.rewards.matching import (
    Claim,
    MatchItem,
    RuleMatcher,
    claim_similarity,
    parse_description,
    parse_relation,
    profile_for,
    weighted_f1,
)

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
    ("northeast of you", ("above", "right")),
    ("to the southwest", ("below", "left")),
    ("upward and rightward", ("above", "right")),
    ("somewhere", (None, None)),
    ("in the same cell as the player", ("same", "same")),
    ("on the player", ("same", "same")),
    # whole words only
    ("a hole that the player must avoid", (None, None)),
    ("on the players route", (None, None)),
    ("the multiplayer's cell", (None, None)),
    ("left of the player's cellar", (None, "left")),
    ("exactly one step up and one step to the left", ("above", "left")),  # both axes named: neither is shared
])
def test_relations_and_their_synonyms(phrase, relation):
    assert parse_relation(phrase) == relation


@pytest.mark.parametrize("joint", [". The", "; the", ", the", ",the", ", and the", " and the"])
def test_a_sentence_semicolon_comma_or_and_before_the_next_object_starts_a_claim(joint):
    text = f"The goal is directly above the player{joint} hole is directly to the right."
    assert parse_description(text, ["goal", "hole"]) == [Claim("goal", "above", "same"), Claim("hole", "same", "right")]


@pytest.mark.parametrize("joint", [" and there is a", ", and there is a", ", there is a"])
def test_there_is_after_an_object_starts_the_next_objects_claim(joint):
    """The second object is not lost, nor its direction given to the first."""
    text = f"The goal is directly above the player{joint} hole directly to the right."
    assert parse_description(text, ["goal", "hole"]) == [Claim("goal", "above", "same"), Claim("hole", "same", "right")]


def test_and_a_bit_goes_on_describing_the_same_object():
    assert parse_description("The goal is above and a bit to the left of the player.", ["goal"]) == [
        Claim("goal", "above", "left")]


@pytest.mark.parametrize("cell", ["row 1, column 0", "row 1 column 0", "row 1, col 0", "row1 col0", "row1,col0",
                                  "(1, 0)", "(1,0)"])
def test_a_cell_is_read_in_each_spelling(cell):
    assert parse_description(f"The goal is at {cell}.", ["goal"]) == [Claim("goal", position=(1, 0))]


def test_a_clause_that_begins_with_an_objects_name_claims_one_of_it():
    assert parse_description("Hole at row 3, column 2.", ["hole"]) == [Claim("hole", position=(3, 2))]


def test_a_plural_in_es_names_its_kind():
    assert parse_description("Two boxes are left of the player.", ["box", "target"]) == [Claim("box", None, "left")] * 2


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


@pytest.mark.parametrize("template", ['{{"hole": {}}}', '{{"objects": {{"hole": {}}}}}',
                                      '{{"goal": [{{"position": {}}}]}}'])
@pytest.mark.parametrize("depth", [3, 600, 990])
def test_lists_nested_deep_under_a_kind_never_raise(template, depth):
    """Within the length parsed (``MAX_TEXT_CHARS``), 600 lists deep under a kind raised RecursionError, failing the
    reward for every turn of the round."""
    text = template.format("[" * depth + "]" * depth)
    assert all(claim.position is None for claim in parse_description(text, ["goal", "hole"]))
    assert 0.0 <= score(text) <= 1.0


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


def test_the_players_cell_is_scored_as_a_kind_only_when_the_description_places_it():
    facts = facts_from_positions((3, 0), [("goal", (1, 0))])
    weights = {"goal": 1.0, "player": 1.0}
    goal = Claim("goal", position=(1, 0))
    assert weighted_f1([goal], facts, weights).f1 == {"goal": 1.0}
    assert weighted_f1([goal, Claim("player", position=(3, 0))], facts, weights).f1 == {"goal": 1.0, "player": 1.0}
    assert weighted_f1([goal, Claim("player", position=(2, 0))], facts, weights).score == pytest.approx(0.5)


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


@pytest.mark.parametrize("none", ["There are no holes.", "There are 0 holes.", "Zero holes are on the board."])
def test_a_count_of_none_claims_no_object(none):
    no_holes = facts_from_positions((0, 0), [("goal", (3, 3))])
    assert parse_description(none, ["goal", "hole"], LAKE.aliases) == []
    assert score("The goal is below and to the right of the player. " + none, no_holes) == pytest.approx(1.0)


def test_prose_names_objects_whose_names_have_several_words():
    facts = facts_from_positions((0, 0), [("red key", (1, 0)), ("key", (0, 2))])
    text = "Two red keys are directly below the player. The key is directly to the right of the player."
    assert parse_description(text, ["red key", "key"]) == [Claim("red key", "below", "same")] * 2 + [
        Claim("key", "same", "right")]
    assert score("The red key is directly below the player. The key is directly to the right of the player.",
                 facts, "my.module:KeyEnv") == pytest.approx(1.0)


def test_an_objects_name_that_ends_the_clause_is_read():
    assert parse_description("To the left of the player is a hole.", ["hole"]) == [Claim("hole", None, "left")]


def test_prose_names_objects_of_at_most_three_words():
    """A longer kind (``MAX_NAME_WORDS``) is never read whole: the words it ends with may name another."""
    assert parse_description("The big red key box is to the left.", ["big red key box", "box"]) == [
        Claim("box", None, "left")]


class KeyLakeEnv(FrozenLakeEnv):
    """A user's env (named by ``module:Class``) that declares its own weights and other names."""

    state_reward_profile = StateRewardProfile({"key": 0.9, "door": 0.1}, {"lock": "door"})


def test_a_module_class_envs_declared_profile_is_used():
    env_id = f"{__name__}:KeyLakeEnv"
    facts = facts_from_positions((0, 0), [("key", (1, 0)), ("door", (0, 3))])
    assert profile_for(env_id, facts) is KeyLakeEnv.state_reward_profile
    assert score("The key is directly below the player.", facts, env_id) == pytest.approx(0.9)
    assert score("The key is directly below the player. The lock is directly to the right of the player.", facts,
                 env_id) == pytest.approx(1.0)
    assert profile_for("no_such_module_here:Env", facts).weights == {"key": 1.0, "door": 1.0}


def test_a_built_in_envs_profile_is_what_its_class_declares():
    assert profile_for("frozenlake", FACTS) is FrozenLakeEnv.state_reward_profile
    assert profile_for("turnrl/Sokoban-v0", FACTS) is SokobanEnv.state_reward_profile
    assert profile_for("Bandit", FACTS).weights == {"goal": 1.0, "hole": 1.0}  # none declared: equal weights


# --------------------------------------------------------------------------- first person, and nothing to score
def test_first_person_relations_ahead_and_behind_are_read():
    """Navigation's facts put ahead/behind of the agent's facing on the vertical axis: the words must count."""
    assert parse_relation("ahead and to the left") == ("ahead", "left")
    assert parse_relation("straight ahead") == ("ahead", "same")
    assert parse_relation("directly behind me") == ("behind", "same")
    assert parse_relation("in front of me, to the right") == ("ahead", "right")
    facts = StateFacts(player=(0, 0), objects=(ObjectFact("red box", (4, -2), "ahead", "left"),
                                               ObjectFact("blue ball", (-3, 0), "behind", "same")))
    text = "The red box is ahead and to the left. The blue ball is directly behind me."
    assert score(text, facts, "Navigation") == pytest.approx(1.0)
    # each object half right (its side, not ahead/behind): F1 0.5 for both kinds
    assert score("The red box is behind and to the left. The blue ball is straight ahead.", facts,
                 "Navigation") == pytest.approx(0.5)


@pytest.mark.parametrize("facts", [StateFacts(player=None, extra={"red_cube": (12, -40, 20), "holding": "nothing"}),
                                   StateFacts(player=None)])
def test_facts_without_objects_or_player_are_unscored_not_a_free_one(facts, caplog):
    """PrimitiveSkill, SVG and the puzzles keep their state in ``extra``: the rule has nothing to check, and any
    text scored 1 (nothing to see, nothing claimed) before."""
    matcher = RuleMatcher()
    with caplog.at_level("WARNING", logger="turnrl.rewards.matching"):
        scores = matcher.score([MatchItem("I like turtles.", facts, "PrimitiveSkill", "observation")] * 2)
    assert scores == [None, None]
    assert sum("matcher: judge" in record.getMessage() for record in caplog.records) == 1  # once per env


def test_a_player_alone_is_still_scored():
    assert score("Nothing here.", StateFacts(player=(1, 1)), "Maze2D") == 1.0  # nothing to see, nothing claimed

"""State-reward weights from settings (``object_weights``): refused at load time where they could only score 0,
each error naming the env and the key."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from turnrl.config import ConfigError, RewardSpec
from turnrl.envs.contract import facts_from_positions
from turnrl.rewards import load_reward_fn
from turnrl.rewards.matching import MatchItem, RuleMatcher, profiles_from_settings

# Player at (2, 2); the goal above left, a hole below right.
FACTS = facts_from_positions((2, 2), [("goal", (1, 1)), ("hole", (3, 3))])
GOAL_ONLY = "The goal is above and to the left of the player."


def lake(weights, **spec) -> dict:
    return {"FrozenLake": {"weights": weights, **spec}}


@pytest.mark.parametrize("weights", [{"goal": 0.0, "hole": 0}, {}])
def test_weights_with_none_positive_are_refused_naming_the_env(weights):
    """All-zero weights scored every description 0 (VAGEN's rule for a zero sum): a reward that never varies."""
    with pytest.raises(ValueError) as info:
        profiles_from_settings(lake(weights))
    assert str(info.value) == (
        f"object_weights['FrozenLake'].weights={weights} gives no kind a positive weight, so every description would "
        "score 0: give the kinds the reward checks weights > 0 (a 0 leaves a kind out)")


def test_the_refusal_comes_when_the_config_loads_the_reward():
    spec = RewardSpec(name="grounding", fn="grounding", settings={"object_weights": lake({"goal": 0, "hole": 0})})
    with pytest.raises(ConfigError, match=r"rewards\.extra 'grounding'.*object_weights\['FrozenLake'\]\.weights="):
        load_reward_fn(spec)


def test_a_zero_beside_a_positive_weight_leaves_its_kind_out():
    profiles = profiles_from_settings(lake({"Goal": 1.0, "hole": 0}))
    assert dict(profiles["FrozenLake"].weights) == {"goal": 1.0, "hole": 0.0}
    item = MatchItem(GOAL_ONLY, FACTS, "FrozenLake", "observation")
    assert RuleMatcher(profiles).score([item]) == [1.0]  # the hole it left out costs nothing


@pytest.mark.parametrize("value", [-0.5, math.nan, math.inf, -math.inf, "heavy", None, True, 10**400, [1.0]],
                         ids=["negative", "nan", "inf", "-inf", "word", "none", "bool", "huge_int", "list"])
def test_a_weight_that_is_no_finite_number_at_least_0_is_refused_naming_its_key(value):
    with pytest.raises(ValueError) as info:
        profiles_from_settings(lake({"goal": 1.0, "hole": value}))
    assert str(info.value).startswith("object_weights['FrozenLake'].weights['hole']=")
    assert str(info.value).endswith(": a weight must be a finite number >= 0 (the share of the reward that kind's "
                                    "F1 carries)")


def test_aliases_that_are_no_mapping_are_refused_clearly():
    """A list of aliases raised AttributeError, which the config load does not turn into a ConfigError."""
    with pytest.raises(ValueError, match=r"object_weights\['FrozenLake'\]\.aliases must map another name"):
        profiles_from_settings(lake({"goal": 1.0}, aliases=["gift"]))


def test_a_kind_given_twice_in_two_cases_is_refused():
    """Kinds are read in lower case: {Goal: 1, goal: 0} silently kept whichever came last."""
    with pytest.raises(ValueError, match="names a kind twice"):
        profiles_from_settings(lake({"Goal": 1.0, "goal": 0.0}))


values = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-3, 3), st.booleans(), st.none(),
                   st.text(max_size=5))


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.text(max_size=6), values, max_size=4),
       st.one_of(st.none(), st.dictionaries(st.text(max_size=4), st.text(max_size=4), max_size=2), st.text(max_size=4)))
def test_any_settings_give_usable_weights_or_a_value_error(weights, aliases):
    try:
        profiles = profiles_from_settings(lake(weights, aliases=aliases))
    except ValueError as error:
        assert "object_weights['FrozenLake']" in str(error)
        return
    kept = profiles["FrozenLake"].weights
    assert all(math.isfinite(w) and w >= 0 for w in kept.values()) and any(w > 0 for w in kept.values())


@pytest.mark.parametrize("configured", ["FrozenLake", "frozenlake", "turnrl/FrozenLake-v0"])
@pytest.mark.parametrize("played", ["FrozenLake", "frozenlake", "turnrl/FrozenLake-v0"])
def test_weights_reach_the_env_however_its_id_is_spelt(configured, played):
    """``env.id`` takes any of these spellings; weights given under one held for that one only, and the others
    silently scored with the built-in weights (goal 0.7 and hole 0.3: a description naming only the goal 0.7)."""
    matcher = RuleMatcher(profiles_from_settings({configured: {"weights": {"goal": 1.0}}}))
    assert matcher.score_one(MatchItem(GOAL_ONLY, FACTS, played, "observation")) == 1.0


def test_one_env_given_twice_in_two_spellings_is_refused():
    with pytest.raises(ValueError, match="names 'FrozenLake' twice"):
        profiles_from_settings({"FrozenLake": {"weights": {"goal": 1}}, "frozenlake": {"weights": {"hole": 1}}})

"""Bandit: conformance, payouts, name splits, one-turn episodes."""

import warnings

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env
from hypothesis import given, settings
from hypothesis import strategies as st

import turnrl.envs  # noqa: F401  (registers the built-in envs)
from tests.envs.games.episodes import assert_same_episode, assert_text_is_data
from turnrl.envs.games.bandit import SPLITS, TEST_PAIRS, TRAIN_PAIRS, BanditEnv, odds_in_words


@pytest.mark.parametrize("mode", ["text", "image"])
@pytest.mark.parametrize("render_mode", [None, "ansi", "rgb_array"])
def test_check_env(mode, render_mode):
    # Gymnasium's checker rejects an env that truncates after its first step;
    # the default max_steps=1 does exactly that for an invalid action, so the
    # check runs with 2 (the dynamics are the same).
    env = gym.make("turnrl/Bandit-v0", mode=mode, render_mode=render_mode, max_steps=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_env(env.unwrapped)


def names(pairs):
    return {arm.name.lower() for pair in pairs for arm in (pair.steady, pair.bold)}


def test_train_and_test_names_are_disjoint():
    assert not names(TRAIN_PAIRS) & names(TEST_PAIRS)
    assert len(names(TRAIN_PAIRS)) == 2 * len(TRAIN_PAIRS)
    assert len(names(TEST_PAIRS)) == 2 * len(TEST_PAIRS)


@pytest.mark.parametrize("split", ["train", "test"])
def test_seed_draws_pair_and_side(split):
    env = BanditEnv(split=split)
    seen_pairs, seen_sides = set(), set()
    for seed in range(200):
        env.reset(seed=seed)
        assert env.pair in SPLITS[split]
        seen_pairs.add(env.pair)
        seen_sides.add(env.bold_first)
        assert env.action_names()[0 if env.bold_first else 1] == env.high_arm
    assert seen_pairs == set(SPLITS[split]) and seen_sides == {True, False}


def test_same_seed_same_episode():
    first = [BanditEnv().reset(seed=s)[0]["text"] for s in range(30)]
    again = [BanditEnv().reset(seed=s)[0]["text"] for s in range(30)]
    assert first == again


def test_same_seed_same_payout_and_the_seeds_draw_both_payouts():
    """The bold arm pays by chance: one seed pays alike on a fresh env and on one that played another episode."""
    rewards = set()
    for seed in range(40):
        episode = assert_same_episode(BanditEnv(mode="image"), BanditEnv(mode="image"), seed,
                                      lambda env, k: env.pair.bold.name, steps=1)
        rewards.add(episode[-1].reward)
    assert rewards == {0.0, 1.0}


def pull_many(env, arm_of, trials, seed=0):
    env.reset(seed=seed)
    rewards = []
    for _ in range(trials):
        env.reset()  # no seed: the payout generator keeps running
        _, reward, terminated, truncated, info = env.step(arm_of(env))
        assert terminated and not truncated and info["action_is_valid"]
        rewards.append(reward)
    return np.array(rewards)


def test_payout_statistics():
    env = BanditEnv()
    high = pull_many(env, lambda e: e.high_arm, 4000)
    assert set(np.unique(high)) <= {0.0, 1.0}
    assert abs(high.mean() - 0.25) < 0.03
    low = pull_many(env, lambda e: e.pair.steady.name, 500)
    assert np.all(low == 0.1)


def test_configurable_payouts():
    env = BanditEnv(low_reward=0.3, high_reward=2.0, high_arm_prob=0.5)
    high = pull_many(env, lambda e: e.high_arm, 4000, seed=1)
    assert set(np.unique(high)) <= {0.0, 2.0}
    assert abs(high.mean() - 1.0) < 0.06
    assert np.all(pull_many(env, lambda e: e.pair.steady.name, 100) == 0.3)


def test_success_solve_and_one_turn():
    env = BanditEnv()
    obs, info = env.reset(seed=5)
    assert not info["success"] and env.solve() == [env.high_arm]
    steady = env.pair.steady.name
    _, reward, terminated, _, info = env.step(steady.upper())  # names are case-insensitive
    assert (reward, terminated, info["success"]) == (0.1, True, False)
    assert env.solve() == []
    _, _, _, _, info = env.step(env.high_arm)  # the episode is over
    assert not info["action_is_valid"]
    env.reset(seed=5)
    _, _, _, _, info = env.step(env.solve()[0])
    assert info["success"] and env.success()
    assert env.state_facts().extra["pulled"] == env.high_arm


@pytest.mark.parametrize(
    "settings, best",
    [
        ({}, "bold"),  # 0.25 * 1.0 against 0.1
        ({"low_reward": 0.5}, "steady"),  # 0.25 against 0.5
        ({"high_arm_prob": 0.05}, "steady"),  # 0.05 against 0.1
        ({"low_reward": 0.3, "high_reward": 2.0, "high_arm_prob": 0.5}, "bold"),  # 1.0 against 0.3
    ],
)
def test_success_and_expert_follow_the_higher_expected_reward(settings, best):
    """The instructions ask for the highest expected reward; success and the expert once always meant the bold
    arm, so with a steady arm worth more the expert pulled the worse arm and an agent that obeyed failed."""
    env = BanditEnv(**settings)
    env.reset(seed=3)
    arms = {"bold": env.pair.bold.name, "steady": env.pair.steady.name}
    best_name, other = arms[best], arms["steady" if best == "bold" else "bold"]
    assert env.solve() == [best_name]
    assert env.step(best_name)[4]["success"]
    env.reset(seed=3)
    assert not env.step(other)[4]["success"]


def test_a_tie_in_expected_reward_makes_either_arm_a_success():
    env = BanditEnv(low_reward=0.25)  # 0.25 * 1.0 = 0.25
    for arm in ("bold", "steady"):
        env.reset(seed=4)
        name = env.pair.bold.name if arm == "bold" else env.pair.steady.name
        assert env.step(name)[4]["success"]


def test_instructions_describe_both_arms_and_odds():
    env = BanditEnv(split="test")
    env.reset(seed=2)
    text = env.instructions()
    for arm in env.arms:
        assert arm.name in text and arm.character in text
    assert "1 pull in 4" in text and "10 times" in text
    assert odds_in_words(0.5) == "about 1 pull in 2"
    assert odds_in_words(0.0) == "never"


def test_instructions_read_as_a_sentence_when_the_steady_arm_pays_nothing():
    env = BanditEnv(low_reward=0.0)
    env.reset(seed=0)
    assert "its large reward is far above the small one." in env.instructions()


def test_image_mode_shows_arms():
    env = BanditEnv(mode="image")
    obs, _ = env.reset(seed=0)
    assert obs["image"].dtype == np.uint8 and obs["image"].ndim == 3
    after = env.step(env.high_arm)[0]
    assert not np.array_equal(after["image"], obs["image"])


BAD_ACTIONS = ["", "Unicorn", "Dragon Phoenix", "x" * 100_000, "龍", None, 1, b"Dragon", ["Dragon"]]


@pytest.mark.parametrize("action", BAD_ACTIONS, ids=range(len(BAD_ACTIONS)))
def test_bad_actions_never_raise(action):
    env = BanditEnv()
    obs, _ = env.reset(seed=0)
    new_obs, reward, terminated, truncated, info = env.step(action)
    assert not info["action_is_valid"] and reward == 0.0
    assert not terminated and truncated  # max_steps=1: the one step is spent
    assert new_obs["text"] == obs["text"] and env.pulled is None


ARM_SPELLINGS = [f" {arm.name.swapcase()}\n" for pair in TRAIN_PAIRS for arm in (pair.steady, pair.bold)]


@settings(max_examples=150, deadline=None)
@given(st.one_of(st.text(max_size=200), st.sampled_from(ARM_SPELLINGS)))
def test_any_text_is_an_arm_or_a_rejection_that_changes_nothing(action):
    env = BanditEnv()
    env.reset(seed=0)
    info = assert_text_is_data(env, action)
    assert info["action_is_valid"] == (action.strip().lower() in {name.lower() for name in env.action_names()})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"split": "val"}, "split"),
        ({"high_arm_prob": 1.5}, "high_arm_prob"),
        ({"low_reward": float("nan")}, "finite"),
        ({"max_steps": 0}, "max_steps"),
    ],
)
def test_constructor_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        BanditEnv(**kwargs)

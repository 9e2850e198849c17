"""Countdown: conformance, scoring, generated instances with known solutions."""

import warnings

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

import turnrl.envs  # noqa: F401  (registers the built-in envs)
from tests.envs.games.episodes import assert_same_episode, cycle, expert_or
from turnrl.envs.games.countdown.arith import evaluate
from turnrl.envs.games.countdown.countdown_env import CountdownEnv, combine, leaf, search_solution


@pytest.mark.parametrize("mode", ["text", "image"])
@pytest.mark.parametrize("render_mode", [None, "ansi", "rgb_array"])
def test_check_env(mode, render_mode):
    # max_steps=2: Gymnasium's checker rejects truncation after one step (see test_bandit).
    env = gym.make("turnrl/Countdown-v0", mode=mode, render_mode=render_mode, max_steps=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_env(env.unwrapped)


def test_observation_format():
    env = CountdownEnv()
    obs, info = env.reset(options={"target": 24, "numbers": [3, 5, 7, 1]})
    assert obs["text"] == "Target 24, nums [3, 5, 7, 1]"
    assert info == {"success": False}
    assert env.state_facts().extra == {"target": 24, "numbers": [3, 5, 7, 1]}
    assert env.action_names() is None


def test_same_seed_same_instance():
    first = [CountdownEnv().reset(seed=s)[0]["text"] for s in range(30)]
    again = [CountdownEnv().reset(seed=s)[0]["text"] for s in range(30)]
    assert first == again and len(set(first)) == 30


@pytest.mark.parametrize(("seed", "policy", "reward"), [(0, expert_or("1 + 1"), 1.0), (1, cycle(["1 + 1"]), 0.0)],
                         ids=["solved", "missed"])
def test_same_seed_same_whole_episode_infos_included(seed, policy, reward):
    episode = assert_same_episode(CountdownEnv(mode="image"), CountdownEnv(mode="image"), seed, policy, steps=1)
    assert episode[-1].reward == reward and episode[-1].terminated


def test_generated_instances_are_solved():
    env = CountdownEnv()
    for seed in range(1000):
        env.reset(seed=seed)
        instance = env.instance
        assert len(instance.numbers) == 4 and all(1 <= n <= 100 for n in instance.numbers)
        assert 1 <= instance.target <= 100
        (answer,) = env.solve()
        _, reward, terminated, truncated, info = env.step(answer)
        assert (reward, terminated, truncated, info["success"]) == (1.0, True, False, True), (instance, answer)


def test_configurable_generation():
    env = CountdownEnv(num_count=3, max_number=10, min_target=20, max_target=50)
    for seed in range(100):
        env.reset(seed=seed)
        assert len(env.instance.numbers) == 3 and all(1 <= n <= 10 for n in env.instance.numbers)
        assert 20 <= env.instance.target <= 50
        assert env.step(env.solve()[0])[1] == 1.0


def play(answer, target=24, numbers=(3, 5, 7, 1)):
    env = CountdownEnv()
    env.reset(options={"target": target, "numbers": list(numbers)})
    obs, reward, terminated, truncated, info = env.step(answer)
    assert terminated and not truncated and info["action_is_valid"]
    assert env.observation_space.contains(obs)
    return reward, info, obs["text"]


@pytest.mark.parametrize(
    ("answer", "reward"),
    [
        ("(5 + 7) * (3 - 1)", 1.0),
        ("(7 - 1) * (5 - 3) * 1", 0.0),  # uses 1 twice
        ("(5+7)*(3-1) = 24", 1.0),  # the right-hand side is ignored
        ("3 * 8", 0.0),  # 8 is not given
        ("3 + 5 + 7 + 1", 0.1),  # right numbers, wrong value
        ("(5 + 7) * 2", 0.0),  # misses 3 and 1
        ("5 * 7 - 3 / 1 - 8", 0.0),
        ("1 * 3 * 7 + 5 - 2", 0.0),
        ("((3 + 5) * (7 - 1)) / 2", 0.0),
        ("(1 + 5) * (7 - 3)", 1.0),
        ("(5 × 7 − 1) ÷ 3 + 7", 0.0),
        ("(5 * 7 - 1) / 3", 0.1),  # the right numbers, but 34/3
    ],
)
def test_scoring(answer, reward):
    assert play(answer)[0] == reward


def test_fractions_along_the_way():
    # 8 / (3 - 8 / 3) = 24, a classic that needs exact fractions.
    assert play("8 / (3 - 8 / 3)", numbers=(8, 3, 8, 3))[0] == 1.0


@pytest.mark.parametrize("answer", ["", "   ", "abc", "1 / 0", "(3 + 5", "x" * 100_000, "三加五", "\x00\x01", "3 + 5 + 7 + 1)"])
def test_malformed_answers_score_zero(answer):
    reward, info, text = play(answer)
    assert reward == 0.0 and info["expression_error"]
    assert "Your answer:" in text and "invalid expression" in text


def test_wrong_value_is_echoed():
    reward, info, text = play("3 + 5 + 7 + 1")
    assert reward == 0.1 and info["expression_error"] is None
    assert text.endswith("Your answer: 3 + 5 + 7 + 1 (= 16, not the target)")
    reward, info, text = play("3 * 8")
    assert reward == 0.0 and "exactly once" in info["expression_error"]
    assert text.endswith("(= 24, but not each given number exactly once)")


@pytest.mark.parametrize("action", [None, 24, 2.5, b"3*8", ["3*8"], {"x": 1}])
def test_non_string_actions_are_invalid(action):
    env = CountdownEnv()
    obs, _ = env.reset(seed=0)
    new_obs, reward, terminated, truncated, info = env.step(action)
    assert not info["action_is_valid"] and reward == 0.0
    assert not terminated and truncated  # max_steps=1
    assert new_obs["text"] == obs["text"] and env.solve() is not None


def test_one_answer_per_episode():
    env = CountdownEnv(max_steps=5)
    env.reset(options={"target": 24, "numbers": [3, 5, 7, 1]})
    env.step("3 + 5 + 7 + 1")
    _, reward, terminated, _, info = env.step("(5 + 7) * (3 - 1)")
    assert not info["action_is_valid"] and reward == 0.0 and terminated
    assert env.solve() == []


def test_given_instances_are_searched():
    env = CountdownEnv()
    env.reset(options={"target": 24, "numbers": [4, 4, 10, 10]})
    (answer,) = env.solve()
    assert env.step(answer)[1] == 1.0
    env.reset(options={"target": 1000, "numbers": [1, 1, 1]})
    assert env.solve() is None
    assert search_solution(10, (1, 2, 3, 4, 5, 6)) is None  # too many numbers to search


def test_minimal_parentheses_keep_values():
    a, b, c = leaf(8), leaf(3), leaf(2)
    cases = [
        (combine(a, "-", combine(b, "-", c)), "8 - (3 - 2)"),
        (combine(a, "/", combine(b, "*", c)), "8 / (3 * 2)"),
        (combine(combine(a, "-", b), "*", c), "(8 - 3) * 2"),
        (combine(a, "+", combine(b, "-", c)), "8 + 3 - 2"),
        (combine(a, "*", combine(b, "/", c)), "8 * 3 / 2"),
    ]
    for node, text in cases:
        assert node.text == text
        assert evaluate(text).value == node.value


def test_image_mode():
    env = CountdownEnv(mode="image")
    obs, _ = env.reset(seed=0)
    assert obs["image"].shape == env.observation_space["image"].shape
    after = env.step("1 + 1")[0]
    assert not np.array_equal(after["image"], obs["image"])


def test_impossible_target_range_fails_loudly():
    env = CountdownEnv(num_count=1, max_number=5, min_target=50, max_target=60)
    with pytest.raises(RuntimeError, match="widen the target range"):
        env.reset(seed=0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_count": 0}, "num_count"),
        ({"num_count": 9}, "num_count"),
        ({"max_number": 0}, "max_number"),
        ({"min_target": 10, "max_target": 5}, "min_target"),
    ],
)
def test_constructor_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CountdownEnv(**kwargs)


@pytest.mark.parametrize(
    "options",
    [{"target": "24", "numbers": [1, 2]}, {"target": 24, "numbers": "1 2"}, {"target": 24, "numbers": []}, {"numbers": [1]}],
)
def test_bad_given_instances(options):
    with pytest.raises(ValueError, match="options"):
        CountdownEnv().reset(options=options)

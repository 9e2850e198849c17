"""check_env: every built-in env passes it, and it names each defect of a broken env."""

from __future__ import annotations

import pytest

from tests.envs import toy_envs
from turnrl.envs import AgentEnv, EnvCheckError, check_env, make
from turnrl.envs.catalog import BUILTIN_ENVS, env_class

BUILTIN_MODES = [(name, mode) for name in BUILTIN_ENVS for mode in env_class(name).modes]
REPLANNING = ("Game2048",)
"""Envs whose solver gives one move at a time because chance decides the next state (a new 2048 tile)."""


@pytest.mark.filterwarnings("error")  # a warning of Gymnasium's checker is a failure too
@pytest.mark.parametrize(("name", "mode"), BUILTIN_MODES)
def test_every_builtin_env_passes_in_every_mode(name, mode):
    env = make(name, mode=mode)
    assert isinstance(env, AgentEnv)
    for seed in (0, 1):
        check_env(env, seed=seed, deterministic=name not in REPLANNING)


def test_slippery_frozenlake_passes_without_the_solve_success_check():
    # The solver plans as if the ice held; a slip can spoil the plan, so only its names are checked.
    for seed in range(5):
        check_env(make("FrozenLake", is_slippery=True), seed=seed, deterministic=False)


def test_a_plain_class_without_gymnasium_passes():
    env = toy_envs.Corridor()
    assert isinstance(env, AgentEnv)
    check_env(env)


@pytest.mark.parametrize(
    ("cls", "expected"),
    [
        (toy_envs.BrokenRaisesOnBadAction, "step() raised KeyError; an invalid action must return"),
        (toy_envs.BrokenIgnoresSeed, "same seed (0) and actions gave different episodes: text after reset"),
        (toy_envs.BrokenObservation, "the observation must be a dict {'text': str} (+ 'image'), got a str (at reset"),
        (toy_envs.BrokenSolveName, "solve() returned actions that are not in action_names(): ['Forward']"),
        (toy_envs.BrokenSolvePlan, "following solve() from reset(seed=0) did not end with info['success'] True"),
        (toy_envs.BrokenAcceptsGarbage, "none of action_names() was not rejected"),
        (toy_envs.BrokenRejectChangesState, "a rejected action changed the observation"),
        (toy_envs.BrokenMetrics, "info['metrics'] must map names to numbers, got 'distance': 'far'"),
    ],
)
def test_a_broken_env_fails_with_a_message_naming_the_problem(cls, expected):
    with pytest.raises(EnvCheckError) as info:
        check_env(cls())
    assert expected in str(info.value)
    assert isinstance(info.value, AssertionError)  # a test that calls check_env fails like an assert


def test_a_rule_broken_by_many_calls_is_one_line_naming_the_first_few():
    with pytest.raises(EnvCheckError) as info:
        check_env(toy_envs.BrokenRaisesOnBadAction())
    (line,) = info.value.failures
    assert line.endswith("(at step('LEFT'), step('left'), step('lEFT') and 8 more)")


def test_the_solve_success_check_is_what_deterministic_false_skips():
    check_env(toy_envs.BrokenSolvePlan(), deterministic=False)


def test_every_failure_is_listed_once():
    class TwoDefects(toy_envs.BrokenSolveName):
        def instructions(self) -> str:
            return "  "

    with pytest.raises(EnvCheckError) as info:
        check_env(TwoDefects())
    failures = info.value.failures
    assert len(failures) == len(set(failures)) == 2
    assert failures[0].startswith("instructions() must be a non-empty str") and "'Forward'" in failures[1]
    assert str(info.value).startswith("TwoDefects fails 2 turnrl env check(s):\n- instructions()")


def test_an_object_without_the_methods_is_told_what_is_missing():
    missing = r"no instructions\(\), action_names\(\), state_facts\(\), solve\(\)"
    with pytest.raises(EnvCheckError, match=missing) as info:
        check_env(toy_envs.NoInstructions())
    assert "may have state_key(), text(), image(), action_budget(), canonical_action(), close()" in str(info.value)


def test_gymnasium_checker_failures_are_reported():
    class NoSpaces(toy_envs.CorridorTurnEnv):
        def __init__(self) -> None:
            super().__init__()
            del self.observation_space

    with pytest.raises(EnvCheckError, match="gymnasium's env_checker"):
        check_env(NoSpaces())

"""check_env: every built-in env passes it, and it names each defect of a broken env."""

from __future__ import annotations

import re

import numpy as np
import pytest

from tests.envs import toy_envs
from turnrl.cli import build_parser
from turnrl.envs import AgentEnv, EnvCheckError, StateFacts, StepOutcome, TurnEnv, check_env, make
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
    assert ("may have state_key(), text(), image(), action_budget(), max_text_length(), canonical_action(), close()"
            in str(info.value))
    assert "define instructions() -> str (task description for the system prompt: goal, symbols, actions)" in str(
        info.value
    )


class CorridorWithoutQueries(TurnEnv):
    """A TurnEnv subclass that implements the dynamics but not instructions() or action_names()."""

    def _reset(self, rng, options):
        self.position = 0

    def _step(self, action):
        return StepOutcome(reward=0.0)

    def text(self):
        return "P_"


class StubbedInstructions(toy_envs.Corridor):
    """A plain class that left one method of the contract as a stub."""

    def instructions(self) -> str:
        raise NotImplementedError


@pytest.mark.parametrize(("cls", "methods"), [
    (CorridorWithoutQueries, ["instructions", "action_names"]),
    (StubbedInstructions, ["instructions"]),
])
def test_an_env_that_does_not_implement_a_query_fails_once_naming_it_and_what_it_returns(cls, methods):
    """Every check (and Gymnasium's checker) failed on the stub, each with "raised NotImplementedError: " and no
    word of which method, nor what it should return."""
    with pytest.raises(EnvCheckError) as info:
        check_env(cls())
    (failure,) = info.value.failures
    name = cls.__name__
    assert failure.startswith(f"{name} raises NotImplementedError from {' and '.join(m + '()' for m in methods)}")
    returns = {"instructions": "instructions() -> str (task description for the system prompt",
               "action_names": "action_names() -> list[str] | None (canonical action names, or None when actions "
                               "are free-form)"}
    assert all(returns[method] in failure for method in methods)
    assert ("action_names()" in failure) == ("action_names" in methods)


@pytest.mark.parametrize(("make_env", "failure_start"), [
    (lambda: make("FrozenLake", is_slippery=True), "following solve() from reset(seed=0), the episode ended after"),
    (toy_envs.BrokenSolvePlan, "following solve() from reset(seed=0) did not end with info['success'] True"),
], ids=["slippery ice", "a wrong plan"])
def test_a_plan_that_fails_points_to_the_check_for_chance_by_function_and_command(make_env, failure_start):
    """A slip on the ice ended the plan with no word of deterministic=False, nor of the command's flag."""
    with pytest.raises(EnvCheckError) as info:
        check_env(make_env())
    (failure,) = info.value.failures
    assert failure.startswith(failure_start)
    assert "check_env(env, deterministic=False)" in failure
    flag = re.search(r"turnrl check-env (--[\w-]+)", failure)
    assert flag is not None
    assert build_parser().parse_args(["check-env", "FrozenLake", flag.group(1)]).stochastic


def test_gymnasium_checker_failures_are_reported():
    class NoSpaces(toy_envs.CorridorTurnEnv):
        def __init__(self) -> None:
            super().__init__()
            del self.observation_space

    with pytest.raises(EnvCheckError, match="gymnasium's env_checker"):
        check_env(NoSpaces())


class DrawsIntoOneBuffer(toy_envs.Corridor):
    """Returns the same image array every call, redrawn: a trajectory's images would all show its last state."""

    def __init__(self) -> None:
        super().__init__()
        self.frame = np.zeros((1, self.length, 3), np.uint8)

    def observation(self):
        self.frame[:] = 0
        self.frame[0, self.position] = 255
        return {"text": super().observation()["text"], "image": self.frame}


class DrawsAnew(DrawsIntoOneBuffer):
    def observation(self):
        obs = super().observation()
        return {**obs, "image": obs["image"].copy()}


def test_an_image_drawn_into_one_buffer_fails_and_new_arrays_pass():
    with pytest.raises(EnvCheckError) as info:
        check_env(DrawsIntoOneBuffer())
    assert "obs['image'] at step 1 shares memory with the image returned at reset" in str(info.value)
    check_env(DrawsAnew())


class NanReward(toy_envs.Corridor):
    def step(self, action):
        obs, _, terminated, truncated, info = super().step(action)
        return obs, float("nan"), terminated, truncated, info


def test_a_nan_reward_is_reported_as_such_and_not_as_chance():
    """NaN != NaN: the same NaN twice is no sign of an unseeded env, nor of a variant that acts otherwise."""
    with pytest.raises(EnvCheckError) as info:
        check_env(NanReward())
    (failure,) = info.value.failures
    assert failure.startswith("the reward must be a finite number (at step(")


class NumpyFlags(toy_envs.Corridor):
    def step(self, action):
        obs, reward, terminated, truncated, info = super().step(action)
        flags = {key: np.bool_(value) for key, value in info.items()}
        return obs, reward, np.bool_(terminated), np.bool_(truncated), flags


class WordyFlags(toy_envs.Corridor):
    def step(self, action):
        obs, reward, terminated, truncated, info = super().step(action)
        return obs, reward, terminated, truncated, {key: str(value) for key, value in info.items()}


def test_info_flags_are_bools_numpys_included():
    """The rollout reads ``bool(info["success"])``: numpy's bools read right, the str "False" reads as True."""
    check_env(NumpyFlags())
    with pytest.raises(EnvCheckError) as info:
        check_env(WordyFlags())
    failures = str(info.value)
    assert "info['action_is_valid'] must be a bool, got a str" in failures
    assert "info['success'] must be a bool, got a str" in failures


class ResetWithoutOptions(toy_envs.Corridor):
    def reset(self, seed=None):  # type: ignore[override]
        return super().reset(seed=seed)


class ResetWithoutSeed(toy_envs.Corridor):
    def reset(self):  # type: ignore[override]
        return super().reset(seed=0)


def test_a_reset_that_cannot_take_the_rollouts_keywords_fails():
    with pytest.raises(EnvCheckError) as info:
        check_env(ResetWithoutOptions())
    assert info.value.failures == [
        "reset() takes no options keyword; the rollout calls reset(seed=..., options=...): define "
        "reset(self, *, seed=None, options=None)"
    ]
    with pytest.raises(EnvCheckError) as info:
        check_env(ResetWithoutSeed())
    (failure,) = info.value.failures  # told once, not by every check that resets
    assert failure.startswith("reset() takes no seed or options keyword")


class UnseededReward(toy_envs.Corridor):
    """Pays a draw of a generator that no reset seeds: no two plays agree."""

    def __init__(self) -> None:
        super().__init__()
        self.chance = np.random.default_rng()

    def step(self, action):
        obs, _, terminated, truncated, info = super().step(action)
        return obs, float(self.chance.random()), terminated, truncated, info


def test_chance_is_reported_as_chance_and_not_as_a_variant_that_acts_otherwise():
    with pytest.raises(EnvCheckError) as info:
        check_env(UnseededReward())
    (failure,) = info.value.failures
    assert failure.startswith("same seed (0) and actions gave different episodes: reward at step 1")


class ExplainsRejections(toy_envs.Corridor):
    """Says why it rejects an action, as ``reason`` makes it (the contract asks for a str)."""

    def __init__(self, reason) -> None:
        super().__init__()
        self.reason = reason

    def step(self, action):
        obs, reward, terminated, truncated, info = super().step(action)
        if not info["action_is_valid"]:
            info["invalid_reason"] = self.reason(action)
        return obs, reward, terminated, truncated, info


def test_a_reason_for_a_rejection_must_be_a_str():
    """The rollout reads info['invalid_reason'] of every rejected action: a code instead of a str failed the
    episode at the first rejection, and check_env passed the env."""
    check_env(ExplainsRejections(lambda action: f"{action[:10]!r} is not Left or Right"))
    check_env(ExplainsRejections(lambda action: None))  # no reason given: the rollout says no more
    with pytest.raises(EnvCheckError) as info:
        check_env(ExplainsRejections(lambda action: len(action)))  # a code, a different one every action
    (failure,) = info.value.failures  # one rule broken by many calls: one line
    assert failure.startswith("info['invalid_reason'] must be a str saying why the action was rejected (or None), "
                              "got a int (at step(")


class GridFacts(toy_envs.Corridor):
    """Keeps its board in ``state_facts().extra`` as numpy arrays (the env service carries arrays there); counts
    the actions it rejected there too, with ``count_rejections``, which the contract forbids (no visible change)."""

    def __init__(self, count_rejections: bool = False) -> None:
        super().__init__()
        self.count_rejections = count_rejections
        self.rejections = 0

    def reset(self, *, seed=None, options=None):
        self.rejections = 0
        return super().reset(seed=seed, options=options)

    def step(self, action):
        result = super().step(action)
        self.rejections += self.count_rejections and not result[4]["action_is_valid"]
        return result

    def state_facts(self):
        facts = super().state_facts()
        grid = np.zeros((2, self.length), np.int64)
        grid[0, self.position], grid[1, 0] = 1, self.rejections
        return StateFacts(facts.player, facts.objects, {"grid": grid, "noise": [np.array([np.nan, 1.0])]})


def test_state_facts_holding_arrays_are_compared_by_value():
    """``facts != before`` raised on an array of several elements: a valid env failed two checks with numpy's
    "truth value of an array is ambiguous", and a rejection that changed the array was not caught."""
    check_env(GridFacts())
    with pytest.raises(EnvCheckError) as info:
        check_env(GridFacts(count_rejections=True))
    (failure,) = info.value.failures
    assert failure.startswith("a rejected action changed state_facts(); leave the state as it was (at step(")


class WorldCorridor(toy_envs.CorridorTurnEnv):
    """The corridor on TurnEnv (so Gymnasium's checker runs too), its text in words from around the world."""

    def text(self) -> str:
        return f"{super().text()} café 日本 ⬛ 😀"


@pytest.mark.filterwarnings("error")
def test_any_unicode_text_passes():
    """'P____ café 日本 ⬛' trained fine, but failed with Gymnasium's "not within the observation space" alone."""
    check_env(WorldCorridor())


class TextOf(toy_envs.CorridorTurnEnv):
    """The corridor whose texts end with ``tail``."""

    def __init__(self, tail: str) -> None:
        super().__init__()
        self.tail = tail

    def text(self) -> str:
        return super().text() + self.tail


@pytest.mark.parametrize(("tail", "says"), [
    ("#" * 9000, "an observation's text may hold 8192 characters, got 9005; an env whose texts need more returns "
                 "its bound from max_text_length() (at reset(seed=0), step("),
    (" \ud800", "an observation's text may hold any character but a control character (other than ASCII whitespace, "
                "such as a newline or tab) or a lone surrogate, which UTF-8 cannot encode, got '\\ud800' at index 6 "
                "(at reset(seed=0), step("),
], ids=["9,000 characters", "a lone surrogate"])
def test_a_text_the_rollout_refuses_is_told_in_turnrls_words_before_gymnasiums(tail, says):
    """Gymnasium's checker said only "The first element returned by env.reset() is not within the observation
    space"."""
    with pytest.raises(EnvCheckError) as info:
        check_env(TextOf(tail))
    ours, gymnasiums = info.value.failures
    assert ours.startswith(says) and gymnasiums.startswith("gymnasium's env_checker")


class LongerEachPosition(toy_envs.Corridor):
    def observation(self):
        return {"text": "#" * (9000 + self.position)}


def test_texts_past_the_limit_by_different_lengths_are_one_line():
    """One rule, one line: the first text found says its length, and the line names the calls that broke it."""
    with pytest.raises(EnvCheckError) as info:
        check_env(LongerEachPosition())
    (failure,) = info.value.failures
    assert re.fullmatch(r"an observation's text may hold 8192 characters, got 900\d; an env whose texts need more "
                        r"returns its bound from max_text_length\(\) \(at reset\(seed=0\), step\('\w+'\), "
                        r"step\('\w+'\) and \d+ more\)", failure), failure


class BareReset(toy_envs.Corridor):
    """Its reset returns the observation alone, as Gymnasium's envs before 0.26 did."""

    def reset(self, *, seed=None, options=None):
        return super().reset(seed=seed, options=options)[0]


class StrReset(toy_envs.Corridor):
    """Its reset returns the text alone, where its steps return the observation dict."""

    def reset(self, *, seed=None, options=None):
        obs, info = super().reset(seed=seed, options=options)
        return obs["text"], info


class BareResetTurnEnv(toy_envs.CorridorTurnEnv):
    def reset(self, *, seed=None, options=None):
        return super().reset(seed=seed, options=options)[0]


@pytest.mark.parametrize(("cls", "failures"), [
    (BareReset, ["reset() must return (observation, info), got a dict: {'text': '___P_'} (at reset(seed=0))"]),
    (StrReset, ["the observation must be a dict {'text': str} (+ 'image'), got a str (at reset(seed=0))"]),
    (BareResetTurnEnv, ["reset() must return (observation, info), got a dict: {'text': '",
                        "gymnasium's env_checker: The result returned by `env.reset()` was not a tuple of the form "
                        "`(obs, info)`"]),
])
def test_a_reset_answer_that_cannot_be_read_is_its_own_failure_without_what_follows(cls, failures):
    """Each also failed "a rejected action changed the observation; leave the state as it was": the reset's
    unread observation compared with the step's."""
    with pytest.raises(EnvCheckError) as info:
        check_env(cls())
    assert len(info.value.failures) == len(failures)
    assert all(line.startswith(start) for line, start in zip(info.value.failures, failures)), info.value.failures


class BareResetRejectChangesState(BareReset, toy_envs.BrokenRejectChangesState):
    """A bare reset, and rejected actions that move the player home: a fault of its own, still told."""


def test_a_fault_apart_from_the_reset_is_still_told():
    with pytest.raises(EnvCheckError) as info:
        check_env(BareResetRejectChangesState())
    failures = info.value.failures
    assert failures[0].startswith("reset() must return (observation, info), got a dict")
    assert any(line.startswith("a rejected action changed state_facts(); leave the state as it was")
               for line in failures), failures

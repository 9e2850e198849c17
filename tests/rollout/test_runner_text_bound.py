"""The env's own bound on an observation's text (``max_text_length()``) in a rollout: read once an episode at its
reset, it lets long texts through (retrieved documents, a web page) where the default refuses them, and an answer
that cannot be a bound ends that env's episode alone, saying what it was."""

from __future__ import annotations

from typing import Any

import pytest

from tests.envs.toy_envs import Corridor
from tests.rollout.test_runner import TextPolicy, TokenPolicy, answer, play
from turnrl.envs import check_env
from turnrl.envs.contract import MAX_TEXT_LENGTH
from turnrl.rollout.runner import EpisodeSlot
from turnrl.rollout.trajectory import ERROR, TRUNCATED, Trajectory

MAX_TURNS = 3
BAD = 1
"""The slot of the batch whose env is under test."""


class Pages(Corridor):
    """A long corridor (``Left`` never ends it) whose every observation is a page of ``chars`` characters, under the
    bound ``bound`` (None: it declares none); counts how often it is asked for the bound."""

    def __init__(self, chars: int, bound: Any = None) -> None:
        super().__init__(length=50)
        self.chars, self.bound, self.asked = chars, bound, 0

    def observation(self) -> Any:
        text = super().observation()["text"]
        return {"text": text + "#" * (self.chars - len(text))}

    def max_text_length(self) -> Any:
        self.asked += 1
        if self.bound == "raises":
            raise RuntimeError("the index is down")
        return MAX_TEXT_LENGTH if self.bound is None else self.bound


def batch(env: Corridor) -> list[EpisodeSlot]:
    envs = [Corridor(length=50), env, Corridor(length=50)]
    return [EpisodeSlot(env=env, seed=k, group=k) for k, env in enumerate(envs)]


def played_alone(trajectories: list[Trajectory]) -> Trajectory:
    """The episode under test, after checking that the others played every turn untouched."""
    for good in trajectories[:BAD] + trajectories[BAD + 1:]:
        assert good.status == TRUNCATED and good.truncation_reason == "max_turns" and good.error is None
        assert len(good.turns) == MAX_TURNS
    return trajectories[BAD]


@pytest.mark.parametrize("tokens", [True, False], ids=["tokens", "text policy"])
def test_an_env_that_declares_a_larger_bound_plays_its_long_texts(tiny_tokenizer, tokens):
    env = Pages(chars=20_000, bound=32_768)
    check_env(env)
    env.asked = 0
    policy = TokenPolicy(tiny_tokenizer, answer("Left")) if tokens else TextPolicy(answer("Left"))
    long = played_alone(play(policy, batch(env), max_turns=MAX_TURNS, max_context_tokens=200_000))
    assert long.status == TRUNCATED and long.truncation_reason == "max_turns" and long.error is None
    assert len(long.turns) == MAX_TURNS and all("#" * 19_000 in turn.observation for turn in long.turns)
    assert long.trainable or not tokens
    assert env.asked == 1  # once an episode, at its reset: not a query a turn


class PageFromStep(Pages):
    """Short texts, then a page from its ``first``-th step on (0: from its reset)."""

    def __init__(self, chars: int, first: int) -> None:
        self.first, self.steps = first, 0
        super().__init__(chars)

    def reset(self, *, seed=None, options=None):
        self.steps = 0
        return super().reset(seed=seed, options=options)

    def step(self, action: str):
        self.steps += 1
        return super().step(action)

    def observation(self) -> Any:
        return super().observation() if self.steps >= self.first else {"text": "a short page"}


@pytest.mark.parametrize(("first", "where"), [(0, "reset failed in turn 1"), (2, "step failed in turn 2")])
def test_the_default_bound_still_refuses_a_text_of_9000_characters(first, where):
    bad = played_alone(play(TextPolicy(answer("Left")), batch(PageFromStep(9000, first)), max_turns=MAX_TURNS))
    assert bad.status == ERROR and len(bad.turns) == first
    assert bad.error.startswith(f"env {where}: ValueError: an observation's text may hold {MAX_TEXT_LENGTH} "
                                "characters, got 9000; an env whose texts need more returns its bound from "
                                "max_text_length()"), bad.error


@pytest.mark.parametrize(("bound", "says"), [
    (0, "ValueError: max_text_length() must return an int >= 1 (the characters an observation's text may hold), got "
        "an int: 0"),
    (True, "ValueError: max_text_length() must return an int >= 1 (the characters an observation's text may hold), "
           "got a bool: True"),
    ("big", "ValueError: max_text_length() must return an int >= 1 (the characters an observation's text may hold), "
            "got a str: 'big'"),
    ("raises", "RuntimeError: the index is down (raised in max_text_length at test_runner_text_bound.py:"),
], ids=["zero", "bool", "str", "raises"])
def test_a_bound_that_cannot_be_used_errs_only_its_own_episode(tiny_tokenizer, bound, says):
    bad = played_alone(play(TokenPolicy(tiny_tokenizer, answer("Left")), batch(Pages(chars=20, bound=bound)),
                            max_turns=MAX_TURNS))
    assert bad.status == ERROR and bad.turns == [] and not bad.trainable
    assert bad.error.startswith(f"env max_text_length() failed in turn 1: {says}"), bad.error

"""check_env against the env's own bound on an observation's text (``max_text_length()``): a bound it declares is
the one its texts are held to, and an answer that is no int of at least one is a failure of its own."""

from __future__ import annotations

from typing import Any

import pytest

from tests.envs import toy_envs
from turnrl.envs import EnvCheckError, check_env


class LongPages(toy_envs.Corridor):
    """The corridor whose observations are pages of ``chars`` characters, under the bound ``bound``."""

    def __init__(self, chars: int = 20_000, bound: Any = 32_768) -> None:
        super().__init__()
        self.chars, self.bound = chars, bound

    def observation(self) -> Any:
        text = super().observation()["text"]
        return {"text": text + "#" * (self.chars - len(text))}

    def max_text_length(self) -> Any:
        return self.bound


class LongPagesTurnEnv(toy_envs.CorridorTurnEnv):
    """The same on ``TurnEnv``: Gymnasium's checker holds its texts to the text space, which takes the bound."""

    def max_text_length(self) -> int:
        return 32_768

    def text(self) -> str:
        return super().text() + "#" * 19_995


@pytest.mark.filterwarnings("error")  # a warning of Gymnasium's checker is a failure too
@pytest.mark.parametrize("env", [LongPages(), LongPagesTurnEnv()], ids=["plain class", "TurnEnv"])
def test_an_env_that_declares_a_larger_bound_passes_with_texts_under_it(env):
    check_env(env)


def test_the_default_bound_still_refuses_a_longer_text():
    with pytest.raises(EnvCheckError) as info:
        check_env(LongPages(chars=9000, bound=8192))
    (failure,) = info.value.failures
    assert failure.startswith("an observation's text may hold 8192 characters, got 9000; an env whose texts need "
                              "more returns its bound from max_text_length() (at reset(seed=0), step("), failure


def test_a_text_past_the_envs_own_bound_is_told_that_bound():
    with pytest.raises(EnvCheckError) as info:
        check_env(LongPages(chars=40_000))
    (failure,) = info.value.failures
    assert failure.startswith("an observation's text may hold 32768 characters, got 40000 (at reset(seed=0), "
                              "step("), failure


class RaisingBound(toy_envs.Corridor):
    def max_text_length(self) -> int:
        raise RuntimeError("no bound today")


@pytest.mark.parametrize(("env", "failure"), [
    (LongPages(chars=5, bound=0), "max_text_length() must return an int >= 1 (the characters an observation's text "
                                  "may hold), got an int: 0"),
    (LongPages(chars=5, bound=True), "max_text_length() must return an int >= 1 (the characters an observation's "
                                     "text may hold), got a bool: True"),
    (LongPages(chars=5, bound="big"), "max_text_length() must return an int >= 1 (the characters an observation's "
                                      "text may hold), got a str: 'big'"),
    (RaisingBound(), "max_text_length() raised RuntimeError: no bound today; return the characters an observation's "
                     "text may hold, an int >= 1"),
], ids=["zero", "bool", "str", "raises"])
def test_a_bound_that_cannot_be_used_is_a_failure_of_its_own(env, failure):
    with pytest.raises(EnvCheckError) as info:
        check_env(env)
    assert info.value.failures == [failure]


def test_an_unusable_bound_leaves_the_texts_held_to_the_default():
    with pytest.raises(EnvCheckError) as info:
        check_env(LongPages(chars=9000, bound=0))
    bound, text = info.value.failures
    assert bound.startswith("max_text_length() must return an int >= 1") and "got an int: 0" in bound
    assert text.startswith("an observation's text may hold 8192 characters, got 9000;"), text

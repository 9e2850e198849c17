"""What an env's answers may be, as the contract states it once: the text of an observation (any Unicode but
controls and lone surrogates, at most the env's max_text_length(), MAX_TEXT_LENGTH by default) and the shape of what
reset returns."""

from __future__ import annotations

import sys
import unicodedata
from typing import Any

import numpy as np
import pytest
from gymnasium import spaces

from turnrl.envs import make
from turnrl.envs.contract import (
    MAX_TEXT_LENGTH,
    OBS_CHARSET,
    TEXT_CHARACTERS_RULE,
    ObservationText,
    StepOutcome,
    TurnEnv,
    check_text_fits,
    max_text_length_of,
    max_text_length_problems,
    reset_answer_problems,
    text_problems,
)

WORLD_TEXT = "P____ café 日本 ⬛ naïve Ωmega 😀 👨\u200d👩\u200d👧 ١٢٣ \u3000全角\xa0nbsp\u200f\r\n\tend"
"""Text from around the world: accents, CJK, a glyph, emoji (one joined with zero-width joiners), Arabic digits, an
ideographic and a non-breaking space, a right-to-left mark and every ASCII whitespace a Windows file holds."""


def test_any_unicode_text_is_an_observation_text():
    """OBS_CHARSET (printable ASCII and a few glyphs) was the rule: 'café 日本 ⬛' failed check-env with
    Gymnasium's "not within the observation space", yet trained fine."""
    assert text_problems(WORLD_TEXT) == []
    assert not WORLD_TEXT.isprintable()  # Python's printable refuses the spaces and joiners: not the rule
    assert ObservationText(MAX_TEXT_LENGTH, min_length=0, charset=OBS_CHARSET).contains(WORLD_TEXT)


@pytest.mark.parametrize(("text", "found"), [
    ("P__\ud800_", "'\\ud800' at index 3"),  # UTF-8 cannot encode it: the tokenizer could not take the text
    ("\x1b[31mP\x1b[0m", "'\\x1b' at index 0, '\\x1b' at index 6"),  # a terminal's colour codes
    ("\x00" * 5, "'\\x00' at index 0, '\\x00' at index 1, '\\x00' at index 2 and 2 more"),
    ("P\x85_", "'\\x85' at index 1"),  # a C1 control, though str.isspace() calls it whitespace
])
def test_a_control_character_or_a_lone_surrogate_is_named_with_where_it_is(text, found):
    (problem,) = text_problems(text)
    assert problem.rule == TEXT_CHARACTERS_RULE and problem.found == found
    assert str(problem) == f"{TEXT_CHARACTERS_RULE}, got {found}"
    assert not ObservationText(MAX_TEXT_LENGTH, min_length=0, charset=OBS_CHARSET).contains(text)


def test_a_text_past_the_default_limit_is_told_its_length_the_limit_and_how_an_env_raises_it():
    assert [str(p) for p in text_problems("#" * 9000)] == [
        f"an observation's text may hold {MAX_TEXT_LENGTH} characters, got 9000; an env whose texts need more "
        "returns its bound from max_text_length()"]
    assert text_problems("#" * MAX_TEXT_LENGTH) == []
    both = text_problems("\ud800" * 9000)
    assert [p.rule for p in both] == [f"an observation's text may hold {MAX_TEXT_LENGTH} characters",
                                      TEXT_CHARACTERS_RULE]


def test_a_text_past_an_envs_own_limit_is_told_that_limit():
    """The env chose its bound, so the message names it and offers no way to raise it."""
    assert text_problems("#" * 20_000, max_length=32_768) == []
    assert [str(p) for p in text_problems("#" * 40_000, max_length=32_768)] == [
        "an observation's text may hold 32768 characters, got 40000"]
    assert [str(p) for p in text_problems("#" * 9, max_length=8)] == ["an observation's text may hold 8 characters, "
                                                                      "got 9"]


class LongDocs(TurnEnv):
    """A search agent's env: each observation a retrieved document of ``chars`` characters, under a bound of
    ``bound``."""

    def __init__(self, chars: int = 20_000, bound: Any = 32_768) -> None:
        self.bound = bound  # before TurnEnv.__init__, whose text space asks for it
        super().__init__()
        self.chars = chars

    def max_text_length(self) -> Any:
        return self.bound

    def _reset(self, rng, options):
        pass

    def _step(self, action):
        return StepOutcome(0.0)

    def text(self) -> str:
        return "#" * self.chars

    def instructions(self) -> str:
        return "Read."

    def action_names(self) -> list[str]:
        return ["next"]


def test_a_turn_envs_text_space_holds_what_its_own_bound_allows():
    env = LongDocs()
    obs, _ = env.reset(seed=0)
    assert max_text_length_of(env) == 32_768 and env.observation_space["text"].max_length == 32_768
    assert env.observation_space.contains(obs) and not env.observation_space.contains({"text": "#" * 32_769})
    assert make("Sokoban").observation_space["text"].max_length == MAX_TEXT_LENGTH


@pytest.mark.parametrize(("bound", "got"), [
    (0, "an int: 0"), (-5, "an int: -5"), (True, "a bool: True"), ("big", "a str: 'big'"), (2.5e4, "a float: 25000.0"),
    (None, "a NoneType: None"),
])
def test_a_bound_that_is_no_int_of_at_least_one_is_refused_with_what_it_was(bound, got):
    expected = f"max_text_length() must return an int >= 1 (the characters an observation's text may hold), got {got}"
    assert max_text_length_problems(bound) == [expected]
    with pytest.raises(ValueError) as info:
        LongDocs(bound=bound)  # a TurnEnv's text space asks at once
    assert str(info.value) == expected


@pytest.mark.parametrize("bound", [1, 32_768, np.int64(50_000)])
def test_an_int_bound_is_taken(bound):
    assert max_text_length_problems(bound) == []


def test_an_envs_longest_text_is_checked_against_the_bound_given():
    check_text_fits(20_000, "a long page", max_length=32_768)
    with pytest.raises(ValueError, match="a long page can need 20000 characters, more than the 8192 an observation "
                                         "may hold; use a shorter page"):
        check_text_fits(20_000, "a long page", "use a shorter page")


def test_the_refused_characters_are_the_controls_but_ascii_whitespace_and_the_surrogates():
    """Checked against Unicode's own categories over every code point: Cc (control) and Cs (surrogate)."""
    refused = {chr(code) for code in range(sys.maxunicode + 1) if text_problems(chr(code))}
    expected = {chr(code) for code in range(sys.maxunicode + 1)
                if unicodedata.category(chr(code)) in ("Cc", "Cs")} - set("\t\n\x0b\x0c\r")
    assert refused == expected


def test_the_text_space_samples_from_its_charset_and_holds_what_it_samples():
    space = ObservationText(12, min_length=0, charset=OBS_CHARSET, seed=0)
    assert all(not text_problems(char) for char in OBS_CHARSET)
    assert all(space.contains(space.sample()) and set(space.sample()) <= OBS_CHARSET for _ in range(50))
    assert not space.contains("x" * 13) and not space.contains(b"bytes") and isinstance(space, spaces.Text)


@pytest.mark.parametrize("name", ["Sokoban", "Countdown"])
def test_a_turn_envs_text_space_is_the_rule(name):
    env = make(name)
    text_space = env.observation_space["text"]
    assert isinstance(text_space, ObservationText) and text_space.contains("café 日本")
    obs, _ = env.reset(seed=0)
    assert env.observation_space.contains(obs) and not env.observation_space.contains({**obs, "text": "\ud800"})


@pytest.mark.parametrize(("answer", "problems"), [
    (({"text": "P_"}, {}), []),
    (({"text": "P_"}, {"success": np.bool_(False)}), []),
    ({"text": "P_"}, ["reset() must return (observation, info), got a dict: {'text': 'P_'}"]),
    # A two-key observation unpacked as (obs, info) read as its keys' names.
    ({"text": "P_", "image": None}, ["reset() must return (observation, info), got a dict: {'text': 'P_', "
                                     "'image': None}"]),
    ("P_", ["reset() must return (observation, info), got a str: 'P_'"]),
    (({"text": "P_"}, {}, {}), ["reset() must return (observation, info), got a tuple of 3"]),
    (({"text": "P_"}, None), ["reset()'s info must be a dict, got a NoneType"]),
], ids=["pair", "numpy info", "bare observation", "two-key observation", "str", "three", "info None"])
def test_a_reset_answer_must_be_the_pair_observation_and_info(answer, problems):
    assert reset_answer_problems(answer) == problems


def test_an_image_mode_without_its_image_shape_says_how_to_give_it():
    from turnrl.envs import TurnEnv

    class Pictured(TurnEnv):
        modes = ("text", "image")

    with pytest.raises(ValueError) as info:
        Pictured(mode="image")
    assert str(info.value) == ("Pictured: an image mode needs image_shape=(height, width), the size of what image() "
                               "draws: pass it to TurnEnv.__init__ (docs/extending.md, An image mode)")
    assert "image" not in Pictured(mode="text").observation_space.spaces  # the text mode needs none

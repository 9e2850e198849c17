"""What an env's answers may be, as the contract states it once: the text of an observation (any Unicode but
controls and lone surrogates, at most MAX_TEXT_LENGTH characters) and the shape of what reset returns."""

from __future__ import annotations

import sys
import unicodedata

import numpy as np
import pytest
from gymnasium import spaces

from turnrl.envs import make
from turnrl.envs.contract import (
    MAX_TEXT_LENGTH,
    OBS_CHARSET,
    TEXT_CHARACTERS_RULE,
    TEXT_LENGTH_RULE,
    ObservationText,
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


def test_a_text_past_the_limit_is_told_its_length_and_the_limit():
    assert [str(p) for p in text_problems("#" * 9000)] == [
        f"an observation's text may hold {MAX_TEXT_LENGTH} characters, got 9000"]
    assert text_problems("#" * MAX_TEXT_LENGTH) == []
    both = text_problems("\ud800" * 9000)
    assert [p.rule for p in both] == [TEXT_LENGTH_RULE, TEXT_CHARACTERS_RULE]


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

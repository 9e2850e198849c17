"""Env settings: allowed values read from Literal types, and the "did you mean" hint of a typo."""

from __future__ import annotations

from typing import Literal, Optional

import pytest
from hypothesis import given
from hypothesis import strategies as st

from turnrl.envs.catalog import env_names, env_parameters, env_setting_choices
from turnrl.envs.settings import check_settings, close_names, did_you_mean, literal_choices, registered_settings

Colour = Literal["red", "green"]


class Painted:
    def __init__(self, colour: Colour = "red", shade: Literal[1, 2, 3] | None = None, size: int = 4,
                 name: str = "x", legacy: Optional[Literal["a", "b"]] = None, mixed: Literal["a"] | int = 1) -> None:
        pass


def paint(colour: Colour = "green", size: int = 4) -> None:
    pass


def test_settings_typed_as_literal_have_their_values_as_choices():
    assert literal_choices(Painted) == {"colour": ("red", "green"), "shade": (1, 2, 3), "legacy": ("a", "b")}
    assert literal_choices(paint) == {"colour": ("red", "green")}


def test_annotations_that_cannot_be_read_give_no_choices():
    class Unreadable:
        def __init__(self, colour: NotImportedHere = "red") -> None:  # type: ignore[name-defined]  # noqa: F821
            pass

    assert literal_choices(Unreadable) == {}


def test_every_built_in_env_setting_with_choices_is_a_setting_and_its_default_is_allowed():
    for name in env_names():
        parameters = env_parameters(name)
        for key, choices in env_setting_choices(name).items():
            assert key in parameters, f"{name}: choices for {key}, which is no setting"
            assert parameters[key] in choices, f"{name}: default {key}={parameters[key]!r} not in {choices}"
    assert env_setting_choices("PrimitiveSkill")["task"] == ("align", "place", "stack", "drawer")


@pytest.mark.parametrize(
    ("word", "names", "near"),
    [
        ("sise", ["size", "num_boxes", "mode"], ["size"]),
        ("sokobn", ["Sokoban", "FrozenLake"], ["Sokoban"]),  # case ignored, the name's own case kept
        ("colour", ["size", "num_boxes"], []),
    ],
)
def test_close_names(word, names, near):
    assert close_names(word, names) == near


def test_did_you_mean_joins_the_near_names_of_every_typo_once():
    assert did_you_mean(["sise", "nm_boxes", "size_"], ["size", "num_boxes"]) == "did you mean size or num_boxes? "
    assert did_you_mean(["zzz"], ["size"]) == ""


def test_an_unknown_setting_names_the_likely_one():
    with pytest.raises(ValueError, match=r"Env has no setting sise; did you mean size\? allowed: size=4, mode='text'"):
        check_settings("Env", {"size": 4, "mode": "text"}, {"sise": 5})


@given(st.text(max_size=40), st.lists(st.text(max_size=20), max_size=8))
def test_did_you_mean_takes_any_text(word, names):
    hint = did_you_mean([word], names)
    assert hint == "" or (hint.startswith("did you mean ") and hint.endswith("? "))


def test_gymnasium_makes_own_settings_show_the_registered_defaults():
    """FrozenLake-v1 registers a 100-step limit: a listing that said max_episode_steps=None would read as none."""
    allowed = registered_settings("FrozenLake-v1")
    assert allowed is not None and allowed["max_episode_steps"] == 100 and allowed["is_slippery"] is True
    assert registered_settings("CliffWalking-v1")["max_episode_steps"] is None  # registered without a limit
    with pytest.raises(ValueError, match=r"has no setting colour.*max_episode_steps=100"):
        check_settings("FrozenLake-v1", allowed, {"colour": "red"})

"""The registry: built-in env names, Gymnasium ids, settings checked at construction."""

from __future__ import annotations

import gymnasium as gym
import pytest

from turnrl.envs import make
from turnrl.envs.base import TurnEnv
from turnrl.envs.registry import BUILTIN_ENVS, env_class, env_names, env_parameters, gym_id, register_all, resolve_name


def test_every_builtin_env_is_listed_with_a_gymnasium_id():
    assert env_names() == list(BUILTIN_ENVS)
    assert set(env_names()) == {"Sokoban", "FrozenLake", "Bandit", "Countdown", "Maze2D"}
    for name in env_names():
        assert gym_id(name) == f"turnrl/{name}-v0"
        assert gym_id(name) in gym.registry


def test_register_all_is_idempotent():
    before = {key for key in gym.registry if key.startswith("turnrl/")}
    register_all()
    register_all()
    assert {key for key in gym.registry if key.startswith("turnrl/")} == before


@pytest.mark.parametrize("name", env_names())
def test_env_class_declares_modes_description_and_settings(name):
    cls = env_class(name)
    assert issubclass(cls, TurnEnv)
    assert "text" in cls.modes and cls.description
    params = env_parameters(name)
    assert "self" not in params and "mode" in params and params["mode"] == "text"


@pytest.mark.parametrize("name", env_names())
def test_make_and_gymnasium_make_build_the_same_episode(name):
    ours = make(name)
    theirs = gym.make(gym_id(name)).unwrapped
    assert type(ours) is type(theirs) is env_class(name)
    assert ours.reset(seed=3)[0]["text"] == theirs.reset(seed=3)[0]["text"]


@pytest.mark.parametrize(
    "spelling", ["FrozenLake", "frozenlake", "FROZENLAKE", "turnrl/FrozenLake-v0", "frozenlake-v0"]
)
def test_names_resolve_case_insensitively_with_or_without_the_gym_prefix(spelling):
    assert resolve_name(spelling) == "FrozenLake"
    assert isinstance(make(spelling), env_class("FrozenLake"))


def test_unknown_env_names_the_builtin_ones():
    with pytest.raises(ValueError) as info:
        make("Tetris")
    message = str(info.value)
    assert "Tetris" in message and all(name in message for name in env_names())


def test_settings_reach_the_constructor():
    env = make("FrozenLake", size=6, mode="image")
    obs, _ = env.reset(seed=0)
    assert len(obs["text"].splitlines()) == 6 and obs["image"].ndim == 3


def test_unknown_setting_names_the_allowed_ones():
    with pytest.raises(ValueError) as info:
        make("Sokoban", colour="red", size=6)
    message = str(info.value)
    assert "colour" in message
    for key in ("size", "num_boxes", "mode", "max_steps"):
        assert f"{key}=" in message

"""make() and the registry: built-in names, module:Class, Gymnasium ids, settings checked at construction."""

from __future__ import annotations

import re
import subprocess
import sys

import gymnasium as gym
import pytest

from tests.envs import toy_envs
from turnrl.envs import AgentEnv, AgentEnvWrapper, check_env, make
from turnrl.envs.contract import TurnEnv
from turnrl.envs.catalog import BUILTIN_ENVS, env_class, env_names, env_parameters, gym_id, register_all, resolve_name


def test_every_builtin_env_is_listed_with_a_gymnasium_id():
    assert env_names() == list(BUILTIN_ENVS)
    assert set(env_names()) == {"Sokoban", "FrozenLake", "Bandit", "Countdown", "Maze2D", "Navigation",
                                "PrimitiveSkill", "SVG", "Spatial", "Sudoku", "Game2048", "RubiksCube"}
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
    assert "self" not in params and "mode" in params and params["mode"] in cls.modes
    # The grid and text envs start in text; the visual tasks (a 3D view, an icon to redraw) in images.
    assert params["mode"] == ("image" if name in ("Navigation", "SVG") else "text")


@pytest.mark.parametrize("name", env_names())
def test_make_and_gymnasium_make_build_the_same_episode(name):
    ours = make(name)
    theirs = gym.make(gym_id(name)).unwrapped
    assert type(ours) is type(theirs) is env_class(name)
    assert ours.reset(seed=3)[0]["text"] == theirs.reset(seed=3)[0]["text"]


@pytest.mark.parametrize(
    "spelling", ["FrozenLake", "frozenlake", "FROZENLAKE", "turnrl/FrozenLake-v0", "TurnRL/frozenlake-V0"]
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
    assert len(env.ansi().splitlines()) == 6 and obs["image"].shape == (150, 150, 3)


def test_unknown_setting_names_the_allowed_ones():
    with pytest.raises(ValueError) as info:
        make("Sokoban", colour="red", size=6)
    message = str(info.value)
    assert "colour" in message
    for key in ("size", "num_boxes", "mode", "max_steps"):
        assert f"{key}=" in message


@pytest.mark.parametrize(
    ("env_id", "settings", "hint"),
    [
        ("Sokobn", {}, "unknown env 'Sokobn'; did you mean Sokoban?"),
        ("Sokoban", {"sise": 6}, "Sokoban has no setting sise; did you mean size?"),
        ("tests.envs.toy_envs:Coridor", {}, "has no attribute 'Coridor'; did you mean Corridor?"),
        ("gym:FrozenLake-v2", {}, "did you mean gym:FrozenLake-v1"),
        ("gym:FrozenLake-v1", {"is_slipery": False}, "has no setting is_slipery; did you mean is_slippery?"),
    ],
)
def test_a_typo_in_an_env_name_or_setting_gets_the_likely_one(env_id, settings, hint):
    with pytest.raises(ValueError, match=re.escape(hint)):
        make(env_id, **settings)


def test_unknown_env_lists_the_three_accepted_forms():
    message = str(pytest.raises(ValueError, make, "Tetris-v9").value)
    assert "module:Class" in message and "gymnasium.register" in message and "built-in name" in message


def test_builtin_envs_satisfy_the_agent_env_protocol():
    for name in env_names():
        assert isinstance(make(name), AgentEnv)
    assert not isinstance(gym.make("FrozenLake-v1").unwrapped, AgentEnv)


def test_import_turnrl_registers_the_builtin_envs_without_importing_them():
    code = (
        "import sys, gymnasium, turnrl\n"
        "assert 'turnrl.envs.games.sokoban' not in sys.modules\n"
        "env = gymnasium.make('turnrl/Sokoban-v0')\n"
        "print(type(env.unwrapped).__name__, env.reset(seed=0)[0]['text'].count('#') > 0)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["SokobanEnv", "True"]


# --------------------------------------------------------------------------- module:Class
def test_module_class_builds_a_class_from_outside_turnrl():
    env = make("tests.envs.toy_envs:Corridor", length=7)
    assert type(env) is toy_envs.Corridor and env.length == 7
    assert env.reset(seed=0)[0]["text"] == toy_envs.Corridor(length=7).reset(seed=0)[0]["text"]


def test_module_class_settings_are_checked_against_the_constructor():
    with pytest.raises(ValueError, match=r"tests.envs.toy_envs:Corridor has no setting width; allowed: length=5"):
        make("tests.envs.toy_envs:Corridor", width=3)


def test_module_class_settings_are_checked_against_the_constructors_annotations():
    """``length="abc"`` reached the constructor and failed at reset in the env's arithmetic (a TypeError)."""
    with pytest.raises(ValueError, match=r"^length must be an int, got a str: 'abc'$"):
        make("tests.envs.toy_envs:Corridor", length="abc")
    with pytest.raises(ValueError, match=r"^length must be an int, got a bool: True$"):
        make("tests.envs.toy_envs:Corridor", length=True)
    assert make("tests.envs.toy_envs:Corridor", length=7).length == 7


def test_type_problems_read_plain_and_optional_annotations_and_leave_the_others():
    from turnrl.envs.settings import type_problems

    def factory(n: int = 1, rate: float = 0.5, flag: bool = False, name: str = "x", maybe: int | None = None,
                either: int | str = 1, anything=None):
        return None

    assert type_problems(factory, {"n": 3, "rate": 1, "flag": True, "name": "y", "maybe": None, "either": "z",
                                   "anything": [1]}) == []
    assert type_problems(factory, {"n": 2.5, "rate": "fast", "flag": "false", "name": 3, "maybe": "2"}) == [
        "n must be an int, got a float: 2.5", "rate must be a number, got a str: 'fast'",
        "flag must be a bool (true or false), got a str: 'false'", "name must be a str, got an int: 3",
        "maybe must be an int, got a str: '2'"]


def test_module_class_without_the_contract_is_refused_naming_what_is_missing():
    with pytest.raises(TypeError) as info:
        make("tests.envs.toy_envs:NoInstructions")
    message = str(info.value)
    assert "NoInstructions has no instructions(), action_names(), state_facts(), solve()" in message
    assert "string actions" in message


@pytest.mark.parametrize(
    ("env_id", "expected"),
    [
        ("tests.envs.no_such_module:Env", "cannot import module 'tests.envs.no_such_module'"),
        ("tests.envs.toy_envs:NoSuchEnv", "module 'tests.envs.toy_envs' has no attribute 'NoSuchEnv'"),
    ],
)
def test_module_class_that_cannot_be_found_says_why(env_id, expected):
    with pytest.raises(ValueError, match=re.escape(expected)):
        make(env_id)


# --------------------------------------------------------------------------- Gymnasium ids
TEST_ID = "turnrl-test/Corridor-v0"


@pytest.fixture
def registered_corridor():
    gym.register(TEST_ID, entry_point="tests.envs.toy_envs:CorridorTurnEnv")
    yield TEST_ID
    del gym.registry[TEST_ID]


def test_a_registered_gymnasium_id_is_made_and_keeps_the_contract(registered_corridor):
    env = make(registered_corridor, length=6)
    assert isinstance(env, AgentEnvWrapper) and isinstance(env, AgentEnv)
    assert isinstance(env.unwrapped, toy_envs.CorridorTurnEnv) and env.unwrapped.length == 6
    env.reset(seed=0)
    assert env.action_names() == ["Left", "Right"] and "corridor" in env.instructions()
    assert env.state_facts() == env.unwrapped.state_facts() and env.solve() == env.unwrapped.solve()
    check_env(env)


def test_a_users_gymnasium_id_that_looks_like_a_builtin_name_stays_theirs():
    gym.register("Bandit-v0", entry_point="tests.envs.toy_envs:CorridorTurnEnv")
    try:
        env = make("Bandit-v0")
        assert isinstance(env.unwrapped, toy_envs.CorridorTurnEnv)
    finally:
        del gym.registry["Bandit-v0"]
    assert type(make("Bandit")).__name__ == "BanditEnv" and type(make("turnrl/Bandit-v0")).__name__ == "BanditEnv"


def test_gymnasium_wrappers_still_apply(registered_corridor):
    env = make(registered_corridor, max_episode_steps=2)
    env.reset(seed=0)
    assert env.step("Wait")[3] is False
    assert env.step("Wait")[3] is True  # TimeLimit, under AgentEnvWrapper


def test_a_registered_id_checks_its_settings(registered_corridor):
    allowed = r"turnrl-test/Corridor-v0 has no setting width; allowed: length=5, .*max_episode_steps"
    with pytest.raises(ValueError, match=allowed):
        make(registered_corridor, width=3)


@pytest.mark.parametrize("env_id", ["FrozenLake-v1", "gymnasium:FrozenLake-v1"])
def test_gymnasium_envs_without_the_contract_are_refused_clearly(env_id):
    with pytest.raises(TypeError) as info:
        make(env_id)
    message = str(info.value)
    assert "'FrozenLake-v1' is not an agent env: FrozenLakeEnv has no instructions(), action_names()" in message
    assert "string actions, dict observations with a 'text' key, instructions() and action_names()" in message


# --------------------------------------------------------------------------- from a user's package
def test_an_env_from_a_users_package_is_named_module_attr_in_the_config(tmp_path, monkeypatch):
    from turnrl.config import load_config
    from turnrl.training.train_config import TrainConfig

    (tmp_path / "user_env_ext.py").write_text(
        "from tests.envs.toy_envs import CorridorTurnEnv\n\n"
        "class LongCorridor(CorridorTurnEnv):\n"
        "    def __init__(self, length: int = 9, **settings):\n"
        "        super().__init__(length=length, **settings)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    config = load_config(TrainConfig, None, ["env.id=user_env_ext:LongCorridor", "env.settings={length: 6}"])
    env = make(config.env.id, **config.env.settings)
    assert type(env).__name__ == "LongCorridor" and env.length == 6
    assert env.reset(seed=0)[0]["text"] == toy_envs.CorridorTurnEnv(length=6).reset(seed=0)[0]["text"]
    assert "user_env_ext:LongCorridor" not in env_names()

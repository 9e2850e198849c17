"""The env contract declared once: the optional methods' defaults, the one adapter that reads them, and the names
read off the declaration."""

from __future__ import annotations

import ast
import copy
from pathlib import Path

import gymnasium as gym
import pytest

from tests.envs.toy_envs import Corridor, CorridorTurnEnv, CorridorWithExtras
from turnrl.envs import make
from turnrl.envs.contract import (
    MAX_TEXT_LENGTH,
    OPTIONAL_METHODS,
    QUERIES,
    REQUIRED_METHODS,
    AgentEnv,
    OptionalMethods,
    invalid_reason,
    max_text_length_of,
    observation_key,
    optional_methods,
    state_key,
)

PACKAGE = Path(__file__).resolve().parents[2] / "turnrl"
CONTRACT_MODULE = PACKAGE / "envs" / "base.py"
LOOKUPS = {"getattr", "hasattr", "get_wrapper_attr", "has_wrapper_attr"}


def lookups_of_optional_methods(path: Path, root: Path = PACKAGE.parent) -> list[str]:
    """``getattr(x, "state_key")``-style lookups (and Gymnasium's wrapper-attribute ones) of an optional method's
    name in one source file, as ``path:line name`` (the path relative to ``root``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if not isinstance(node, ast.Call):
            continue
        called = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
        names = [arg.value for arg in node.args if isinstance(arg, ast.Constant) and isinstance(arg.value, str)]
        found += [f"{path.relative_to(root)}:{node.lineno} {name}" for name in names
                  if called in LOOKUPS and name in OPTIONAL_METHODS]
    return found


def test_no_module_but_the_contract_looks_up_an_optional_method():
    found = [hit for path in sorted(PACKAGE.rglob("*.py")) if path != CONTRACT_MODULE
             for hit in lookups_of_optional_methods(path)]
    assert found == []


def test_the_scan_finds_a_lookup(tmp_path):
    source = tmp_path / "turnrl" / "x.py"
    source.parent.mkdir()
    source.write_text('f = getattr(env, "action_budget", None)\nok = env.has_wrapper_attr("text")\n')
    assert lookups_of_optional_methods(source, tmp_path) == ["turnrl/x.py:1 action_budget", "turnrl/x.py:2 text"]


def test_the_names_are_read_off_the_declaration():
    assert REQUIRED_METHODS == ("reset", "step", "instructions", "action_names", "state_facts", "solve")
    assert OPTIONAL_METHODS == ("state_key", "text", "image", "action_budget", "max_text_length", "canonical_action",
                                "close")
    assert QUERIES == ("instructions", "action_names", "state_facts", "solve", "state_key", "text", "image",
                       "action_budget", "max_text_length")
    # A query takes no argument: everything but self is optional or keyword-only in its declaration.
    for name in QUERIES:
        declared = getattr(AgentEnv, name, None) or getattr(OptionalMethods, name)
        assert declared.__code__.co_argcount == 1, name


def test_an_env_without_the_optional_methods_gets_their_defaults():
    env = Corridor()
    obs, _ = env.reset(seed=0)
    offered = optional_methods(env)
    assert offered.state_key() is None and state_key(env, obs) == observation_key(obs)
    assert offered.text() == "" and offered.action_budget() is None and offered.canonical_action("right") is None
    assert offered.max_text_length() == MAX_TEXT_LENGTH and offered.close() is None
    with pytest.raises(NotImplementedError, match="offers no image"):
        offered.image()


def test_an_env_with_the_optional_methods_has_them_used():
    env = CorridorWithExtras()
    obs, _ = env.reset(seed=0)
    offered = optional_methods(env)
    assert state_key(env, obs) == offered.state_key() == f"at {env.position}"
    assert offered.text() == obs["text"] and offered.action_budget() == 4
    assert offered.canonical_action(" RIGHT ") == "Right" and offered.image().shape == (2, 5, 3)
    offered.close()
    assert env.closed == 1


def test_a_turn_env_is_its_own_optional_methods():
    env = make("Sokoban")
    assert optional_methods(env) is env


def test_an_attribute_that_only_shares_a_name_is_not_the_method():
    class Captioned(Corridor):
        text = "a caption"  # a str, not the text() of the contract

    assert optional_methods(Captioned()).text() == ""


@pytest.fixture
def registered():
    ids = {"turnrl-test/Extras-v0": "tests.envs.toy_envs:CorridorTurnEnv",
           "turnrl-test/Plain-v0": "tests.envs.toy_envs:CorridorGymEnv"}
    for env_id, entry_point in ids.items():
        gym.register(env_id, entry_point=entry_point, max_episode_steps=50)
    yield list(ids)
    for env_id in ids:
        del gym.registry[env_id]


def test_a_gymnasium_id_keeps_its_optional_methods_through_the_wrappers(registered):
    """gymnasium.make puts wrappers around the env that forward no attribute; its optional methods still count."""
    extras_id, plain_id = registered
    env = make(extras_id, length=6, max_steps=9)
    obs, _ = env.reset(seed=0)
    offered, inner = optional_methods(env), env.unwrapped
    assert offered.state_key() == inner.state_key() and state_key(env, obs) == inner.state_key()
    assert offered.action_budget() == 9 and offered.text() == inner.text() == obs["text"]
    assert offered.canonical_action(" left ") == "Left"
    plain = make(plain_id)
    obs, _ = plain.reset(seed=0)
    offered = optional_methods(plain)
    assert offered.state_key() is None and state_key(plain, obs) == observation_key(obs)
    assert offered.action_budget() is None and offered.text() == "" and offered.canonical_action("Left") is None
    offered.close()  # Gymnasium's own close, through every wrapper
    with pytest.raises(AttributeError, match="no attribute 'nonsense'"):
        plain.nonsense  # noqa: B018 - only the contract's names are forwarded


class LongCorridor(CorridorTurnEnv):
    """The corridor with a bound of its own on an observation's text."""

    def max_text_length(self) -> int:
        return 32_768


def test_a_gymnasium_id_keeps_its_envs_bound_on_text_through_the_wrappers():
    gym.register("turnrl-test/Long-v0", entry_point="tests.envs.test_contract:LongCorridor", max_episode_steps=50)
    try:
        env = make("turnrl-test/Long-v0")
    finally:
        del gym.registry["turnrl-test/Long-v0"]
    assert type(env) is not LongCorridor and max_text_length_of(env) == 32_768
    assert env.observation_space["text"].max_length == 32_768


def test_a_deep_copy_of_a_wrapped_env_keeps_its_state(registered):
    env = make(registered[0], length=6)
    env.reset(seed=1)
    twin = copy.deepcopy(env)
    assert twin.state_key() == env.state_key() and twin.solve() == env.solve()


@pytest.mark.parametrize(("env_id", "settings", "actions"), [
    ("Sokoban", {"size": 6, "num_boxes": 1}, ["Up", "Left", "Down", "Right", "Left"]),
    ("FrozenLake", {"size": 4}, ["Right", "Down", "Down", "Right"]),
    ("PrimitiveSkill", {"task": "place", "image_size": 64}, None),
])
def test_a_planning_copy_plays_as_the_env_and_draws_no_images(env_id, settings, actions):
    """The expert simulates its actions on a planning copy: every step's text, reward, ending, info and facts
    are the env's own, but no picture is drawn (PrimitiveSkill's renderer is 0.15 s a copy); the env it was
    copied from still draws its own."""
    env = make(env_id, mode="image", **settings)
    env.reset(seed=5)
    shadow = env.planning_copy()
    assert shadow.draws_images is False and env.draws_images is True
    for action in actions if actions is not None else env.solve()[:2]:
        (obs, *rest), (shadow_obs, *shadow_rest) = env.step(action), shadow.step(action)
        assert "image" in obs and "image" not in shadow_obs and shadow_obs["text"] == obs["text"]
        assert shadow_rest == rest
        assert shadow.state_facts().describe() == env.state_facts().describe()
    assert "image" in env.observation() and "image" not in shadow.observation()


@pytest.mark.parametrize("env_id", ["Sokoban", "FrozenLake", "Bandit", "Maze2D"])
def test_a_planning_copy_shares_the_spaces_and_leaves_the_envs_state_alone(env_id):
    """The copy shares what never changes with the state (the spaces; copying them was most of a copy's time) and
    nothing that does: playing the copy to its end leaves the env's state, random draws and next step as they were."""
    env, twin = make(env_id), make(env_id)
    env.reset(seed=3), twin.reset(seed=3)
    shadow = env.planning_copy()
    assert shadow.observation_space is env.observation_space and shadow.action_space is env.action_space
    assert shadow.np_random is not env.np_random
    for action in (shadow.solve() or shadow.action_names())[:8]:
        shadow.step(action)
    assert env.state_key() == twin.state_key() and env.observation() == twin.observation()
    action = (env.solve() or env.action_names())[0]
    assert env.step(action)[:4] == twin.step(action)[:4]


@pytest.mark.parametrize(("info", "expected"), [
    ({}, None),
    ({"invalid_reason": None}, None),
    ({"invalid_reason": " \n"}, None),
    ({"invalid_reason": "a wall is\n in the way "}, "a wall is in the way"),
])
def test_the_reason_for_a_rejection_is_one_line_of_the_envs_text_or_none(info, expected):
    assert invalid_reason(info) == expected


def test_a_reason_for_a_rejection_must_be_text():
    with pytest.raises(ValueError, match=r"info\['invalid_reason'\] must be a str .*got a list"):
        invalid_reason({"invalid_reason": ["wall"]})

"""Env ids: registered names (:data:`ENVS`), ``module:Class``, Gymnasium ids and ``gym:<id>``, resolved by
:func:`make`.

The registered envs register with Gymnasium as ``turnrl/<Name>-v0`` when
``turnrl`` is imported (as ``import ale_py`` registers the Atari envs), by
entry-point strings, so that registering imports no env module.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, cast

import gymnasium as gym

from turnrl.envs.contract import AgentEnv, AgentEnvWrapper, TurnEnv, missing_methods
from turnrl.envs.gym_adapter import GYM_PREFIX, make_image_env
from turnrl.envs.settings import (
    check_settings,
    did_you_mean,
    keyword_parameters,
    literal_choices,
    registered_settings,
    type_problems,
)
from turnrl.registry import Registry, RegistryError

EnvFactory = Callable[..., AgentEnv]
"""What an env name stands for: a class (or function) that takes the env's settings as keywords and returns an
:class:`~turnrl.envs.contract.AgentEnv`. A *registered* name is a :class:`~turnrl.envs.contract.TurnEnv` subclass, whose
modes, description and settings ``turnrl envs`` lists; ``module:attr`` may name any factory."""

ENVS: Registry[EnvFactory] = Registry("env")
"""Every env by name; ``env.id`` takes a name, ``module:attr`` or a Gymnasium id (:func:`make`). The built-in
ones are registered by ``module:Class`` strings, so that listing them imports no env module."""

ENVS.register("Sokoban", "turnrl.envs.games.sokoban:SokobanEnv")
ENVS.register("FrozenLake", "turnrl.envs.games.frozenlake:FrozenLakeEnv")
ENVS.register("Bandit", "turnrl.envs.games.bandit:BanditEnv")
ENVS.register("Countdown", "turnrl.envs.games.countdown:CountdownEnv")
ENVS.register("Maze2D", "turnrl.envs.games.maze:Maze2DEnv")
ENVS.register("Navigation", "turnrl.envs.games.navigation:NavigationEnv")
ENVS.register("PrimitiveSkill", "turnrl.envs.games.primitive_skill:PrimitiveSkillEnv")
ENVS.register("SVG", "turnrl.envs.games.svg:SVGEnv")
ENVS.register("Spatial", "turnrl.envs.games.spatial:SpatialEnv")
ENVS.register("Sudoku", "turnrl.envs.games.sudoku:SudokuEnv")
ENVS.register("Game2048", "turnrl.envs.games.game2048:Game2048Env")
ENVS.register("RubiksCube", "turnrl.envs.games.rubiks:RubiksCubeEnv")

BUILTIN_ENVS: tuple[str, ...] = ENVS.names()
"""The names of the envs that come with turnrl."""

CONTRACT_HINT = (
    "turnrl needs string actions, dict observations with a 'text' key, instructions() and action_names() "
    "(and state_facts() and solve(); see turnrl.envs.AgentEnv, or subclass turnrl.envs.TurnEnv)"
)


def gym_id(name: str) -> str:
    return f"turnrl/{name}-v0"


def register_all() -> None:
    """Register every registered env with Gymnasium as ``turnrl/<Name>-v0`` (idempotent)."""
    for name in ENVS.names():
        if gym_id(name) not in gym.registry:
            # gymnasium types its entry points as making a gymnasium.Env; ours are typed by the agent-env contract
            gym.register(id=gym_id(name), entry_point=ENVS.target(name))  # type: ignore[arg-type]


def env_names() -> list[str]:
    """Every registered env name (the built-in ones first)."""
    return list(ENVS.names())


def builtin_name(env_id: str) -> str | None:
    """``"sokoban"``, ``"Sokoban"`` or ``"turnrl/Sokoban-v0"`` -> ``"Sokoban"``; None if not registered.

    Only a bare name or turnrl's own Gymnasium id: ``"Bandit-v0"`` may be someone else's registered env.
    """
    bare = env_id.lower()
    if bare.startswith("turnrl/") and bare.endswith("-v0"):
        bare = bare.removeprefix("turnrl/").removesuffix("-v0")
    return next((name for name in ENVS.names() if name.lower() == bare), None)


def resolve_name(env_id: str) -> str:
    """The built-in name of ``env_id``; ValueError (listing the accepted ids) if it is not one."""
    name = builtin_name(env_id)
    if name is None:
        raise ValueError(unknown_env_message(env_id))
    return name


def unknown_env_message(env_id: str) -> str:
    """One line: what ``env.id`` takes, with the built-in names (and the likely one of a typo)."""
    return (
        f"unknown env {env_id!r}; {did_you_mean([env_id], ENVS.names())}"
        f"env.id takes a built-in name ({', '.join(ENVS.names())}; `turnrl envs` lists "
        "them), module:Class (e.g. my_package.envs:CorridorEnv), an id registered with gymnasium.register, or "
        "gym:<id> for a Gymnasium env with rgb_array frames (e.g. gym:FrozenLake-v1)"
    )


def env_class(env_id: str) -> type[TurnEnv]:
    """The class of a registered env.

    Raises:
        TypeError: the name is registered to something other than a :class:`TurnEnv` subclass.
    """
    name = resolve_name(env_id)
    cls = ENVS.get(name)
    if not (inspect.isclass(cls) and issubclass(cls, TurnEnv)):
        raise TypeError(f"env {name!r} is registered as {cls!r}; a registered env name is a TurnEnv subclass "
                        "(name any other factory as module:attr)")
    return cls


def env_parameters(env_id: str) -> dict[str, Any]:
    """Constructor parameters of a built-in env and their defaults."""
    return keyword_parameters(env_class(env_id)) or {}


def env_setting_choices(env_id: str) -> dict[str, tuple[Any, ...]]:
    """The allowed values of a built-in env's settings that take one of a fixed set: those its constructor
    types as ``Literal``, those its class declares in ``setting_choices``, and ``mode`` (its ``modes``)."""
    cls = env_class(env_id)
    return {**literal_choices(cls), **cls.setting_choices, "mode": tuple(cls.modes)}


def make(env_id: str, **settings: Any) -> AgentEnv:
    """Build the env that ``env.id`` names, with keyword settings.

    ``env_id`` is tried as, in this order:

    1. a built-in name: ``Sokoban`` (any case) or ``turnrl/Sokoban-v0``;
    2. ``module:Class``: the module is imported and the class (anything with
       the :class:`~turnrl.envs.contract.AgentEnv` methods) built with the settings;
       ``module:gym-id`` also works, for a module that registers Gymnasium ids
       on import;
    3. an id in ``gymnasium.registry``: made with ``gymnasium.make(env_id,
       **settings)`` (wrappers such as ``TimeLimit`` included) and wrapped in
       :class:`AgentEnvWrapper` so that the contract methods reach the env.

    ``gym:<id>`` is any Gymnasium env that renders ``rgb_array`` frames, as an
    image env (:func:`turnrl.envs.gym_adapter.make_image_env`): observations
    are its frames, actions the names of an action map.

    Settings are checked against the constructor before anything is built.
    """
    name = builtin_name(env_id)
    if name is not None:
        return _build(name, env_class(name), settings)
    if env_id.startswith(GYM_PREFIX):
        # Wrapper.step is typed for any action and a SupportsFloat reward; the contract methods are the point here.
        return cast(AgentEnv, make_image_env(env_id.removeprefix(GYM_PREFIX), **settings))
    if ":" in env_id:
        return _make_entry_point(env_id, settings)
    if env_id in gym.registry:
        return _make_registered(env_id, settings)
    raise ValueError(unknown_env_message(env_id))


def entry_point(env_id: str) -> EnvFactory | str:
    """What a ``package.module:attr`` id names once its module imports: the factory, or the Gymnasium id the import
    registered (gymnasium's own ``module:id`` form).

    Raises:
        RegistryError: the module does not import, or has no such attribute (the message says which).
    """
    try:
        return ENVS.get(env_id)
    except RegistryError:
        attribute = env_id.partition(":")[2]
        if attribute in gym.registry:
            return attribute
        raise


def _make_entry_point(env_id: str, settings: dict[str, Any]) -> AgentEnv:
    """``package.module:Class`` (or ``package.module:registered/Id-v0``) -> an env."""
    found = entry_point(env_id)
    return _make_registered(found, settings) if isinstance(found, str) else _build(env_id, found, settings)


def _build(label: str, factory: EnvFactory, settings: dict[str, Any]) -> AgentEnv:
    """``factory(**settings)``, its settings checked first, and refused unless it has the agent-env methods."""
    if inspect.isclass(factory) and missing_methods(factory):
        raise TypeError(_not_an_agent_env(label, factory.__name__, missing_methods(factory)))
    check_settings(label, keyword_parameters(factory), settings)
    problems = type_problems(factory, settings)
    if problems:
        raise ValueError("; ".join(problems))  # the callers name the env and the setting (build_env)
    env = factory(**settings)
    if missing_methods(env):
        raise TypeError(_not_an_agent_env(label, type(env).__name__, missing_methods(env)))
    return env


def _not_an_agent_env(env_id: str, type_name: str, missing: list[str]) -> str:
    methods = ", ".join(f"{name}()" for name in missing)
    return f"env {env_id!r} is not an agent env: {type_name} has no {methods}. {CONTRACT_HINT}."


def _make_registered(env_id: str, settings: dict[str, Any]) -> AgentEnv:
    """``gymnasium.make`` a registered id; refuse an env without the contract methods."""
    check_settings(env_id, registered_settings(env_id), settings)
    env = gym.make(env_id, **settings)
    missing = missing_methods(env.unwrapped)
    if missing:
        env.close()
        raise TypeError(
            f"{_not_an_agent_env(env_id, type(env.unwrapped).__name__, missing)} Gymnasium's own envs "
            "(integer actions, array observations) are not agent envs; wrap one in a class that provides "
            f"these and pass it as module:Class, or use env.id=gym:{env_id} for an env that renders rgb_array "
            "images (observations are its frames, actions the names of an action map)."
        )
    # Wrapper.step is typed for any action and a SupportsFloat reward; the contract methods are the point here.
    return cast(AgentEnv, AgentEnvWrapper(env))

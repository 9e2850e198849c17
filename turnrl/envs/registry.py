"""Env ids: built-in names, ``module:Class``, Gymnasium ids and ``gym:<id>``, resolved by :func:`make`.

The built-in envs register with Gymnasium as ``turnrl/<Name>-v0`` when
``turnrl`` is imported (as ``import ale_py`` registers the Atari envs), by
entry-point strings, so that registering imports no env module.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any, cast

import gymnasium as gym

from turnrl.envs.base import AgentEnv, AgentEnvWrapper, TurnEnv, missing_methods
from turnrl.envs.gym_adapter import GYM_PREFIX, make_image_env
from turnrl.envs.settings import check_settings, did_you_mean, keyword_parameters, literal_choices, registered_settings

BUILTIN_ENVS: dict[str, str] = {
    "Sokoban": "turnrl.envs.games.sokoban:SokobanEnv",
    "FrozenLake": "turnrl.envs.games.frozenlake:FrozenLakeEnv",
    "Bandit": "turnrl.envs.games.bandit:BanditEnv",
    "Countdown": "turnrl.envs.games.countdown:CountdownEnv",
    "Maze2D": "turnrl.envs.games.maze:Maze2DEnv",
    "Navigation": "turnrl.envs.games.navigation:NavigationEnv",
    "PrimitiveSkill": "turnrl.envs.games.primitive_skill:PrimitiveSkillEnv",
    "SVG": "turnrl.envs.games.svg:SVGEnv",
    "Spatial": "turnrl.envs.games.spatial:SpatialEnv",
    "Sudoku": "turnrl.envs.games.sudoku:SudokuEnv",
    "Game2048": "turnrl.envs.games.game2048:Game2048Env",
    "RubiksCube": "turnrl.envs.games.rubiks:RubiksCubeEnv",
}

CONTRACT_HINT = (
    "turnrl needs string actions, dict observations with a 'text' key, instructions() and action_names() "
    "(and state_facts() and solve(); see turnrl.envs.AgentEnv, or subclass turnrl.envs.TurnEnv)"
)


def gym_id(name: str) -> str:
    return f"turnrl/{name}-v0"


def register_all() -> None:
    """Register every built-in env with Gymnasium (idempotent)."""
    for name, entry_point in BUILTIN_ENVS.items():
        if gym_id(name) not in gym.registry:
            gym.register(id=gym_id(name), entry_point=entry_point)


def env_names() -> list[str]:
    return list(BUILTIN_ENVS)


def builtin_name(env_id: str) -> str | None:
    """``"sokoban"``, ``"Sokoban"`` or ``"turnrl/Sokoban-v0"`` -> ``"Sokoban"``; None if not built in.

    Only a bare name or turnrl's own Gymnasium id: ``"Bandit-v0"`` may be someone else's registered env.
    """
    bare = env_id.lower()
    if bare.startswith("turnrl/") and bare.endswith("-v0"):
        bare = bare.removeprefix("turnrl/").removesuffix("-v0")
    return next((name for name in BUILTIN_ENVS if name.lower() == bare), None)


def resolve_name(env_id: str) -> str:
    """The built-in name of ``env_id``; ValueError (listing the accepted ids) if it is not one."""
    name = builtin_name(env_id)
    if name is None:
        raise ValueError(unknown_env_message(env_id))
    return name


def unknown_env_message(env_id: str) -> str:
    """One line: what ``env.id`` takes, with the built-in names (and the likely one of a typo)."""
    return (
        f"unknown env {env_id!r}; {did_you_mean([env_id], BUILTIN_ENVS)}"
        f"env.id takes a built-in name ({', '.join(BUILTIN_ENVS)}; `turnrl envs` lists "
        "them), module:Class (e.g. my_package.envs:CorridorEnv), an id registered with gymnasium.register, or "
        "gym:<id> for a Gymnasium env with rgb_array frames (e.g. gym:FrozenLake-v1)"
    )


def env_class(env_id: str) -> type[TurnEnv]:
    """The class of a built-in env."""
    module_name, class_name = BUILTIN_ENVS[resolve_name(env_id)].split(":")
    return getattr(importlib.import_module(module_name), class_name)


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
       the :class:`~turnrl.envs.base.AgentEnv` methods) built with the settings;
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
        cls = env_class(name)
        check_settings(name, env_parameters(name), settings)
        return cls(**settings)
    if env_id.startswith(GYM_PREFIX):
        # Wrapper.step is typed for any action and a SupportsFloat reward; the contract methods are the point here.
        return cast(AgentEnv, make_image_env(env_id.removeprefix(GYM_PREFIX), **settings))
    if ":" in env_id:
        return _make_entry_point(env_id, settings)
    if env_id in gym.registry:
        return _make_registered(env_id, settings)
    raise ValueError(unknown_env_message(env_id))


def _make_entry_point(env_id: str, settings: dict[str, Any]) -> AgentEnv:
    """``package.module:Class`` (or ``package.module:registered/Id-v0``) -> an env."""
    module_name, _, attribute = env_id.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(f"env {env_id!r}: cannot import module {module_name!r} ({error})") from error
    factory = _lookup(module, attribute)
    if factory is None:
        if attribute in gym.registry:  # gymnasium's own "module:id" form
            return _make_registered(attribute, settings)
        hint = did_you_mean([attribute], [name for name in dir(module) if not name.startswith("_")])
        raise ValueError(f"env {env_id!r}: module {module_name!r} has no attribute {attribute!r}"
                         + (f"; {hint.strip()}" if hint else ""))
    if inspect.isclass(factory) and missing_methods(factory):
        raise TypeError(_not_an_agent_env(env_id, factory.__name__, missing_methods(factory)))
    check_settings(env_id, keyword_parameters(factory), settings)
    env = factory(**settings)
    if missing_methods(env):
        raise TypeError(_not_an_agent_env(env_id, type(env).__name__, missing_methods(env)))
    return env


def _lookup(module: Any, dotted: str) -> Any:
    """``module.A.B`` for ``"A.B"``, or None."""
    obj = module
    for part in dotted.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


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

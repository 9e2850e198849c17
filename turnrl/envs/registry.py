"""The built-in environments, registered with Gymnasium as ``turnrl/<Name>-v0``."""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import gymnasium as gym

from turnrl.envs.base import TurnEnv

BUILTIN_ENVS: dict[str, str] = {
    "Sokoban": "turnrl.envs.sokoban:SokobanEnv",
    "FrozenLake": "turnrl.envs.frozenlake:FrozenLakeEnv",
    "Bandit": "turnrl.envs.bandit:BanditEnv",
    "Countdown": "turnrl.envs.countdown:CountdownEnv",
    "Maze2D": "turnrl.envs.maze:Maze2DEnv",
}


def gym_id(name: str) -> str:
    return f"turnrl/{name}-v0"


def register_all() -> None:
    """Register every built-in env with Gymnasium (idempotent)."""
    for name, entry_point in BUILTIN_ENVS.items():
        if gym_id(name) not in gym.registry:
            gym.register(id=gym_id(name), entry_point=entry_point)


def env_names() -> list[str]:
    return list(BUILTIN_ENVS)


def resolve_name(env_id: str) -> str:
    """``"sokoban"``, ``"Sokoban"`` or ``"turnrl/Sokoban-v0"`` -> ``"Sokoban"``."""
    bare = env_id.removeprefix("turnrl/").removesuffix("-v0")
    for name in BUILTIN_ENVS:
        if name.lower() == bare.lower():
            return name
    raise ValueError(f"unknown env {env_id!r}; built-in envs: {', '.join(BUILTIN_ENVS)} (see `turnrl envs`)")


def env_class(env_id: str) -> type[TurnEnv]:
    module_name, class_name = BUILTIN_ENVS[resolve_name(env_id)].split(":")
    return getattr(importlib.import_module(module_name), class_name)


def env_parameters(env_id: str) -> dict[str, Any]:
    """Constructor parameters of an env and their defaults."""
    signature = inspect.signature(env_class(env_id).__init__)
    return {
        name: param.default
        for name, param in signature.parameters.items()
        if name != "self" and param.kind is not inspect.Parameter.VAR_KEYWORD
    }


def make(env_id: str, **kwargs: Any) -> TurnEnv:
    """Build a built-in env by name with keyword settings.

    Unknown settings fail here, naming the allowed ones, rather than deep in a run.
    """
    cls = env_class(env_id)
    allowed = env_parameters(env_id)
    unknown = sorted(set(kwargs) - set(allowed))
    if unknown:
        listing = ", ".join(f"{k}={v!r}" for k, v in allowed.items())
        raise ValueError(f"{resolve_name(env_id)} has no setting {', '.join(unknown)}; allowed: {listing}")
    return cls(**kwargs)

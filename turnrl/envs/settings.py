"""Env settings: what an env's constructor, or a registered Gymnasium id, accepts, checked before anything is
built (the registry and the Gymnasium adapter both check them)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import gymnasium as gym
from gymnasium.envs.registration import load_env_creator

_GYM_MAKE_SETTINGS = {"max_episode_steps": None, "disable_env_checker": None}
"""Settings that ``gymnasium.make`` takes itself rather than passing to the env."""


def keyword_parameters(factory: Callable[..., Any]) -> dict[str, Any] | None:
    """Keyword parameters of ``factory`` and their defaults; None if it takes ``**kwargs``."""
    params = inspect.signature(factory).parameters.values()
    if any(param.kind is inspect.Parameter.VAR_KEYWORD for param in params):
        return None
    return {param.name: param.default for param in params if param.kind is not inspect.Parameter.VAR_POSITIONAL}


def check_settings(label: str, allowed: dict[str, Any] | None, settings: dict[str, Any]) -> None:
    """Fail here, naming the allowed settings, rather than with a TypeError deep in a run."""
    if allowed is None:  # the constructor takes **kwargs: it checks its own settings
        return
    unknown = sorted(set(settings) - set(allowed))
    if unknown:
        listing = ", ".join(f"{k}={v!r}" for k, v in allowed.items())
        raise ValueError(f"{label} has no setting {', '.join(unknown)}; allowed: {listing}")


def registered_settings(env_id: str) -> dict[str, Any] | None:
    """What ``gymnasium.make(env_id, ...)`` accepts, with defaults; None if the env's creator takes ``**kwargs``.

    The creator's parameters, the registration's kwargs and ``gymnasium.make``'s own settings.
    """
    spec = gym.spec(env_id)
    creator = load_env_creator(spec.entry_point) if isinstance(spec.entry_point, str) else spec.entry_point
    allowed = keyword_parameters(creator) if creator is not None else None
    return None if allowed is None else {**allowed, **spec.kwargs, **_GYM_MAKE_SETTINGS}

"""Env settings: what an env's constructor, or a registered Gymnasium id, accepts, checked before anything is
built (the registry and the Gymnasium adapter both check them)."""

from __future__ import annotations

import inspect
import numbers
import types
from collections.abc import Callable, Iterable
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

import gymnasium as gym
from gymnasium.envs.registration import load_env_creator

from turnrl.envs.contract import described
from turnrl.registry import close_names

__all__ = ["check_settings", "close_names", "did_you_mean", "keyword_parameters", "literal_choices",
           "registered_settings", "type_problems"]


def keyword_parameters(factory: Callable[..., Any]) -> dict[str, Any] | None:
    """Keyword parameters of ``factory`` and their defaults; None if it takes ``**kwargs``."""
    params = inspect.signature(factory).parameters.values()
    if any(param.kind is inspect.Parameter.VAR_KEYWORD for param in params):
        return None
    return {param.name: param.default for param in params if param.kind is not inspect.Parameter.VAR_POSITIONAL}


def literal_choices(factory: Callable[..., Any]) -> dict[str, tuple[Any, ...]]:
    """The allowed values of the keyword parameters of ``factory`` (a class: its ``__init__``) typed as a
    ``Literal`` (or a ``Literal`` or None): ``task: Literal["align", "place"]`` -> ``{"task": ("align",
    "place")}``. Annotations that cannot be read here (names imported only for type checkers) give none."""
    target = factory.__init__ if inspect.isclass(factory) else factory
    try:
        hints = get_type_hints(target)
    except (NameError, TypeError, AttributeError):
        return {}
    choices: dict[str, tuple[Any, ...]] = {}
    for name, hint in hints.items():
        options = [hint] if get_origin(hint) is Literal else []
        if get_origin(hint) is Union or isinstance(hint, types.UnionType):  # Literal[...] | None
            options = [arg for arg in get_args(hint) if arg is not type(None)]
        if name != "return" and len(options) == 1 and get_origin(options[0]) is Literal:
            choices[name] = get_args(options[0])
    return choices


PLAIN_TYPES: dict[type, tuple[str, Callable[[Any], bool]]] = {
    bool: ("a bool (true or false)", lambda value: isinstance(value, bool)),
    int: ("an int", lambda value: isinstance(value, numbers.Integral) and not isinstance(value, bool)),
    float: ("a number", lambda value: isinstance(value, numbers.Real) and not isinstance(value, bool)),
    str: ("a str", lambda value: isinstance(value, str)),
}
"""The annotations :func:`type_problems` checks a setting against: what to call each, and whether a value is one."""


def type_problems(factory: Callable[..., Any], settings: dict[str, Any]) -> list[str]:
    """What is wrong with the types of ``settings`` for the keyword parameters of ``factory`` (a class: its
    ``__init__``) annotated as a plain ``bool``, ``int``, ``float`` or ``str`` (or one of them or None), one line
    each: ``length must be an int, got a str: 'abc'``. A setting of a wrong type otherwise fails deep in the env
    (a TypeError in its arithmetic at reset), or not at all (``"false"`` is a true flag). Other annotations, and
    those that cannot be read here, are not checked."""
    target = factory.__init__ if inspect.isclass(factory) else factory
    try:
        hints = get_type_hints(target)
    except (NameError, TypeError, AttributeError):
        return []
    problems = []
    for name, value in settings.items():
        hint = hints.get(name)
        options = [arg for arg in get_args(hint) if arg is not type(None)] if get_origin(hint) is Union or \
            isinstance(hint, types.UnionType) else [hint]
        if len(options) != 1 or options[0] not in PLAIN_TYPES or (value is None and len(get_args(hint)) == 2):
            continue
        expected, accepts = PLAIN_TYPES[options[0]]
        if not accepts(value):
            problems.append(f"{name} must be {expected}, got {described(value)}")
    return problems


def did_you_mean(words: Iterable[str], names: Iterable[str]) -> str:
    """``"did you mean size? "`` for the names close to any of ``words``, else ``""``."""
    names = list(names)
    near = list(dict.fromkeys(name for word in words for name in close_names(word, names)))
    return f"did you mean {' or '.join(near)}? " if near else ""


def check_settings(label: str, allowed: dict[str, Any] | None, settings: dict[str, Any]) -> None:
    """Fail here, naming the allowed settings (and the likely one of a typo), rather than with a TypeError deep
    in a run."""
    if allowed is None:  # the constructor takes **kwargs: it checks its own settings
        return
    unknown = sorted(set(settings) - set(allowed))
    if unknown:
        listing = ", ".join(k if v is inspect.Parameter.empty else f"{k}={v!r}" for k, v in allowed.items())
        hint = did_you_mean(unknown, allowed)
        raise ValueError(f"{label} has no setting {', '.join(unknown)}; {hint}allowed: {listing}")


def registered_settings(env_id: str) -> dict[str, Any] | None:
    """What ``gymnasium.make(env_id, ...)`` accepts, with defaults; None if the env's creator takes ``**kwargs``.

    The creator's parameters, the registration's kwargs and ``gymnasium.make``'s own settings, whose defaults
    are the registration's (FrozenLake-v1's ``max_episode_steps`` is 100, not None: no limit).
    """
    spec = gym.spec(env_id)
    creator = load_env_creator(spec.entry_point) if isinstance(spec.entry_point, str) else spec.entry_point
    allowed = keyword_parameters(creator) if creator is not None else None
    # The settings gymnasium.make takes itself rather than passing to the env.
    own = {"max_episode_steps": spec.max_episode_steps, "disable_env_checker": spec.disable_env_checker}
    return None if allowed is None else {**allowed, **spec.kwargs, **own}

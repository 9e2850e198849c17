"""One-line messages for a config that cannot load: what is wrong, at which key, and what to write instead.

Pure functions of what the user wrote (a YAML file's mapping, or an override's as nested mappings), the
declared types of the config dataclasses, and the errors of PyYAML and OmegaConf, whose own texts name
OmegaConf's classes (``ListConfig``, ``Dict[str, Any]``) or a list index the user never wrote.
:mod:`turnrl.config` raises them as ``ConfigError``.
"""

from __future__ import annotations

import difflib
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, fields, is_dataclass
from typing import Any

import yaml
from omegaconf.errors import OmegaConfBaseException

from turnrl.registry import close_names

PLACEHOLDERS = {"section": "{KEY: VALUE}", "mapping": "{KEY: VALUE}", "list": "[a, b]", "value": "VALUE"}
"""What a message writes for a value of each kind of key, in its examples."""


@dataclass(frozen=True)
class KeyShape:
    """What one config key takes, read from its declared type."""

    kind: str
    """``section`` (a dataclass of keys), ``mapping`` (a dict), ``list``, or ``value`` (a number, text, ...)."""
    nullable: bool
    """Whether null is allowed (``Optional[...]``)."""
    is_text: bool = False
    """Whether it takes a text (``str``)."""
    choices: tuple[Any, ...] = ()
    """The values a ``Literal`` type allows; empty for any of its type."""


def key_shapes(cls: type, prefix: str = "") -> dict[str, KeyShape]:
    """The shape of every key of dataclass ``cls`` and of the dataclasses in it, by dotted key (sections too)."""
    shapes = {}
    hints = typing.get_type_hints(cls)
    for item in fields(cls):
        hint, key = hints[item.name], f"{prefix}{item.name}"
        nullable = typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in typing.get_args(hint)
        if nullable:
            hint = next(arg for arg in typing.get_args(hint) if arg is not type(None))
        origin = typing.get_origin(hint) or hint
        if is_dataclass(hint):
            shapes[key] = KeyShape("section", nullable)
            shapes.update(key_shapes(hint, f"{key}."))  # type: ignore[arg-type]
        else:
            kind = "mapping" if origin is dict else "list" if origin is list else "value"
            choices = typing.get_args(hint) if origin is typing.Literal else ()
            shapes[key] = KeyShape(kind, nullable, hint is str, choices)
    return shapes


def nested(key: str, text: str) -> str:
    """``a.b.c`` set to ``text`` as a YAML file writes it: ``a: {b: {c: text}}``."""
    first, *rest = key.split(".")
    for part in reversed(rest):
        text = f"{{{part}: {text}}}"
    return f"{first}: {text}"


def flow(value: Any) -> str:
    """``value`` as YAML on one line (``{steps: 2}``, ``[1, 2]``, ``Sokoban``)."""
    return str(yaml.safe_dump(value, default_flow_style=True, width=10**9)).strip().removesuffix("...").strip()


def choice_problem(key: str, value: Any, allowed: tuple[Any, ...] | list[Any]) -> str | None:
    """Why ``value`` is not one of the ``allowed`` values of ``key``, with the likely one of a typo; None if it is."""
    if value in allowed:
        return None
    near = close_names(str(value), [str(choice) for choice in allowed], n=1)
    hint = f"; did you mean {near[0]}?" if near else ""
    return f"{key}={value!r} is not allowed; choose one of {list(allowed)}{hint}"


def shape_problem(written: Any, shapes: Mapping[str, KeyShape], override: str | None = None,
                  file: str = "") -> str | None:
    """The first key in ``written`` whose value its type does not take, said with what to write instead: a list or
    a value for a section or a mapping, a mapping or a value for a list, a list or a mapping for a value, null
    for a key that needs a value, a value outside a ``Literal``'s choices, or (in a file) a dotted key. None if
    every key takes its value or is unknown (OmegaConf names unknown keys, with the close ones).

    ``override``: the ``key=value`` that ``written`` was read from; None for the config file named ``file``.
    """

    def walk(node: Any, prefix: str) -> str | None:
        for name, value in node.items() if isinstance(node, dict) else ():
            key = f"{prefix}{name}"
            if override is None and "." in str(name):
                return (f"config file {file!r} writes the dotted key {str(name)!r}; a file nests its keys, as "
                        f"{nested(key, flow(value))} (dotted keys are for overrides: {key}={flow(value)})")
            shape = shapes.get(key)
            problem = None if shape is None else _value_problem(key, shape, value, override, file)
            if problem is None and shape is not None and shape.kind == "section":
                problem = walk(value, f"{key}.")
            if problem is not None:
                return problem
        return None

    return walk(written, "")


def _value_problem(key: str, shape: KeyShape, value: Any, override: str | None, file: str) -> str | None:
    def example(text: str) -> str:
        return f"{key}={text}" if override is not None else nested(key, text)

    if value is None and override is not None and not override.split("=", 1)[1].strip():
        return f"override {override!r} gives no value; write {key}=VALUE (`turnrl config show` lists every key)"
    if shape.kind == "section" and not isinstance(value, dict):
        if override is not None:
            return (f"override {override!r} gives a value to the section {key}; set its keys, e.g. {key}.KEY=VALUE "
                    "(`turnrl config show` lists them)")
        return (f"config file {file!r} gives a value to the section {key} ({nested(key, flow(value))}); a section "
                f"takes a mapping of its keys, e.g. {example('{KEY: VALUE}')} (`turnrl config show` lists them)")
    if value is None:
        if shape.nullable:
            return None
        if shape.is_text:
            return (f"config key {key!r} takes a text, not null; write {example('TEXT')}, or "
                    f"{example(repr('null'))} for the word itself")
        return f"config key {key!r} needs a value, not null; write {example(PLACEHOLDERS[shape.kind])}"
    if shape.kind == "mapping" and not isinstance(value, dict):
        return f"config key {key!r} takes a mapping, e.g. {example('{KEY: VALUE}')}"
    if shape.kind == "list" and not isinstance(value, list):
        if isinstance(value, dict) and all(str(index).isdigit() for index in value):
            return None  # an override of a list's item by its index (`sampling.stop.0=x`): load_config says so
        none = "" if isinstance(value, dict) else f" ({example('[]')} for none)"
        return f"config key {key!r} takes a list, e.g. {example('[a, b]')}{none}"
    if shape.kind == "value" and isinstance(value, (dict, list)):
        given = "mapping" if isinstance(value, dict) else "list"
        return f"config key {key!r} takes one value, not a {given}; write {example('VALUE')}"
    return choice_problem(key, value, shape.choices) if shape.choices else None


def container_mismatch(default: Any, given: Any, key: str = "") -> str | None:
    """The fix where ``given`` has a list for a mapping of ``default`` or the reverse (merge's TypeError names none)."""
    if isinstance(default, dict) and isinstance(given, dict):
        found = (container_mismatch(default.get(name), given[name], f"{key}.{name}".lstrip(".")) for name in given)
        return next(filter(None, found), None)
    wanted: dict[type, str] = {dict: f"a mapping, e.g. {key}={{KEY: VALUE}}", list: f"a list, e.g. {key}=[a, b]"}
    return f"config key {key!r} takes {wanted[type(default)]}" if {type(default), type(given)} == {dict, list} else None


def yaml_problem(error: yaml.YAMLError, where: bool = True) -> str:
    """PyYAML's error on one line: what is wrong, and (``where``) the line and column of the file where it is
    (its own text takes four lines, two of them the context's place)."""
    if not isinstance(error, yaml.MarkedYAMLError) or error.problem is None:
        return " ".join(str(error).split())
    mark = error.problem_mark
    return f"{error.problem} at line {mark.line + 1}, column {mark.column + 1}" if where and mark else error.problem


def format_omegaconf_error(error: OmegaConfBaseException) -> str:
    key = getattr(error, "full_key", None)
    message = str(error).splitlines()[0]
    return f"config key {key!r}: {message}" if key else message


def close_keys(key: str, allowed: list[str], n: int = 3) -> list[str]:
    """The allowed keys closest to a mistyped ``key``: by the whole dotted name, then by its last part
    (``max_turn`` finds ``agent.max_turns``; ``sampling.temprature`` finds ``sampling.temperature``); a
    mistyped section (``samplng``) finds its section."""
    sections = sorted({name.rsplit(".", 1)[0] for name in allowed if "." in name})
    allowed = [*allowed, *sections]
    matches = difflib.get_close_matches(key, allowed, n=n, cutoff=0.75)
    leaf = key.rsplit(".", 1)[-1]
    by_leaf: dict[str, list[str]] = {}
    for name in allowed:
        by_leaf.setdefault(name.rsplit(".", 1)[-1], []).append(name)
    for near in difflib.get_close_matches(leaf, list(by_leaf), n=n, cutoff=0.75):
        matches.extend(name for name in by_leaf[near] if name not in matches)
    return matches[:n]

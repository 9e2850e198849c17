"""Reading a Spatial turn: one action sequence such as ``Actions: [JumpTo(red chair), Rotate(90), Observe()]``.

The grammar is RAGEN's (its Spatial env's ``ActionSequence``): zero or more moves, ``JumpTo(<object>)`` and
``Rotate(<degrees>)``, then exactly one final action, ``Observe()`` or ``Term(<letter>)``, and ``Term`` only
alone. Like RAGEN, the list is found anywhere in the text (``Actions:`` is optional, and so is text around the
brackets); action names are read in any case and spacing, object names with spaces or underscores. A list
without brackets is read too when it is the whole text.

A sequence that breaks the grammar is *unreadable* (:func:`parse_sequence` returns None; the env rejects it
and pays its penalty). A readable sequence can still fail when played: a jump to an unknown or unseen object,
or a turn by a degree that is not a multiple of 90, fails there (RAGEN's behaviour), not here.

Parsing never raises and takes time linear in the text, which is cut at :data:`MAX_CHARS`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

MAX_CHARS = 2000
"""Longer texts are unreadable (a sequence is a few dozen characters)."""
MAX_ACTIONS = 16

_LIST = re.compile(r"\[([^\[\]]*)\]")
_CALL = re.compile(r"\s*([A-Za-z_]+)\s*\(([^()]*)\)\s*")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9 _-]*")
_DEGREES = re.compile(r"[+-]?\d{1,4}")
_LETTER = re.compile(r"""["'`]?([A-Za-z])[.)]?["'`]?""")
_PREFIX = re.compile(r"^\s*actions?\s*:\s*", re.IGNORECASE)


@dataclass(frozen=True)
class Action:
    """One parsed action: ``kind`` is ``jump``, ``rotate``, ``observe`` or ``term``."""

    kind: str
    target: str = ""
    """The object of a jump (lower case, single spaces) or the letter of an answer (upper case)."""
    degrees: int = 0

    def text(self) -> str:
        if self.kind == "jump":
            return f"JumpTo({self.target})"
        if self.kind == "rotate":
            return f"Rotate({self.degrees})"
        if self.kind == "observe":
            return "Observe()"
        return f"Term({self.target})"

    @property
    def is_final(self) -> bool:
        return self.kind in ("observe", "term")


def sequence_text(actions: tuple[Action, ...]) -> str:
    """The canonical spelling: ``Actions: [Rotate(90), Observe()]``."""
    return f"Actions: [{', '.join(action.text() for action in actions)}]"


def _action(call: str) -> Action | None:
    match = _CALL.fullmatch(call)
    if match is None:
        return None
    name, argument = match[1].lower().replace("_", ""), match[2].strip()
    if name == "jumpto":
        target = argument.strip("\"'`").strip()
        if not _NAME.fullmatch(target):
            return None
        return Action("jump", " ".join(target.replace("_", " ").lower().split()))
    if name == "rotate":
        if not _DEGREES.fullmatch(argument):
            return None
        return Action("rotate", degrees=int(argument))
    if name == "observe":
        return Action("observe") if not argument else None
    if name == "term":
        answer = _LETTER.fullmatch(argument)
        return Action("term", answer[1].upper()) if answer else None
    return None


def _split_calls(body: str) -> list[str] | None:
    """The comma-separated calls of a list body (commas inside parentheses do not split)."""
    calls, depth, start = [], 0, 0
    for k, ch in enumerate(body):
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
            if depth < 0:
                return None
        elif ch == "," and depth == 0:
            calls.append(body[start:k])
            start = k + 1
    calls.append(body[start:])
    calls = [call for call in calls if call.strip()]
    return calls if depth == 0 else None


def parse_sequence(text: object) -> tuple[Action, ...] | None:
    """The actions of one turn, or None when ``text`` is not a readable sequence."""
    if not isinstance(text, str) or len(text) > MAX_CHARS:
        return None
    found = _LIST.search(text)
    body = found[1] if found else _PREFIX.sub("", text.strip().strip("`"))
    calls = _split_calls(body)
    if not calls or len(calls) > MAX_ACTIONS:
        return None
    actions = []
    for call in calls:
        action = _action(call)
        if action is None:
            return None
        actions.append(action)
    if not actions[-1].is_final or any(action.is_final for action in actions[:-1]):
        return None
    if actions[-1].kind == "term" and len(actions) > 1:
        return None
    return tuple(actions)

"""VisGym's tuple actions, read without evaluating them: ``('move', 0)``, ``("stop",)``.

One grammar for every part of turnrl that takes a tuple action (the response
formats, the Gymnasium adapter, Maze2D): a parenthesized tuple of 1 to 8
plain literals, quoted strings (letters, digits, ``_ . -`` and spaces; single
or double quotes), integers of up to 9 digits and decimals, with an optional
trailing comma. Anything else (names, calls, nested tuples, lists, huge
numbers, escapes) is rejected; nothing is ever passed to ``eval``.
"""

from __future__ import annotations

import re
from typing import Any

MAX_TUPLE_CHARS = 200
MAX_TUPLE_ITEMS = 8
_STRING_ITEM = re.compile(r"'([A-Za-z0-9_ .\-]{1,32})'|\"([A-Za-z0-9_ .\-]{1,32})\"")
_INT_ITEM = re.compile(r"[+-]?[0-9]{1,9}")
_FLOAT_ITEM = re.compile(r"[+-]?[0-9]{1,9}\.[0-9]{1,9}")

TupleItem = str | int | float


def _item(text: str) -> TupleItem | None:
    """One tuple element as a value, or None if it is not a plain literal."""
    text = text.strip()
    if m := _STRING_ITEM.fullmatch(text):
        return m.group(1) if m.group(1) is not None else m.group(2)
    if _INT_ITEM.fullmatch(text):
        return int(text)
    if _FLOAT_ITEM.fullmatch(text):
        value = float(text)
        return value if abs(value) < 1e9 else None  # 999999999.999999999 is 1e9: no spelling of 9 digits
    return None


def parse_tuple(text: Any) -> tuple[TupleItem, ...] | None:
    """The items of a tuple action, or None if ``text`` is not one.

    >>> parse_tuple('( "move" ,0 )')
    ('move', 0)
    >>> parse_tuple("__import__('os')") is None
    True
    """
    if not isinstance(text, str):
        return None
    text = text.strip()
    if not 2 <= len(text) <= MAX_TUPLE_CHARS or text[0] != "(" or text[-1] != ")":
        return None
    parts = text[1:-1].split(",")
    if len(parts) > 1 and not parts[-1].strip():
        parts = parts[:-1]  # a trailing comma, as in ('stop',)
    if not 1 <= len(parts) <= MAX_TUPLE_ITEMS:
        return None
    items = [_item(part) for part in parts]
    if any(item is None for item in items):
        return None
    return tuple(items)  # type: ignore[arg-type]


def tuple_text(items: tuple[TupleItem, ...]) -> str:
    """The canonical spelling of a tuple action: single quotes, ``', '`` between items, ``(x,)`` for one.

    >>> tuple_text(("move", 0))
    "('move', 0)"
    """
    body = ", ".join(f"'{item}'" if isinstance(item, str) else _decimal(item) if isinstance(item, float) else repr(item)
                     for item in items)
    return f"({body},)" if len(items) == 1 else f"({body})"


def _decimal(value: float) -> str:
    """A float as the grammar reads it back: a plain decimal (``0.00001``, where ``repr`` writes ``1e-05``) of at
    most 9 digits after the point, trailing zeros dropped but one."""
    text = f"{value:.9f}".rstrip("0")
    return text + "0" if text.endswith(".") else text

"""Pieces of a response for the page: which text sits in which reasoning field, and heatmap colours.

Everything returns plain text pieces with a kind; the template escapes the
text (model output is untrusted), and the kinds map onto a fixed set of CSS
classes, so no response can inject markup or styles.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache

from turnrl.agent.formats import BUILTIN_FORMATS, get_format

# Fields with a colour of their own; any other field gets the ``other`` colour.
FIELD_CLASSES = ("think", "observation", "reasoning", "prediction", "justification", "answer", "action")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_-]{0,39}")


@dataclass(frozen=True)
class Segment:
    """A run of response text."""

    text: str
    field: str | None
    """The innermost reasoning field the text sits in (None outside every field)."""
    is_tag: bool = False
    """The text is a tag itself (``<think>``, ``</answer>``)."""

    @property
    def css_class(self) -> str:
        """One of a fixed set of class names: ``f-think`` ..., ``f-other`` or ``f-none``, plus ``tag``."""
        name = "f-none" if self.field is None else f"f-{self.field}" if self.field in FIELD_CLASSES else "f-other"
        return f"{name} tag" if self.is_tag else name


@lru_cache(maxsize=1)
def known_tags() -> frozenset[str]:
    """Every tag name of the built-in formats."""
    return frozenset(name for fmt in BUILTIN_FORMATS for name in get_format(fmt).tag_names)


@lru_cache(maxsize=256)
def _tag_pattern(names: frozenset[str]) -> re.Pattern[str]:
    alternatives = "|".join(re.escape(name) for name in sorted(names, key=lambda n: (-len(n), n)))
    return re.compile(rf"<(/?)({alternatives})>")


def response_segments(response: str, field_names: frozenset[str] | set[str] = frozenset()) -> list[Segment]:
    """Split ``response`` into runs of text by the reasoning field they sit in.

    Tags are those of the built-in formats plus ``field_names`` (names that are not identifiers are
    ignored), matched exactly as the parsers do (``<think>``, not ``<Think >``). Nesting follows the
    tags as written: an opening tag starts a field, its closing tag ends it (and any field left open
    inside it); a stray closing tag is plain text of the field around it. Joining the texts gives
    ``response`` back. Linear in the length of the response.
    """
    names = known_tags() | {n for n in field_names if _NAME.fullmatch(n)}
    segments: list[Segment] = []
    stack: list[str] = []
    # How often each name is open: asking the stack itself costs its depth per closing tag, quadratic in a
    # response of thousands of unclosed tags (a model stuck repeating one).
    open_count: Counter[str] = Counter()

    def add(text: str, is_tag: bool = False) -> None:
        if text:
            segments.append(Segment(text, stack[-1] if stack else None, is_tag))

    position = 0
    for match in _tag_pattern(frozenset(names)).finditer(response):
        add(response[position : match.start()])
        closing, name = match.group(1) == "/", match.group(2)
        if not closing:
            stack.append(name)
            open_count[name] += 1
            add(match.group(0), is_tag=True)
        elif open_count[name]:
            while (closed := stack.pop()) != name:
                open_count[closed] -= 1
            open_count[name] -= 1
            segments.append(Segment(match.group(0), name, is_tag=True))
        else:
            add(match.group(0))
        position = match.end()
    add(response[position:])
    return segments


def advantage_color(value: float, scale: float) -> str:
    """A CSS colour for a token's advantage: red for positive, blue for negative, stronger when larger.

    ``scale`` is the value drawn at full strength (the largest absolute finite advantage of the file); 0 or a
    non-finite value draws every token clear. A non-finite advantage (NaN or an infinity) is drawn clear too,
    as the scale leaves it out: full strength is the colour of the file's largest real advantage, which an
    infinity is not (it is a defect; the token's title reads ``inf``, as a NaN's reads ``NaN``).
    """
    if not (math.isfinite(scale) and scale > 0 and math.isfinite(value)):
        return "rgba(0, 0, 0, 0)"
    strength = min(1.0, abs(value) / scale) * 0.85
    red, green, blue = (214, 39, 40) if value > 0 else (31, 119, 180)
    return f"rgba({red}, {green}, {blue}, {strength:.3f})"

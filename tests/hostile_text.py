"""Text nested deeper than Python's parsers follow: JSON's and PyYAML's read a level by recursion and raise
``RecursionError``, which a reader that catches its parser's own errors lets through."""

from __future__ import annotations

import sys

OPENINGS = ("[", '{"a": ', "{a: ", "- ")
"""A JSON array, a JSON object, a YAML flow mapping and a YAML block sequence, each opened again and again."""


def too_deep(opening: str = "[") -> str:
    """``opening`` repeated past the interpreter's recursion limit (JSON's parser counts its levels against it;
    PyYAML's takes about three calls a level). Just past it: PyYAML's scanner takes time quadratic in the depth."""
    return opening * (sys.getrecursionlimit() + 100)

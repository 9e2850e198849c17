"""Geometry of the Spatial env: headings, the field of view and the bins that observations and answers use.

Cells are integer ``(x, y)`` pairs, x growing to the east and y to the north (a map seen from above). Every
test here is exact on integer vectors: a bin boundary at 22.5 degrees (and its multiples) is never hit by an
integer vector, because tan(22.5) is irrational, and the 45 degrees edges of the field of view are compared
with integers.

Notation: ``v`` is a vector ``(dx, dy)`` from a viewer to a target; ``heading`` is 0 (north), 1 (east),
2 (south) or 3 (west), the quarter turns clockwise from north.
"""

from __future__ import annotations

import math

Cell = tuple[int, int]
"""A cell as ``(x, y)``: x grows to the east, y to the north."""

HEADINGS: tuple[Cell, ...] = ((0, 1), (1, 0), (0, -1), (-1, 0))
"""Unit vector of each heading: north, east, south, west."""
HEADING_NAMES = ("north", "east", "south", "west")
RELATIVE_FACINGS = ("forward", "right", "backward", "left")
"""Where an object faces, seen by a viewer: the quarter turns clockwise from the viewer's heading."""

EGO_BINS = ("front-left", "front-slight-left", "front", "front-slight-right", "front-right")
"""Bearing of a visible object: front is dead ahead, the slight bins reach 22.5 degrees to a side and the
others 45 (the edge of the field of view)."""
DISTANCE_BINS = ("near", "mid distance", "slightly far", "far", "very far", "extremely far")
DISTANCE_LIMITS_SQ = (4, 16, 64, 256, 1024)
"""The largest squared distance of each distance bin but the last: up to 2, 4, 8, 16 and 32 cells."""
COMPASS = ("north", "north-east", "east", "south-east", "south", "south-west", "west", "north-west")
"""Eight 45-degree sectors, centred on the compass directions (the first is centred on the frame's north)."""
CLOCK = (
    "around 12 o'clock", "around 1:30", "around 3 o'clock", "around 4:30",
    "around 6 o'clock", "around 7:30", "around 9 o'clock", "around 10:30",
)
"""The same sectors named as clock positions (12 o'clock is straight ahead)."""

_TAN_22_5 = math.sqrt(2.0) - 1.0


def offset(a: Cell, b: Cell) -> Cell:
    """The vector from ``b`` to ``a``."""
    return a[0] - b[0], a[1] - b[1]


def ego(v: Cell, heading: int) -> tuple[int, int]:
    """``(ahead, right)``: the components of ``v`` along the heading and to its right."""
    fx, fy = HEADINGS[heading]
    rx, ry = HEADINGS[(heading + 1) % 4]
    return v[0] * fx + v[1] * fy, v[0] * rx + v[1] * ry


def in_view(v: Cell, heading: int) -> bool:
    """Whether a target at ``v`` is in the 90-degree field of view (45 degrees to each side, edges included)."""
    ahead, right = ego(v, heading)
    return ahead > 0 and abs(right) <= ahead


def ego_bin(v: Cell, heading: int) -> int:
    """Index in :data:`EGO_BINS` of a target in view."""
    ahead, right = ego(v, heading)
    if right == 0:
        return 2
    slight = abs(right) < ahead * _TAN_22_5
    if right > 0:
        return 3 if slight else 4
    return 1 if slight else 0


def distance_bin(v: Cell) -> int:
    """Index in :data:`DISTANCE_BINS` of the length of ``v`` (which is not zero)."""
    squared = v[0] * v[0] + v[1] * v[1]
    return next((k for k, limit in enumerate(DISTANCE_LIMITS_SQ) if squared <= limit), len(DISTANCE_LIMITS_SQ))


def bearing(v: Cell, heading: int = 0) -> float:
    """Degrees clockwise from the heading to ``v``, in ``[0, 360)``; 0 for a target dead ahead."""
    ahead, right = ego(v, heading)
    return math.degrees(math.atan2(right, ahead)) % 360.0


def sector(v: Cell, heading: int = 0) -> int:
    """Index in :data:`COMPASS` (or :data:`CLOCK`) of ``v`` in the frame whose north is ``heading``."""
    return int(round(bearing(v, heading) / 45.0)) % 8


def relative_facing(target_heading: int, viewer_heading: int) -> int:
    """Index in :data:`RELATIVE_FACINGS`: where a target facing ``target_heading`` faces for the viewer."""
    return (target_heading - viewer_heading) % 4

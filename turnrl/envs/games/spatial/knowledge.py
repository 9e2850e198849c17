"""What an explorer can know: the cells each object may be in, given the views taken from the start.

An agent that has not jumped yet knows its own pose exactly (the start, as ``(0, 0)``, and the headings it
turned to), so each view it took there constrains every object: an object reported in the view lies in a
cell with the reported bearing and distance bins, an object not reported lies outside the field of view, a
reported facing gives the object's compass heading, and a close pair (or two objects in one view that are not
a close pair) constrains the two objects together. :class:`Knowledge` keeps those constraints, with cells
relative to the start, and answers the questions the multiple-choice checks ask (which relations, which
sightings are possible).

Every answer is *sound*: it is computed from the reports alone, never from the true room, and the true room
always satisfies the constraints, so what is true is always possible. The question generator offers as wrong
choices only claims that are impossible given the four views from the start, and the expert answers with the
one choice that is still possible; together they make every question answerable by exploring.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from turnrl.envs.games.spatial.geometry import Cell, distance_bin, ego_bin, in_view, offset, sector
from turnrl.envs.games.spatial.room import CLOSE_LIMIT_SQ, OBJECTS_WITH_FRONT, ClosePair, Sighting, View


class Knowledge:
    """Constraints on each object's cell (relative to the start) from views taken at the start.

    Args:
        size: the room's side (the agent is told it), which bounds how far an object can be.
        names: the objects of the room (the agent is told them).
        views: views taken from the start; only their reports are read (one per heading is enough).
    """

    def __init__(self, size: int, names: Sequence[str], views: Iterable[View]) -> None:
        self.size = size
        self.names = tuple(names)
        self.views: dict[int, View] = {}
        for view in views:
            self.views.setdefault(view.heading, view)
        reach = range(-(size - 1), size)
        box = [(x, y) for x in reach for y in reach if (x, y) != (0, 0)]
        self.cells: dict[str, tuple[Cell, ...]] = {}
        self.headings: dict[str, int] = {}
        """Compass heading of each object with a front that a view showed."""
        for name in self.names:
            cells = box
            for heading, view in self.views.items():
                seen = next((s for s in view.sightings if s.name == name), None)
                cells = [c for c in cells if _fits_view(c, heading, seen)]
                if seen is not None and seen.facing is not None:
                    self.headings[name] = (heading + seen.facing) % 4
            self.cells[name] = tuple(cells)
        self._pair_rules: dict[tuple[str, str], list[tuple[int, ClosePair | None]]] = {}
        for heading, view in self.views.items():
            reported = {frozenset((pair.first, pair.second)): pair for pair in view.close_pairs}
            for i, a in enumerate(view.names):
                for b in view.names[i + 1 :]:
                    key = (a, b) if a < b else (b, a)
                    self._pair_rules.setdefault(key, []).append((heading, reported.get(frozenset((a, b)))))
        self._sightings: dict[tuple[str, Cell, int], frozenset[tuple[int, int]]] = {}
        self._hides: dict[tuple[str, Cell, int], bool] = {}
        self._relations: dict[tuple[str, str, int], frozenset[tuple[int, int]]] = {}

    # ----------------------------------------------------------------- single objects
    def has_front(self, name: str) -> bool:
        return name in OBJECTS_WITH_FRONT

    def heading_options(self, name: str) -> tuple[int, ...]:
        """The compass headings the object may face: the seen one, or any while unseen."""
        return (self.headings[name],) if name in self.headings else (0, 1, 2, 3)

    def sightings_from(self, name: str, cell: Cell, heading: int) -> frozenset[tuple[int, int]]:
        """The ``(ego_bin, distance_bin)`` pairs ``name`` may show from a viewer at ``cell`` facing ``heading``
        (objects never share a cell with the viewer)."""
        key = (name, cell, heading)
        if key not in self._sightings:
            found = set()
            for c in self.cells[name]:
                v = offset(c, cell)
                if c != cell and in_view(v, heading):
                    found.add((ego_bin(v, heading), distance_bin(v)))
            self._sightings[key] = frozenset(found)
        return self._sightings[key]

    def can_hide(self, name: str, cell: Cell, heading: int) -> bool:
        """Whether ``name`` may be out of view of a viewer at ``cell`` facing ``heading``."""
        key = (name, cell, heading)
        if key not in self._hides:
            self._hides[key] = any(c != cell and not in_view(offset(c, cell), heading) for c in self.cells[name])
        return self._hides[key]

    def facing_possible(self, sighting: Sighting, viewer_heading: int) -> bool:
        """Whether the sighting's facing agrees with what is known of the object's heading."""
        if sighting.facing is None or not self.has_front(sighting.name):
            return sighting.facing is None and not self.has_front(sighting.name)
        return any((h - viewer_heading) % 4 == sighting.facing for h in self.heading_options(sighting.name))

    # ----------------------------------------------------------------- pairs
    def pair_ok(self, a: str, b: str, cell_a: Cell, cell_b: Cell) -> bool:
        """Whether ``a`` on ``cell_a`` and ``b`` on ``cell_b`` agree with every view that showed both."""
        if cell_a == cell_b:
            return False
        for heading, pair in self._pair_rules.get((a, b) if a < b else (b, a), ()):
            if pair is None:
                v = offset(cell_a, cell_b)
                if v[0] * v[0] + v[1] * v[1] <= CLOSE_LIMIT_SQ:
                    return False
                continue
            first, second = (cell_a, cell_b) if pair.first == a else (cell_b, cell_a)
            v = offset(first, second)
            if sector(v, heading) != pair.sector or distance_bin(v) != pair.distance_bin:
                return False
        return True

    def relations(self, subject: str, anchor: str, frame: int) -> frozenset[tuple[int, int]]:
        """The ``(sector, distance_bin)`` pairs ``subject`` may have from ``anchor`` in the frame whose north
        is the compass heading ``frame``."""
        key = (subject, anchor, frame)
        if key not in self._relations:
            found = set()
            for a in self.cells[subject]:
                for b in self.cells[anchor]:
                    if self.pair_ok(subject, anchor, a, b):
                        v = offset(a, b)
                        found.add((sector(v, frame), distance_bin(v)))
            self._relations[key] = frozenset(found)
        return self._relations[key]


def _fits_view(cell: Cell, heading: int, seen: Sighting | None) -> bool:
    """Whether an object on ``cell`` (relative to the viewer) agrees with a view that reported ``seen`` of it
    (None: the view did not show it)."""
    if not in_view(cell, heading):
        return seen is None
    return seen is not None and ego_bin(cell, heading) == seen.ego_bin and distance_bin(cell) == seen.distance_bin

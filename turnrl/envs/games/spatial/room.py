"""The room of the Spatial env: generation from a seed, and what a viewer sees from a pose.

As in RAGEN's Spatial env (level 0: one room), objects and the agent stand on distinct cells of a square
room; objects with a front (a chair, a television, ...) face one of the four compass directions, the others
(a table, a plant, ...) face nowhere; the agent starts facing north.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from turnrl.envs.games.spatial.geometry import (
    COMPASS,
    DISTANCE_BINS,
    EGO_BINS,
    RELATIVE_FACINGS,
    Cell,
    distance_bin,
    ego,
    ego_bin,
    in_view,
    offset,
    relative_facing,
    sector,
)

OBJECTS_WITH_FRONT = (
    "chair", "sofa", "bookshelf", "cabinet", "television", "refrigerator", "microwave", "oven", "computer",
    "printer", "scanner", "monitor", "projector", "whiteboard", "air conditioner",
)
OBJECTS_WITHOUT_FRONT = ("table", "lamp", "plant", "vase", "trash can")
OBJECT_NAMES = OBJECTS_WITH_FRONT + OBJECTS_WITHOUT_FRONT
"""The household objects a room is furnished from (RAGEN's list): names are unique within a room."""
CLOSE_LIMIT_SQ = 4
"""Two objects in view are described as a close pair when they are at most 2 cells apart."""


@dataclass(frozen=True)
class Thing:
    """One object of the room."""

    name: str
    cell: Cell
    heading: int | None
    """Where it faces (0 north ... 3 west), None for an object without a front."""


@dataclass(frozen=True)
class Room:
    """A furnished square room and the agent's start (facing north)."""

    size: int
    things: tuple[Thing, ...]
    start: Cell

    def thing(self, name: str) -> Thing | None:
        return next((thing for thing in self.things if thing.name == name), None)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(thing.name for thing in self.things)

    def contains(self, cell: Cell) -> bool:
        return 0 <= cell[0] < self.size and 0 <= cell[1] < self.size

    def occupied(self, cell: Cell) -> bool:
        return any(thing.cell == cell for thing in self.things)


def check_room(room: object, size: int) -> Room:
    """``room`` if it is a valid :class:`Room` of side ``size``; ValueError naming the problem otherwise."""
    if not isinstance(room, Room):
        raise ValueError(f"options['room'] must be a turnrl.envs.games.spatial.room.Room, got {type(room).__name__}")
    if room.size != size:
        raise ValueError(f"the room's size is {room.size} but this env has room_size={size}; make one with "
                         f"room_size={room.size}")
    cells = [room.start, *(thing.cell for thing in room.things)]
    if not all(room.contains(cell) for cell in cells) or len(set(cells)) != len(cells):
        raise ValueError("every object and the start must be on distinct cells inside the room")
    names = room.names
    if len(set(names)) != len(names) or not set(names) <= set(OBJECT_NAMES) or len(names) < 3:
        raise ValueError(f"a room needs at least 3 objects with distinct names from {list(OBJECT_NAMES)}")
    for thing in room.things:
        if (thing.heading is None) != (thing.name in OBJECTS_WITHOUT_FRONT) or thing.heading not in (None, 0, 1, 2, 3):
            raise ValueError(f"the {thing.name} must face 0 (north), 1, 2 or 3 if it has a front, None if not")
    return room


def generate_room(rng: np.random.Generator, size: int, n_objects: int) -> Room:
    """A ``size x size`` room with ``n_objects`` objects on distinct cells and a start on another cell."""
    cells = rng.choice(size * size, n_objects + 1, replace=False)
    names = rng.choice(len(OBJECT_NAMES), n_objects, replace=False)
    headings = rng.integers(0, 4, n_objects)
    things = []
    for k in range(n_objects):
        name = OBJECT_NAMES[int(names[k])]
        heading = int(headings[k]) if name in OBJECTS_WITH_FRONT else None
        things.append(Thing(name, divmod(int(cells[k + 1]), size), heading))
    return Room(size, tuple(things), divmod(int(cells[0]), size))


@dataclass(frozen=True)
class Sighting:
    """One object as a viewer reports it."""

    name: str
    ego_bin: int
    """Index in :data:`~turnrl.envs.games.spatial.geometry.EGO_BINS`."""
    distance_bin: int
    facing: int | None
    """Index in :data:`~turnrl.envs.games.spatial.geometry.RELATIVE_FACINGS`, None for an object without a front."""

    def describe(self) -> str:
        """``"chair: front-left, mid distance, facing right"``."""
        text = f"{self.name}: {EGO_BINS[self.ego_bin]}, {DISTANCE_BINS[self.distance_bin]}"
        return text if self.facing is None else f"{text}, facing {RELATIVE_FACINGS[self.facing]}"

    def sentence(self) -> str:
        """``"the chair is front-left, mid distance, facing right"``."""
        name, _, rest = self.describe().partition(": ")
        return f"the {name} is {rest}"


@dataclass(frozen=True)
class ClosePair:
    """Two objects in view at most 2 cells apart: where ``first`` is from ``second``, the viewer's heading
    taken as north."""

    first: str
    second: str
    sector: int
    """Index in :data:`~turnrl.envs.games.spatial.geometry.COMPASS`."""
    distance_bin: int

    def describe(self) -> str:
        """``"lamp is north-east of vase, near"``."""
        return f"{self.first} is {COMPASS[self.sector]} of {self.second}, {DISTANCE_BINS[self.distance_bin]}"


@dataclass(frozen=True)
class View:
    """What one ``Observe()`` reports: the objects in view, left to right, and the close pairs among them."""

    cell: Cell
    heading: int
    sightings: tuple[Sighting, ...]
    close_pairs: tuple[ClosePair, ...]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.sightings)

    def lines(self) -> list[str]:
        """The report, one line per object and per close pair."""
        if not self.sightings:
            return ["Nothing is in your field of view."]
        lines = [f"- {s.describe()}" for s in self.sightings]
        if self.close_pairs:
            lines.append("Close pairs (taking the way you face as north):")
            lines.extend(f"- {pair.describe()}" for pair in self.close_pairs)
        return lines


def observe(room: Room, cell: Cell, heading: int) -> View:
    """The view from ``cell`` facing ``heading``: every object in the field of view but one on ``cell``."""
    seen: list[tuple[float, int, Thing]] = []
    for thing in room.things:
        v = offset(thing.cell, cell)
        if thing.cell != cell and in_view(v, heading):
            ahead, right = ego(v, heading)
            seen.append((right / ahead, v[0] * v[0] + v[1] * v[1], thing))
    seen.sort(key=lambda item: (item[0], item[1], item[2].name))  # left to right, then near to far
    sightings = tuple(
        Sighting(
            thing.name,
            ego_bin(offset(thing.cell, cell), heading),
            distance_bin(offset(thing.cell, cell)),
            None if thing.heading is None else relative_facing(thing.heading, heading),
        )
        for _, _, thing in seen
    )
    pairs = []
    for i, (_, _, a) in enumerate(seen):
        for _, _, b in seen[i + 1 :]:
            v = offset(a.cell, b.cell)
            if v[0] * v[0] + v[1] * v[1] <= CLOSE_LIMIT_SQ:
                pairs.append(ClosePair(a.name, b.name, sector(v, heading), distance_bin(v)))
    return View(cell, heading, sightings, tuple(pairs))

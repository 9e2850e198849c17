"""Floor plans and objects of the Navigation env, drawn from a seed (pure Python; no OpenGL here).

A :class:`Layout` says everything that makes one episode's world: rectangular
rooms (metres, MiniWorld's x and z axes, no ceilings), the openings between
them, the objects on the floor and the agent's start. MiniWorld builds and
draws it (:mod:`turnrl.envs.games.navigation.gl`); whether the target can be reached
is decided there, with MiniWorld's own collision test.

Layout kinds (``LAYOUT_KINDS``), each with random sizes, textures and objects:

- ``one_room``: a single room of 6 to 10 m a side;
- ``two_rooms``: two rooms side by side, one opening between them;
- ``three_rooms``: a wide room with two smaller rooms off one side (MiniWorld's
  ThreeRooms plan), an opening into each;
- ``four_rooms``: a 2x2 block of rooms with an opening in each inner wall.

Objects come from :data:`CATALOG` (MiniWorld's boxes and balls in six colours
and its meshes: barrel, traffic cone, rubber duck, office chair, medkit,
potion), at most one of each name, so that the instruction's name is unique.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

LAYOUT_KINDS = ("one_room", "two_rooms", "three_rooms", "four_rooms")
COLORS = ("blue", "green", "grey", "purple", "red", "yellow")
"""MiniWorld's colour names (``miniworld.entity.COLOR_NAMES``)."""
WALL_TEXTURES = ("brick_wall", "concrete", "drywall", "stucco", "cinder_blocks", "marble")
FLOOR_TEXTURES = ("floor_tiles_bw", "wood_planks", "concrete_tiles", "asphalt", "marble")
FOOTPRINT = 0.5
"""Largest footprint radius (m) of any catalogue object; spacing uses it (a test checks it against MiniWorld)."""
WALL_GAP = 0.5
"""Thickness of the wall between two rooms (MiniWorld fills an opening across it with a short passage)."""
DOOR_WIDTH = (1.6, 2.2)
"""Range of opening widths (m). The agent is 0.8 m wide; 1.6 m leaves 0.8 m of centre positions, more than
one 0.5 m step, so every opening is passable on the agent's lattice."""


@dataclass(frozen=True)
class CatalogEntry:
    """A kind of object that can be placed."""

    name: str
    kind: str
    """``"box"``, ``"ball"`` or a MiniWorld mesh name."""
    color: str | None
    size: float
    """Edge (box), diameter (ball) or height (mesh), in metres."""


CATALOG: tuple[CatalogEntry, ...] = (
    *(CatalogEntry(f"{color} box", "box", color, 0.7) for color in COLORS),
    *(CatalogEntry(f"{color} ball", "ball", color, 0.6) for color in COLORS),
    CatalogEntry("barrel", "barrel", None, 1.0),
    CatalogEntry("traffic cone", "cone", None, 0.75),
    CatalogEntry("rubber duck", "duckie", None, 0.45),
    CatalogEntry("office chair", "office_chair", None, 1.0),
    CatalogEntry("medkit", "medkit", None, 0.4),
    CatalogEntry("potion", "potion", None, 0.5),
)


@dataclass(frozen=True)
class RoomSpec:
    """An axis-aligned rectangular room, in metres."""

    min_x: float
    max_x: float
    min_z: float
    max_z: float
    wall_tex: str = "concrete"
    floor_tex: str = "floor_tiles_bw"

    def contains(self, x: float, z: float, margin: float = 0.0) -> bool:
        """Whether ``(x, z)`` lies inside, at least ``margin`` from every wall."""
        return self.min_x + margin <= x <= self.max_x - margin and self.min_z + margin <= z <= self.max_z - margin


@dataclass(frozen=True)
class DoorSpec:
    """An opening between rooms ``a`` and ``b`` (indices into ``Layout.rooms``)."""

    a: int
    b: int
    axis: str
    """``"x"``: the shared wall runs along x and the opening spans x from ``lo`` to ``hi``; ``"z"``: along z."""
    lo: float
    hi: float


@dataclass(frozen=True)
class ObjectSpec:
    """One object on the floor: what it is and where."""

    name: str
    """What the instruction calls it, e.g. ``"red box"``; unique within a layout."""
    kind: str
    color: str | None
    size: float
    x: float
    z: float
    heading: float
    """Rotation about the vertical axis, radians (looks only)."""


@dataclass(frozen=True)
class Layout:
    """One episode's world: rooms, openings, objects (the target first) and the agent's start."""

    kind: str
    rooms: tuple[RoomSpec, ...]
    doors: tuple[DoorSpec, ...]
    objects: tuple[ObjectSpec, ...]
    start_x: float
    start_z: float
    start_heading: int
    """Quarter turns: 0 faces +x, 1 faces -z, 2 faces -x, 3 faces +z (MiniWorld's angles, counter-clockwise)."""

    @property
    def target(self) -> ObjectSpec:
        return self.objects[0]

    def room_of(self, x: float, z: float) -> int | None:
        """Index of the room that contains ``(x, z)``, or None (in a doorway or outside)."""
        return next((k for k, room in enumerate(self.rooms) if room.contains(x, z)), None)


# --------------------------------------------------------------------------- floor plans
def _uniform(rng: np.random.Generator, lo: float, hi: float, quantum: float = 0.1) -> float:
    """A uniform draw from ``[lo, hi]`` rounded to ``quantum`` (tidy numbers in layouts and logs)."""
    return round(round(float(rng.uniform(lo, hi)) / quantum) * quantum, 6)


def _door(rng: np.random.Generator, lo: float, hi: float) -> tuple[float, float]:
    """An opening of random width at a random place within ``[lo, hi]`` (0.3 m clear of the corners)."""
    width = _uniform(rng, *DOOR_WIDTH)
    start = _uniform(rng, lo + 0.3, hi - 0.3 - width)
    return start, round(start + width, 6)


def _textures(rng: np.random.Generator) -> tuple[str, str]:
    return str(rng.choice(WALL_TEXTURES)), str(rng.choice(FLOOR_TEXTURES))


def one_room(rng: np.random.Generator) -> tuple[tuple[RoomSpec, ...], tuple[DoorSpec, ...]]:
    """One room of 6 to 10 m a side."""
    wall, floor = _textures(rng)
    return (RoomSpec(0.0, _uniform(rng, 6, 10), 0.0, _uniform(rng, 6, 10), wall, floor),), ()


def two_rooms(rng: np.random.Generator) -> tuple[tuple[RoomSpec, ...], tuple[DoorSpec, ...]]:
    """Two rooms side by side along x (each 4 to 7 m wide, 5 to 8 m deep), one opening between them."""
    wall, floor = _textures(rng)
    depth = _uniform(rng, 5, 8)
    width_a, width_b = _uniform(rng, 4, 7), _uniform(rng, 4, 7)
    a = RoomSpec(0.0, width_a, 0.0, depth, wall, floor)
    b = RoomSpec(width_a + WALL_GAP, width_a + WALL_GAP + width_b, 0.0, depth, *_textures(rng))
    lo, hi = _door(rng, 0.0, depth)
    return (a, b), (DoorSpec(0, 1, "z", lo, hi),)


def three_rooms(rng: np.random.Generator) -> tuple[tuple[RoomSpec, ...], tuple[DoorSpec, ...]]:
    """A wide room (9 to 12 m by 4 to 6 m) with two rooms off its +z side, an opening into each."""
    wall, floor = _textures(rng)
    width, depth = _uniform(rng, 9, 12), _uniform(rng, 4, 6)
    half = round((width - WALL_GAP) / 2, 6)
    depth_b = _uniform(rng, 4, 6)
    z0 = depth + WALL_GAP
    hall = RoomSpec(0.0, width, 0.0, depth, wall, floor)
    left = RoomSpec(0.0, half, z0, z0 + depth_b, *_textures(rng))
    right = RoomSpec(half + WALL_GAP, width, z0, z0 + depth_b, *_textures(rng))
    doors = (DoorSpec(0, 1, "x", *_door(rng, 0.0, half)), DoorSpec(0, 2, "x", *_door(rng, half + WALL_GAP, width)))
    return (hall, left, right), doors


def four_rooms(rng: np.random.Generator) -> tuple[tuple[RoomSpec, ...], tuple[DoorSpec, ...]]:
    """A 2x2 block of rooms (columns 4 to 6 m wide, rows 4 to 6 m deep), an opening in each of the 4 inner walls."""
    w0, w1, d0, d1 = (_uniform(rng, 4, 6) for _ in range(4))
    x1, z1 = w0 + WALL_GAP, d0 + WALL_GAP
    rooms = (
        RoomSpec(0.0, w0, 0.0, d0, *_textures(rng)),
        RoomSpec(x1, x1 + w1, 0.0, d0, *_textures(rng)),
        RoomSpec(0.0, w0, z1, z1 + d1, *_textures(rng)),
        RoomSpec(x1, x1 + w1, z1, z1 + d1, *_textures(rng)),
    )
    doors = (
        DoorSpec(0, 1, "z", *_door(rng, 0.0, d0)),
        DoorSpec(2, 3, "z", *_door(rng, z1, z1 + d1)),
        DoorSpec(0, 2, "x", *_door(rng, 0.0, w0)),
        DoorSpec(1, 3, "x", *_door(rng, x1, x1 + w1)),
    )
    return rooms, doors


FLOOR_PLANS = {"one_room": one_room, "two_rooms": two_rooms, "three_rooms": three_rooms, "four_rooms": four_rooms}


# --------------------------------------------------------------------------- objects and the start
def _free_spot(
    rng: np.random.Generator, rooms: tuple[RoomSpec, ...], taken: list[tuple[float, float, float]], radius: float
) -> tuple[float, float] | None:
    """A spot inside a random room, ``radius`` + 0.3 m from its walls and clear of every ``(x, z, r)`` in ``taken``.

    Rooms are drawn by floor area, like MiniWorld's ``place_entity``. None after 200 tries.
    """
    areas = np.array([(r.max_x - r.min_x) * (r.max_z - r.min_z) for r in rooms])
    for _ in range(200):
        room = rooms[int(rng.choice(len(rooms), p=areas / areas.sum()))]
        margin = radius + 0.3
        x = _uniform(rng, room.min_x + margin, room.max_x - margin, 0.05)
        z = _uniform(rng, room.min_z + margin, room.max_z - margin, 0.05)
        # 0.9 m between bodies: the agent (0.8 m wide) can pass between any two objects.
        if all(math.hypot(x - ox, z - oz) >= radius + r + 0.9 for ox, oz, r in taken):
            return x, z
    return None


def draw_layout(rng: np.random.Generator, kinds: tuple[str, ...], num_objects: int) -> Layout | None:
    """A layout of a kind drawn from ``kinds`` with ``num_objects`` objects (the first is the target).

    Returns None when the objects do not fit (the caller draws again).
    """
    kind = str(kinds[int(rng.integers(len(kinds)))])
    rooms, doors = FLOOR_PLANS[kind](rng)
    picks = rng.choice(len(CATALOG), size=num_objects, replace=False)
    taken: list[tuple[float, float, float]] = []
    objects = []
    for index in picks:
        entry = CATALOG[int(index)]
        spot = _free_spot(rng, rooms, taken, FOOTPRINT)
        if spot is None:
            return None
        taken.append((*spot, FOOTPRINT))
        heading = _uniform(rng, -math.pi, math.pi, 0.01)
        objects.append(ObjectSpec(entry.name, entry.kind, entry.color, entry.size, spot[0], spot[1], heading))
    start = _free_spot(rng, rooms, taken, 0.4)
    if start is None:
        return None
    return Layout(kind, rooms, doors, tuple(objects), start[0], start[1], int(rng.integers(4)))

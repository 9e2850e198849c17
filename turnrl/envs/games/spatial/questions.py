"""The multiple-choice questions of the Spatial env, with RAGEN's task names.

=============  ==========================================================================================
``dir``        where one object is from another on the map (compass sector and distance)
``pov``        where one object is from another object's point of view (clock position and distance)
``rot``        the order in which objects come straight ahead while turning a full circle at the start
``rot_dual``   which way one turned, given that order
``e2a``        the objects' cells and headings, the start as origin (egocentric to allocentric)
``bwd_pov``    which object one stands on, given part of its view
``fwd_loc``    what is in view from a given cell and heading
``bwd_loc``    which cell one is in, given the whole view from it
``fwd_fov``    what is in view after a given turn, jump and turn from the start
``bwd_nav``    which turn, jump and turn from the start give a described view
=============  ==========================================================================================

Every choice is a *claim* with a ``possible(knowledge)`` test (:mod:`.knowledge`). The correct choice is
computed from the room; wrong choices are drawn near the truth first (an adjacent sector, a swapped pair, a
nearby cell) and kept only when the four views from the start rule them out. So a question always has
exactly one choice that agrees with what an explorer can see, and :meth:`Question.possible_choices` is the
expert's answer.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

import numpy as np

from turnrl.envs.games.spatial.geometry import (
    CLOCK,
    COMPASS,
    DISTANCE_BINS,
    HEADING_NAMES,
    Cell,
    bearing,
    distance_bin,
    in_view,
    offset,
    sector,
)
from turnrl.envs.games.spatial.knowledge import Knowledge
from turnrl.envs.games.spatial.room import Room, Sighting, Thing, observe

TASKS = ("dir", "rot", "rot_dual", "pov", "bwd_pov", "e2a", "fwd_loc", "bwd_loc", "fwd_fov", "bwd_nav")
"""RAGEN's default evaluation tasks, in its order."""
CHOICES = 4
ATTEMPTS_PER_TASK = 8
TURNS = (0, 90, 180, -90)
"""The turn of each number of quarter turns clockwise, as questions write it."""


class Claim(Protocol):
    """One choice of a question."""

    @property
    def label(self) -> str:
        """The choice as the question shows it."""
        ...

    def possible(self, knowledge: Knowledge) -> bool:
        """Whether the claim agrees with ``knowledge`` (sound: a true claim is always possible)."""
        ...


@dataclass(frozen=True)
class Question:
    task: str
    prompt: str
    claims: tuple[Claim, ...]
    answer: int
    """Index of the correct claim."""

    @property
    def letter(self) -> str:
        return letter(self.answer)

    @property
    def choices(self) -> tuple[str, ...]:
        return tuple(claim.label for claim in self.claims)

    def text(self) -> str:
        lines = [self.prompt, *(f"{letter(k)}. {label}" for k, label in enumerate(self.choices))]
        return "\n".join(lines)

    def possible_choices(self, knowledge: Knowledge) -> list[int]:
        """Indices of the claims that agree with ``knowledge``."""
        return [k for k, claim in enumerate(self.claims) if claim.possible(knowledge)]


def letter(index: int) -> str:
    return chr(ord("A") + index)


# --------------------------------------------------------------------------- claims
@dataclass(frozen=True)
class RelationClaim:
    """``subject`` is in ``sector`` at ``distance`` from ``anchor``; the frame's north is the compass north
    (``from_anchor`` False) or the way the anchor faces."""

    label: str
    subject: str
    anchor: str
    from_anchor: bool
    sector: int
    distance: int

    def possible(self, knowledge: Knowledge) -> bool:
        frames = knowledge.heading_options(self.anchor) if self.from_anchor else (0,)
        return any((self.sector, self.distance) in knowledge.relations(self.subject, self.anchor, f) for f in frames)


@dataclass(frozen=True)
class OrderClaim:
    """Turning from north (clockwise or not), the objects come straight ahead in the order of ``names``."""

    label: str
    names: tuple[str, ...]
    clockwise: bool

    def possible(self, knowledge: Knowledge) -> bool:
        ranges = [_angle_range(knowledge, name, self.clockwise) for name in self.names]
        # Sound pairwise test: an earlier object must be able to come before each later one.
        return all(ranges[i][0] < ranges[j][1] for i in range(len(ranges)) for j in range(i + 1, len(ranges)))


def turn_angle(cell: Cell, clockwise: bool) -> float:
    """Degrees turned from north, in the given direction, until ``cell`` (relative to the viewer) is ahead."""
    angle = bearing(cell)
    return angle if clockwise else (360.0 - angle) % 360.0


def _angle_range(knowledge: Knowledge, name: str, clockwise: bool) -> tuple[float, float]:
    angles = [turn_angle(c, clockwise) for c in knowledge.cells[name]]
    return (min(angles), max(angles)) if angles else (360.0, -1.0)


@dataclass(frozen=True)
class PlacementClaim:
    """Each object is on its cell (relative to the start) and, if it has a front, faces its heading."""

    label: str
    items: tuple[tuple[str, Cell, int | None], ...]

    def possible(self, knowledge: Knowledge) -> bool:
        for name, cell, heading in self.items:
            if cell not in knowledge.cells[name]:
                return False
            if knowledge.has_front(name) != (heading is not None):
                return False
            if heading is not None and heading not in knowledge.heading_options(name):
                return False
        return all(
            knowledge.pair_ok(a, b, cell_a, cell_b)
            for (a, cell_a, _), (b, cell_b, _) in itertools.combinations(self.items, 2)
        )


class Pose(Protocol):
    """Where a viewer may stand, given what is known."""

    def poses(self, knowledge: Knowledge) -> Iterable[tuple[Cell, int]]:
        """``(cell relative to the start, heading)`` pairs."""
        ...


@dataclass(frozen=True)
class FixedPose:
    cell: Cell
    heading: int

    def poses(self, knowledge: Knowledge) -> Iterable[tuple[Cell, int]]:
        return ((self.cell, self.heading),)


@dataclass(frozen=True)
class ObjectPose:
    """On an object, facing the way it faces."""

    name: str

    def poses(self, knowledge: Knowledge) -> Iterable[tuple[Cell, int]]:
        return ((c, h) for c in knowledge.cells[self.name] for h in knowledge.heading_options(self.name))


@dataclass(frozen=True)
class JumpPose:
    """From the start facing north: turn ``first`` quarter turns, jump to ``name`` (which must be in view
    then), turn ``second`` quarter turns."""

    first: int
    name: str
    second: int

    def poses(self, knowledge: Knowledge) -> Iterable[tuple[Cell, int]]:
        heading = (self.first + self.second) % 4
        return ((c, heading) for c in knowledge.cells[self.name] if in_view(c, self.first))


@dataclass(frozen=True)
class ViewClaim:
    """From ``pose``, the objects in view are exactly ``seen`` or, with ``described``, show these sightings
    (all of the view when ``complete``). ``standing_on`` is the object under the viewer, never in view."""

    label: str
    pose: Pose
    seen: frozenset[str] | None = None
    described: tuple[Sighting, ...] = ()
    complete: bool = False
    standing_on: str | None = None

    def possible(self, knowledge: Knowledge) -> bool:
        if any(s.name == self.standing_on for s in self.described) or self.standing_on in (self.seen or ()):
            return False
        return any(self._fits(knowledge, cell, heading) for cell, heading in self.pose.poses(knowledge))

    def _fits(self, knowledge: Knowledge, cell: Cell, heading: int) -> bool:
        described = {s.name: s for s in self.described}
        for name in knowledge.names:
            if name == self.standing_on:
                continue
            if self.seen is not None:
                want_seen = name in self.seen
            elif name in described:
                want_seen = True
            elif self.complete:
                want_seen = False
            else:
                continue
            if not want_seen:
                if not knowledge.can_hide(name, cell, heading):
                    return False
                continue
            options = knowledge.sightings_from(name, cell, heading)
            sighting = described.get(name)
            if sighting is None:
                if not options:
                    return False
            elif (sighting.ego_bin, sighting.distance_bin) not in options or not knowledge.facing_possible(
                sighting, heading
            ):
                return False
        return True


# --------------------------------------------------------------------------- building questions
T = TypeVar("T")


def _shuffled(rng: np.random.Generator, items: Sequence[T]) -> list[T]:
    return [items[int(k)] for k in rng.permutation(len(items))]


def _pick(rng: np.random.Generator, items: Sequence[T]) -> T:
    return items[int(rng.integers(len(items)))]


def _near_first(rng: np.random.Generator, items: Sequence[T], distance: Callable[[T], float]) -> list[T]:
    """``items`` from the nearest to the truth to the farthest, ties in random order."""
    noise = rng.random(len(items))
    order = sorted(range(len(items)), key=lambda k: (distance(items[k]), noise[k]))
    return [items[k] for k in order]


def _multiple_choice(
    task: str, prompt: str, truth: Claim, pool: Iterable[Claim], knowledge: Knowledge, rng: np.random.Generator,
    choices: int = CHOICES,
) -> Question | None:
    """The truth and the first ``choices - 1`` claims of ``pool`` that ``knowledge`` rules out, shuffled;
    None when the pool has too few."""
    if not truth.possible(knowledge):
        raise RuntimeError(f"Spatial {task}: the true answer {truth.label!r} was ruled out by what is seen; the "
                           "knowledge or the claim is wrong")
    wrong: list[Claim] = []
    labels = {truth.label}
    for claim in pool:
        if claim.label in labels:
            continue
        labels.add(claim.label)
        if not claim.possible(knowledge):
            wrong.append(claim)
            if len(wrong) == choices - 1:
                break
    if len(wrong) < choices - 1:
        return None
    order = [int(k) for k in rng.permutation(choices)]
    claims = [([truth, *wrong])[k] for k in order]
    return Question(task, prompt, tuple(claims), order.index(0))


def _relative(room: Room, cell: Cell) -> Cell:
    return offset(cell, room.start)


def _relation_label(sector_index: int, distance: int, clock: bool) -> str:
    return f"{(CLOCK if clock else COMPASS)[sector_index]}, {DISTANCE_BINS[distance]}"


def _relation_pool(
    truth: RelationClaim, room: Room, rng: np.random.Generator
) -> list[RelationClaim]:
    far = distance_bin((room.size - 1, room.size - 1))
    options = [(s, d) for s in range(8) for d in range(far + 1) if (s, d) != (truth.sector, truth.distance)]

    def gap(option: tuple[int, int]) -> float:
        s, d = option
        turn = abs(s - truth.sector) % 8
        return min(turn, 8 - turn) + abs(d - truth.distance)

    return [
        RelationClaim(_relation_label(s, d, truth.from_anchor), truth.subject, truth.anchor, truth.from_anchor, s, d)
        for s, d in _near_first(rng, options, gap)
    ]


def ask_dir(room: Room, knowledge: Knowledge, rng: np.random.Generator) -> Question | None:
    a, b = (room.things[int(k)] for k in rng.choice(len(room.things), 2, replace=False))
    v = offset(a.cell, b.cell)
    truth = RelationClaim(_relation_label(sector(v), distance_bin(v), False), a.name, b.name, False, sector(v),
                          distance_bin(v))
    prompt = (f"On the map seen from above, where is the {a.name} from the {b.name}? Each choice gives a compass "
              "direction (north is the way you faced at the start) and a distance.")
    return _multiple_choice("dir", prompt, truth, _relation_pool(truth, room, rng), knowledge, rng)


def ask_pov(room: Room, knowledge: Knowledge, rng: np.random.Generator) -> Question | None:
    anchors = [t for t in room.things if t.heading is not None]
    if not anchors:
        return None
    b = _pick(rng, anchors)
    a = _pick(rng, [t for t in room.things if t is not b])
    v = offset(a.cell, b.cell)
    s, d = sector(v, b.heading or 0), distance_bin(v)
    truth = RelationClaim(_relation_label(s, d, True), a.name, b.name, True, s, d)
    prompt = (f"Imagine standing on the {b.name} and facing the way it faces. Where is the {a.name} from you? "
              "Each choice gives a clock position (12 o'clock is straight ahead) and a distance.")
    return _multiple_choice("pov", prompt, truth, _relation_pool(truth, room, rng), knowledge, rng)


def _turn_subset(room: Room, rng: np.random.Generator) -> list[Thing] | None:
    """3 to 5 objects in distinct directions from the start (so their turning order is defined)."""
    count = int(rng.integers(3, min(5, len(room.things)) + 1))
    chosen: list[Thing] = []
    for thing in _shuffled(rng, list(room.things)):
        angle = bearing(_relative(room, thing.cell))
        if all(abs(angle - bearing(_relative(room, other.cell))) > 1e-9 for other in chosen):
            chosen.append(thing)
            if len(chosen) == count:
                return chosen
    return None


def _turn_order(room: Room, things: list[Thing], clockwise: bool) -> tuple[str, ...]:
    return tuple(t.name for t in sorted(things, key=lambda t: turn_angle(_relative(room, t.cell), clockwise)))


def ask_rot(room: Room, knowledge: Knowledge, rng: np.random.Generator) -> Question | None:
    things = _turn_subset(room, rng)
    if things is None:
        return None
    clockwise = bool(rng.integers(2))
    order = _turn_order(room, things, clockwise)
    truth = OrderClaim(", ".join(order), order, clockwise)
    pool = (OrderClaim(", ".join(p), p, clockwise) for p in _shuffled(rng, list(itertools.permutations(order))))
    way = "clockwise" if clockwise else "counterclockwise"
    prompt = (f"Back at your start and facing north, you turn {way} in place through a full circle. In which order "
              f"do these objects come straight ahead of you: {', '.join(sorted(order))}? (One already straight "
              "ahead comes first.)")
    return _multiple_choice("rot", prompt, truth, pool, knowledge, rng)


def ask_rot_dual(room: Room, knowledge: Knowledge, rng: np.random.Generator) -> Question | None:
    things = _turn_subset(room, rng)
    if things is None:
        return None
    clockwise = bool(rng.integers(2))
    order = _turn_order(room, things, clockwise)
    truth = OrderClaim("clockwise" if clockwise else "counterclockwise", order, clockwise)
    other = OrderClaim("counterclockwise" if clockwise else "clockwise", order, not clockwise)
    prompt = (f"Back at your start and facing north, you turned a full circle in place, and these objects came "
              f"straight ahead of you in this order: {', '.join(order)}. Which way did you turn?")
    return _multiple_choice("rot_dual", prompt, truth, [other], knowledge, rng, choices=2)


def _placement_label(items: tuple[tuple[str, Cell, int | None], ...]) -> str:
    parts = []
    for name, (x, y), heading in items:
        facing = "" if heading is None else f" facing {HEADING_NAMES[heading]}"
        parts.append(f"{name} at ({x}, {y}){facing}")
    return "; ".join(parts)


def ask_e2a(room: Room, knowledge: Knowledge, rng: np.random.Generator) -> Question | None:
    count = min(4, len(room.things))
    things = [room.things[int(k)] for k in sorted(rng.choice(len(room.things), count, replace=False))]
    items = tuple((t.name, _relative(room, t.cell), t.heading) for t in things)
    truth = PlacementClaim(_placement_label(items), items)
    cells = [_relative(room, (x, y)) for x in range(room.size) for y in range(room.size) if (x, y) != room.start]

    def mutations() -> Iterator[PlacementClaim]:
        for _ in range(200):
            changed = list(items)
            for k in rng.choice(count, int(rng.integers(1, 3)), replace=False):
                name, cell, heading = changed[int(k)]
                if heading is not None and rng.random() < 0.4:
                    heading = (heading + int(rng.integers(1, 4))) % 4
                else:
                    cell = cells[int(rng.integers(len(cells)))]
                changed[int(k)] = (name, cell, heading)
            yield PlacementClaim(_placement_label(tuple(changed)), tuple(changed))

    prompt = ("Take your start as (0, 0), with x growing to the east and y to the north. Which choice gives the "
              "right cells of these objects (and, for objects with a front, the compass direction they face)?")
    return _multiple_choice("e2a", prompt, truth, mutations(), knowledge, rng)


def _sentences(sightings: Iterable[Sighting]) -> str:
    return "; ".join(s.sentence() for s in sightings)


def ask_bwd_pov(room: Room, knowledge: Knowledge, rng: np.random.Generator) -> Question | None:
    fronted = [t for t in room.things if t.heading is not None]
    anchors = [t for t in fronted if t.heading is not None and observe(room, t.cell, t.heading).sightings]
    if not anchors or len(fronted) < 2:
        return None
    anchor = _pick(rng, anchors)
    view = observe(room, anchor.cell, anchor.heading or 0).sightings
    shown = [view[int(k)] for k in sorted(rng.choice(len(view), min(3, len(view)), replace=False))]

    def claim(name: str) -> ViewClaim:
        return ViewClaim(name, ObjectPose(name), described=tuple(shown), standing_on=name)

    others = [claim(t.name) for t in _shuffled(rng, fronted) if t is not anchor]
    prompt = (f"You stand on one of the objects, facing the way it faces. Among what you see: {_sentences(shown)}. "
              "Which object are you standing on?")
    return _multiple_choice("bwd_pov", prompt, claim(anchor.name), others, knowledge, rng,
                            choices=min(CHOICES, len(fronted)))


def _set_label(names: Iterable[str]) -> str:
    names = sorted(names)
    return ", ".join(names) if names else "nothing"


def _set_pool(truth: frozenset[str], names: list[str], rng: np.random.Generator) -> list[frozenset[str]]:
    """Sets one change away from ``truth`` (an object added, removed or swapped), then two changes away."""
    inside, outside = sorted(truth), sorted(set(names) - truth)
    one = [truth | {n} for n in outside] + [truth - {n} for n in inside]
    two = [(truth - {a}) | {b} for a in inside for b in outside]
    two += [truth | {a, b} for a, b in itertools.combinations(outside, 2)]
    two += [truth - {a, b} for a, b in itertools.combinations(inside, 2)]
    return _shuffled(rng, one) + _shuffled(rng, two)


def _empty_cell(room: Room, rng: np.random.Generator) -> Cell | None:
    empty = [(x, y) for x in range(room.size) for y in range(room.size)
             if (x, y) != room.start and not room.occupied((x, y))]
    return _pick(rng, empty) if empty else None


def ask_fwd_loc(room: Room, knowledge: Knowledge, rng: np.random.Generator) -> Question | None:
    cell = _empty_cell(room, rng)
    if cell is None:
        return None
    heading = int(rng.integers(4))
    seen = frozenset(observe(room, cell, heading).names)
    pose = FixedPose(_relative(room, cell), heading)
    truth = ViewClaim(_set_label(seen), pose, seen=seen)
    pool = (ViewClaim(_set_label(s), pose, seen=s) for s in _set_pool(seen, list(room.names), rng))
    x, y = pose.cell
    prompt = (f"Take your start as (0, 0), with x growing to the east and y to the north. You move to the empty "
              f"cell ({x}, {y}) and face {HEADING_NAMES[heading]}. Which objects are in your field of view?")
    return _multiple_choice("fwd_loc", prompt, truth, pool, knowledge, rng)


def ask_bwd_loc(room: Room, knowledge: Knowledge, rng: np.random.Generator) -> Question | None:
    cell = _empty_cell(room, rng)
    if cell is None:
        return None
    heading = int(rng.integers(4))
    view = observe(room, cell, heading).sightings
    if not view:
        return None
    target = _relative(room, cell)

    def claim(c: Cell) -> ViewClaim:
        return ViewClaim(f"({c[0]}, {c[1]})", FixedPose(c, heading), described=view, complete=True)

    cells = [_relative(room, (x, y)) for x in range(room.size) for y in range(room.size)
             if (x, y) not in (room.start, cell)]
    pool = (claim(c) for c in _near_first(rng, cells, lambda c: abs(c[0] - target[0]) + abs(c[1] - target[1])))
    prompt = (f"You move to an empty cell and face {HEADING_NAMES[heading]}. You see exactly this: "
              f"{_sentences(view)}. Take your start as (0, 0), with x growing to the east and y to the north: which "
              "cell are you in?")
    return _multiple_choice("bwd_loc", prompt, claim(target), pool, knowledge, rng)


def _jump(room: Room, rng: np.random.Generator) -> tuple[int, Thing, int] | None:
    """A turn from north, an object then in view, and a second turn (in quarter turns)."""
    options = [(first, name) for first in range(4) for name in observe(room, room.start, first).names]
    if not options:
        return None
    first, name = _pick(rng, options)
    thing = room.thing(name)
    assert thing is not None
    return first, thing, int(rng.integers(4))


def _actions_text(first: int, name: str, second: int) -> str:
    return f"Rotate({TURNS[first]}), JumpTo({name}), Rotate({TURNS[second]})"


def ask_fwd_fov(room: Room, knowledge: Knowledge, rng: np.random.Generator) -> Question | None:
    jump = _jump(room, rng)
    if jump is None:
        return None
    first, thing, second = jump
    seen = frozenset(observe(room, thing.cell, (first + second) % 4).names)
    pose = JumpPose(first, thing.name, second)
    truth = ViewClaim(_set_label(seen), pose, seen=seen, standing_on=thing.name)
    others = [n for n in room.names if n != thing.name]
    pool = (ViewClaim(_set_label(s), pose, seen=s, standing_on=thing.name) for s in _set_pool(seen, others, rng))
    prompt = (f"Back at your start and facing north, you do {_actions_text(first, thing.name, second)}. Which "
              "objects are in your field of view then?")
    return _multiple_choice("fwd_fov", prompt, truth, pool, knowledge, rng)


def ask_bwd_nav(room: Room, knowledge: Knowledge, rng: np.random.Generator) -> Question | None:
    jump = _jump(room, rng)
    if jump is None:
        return None
    first, thing, second = jump
    view = observe(room, thing.cell, (first + second) % 4).sightings
    if not view:
        return None

    def claim(a: int, name: str, b: int) -> ViewClaim:
        return ViewClaim(_actions_text(a, name, b), JumpPose(a, name, b), described=view, complete=True,
                         standing_on=name)

    options = [(a, n, b) for a in range(4) for n in room.names for b in range(4)]
    pool = (claim(*option) for option in _shuffled(rng, options))
    prompt = (f"Back at your start and facing north, you did Rotate(a), JumpTo(an object), Rotate(b), and then saw "
              f"exactly this: {_sentences(view)}. Which actions did you do?")
    return _multiple_choice("bwd_nav", prompt, claim(first, thing.name, second), pool, knowledge, rng)


ASKERS: dict[str, Callable[[Room, Knowledge, np.random.Generator], Question | None]] = {
    "dir": ask_dir, "rot": ask_rot, "rot_dual": ask_rot_dual, "pov": ask_pov, "bwd_pov": ask_bwd_pov,
    "e2a": ask_e2a, "fwd_loc": ask_fwd_loc, "bwd_loc": ask_bwd_loc, "fwd_fov": ask_fwd_fov, "bwd_nav": ask_bwd_nav,
}


def ask(room: Room, knowledge: Knowledge, rng: np.random.Generator, tasks: tuple[str, ...]) -> Question | None:
    """A question of one of ``tasks`` (drawn at random; another one where a task cannot be asked about this
    room), or None when none can."""
    remaining = list(tasks)
    while remaining:
        task = remaining.pop(int(rng.integers(len(remaining))))
        for _ in range(ATTEMPTS_PER_TASK):
            question = ASKERS[task](room, knowledge, rng)
            if question is not None:
                return question
    return None

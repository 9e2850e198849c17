"""Spatial questions and what exploring can know: sound knowledge, exactly one answerable choice, true answers."""

import math

import numpy as np
import pytest

from turnrl.envs.games.spatial.geometry import offset
from turnrl.envs.games.spatial.knowledge import Knowledge
from turnrl.envs.games.spatial.questions import ASKERS, TASKS, Question
from turnrl.envs.games.spatial.room import Room, Thing, generate_room, observe

ROOM = Room(
    size=6,
    things=(
        Thing("chair", (2, 4), 2),  # two cells north of the start, facing south
        Thing("table", (5, 2), None),  # three cells east
        Thing("lamp", (0, 0), None),  # south-west
        Thing("television", (4, 4), 3),  # north-east, facing west
        Thing("sofa", (2, 0), 1),  # two cells south, facing east
    ),
    start=(2, 2),
)


def full_knowledge(room):
    return Knowledge(room.size, room.names, [observe(room, room.start, h) for h in range(4)])


def rooms(count, size=6, n_objects=5, seed=0):
    rng = np.random.default_rng(seed)
    return [generate_room(rng, size, n_objects) for _ in range(count)]


@pytest.mark.parametrize(("size", "n_objects"), [(6, 5), (4, 3), (9, 10)])
def test_knowledge_is_sound_for_any_views(size, n_objects):
    # Whatever views from the start were taken, the true cells, headings and pairs stay possible.
    rng = np.random.default_rng(1)
    for room in rooms(60, size, n_objects, seed=size):
        headings = [h for h in range(4) if rng.random() < 0.6]
        knowledge = Knowledge(room.size, room.names, [observe(room, room.start, h) for h in headings])
        for thing in room.things:
            assert offset(thing.cell, room.start) in knowledge.cells[thing.name]
            if thing.heading is not None:
                assert thing.heading in knowledge.heading_options(thing.name)
        for a in room.things:
            for b in room.things:
                if a is not b:
                    ca, cb = offset(a.cell, room.start), offset(b.cell, room.start)
                    assert knowledge.pair_ok(a.name, b.name, ca, cb)


def test_four_views_show_every_object_and_narrow_it_down():
    for room in rooms(40):
        knowledge = full_knowledge(room)
        everywhere = Knowledge(room.size, room.names, [])
        assert set(knowledge.headings) == {t.name for t in room.things if t.heading is not None}
        for name in room.names:
            assert 0 < len(knowledge.cells[name]) < len(everywhere.cells[name])


def test_known_views_of_the_hand_made_room():
    north = observe(ROOM, ROOM.start, 0)
    assert north.lines() == [
        "- chair: front, near, facing backward",
        "- television: front-right, mid distance, facing left",
        "Close pairs (taking the way you face as north):",
        "- chair is west of television, near",
    ]
    east = observe(ROOM, ROOM.start, 1)
    assert [s.describe() for s in east.sightings] == [
        "television: front-left, mid distance, facing backward", "table: front, mid distance"]
    assert observe(ROOM, (5, 2), 3).names == ("sofa", "lamp", "chair")  # from the table, facing west, left to right
    assert observe(ROOM, (2, 4), 2).names == ("sofa", "lamp")  # on the chair facing south: not the chair itself


@pytest.mark.parametrize("task", TASKS)
def test_every_question_has_exactly_one_answerable_choice(task):
    asked = 0
    for index, room in enumerate(rooms(40, seed=7)):
        rng = np.random.default_rng(index)
        knowledge = full_knowledge(room)
        question = ASKERS[task](room, knowledge, rng)
        if question is None:
            continue
        asked += 1
        assert isinstance(question, Question) and question.task == task
        assert len(set(question.choices)) == len(question.choices)
        # Two ways to turn; bwd_pov offers the objects with a front, up to four.
        assert len(question.choices) in ((2,) if task == "rot_dual" else (2, 3, 4) if task == "bwd_pov" else (4,))
        assert question.possible_choices(knowledge) == [question.answer]
    assert asked >= 20


@pytest.mark.parametrize("task", TASKS)
def test_questions_need_exploring(task):
    # Before any view, more than one choice is possible for most questions: the answer is not given away.
    ambiguous = asked = 0
    for index, room in enumerate(rooms(12, seed=11)):
        question = ASKERS[task](room, full_knowledge(room), np.random.default_rng(index))
        if question is None:
            continue
        asked += 1
        ambiguous += len(question.possible_choices(Knowledge(room.size, room.names, []))) > 1
    assert asked >= 6 and ambiguous >= asked - 1


def ask(task, seed=0):
    for k in range(50):
        question = ASKERS[task](ROOM, full_knowledge(ROOM), np.random.default_rng(seed + k))
        if question is not None:
            return question
    raise AssertionError(f"no {task} question about the hand-made room")


def compass(v):
    names = ["north", "north-east", "east", "south-east", "south", "south-west", "west", "north-west"]
    return names[int(math.floor((math.degrees(math.atan2(v[0], v[1])) % 360 + 22.5) / 45)) % 8]


def distance(v):
    d = math.hypot(*v)
    return next(label for label, top in zip(["near", "mid distance", "slightly far", "far"], [2, 4, 8, 16]) if d <= top)


def test_dir_answers_on_the_map():
    cells = {t.name: t.cell for t in ROOM.things}
    for seed in range(20):
        question = ask("dir", seed)
        claim = question.claims[question.answer]
        v = offset(cells[claim.subject], cells[claim.anchor])
        assert claim.label == f"{compass(v)}, {distance(v)}"


def test_pov_answers_from_the_anchor():
    # Standing on the television (4, 4) facing west, the chair (2, 4) is straight ahead at 2 cells, the
    # sofa (2, 0) ahead-left, the table (5, 2) behind on the left.
    expected = {"chair": "around 12 o'clock, near", "sofa": "around 10:30, slightly far",
                "table": "around 7:30, mid distance", "lamp": "around 10:30, slightly far"}
    found = {}
    for seed in range(60):
        question = ask("pov", seed)
        claim = question.claims[question.answer]
        if claim.anchor == "television":
            found[claim.subject] = claim.label
    assert found and all(expected[name] == label for name, label in found.items())


def test_rotation_order():
    # From (2, 2): chair at 0 degrees, television 45, table 90, sofa 180, lamp 225 (clockwise from north).
    clockwise = ["chair", "television", "table", "sofa", "lamp"]
    for seed in range(20):
        question = ask("rot", seed)
        claim = question.claims[question.answer]
        order = list(claim.names)
        reference = clockwise if claim.clockwise else [clockwise[0], *reversed(clockwise[1:])]
        assert order == [name for name in reference if name in order]
        dual = ask("rot_dual", seed)
        assert dual.choices[dual.answer] == ("clockwise" if dual.claims[dual.answer].clockwise else "counterclockwise")


def test_e2a_coordinates_and_localization():
    question = ask("e2a")
    truth = question.choices[question.answer]
    for thing in ROOM.things:
        if f"{thing.name} at" in truth:
            x, y = offset(thing.cell, ROOM.start)
            assert f"{thing.name} at ({x}, {y})" in truth
    question = ask("bwd_loc")
    x, y = (int(n) for n in question.choices[question.answer].strip("()").split(", "))
    cell = (ROOM.start[0] + x, ROOM.start[1] + y)
    assert ROOM.contains(cell) and not ROOM.occupied(cell) and cell != ROOM.start

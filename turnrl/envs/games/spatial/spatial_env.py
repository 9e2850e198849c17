"""Spatial: explore a room by turning, jumping and observing, then answer a multiple-choice question about it.

RAGEN's Spatial env (its ``ragen/env/spatial``, built on the Theory-of-Space base), written anew:

- **Room** (:mod:`.room`): a square room (``room_size``, RAGEN's 6) with ``n_objects`` household objects
  (RAGEN's 5) on distinct cells; objects with a front face a compass direction. The agent starts on another
  cell facing north and is told the room's size and the objects' names, not where they are.
- **Turn**: one action sequence, ``Actions: [<move>, ..., <final>]`` (:mod:`.actions`): ``JumpTo(obj)``
  onto an object already observed and now in view (the heading stays), ``Rotate(deg)`` by a multiple of 90
  (clockwise positive), then ``Observe()`` or, alone, ``Term(<letter>)``. A move that fails (unknown or
  unseen object, a bad angle) skips the rest of the sequence and the agent observes instead, as in RAGEN.
- **Observe()** reports each object in the 90-degree field of view with a bearing bin (front,
  front-slight-left/right, front-left/right), a distance bin (near ... extremely far) and, for objects with a
  front, where it faces relative to the agent; close pairs (at most 2 cells apart) get a compass relation
  with the agent's heading as north.
- **Question** (:mod:`.questions`): one of RAGEN's ten tasks (``tasks``), with four choices (two for
  ``rot_dual``) whose correct one is computed from the room and whose wrong ones are ruled out by the views
  from the start, so exploring can always answer it.
- **Rewards** (RAGEN's ``SpatialGym.step``): ``correct_reward`` (+10) for a right answer, ``wrong_reward``
  (RAGEN: -1) for a wrong one, ``step_reward`` (-0.1) for every other step, ``invalid_reward`` (-1) for a
  turn that is not a readable sequence (the state is unchanged and the step counts). ``max_steps`` is RAGEN's
  ``max_exp_steps + 1`` = 11; reaching it with a readable sequence truncates the episode (an unreadable one
  does not, as RAGEN's ``done=False``).
- **Modes**: ``text``, and ``image``: a top-down map of what has been observed (the cells the views covered,
  the objects seen, the agent and its start), with the question and the action feedback as text.
- **Expert** (:meth:`SpatialEnv.solve`): observe from the start in the four directions, then answer with the
  one choice that the views leave possible; it never reads the room to answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from PIL import Image, ImageDraw

from turnrl.envs.contract import StateFacts, StateRewardProfile, StepOutcome, TurnEnv, facts_from_positions
from turnrl.envs.draw import font
from turnrl.envs.games.spatial.action_sequence import MAX_CHARS, Action, parse_sequence, sequence_text
from turnrl.envs.games.spatial.geometry import HEADING_NAMES, HEADINGS, Cell, in_view, offset
from turnrl.envs.games.spatial.knowledge import Knowledge
from turnrl.envs.games.spatial.questions import TASKS, TURNS, Question, ask, letter
from turnrl.envs.games.spatial.room import OBJECT_NAMES, Room, View, check_room, generate_room, observe

MAX_ROOM_TRIES = 100
VALID_DEGREES = (0, 90, 180, 270, -90, -180, -270)
LEGEND_PX = 170
LINE_PX = 16
FLOOR_SEEN, FLOOR_UNSEEN, WALL, GRID = (236, 236, 226), (160, 160, 160), (80, 80, 80), (205, 205, 200)
AGENT_COLOR, START_COLOR = (220, 40, 40), (40, 90, 220)
PALETTE = (
    (31, 119, 180), (255, 127, 14), (44, 160, 44), (148, 103, 189), (140, 86, 75), (227, 119, 194),
    (127, 127, 127), (188, 189, 34), (23, 190, 207), (214, 39, 40),
)


class SpatialEnv(TurnEnv):
    """Explore a room, then answer a spatial question about it (RAGEN's Spatial).

    Args:
        mode: ``"text"`` or ``"image"`` (a top-down map of what has been observed).
        room_size: side of the square room in cells (3 to 20; RAGEN: 6).
        n_objects: objects in the room (3 to 20, fewer than the cells; RAGEN: 5).
        tasks: the question tasks drawn from: ``"all"`` (RAGEN's ten, see :mod:`.questions`), a list of task
            names, or their names separated by commas.
        correct_reward: paid for a right answer (RAGEN: 10).
        wrong_reward: paid for a wrong answer (RAGEN: -1).
        step_reward: paid for every step that does not answer (RAGEN: -0.1).
        invalid_reward: paid for a turn that is not a readable action sequence (RAGEN: -1).
        max_steps: steps before truncation (RAGEN: max_exp_steps + 1 = 11).
        cell_px: pixels per cell of the map in image mode.
        render_mode: ``None``, ``"ansi"`` or ``"rgb_array"``.
    """

    reset_options = ("room", "task")

    invalid_step_truncates = False  # RAGEN: an unreadable sequence returns done=False at any count
    modes = ("text", "image")
    # Every object counts the same; the aliases let a description name the two-word objects by their telling word
    # (state rewards read one word at a time) or by a common other name.
    state_reward_profile = StateRewardProfile(
        {name: 1.0 for name in OBJECT_NAMES},
        {"conditioner": "air conditioner", "trash": "trash can", "bin": "trash can", "tv": "television",
         "fridge": "refrigerator", "couch": "sofa", "bookcase": "bookshelf", "pc": "computer", "screen": "monitor"},
    )
    description = (
        "Spatial: explore a room by turning, jumping and observing, then answer a multiple-choice spatial "
        "question (RAGEN)."
    )

    def __init__(
        self,
        mode: str = "text",
        room_size: int = 6,
        n_objects: int = 5,
        tasks: Sequence[str] | str = "all",
        correct_reward: float = 10.0,
        wrong_reward: float = -1.0,
        step_reward: float = -0.1,
        invalid_reward: float = -1.0,
        max_steps: int = 11,
        cell_px: int = 32,
        render_mode: str | None = None,
    ) -> None:
        if not isinstance(room_size, (int, np.integer)) or isinstance(room_size, bool) or not 3 <= room_size <= 20:
            raise ValueError(f"room_size must be an int from 3 to 20, got {room_size!r}")
        room_size = int(room_size)
        most = min(len(OBJECT_NAMES), room_size * room_size - 1)
        if not isinstance(n_objects, (int, np.integer)) or isinstance(n_objects, bool) or not 3 <= n_objects <= most:
            raise ValueError(f"n_objects must be an int from 3 to {most} for room_size={room_size}, got {n_objects!r}")
        if isinstance(tasks, str):
            tasks = TASKS if tasks.strip() == "all" else [t.strip() for t in tasks.split(",")]
        tasks = tuple(tasks)
        unknown = [t for t in tasks if t not in TASKS]
        if not tasks or unknown:
            raise ValueError(f"tasks must be 'all' or a non-empty list drawn from {list(TASKS)}, got {list(tasks)}")
        rewards = {"correct_reward": correct_reward, "wrong_reward": wrong_reward, "step_reward": step_reward,
                   "invalid_reward": invalid_reward}
        for key, value in rewards.items():
            if not np.isfinite(value):
                raise ValueError(f"{key} must be a finite number, got {value}")
        if not 8 <= cell_px <= 128:
            raise ValueError(f"cell_px must be from 8 to 128, got {cell_px}")
        map_px = (room_size + 2) * cell_px
        shape = (max(map_px, LINE_PX * (n_objects + 3) + 8), map_px + LEGEND_PX)
        super().__init__(mode=mode, max_steps=max_steps, image_shape=shape, render_mode=render_mode)
        self.room_size = room_size
        self.n_objects = int(n_objects)
        self.tasks = tasks
        self.correct_reward = float(correct_reward)
        self.wrong_reward = float(wrong_reward)
        self.step_reward = float(step_reward)
        self.invalid_action_reward = float(invalid_reward)
        self.cell_px = int(cell_px)
        self._image_shape = shape
        self.room = Room(room_size, (), (0, 0))
        self.question = Question("", "", (), 0)
        self.cell: Cell = (0, 0)
        self.heading = 0
        self.jumped = False
        self.views: list[View] = []
        self.observed: set[str] = set()
        self.feedback: tuple[str, ...] = ()
        self.answer: str | None = None

    # ----------------------------------------------------------------- episode
    def _reset(self, rng: np.random.Generator, options: dict[str, Any]) -> None:
        tasks = self.tasks
        if "task" in options:
            if options["task"] not in TASKS:
                raise ValueError(f"options['task'] must be one of {list(TASKS)}, got {options['task']!r}")
            tasks = (options["task"],)
        given = check_room(options["room"], self.room_size) if "room" in options else None
        for _ in range(1 if given is not None else MAX_ROOM_TRIES):
            room = given or generate_room(rng, self.room_size, self.n_objects)
            knowledge = Knowledge(room.size, room.names, [observe(room, room.start, h) for h in range(4)])
            question = ask(room, knowledge, rng, tasks)
            if question is not None:
                break
        else:
            where = "the given room" if given is not None else (
                f"{MAX_ROOM_TRIES} rooms of size {self.room_size} with {self.n_objects} objects")
            raise ValueError(f"Spatial: no question of {list(tasks)} can be asked about {where}; use other tasks")
        self.room, self.question = room, question
        self.cell, self.heading, self.jumped = room.start, 0, False
        self.views, self.observed, self.feedback, self.answer = [], set(), (), None

    def canonical_action(self, action: Any) -> str | None:
        """The canonical spelling of a readable action sequence (:mod:`.actions`), else None.

        A spelling longer than ``MAX_CHARS`` is unreadable too: it would not read back (``Actions: [`` and the
        spaces after commas can lengthen a text just under the limit), and ``_step`` reads the spelling.
        """
        actions = parse_sequence(action)
        text = None if actions is None else sequence_text(actions)
        return text if text is not None and len(text) <= MAX_CHARS else None

    def _step(self, action: str) -> StepOutcome:
        actions = parse_sequence(action)
        assert actions is not None  # canonical_action read it
        if actions[-1].kind == "term":
            return self._answer(actions[-1].target)
        before = self.state_key()
        messages: list[str] = []
        failed = 0
        for move in actions[:-1]:
            ok, message = self._move(move)
            messages.append(message)
            if not ok:
                failed = 1
                messages.append("The rest of the sequence is skipped; you observe instead.")
                break
        view = observe(self.room, self.cell, self.heading)
        self.views.append(view)
        self.observed.update(view.names)
        messages.extend(self._view_lines(view))
        self.feedback = tuple(messages)
        info = {"failed_moves": failed}
        return StepOutcome(self.step_reward, effective=self.state_key() != before, info=info)

    def _move(self, move: Action) -> tuple[bool, str]:
        if move.kind == "rotate":
            if move.degrees not in VALID_DEGREES:
                return False, f"Cannot rotate by {move.degrees} degrees: only 0, 90, 180, 270, -90, -180, -270."
            self.heading = (self.heading + move.degrees // 90) % 4
            if move.degrees == 0:
                return True, "You did not turn."
            way = "clockwise" if move.degrees > 0 else "counterclockwise"
            return True, f"You turned {way} by {abs(move.degrees)} degrees."
        thing = self.room.thing(move.target)
        if thing is None:
            return False, f"Cannot jump to {move.target}: there is no such object."
        if thing.name not in self.observed:
            return False, f"Cannot jump to the {thing.name}: you have not observed it yet."
        if thing.cell == self.cell or not in_view(offset(thing.cell, self.cell), self.heading):
            return False, f"Cannot jump to the {thing.name}: it is not in your field of view."
        self.cell, self.jumped = thing.cell, True
        return True, f"You jumped to the {thing.name}."

    def _answer(self, choice: str) -> StepOutcome:
        self.answer = choice
        correct = self.success()
        reward = self.correct_reward if correct else self.wrong_reward
        self.feedback = (f"You answered {choice}: {'correct' if correct else 'wrong'}.",)
        info = {"answer": choice, "correct_answer": self.question.letter, "task": self.question.task}
        return StepOutcome(reward, terminated=True, success=correct, info=info)

    def success(self) -> bool:
        return self.answer == self.question.letter

    def solve(self) -> list[str] | None:
        """Observe from the start in every direction not yet seen from there, then answer with the one choice
        the views leave possible (the first of them should several remain, e.g. after a jump too early).
        Views are kept to the steps left, one being needed to answer."""
        if self.answer is not None:
            return []
        plan: list[str] = []
        views = [view for view in self.views if view.cell == self.room.start]
        if not self.jumped:
            heading, seen = self.heading, {view.heading for view in views}
            room_for = max(0, self.max_steps - self.steps - 1)
            for target in sorted(set(range(4)) - seen, key=lambda h: (h - self.heading) % 4)[:room_for]:
                turn = TURNS[(target - heading) % 4]
                plan.append(f"Actions: [Rotate({turn}), Observe()]" if turn else "Actions: [Observe()]")
                views.append(observe(self.room, self.room.start, target))
                heading = target
        knowledge = Knowledge(self.room.size, self.room.names, views)
        possible = self.question.possible_choices(knowledge)
        plan.append(f"Actions: [Term({letter(possible[0] if possible else 0)})]")
        return plan

    # ----------------------------------------------------------------- views
    def _view_lines(self, view: View) -> list[str]:
        if self.is_image_mode:
            seen = ", ".join(view.names) if view.names else "nothing"
            return [f"You observe: {seen} (the map shows where)."]
        return ["You observe:", *view.lines()]

    def text(self) -> str:
        if self.answer is not None:
            return f"{self.feedback[0]} The correct answer was {self.question.letter}."
        if self.feedback:
            return "\n".join(self.feedback)
        n = self.room_size
        intro = (
            f"You are in a {n}x{n} room, seen from above as a grid of cells (x grows to the east, y to the north). "
            f"You stand on an empty cell, facing north. Objects in the room: {', '.join(self.room.names)}."
        )
        if self.is_image_mode:
            intro += " The map shows what you have observed so far."
        return f"{intro}\nQuestion: {self.question.text()}\nExplore, then answer with Term(<letter>)."

    def state_key(self) -> str:
        views = sorted({(view.cell, view.heading) for view in self.views})
        return f"{self.cell}|{self.heading}|{views}|{self.answer}"

    def state_facts(self) -> StateFacts:
        """The agent and the objects it has observed, on the map (row 0 is the north wall), with its heading."""
        top = self.room_size - 1
        player = (top - self.cell[1], self.cell[0])
        seen = [(t.name, (top - t.cell[1], t.cell[0])) for t in self.room.things if t.name in self.observed]
        facts = facts_from_positions(player, seen)
        return StateFacts(player=facts.player, objects=facts.objects, extra={"facing": HEADING_NAMES[self.heading]})

    def image(self) -> np.ndarray:
        height, width = self._image_shape
        px, n = self.cell_px, self.room_size
        image = Image.new("RGB", (width, height), (255, 255, 255))
        draw = ImageDraw.Draw(image)
        seen_cells = {
            (x, y) for view in self.views for x in range(n) for y in range(n)
            if in_view(offset((x, y), view.cell), view.heading)
        }

        def box(cell: Cell, inset: float = 0.0) -> tuple[float, float, float, float]:
            left, top = (cell[0] + 1) * px, (n - cell[1]) * px
            return left + inset, top + inset, left + px - 1 - inset, top + px - 1 - inset

        draw.rectangle((0, 0, (n + 2) * px - 1, (n + 2) * px - 1), fill=WALL)
        for x in range(n):
            for y in range(n):
                draw.rectangle(box((x, y)), fill=FLOOR_SEEN if (x, y) in seen_cells else FLOOR_UNSEEN, outline=GRID)
        x0, y0, x1, y1 = box(self.room.start, px * 0.3)
        draw.line((x0, y0, x1, y1), fill=START_COLOR, width=max(2, px // 10))
        draw.line((x0, y1, x1, y0), fill=START_COLOR, width=max(2, px // 10))
        label_font = font(max(9, px // 3))
        for index, thing in enumerate(self.room.things):
            if thing.name not in self.observed:
                continue
            color = PALETTE[index % len(PALETTE)]
            x0, y0, x1, y1 = box(thing.cell)
            cx, cy = (x0 + x1) / 2, (y0 + y1) / 2
            draw.ellipse(box(thing.cell, px * 0.15), fill=color)
            if thing.heading is not None:  # a tick from the rim of the dot towards where it faces
                dx, dy = HEADINGS[thing.heading]
                draw.line((cx + dx * px * 0.3, cy - dy * px * 0.3, cx + dx * px * 0.5, cy - dy * px * 0.5),
                          fill=(0, 0, 0), width=max(2, px // 8))
            draw.text((cx, cy), str(index + 1), fill=(255, 255, 255), font=label_font, anchor="mm")
        cx, cy = (box(self.cell)[0] + box(self.cell)[2]) / 2, (box(self.cell)[1] + box(self.cell)[3]) / 2
        fx, fy = HEADINGS[self.heading]
        rx, ry = HEADINGS[(self.heading + 1) % 4]
        tip, half = px * 0.4, px * 0.25
        draw.polygon(
            [(cx + fx * tip, cy - fy * tip), (cx - fx * half + rx * half, cy + fy * half - ry * half),
             (cx - fx * half - rx * half, cy + fy * half + ry * half)],
            fill=AGENT_COLOR,
        )
        legend_font = font(12)
        left = (n + 2) * px + 8
        draw.text((left, 4), "red triangle: you", fill=AGENT_COLOR, font=legend_font)
        draw.text((left, 4 + LINE_PX), "blue cross: start", fill=START_COLOR, font=legend_font)
        row = 2
        for index, thing in enumerate(self.room.things):
            if thing.name in self.observed:
                draw.text((left, 4 + LINE_PX * row), f"{index + 1}: {thing.name}", fill=PALETTE[index % len(PALETTE)],
                          font=legend_font)
                row += 1
        return np.asarray(image, dtype=np.uint8)

    def instructions(self) -> str:
        if self.is_image_mode:
            seeing = (
                "The image is a map seen from above, north up: grey walls around the room, light cells are ones "
                "your views have covered, darker cells are unseen, each observed object is a numbered dot (the "
                "legend names it; a black tick shows where an object with a front faces), the red triangle is "
                "you pointing where you face, the blue cross is your start. Observe() adds what you see to the map."
            )
        else:
            seeing = (
                "Observe() lists each object in your field of view with its bearing (front: dead ahead; "
                "front-slight-left/right: up to 22.5 degrees to a side; front-left/right: up to 45 degrees), its "
                "distance (near: up to 2 cells; mid distance: up to 4; slightly far: up to 8; far: up to 16; very "
                "far: up to 32; extremely far: more) and, for an object with a front, where it faces for you "
                "(forward, backward, left or right); two objects in view at most 2 cells apart are a close pair, "
                "given as a compass direction taking the way you face as north."
            )
        return (
            f"Spatial. You are in a {self.room_size}x{self.room_size} room with some objects and must answer a "
            "multiple-choice question about where things are. Explore first. Each turn, write one action "
            "sequence: Actions: [<move>, ..., <final action>]. Moves (zero or more): JumpTo(<object>) puts you on "
            "an object you have observed before and can see now (you keep facing the same way); Rotate(<degrees>) "
            "turns you in place, clockwise for positive degrees (0, 90, 180, 270, -90, -180 or -270). Final "
            "action (exactly one, last): Observe() shows your field of view (90 degrees: 45 to each side of where "
            "you face) from where you stand; Term(<letter>) answers the question and ends the episode, and must "
            "be alone. If a move fails, the rest is skipped and you observe instead. "
            f"{seeing} Rewards: {self.correct_reward:g} for a right answer, {self.wrong_reward:g} for a wrong "
            f"one, {self.step_reward:g} for every other step, {self.invalid_action_reward:g} for a sequence that "
            f"cannot be read (it does nothing). You have {self.max_steps} steps. Examples: Actions: [Observe()] "
            "| Actions: [Rotate(90), Observe()] | Actions: [JumpTo(chair), Rotate(-90), Observe()] | "
            "Actions: [Term(B)]"
        )

    def action_names(self) -> list[str] | None:
        return None

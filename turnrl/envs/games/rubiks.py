"""Rubik's cube: restore a scrambled 2x2 cube (the pocket cube of RAGEN's ``rubikscube`` env).

RAGEN's settings: a 2x2 cube scrambled by ``scramble_depth`` random face turns
(1 in RAGEN's registered env, the default here), 20 steps before truncation,
reward 1 when every face shows one colour and 0 otherwise (an unknown action
pays 0 too). A scramble never turns a face straight back nor turns one face
three times in a row, and a scramble that leaves the cube solved is drawn
again, so every episode needs at least one move.

Actions: the twelve quarter turns in Singmaster notation, ``U U' D D' L L' R R'
F F' B B'`` (a letter alone turns that face 90 degrees clockwise as seen
looking at the face, a prime counter-clockwise). Solved means each face shows
one colour, whichever way the whole cube is held (as RAGEN: on a 2x2, ``U D'``
only turns the whole cube).

The cube is modelled geometrically: each sticker is a cubie corner position
and a face normal, and a turn rotates the stickers of one layer by a quarter
turn about that face's axis, so every permutation comes from one rotation
formula rather than hand-written tables. Colours (RAGEN's): white up, orange
left, green front, red right, blue back, yellow down.

The expert (:meth:`RubiksCubeEnv.solve`) is an optimal solver from any state:
turns of U, R and F never move the down-left-back corner, so every state is
solved by them relative to that corner; a breadth-first table over the 3.67
million positions of the other seven corners (built once, in about a second,
with numpy) gives the distance of each, and the solver walks down it: at most
14 quarter turns (the pocket cube's diameter), never more than the scramble.

Text: each face as a 2x2 block of colour letters, RAGEN's layout. Image: the
unfolded cube (a cross: U on top; L, F, R, B in a row; D below).
"""

from __future__ import annotations

from functools import lru_cache
from itertools import permutations
from typing import Any

import numpy as np
from PIL import Image, ImageDraw

from turnrl.envs.contract import IMAGE_CAPTION, StateFacts, StepOutcome, TurnEnv

Vector = tuple[int, int, int]
State = tuple[int, ...]
"""Colour index of each of the 24 stickers, face by face (:data:`FACES` order), each face row by row as seen
from outside in the net."""

FACES = "ULFRBD"
FACE_NAMES = {"U": "Up", "L": "Left", "F": "Front", "R": "Right", "B": "Back", "D": "Down"}
COLOURS = "WOGRBY"
"""Colour letter of each face when solved (RAGEN's): white, orange, green, red, blue, yellow."""
COLOUR_RGB = ((245, 245, 245), (255, 140, 0), (0, 155, 72), (200, 20, 30), (0, 70, 173), (255, 213, 0))
COLOUR_WORDS = ("white", "orange", "green", "red", "blue", "yellow")
OPPOSITE = {"U": "D", "D": "U", "L": "R", "R": "L", "F": "B", "B": "F"}

# Axes: x to the right, y up, z towards the viewer (the front). Each face: its outward normal, then the
# directions of "right" and "down" on the face as drawn in the net.
FRAMES: dict[str, tuple[Vector, Vector, Vector]] = {
    "U": ((0, 1, 0), (1, 0, 0), (0, 0, 1)),
    "L": ((-1, 0, 0), (0, 0, 1), (0, -1, 0)),
    "F": ((0, 0, 1), (1, 0, 0), (0, -1, 0)),
    "R": ((1, 0, 0), (0, 0, -1), (0, -1, 0)),
    "B": ((0, 0, -1), (-1, 0, 0), (0, -1, 0)),
    "D": ((0, -1, 0), (1, 0, 0), (0, 0, -1)),
}
ACTIONS = ("U", "U'", "D", "D'", "L", "L'", "R", "R'", "F", "F'", "B", "B'")
SOLVER_MOVES = ("U", "U'", "R", "R'", "F", "F'")
"""The turns the solver uses: none moves the down-left-back corner."""
DIAMETER = 14
"""Most quarter turns any pocket-cube position needs (God's number, quarter-turn metric)."""
MAX_SCRAMBLE = 100
SOLVED: State = tuple(face for face in range(6) for _ in range(4))


def _add(*vectors: Vector) -> Vector:
    return (sum(v[0] for v in vectors), sum(v[1] for v in vectors), sum(v[2] for v in vectors))


def _scale(k: int, v: Vector) -> Vector:
    return (k * v[0], k * v[1], k * v[2])


def _dot(a: Vector, b: Vector) -> int:
    return a[0] * b[0] + a[1] * b[1] + a[2] * b[2]


def _cross(a: Vector, b: Vector) -> Vector:
    return (a[1] * b[2] - a[2] * b[1], a[2] * b[0] - a[0] * b[2], a[0] * b[1] - a[1] * b[0])


def quarter_turn(axis: Vector, v: Vector) -> Vector:
    """``v`` turned 90 degrees clockwise as seen from the tip of ``axis`` (a unit axis vector).

    Rodrigues' formula at -90 degrees: ``R v = -(axis x v) + axis (axis . v)``.

    >>> quarter_turn((0, 1, 0), (0, 0, 1))  # seen from above, the front turns to the left
    (-1, 0, 0)
    """
    return _add(_scale(-1, _cross(axis, v)), _scale(_dot(axis, v), axis))


@lru_cache(maxsize=1)
def stickers() -> tuple[tuple[Vector, Vector], ...]:
    """``(cubie corner, face normal)`` of each sticker index (corners at coordinates of +-1)."""
    out = []
    for face in FACES:
        normal, right, down = FRAMES[face]
        for row in range(2):
            for col in range(2):
                out.append((_add(normal, _scale(2 * col - 1, right), _scale(2 * row - 1, down)), normal))
    return tuple(out)


@lru_cache(maxsize=1)
def move_sources() -> dict[str, tuple[int, ...]]:
    """For each action, ``sources`` with ``new[i] = old[sources[i]]``: which sticker lands where."""
    index = {sticker: i for i, sticker in enumerate(stickers())}
    sources: dict[str, tuple[int, ...]] = {}
    for face in FACES:
        axis = FRAMES[face][0]
        clockwise = list(range(24))
        for i, (corner, normal) in enumerate(stickers()):
            if _dot(corner, axis) > 0:  # in the turning layer
                clockwise[index[(quarter_turn(axis, corner), quarter_turn(axis, normal))]] = i
        sources[face] = tuple(clockwise)
        sources[face + "'"] = tuple(clockwise[clockwise[clockwise[i]]] for i in range(24))  # three turns
    return sources


def apply(state: State, action: str) -> State:
    """``state`` after one turn."""
    return tuple(state[i] for i in move_sources()[action])


def is_solved(state: State) -> bool:
    """Whether every face shows one colour (however the whole cube is held)."""
    return all(state[4 * f] == state[4 * f + 1] == state[4 * f + 2] == state[4 * f + 3] for f in range(6))


def scramble(rng: np.random.Generator, depth: int) -> list[str]:
    """``depth`` random turns that never undo the previous one nor turn one face three times in a row."""
    moves: list[str] = []
    while len(moves) < depth:
        move = ACTIONS[int(rng.integers(len(ACTIONS)))]
        if moves and move == _inverse(moves[-1]):
            continue
        if len(moves) >= 2 and moves[-1] == moves[-2] == move:
            continue
        moves.append(move)
    return moves


def _inverse(move: str) -> str:
    return move[0] if move.endswith("'") else move + "'"


def parse_moves(moves: Any) -> list[str]:
    """Turns written as a string (``"R U F'"``) or a list of names; ValueError naming a bad one."""
    if isinstance(moves, str):
        moves = moves.split()
    if not isinstance(moves, (list, tuple)) or not all(isinstance(m, str) for m in moves):
        raise ValueError(f"a scramble is a string of turns such as \"R U F'\" or a list of them, got {moves!r}")
    lookup = {name.lower(): name for name in ACTIONS}
    bad = [m for m in moves if m.strip().lower() not in lookup]
    if bad:
        raise ValueError(f"unknown turns {bad[:5]}; use {' '.join(ACTIONS)}")
    return [lookup[m.strip().lower()] for m in moves]


# --------------------------------------------------------------------------- the solver
@lru_cache(maxsize=1)
def _corners() -> tuple[tuple[int, int, int], ...]:
    """The sticker indices of each corner position, the down-left-back corner last.

    Each corner's three stickers start with its up or down sticker and go round in one rotational sense
    (``det(n0, n1, n2) = +1``), the same at every corner, so a twist is a cyclic shift.
    """
    by_corner: dict[Vector, list[int]] = {}
    for i, (corner, _) in enumerate(stickers()):
        by_corner.setdefault(corner, []).append(i)
    corners = []
    for corner in sorted(by_corner, key=lambda c: c == (-1, -1, -1)):
        ids = by_corner[corner]
        first = next(i for i in ids if stickers()[i][1][1] != 0)
        a, b = (i for i in ids if i != first)
        n0, na, nb = (stickers()[i][1] for i in (first, a, b))
        if _dot(_cross(n0, na), nb) < 0:
            a, b = b, a
        corners.append((first, a, b))
    return tuple(corners)


def _corner_state(labels: State) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Which home corner sits at each of the 7 moving corner positions, and its twist (0-2), for a state
    whose stickers carry face indices (the face each sticker belongs on)."""
    corners = _corners()
    home = {frozenset(SOLVED[i] for i in ids): k for k, ids in enumerate(corners)}
    pieces, twists = [], []
    for ids in corners[:7]:
        faces = [labels[i] for i in ids]
        pieces.append(home[frozenset(faces)])
        twists.append(next(k for k, face in enumerate(faces) if FACES[face] in "UD"))
    return tuple(pieces), tuple(twists)


def relabel(state: State) -> State:
    """The state with each colour replaced by the face it belongs on, judged from the down-left-back corner
    (which the solver's turns never move): its down sticker's colour belongs on D, its left one's on L, its
    back one's on B, and the opposite colours on U, R and F."""
    colour_face: dict[int, int] = {}
    for index, normal in _anchor_stickers():
        face = next(f for f in FACES if FRAMES[f][0] == normal)
        colour_face[state[index]] = FACES.index(face)
        colour_face[FACES.index(OPPOSITE[FACES[state[index]]])] = FACES.index(OPPOSITE[face])
    return tuple(colour_face[c] for c in state)


@lru_cache(maxsize=1)
def _anchor_stickers() -> tuple[tuple[int, Vector], ...]:
    """``(sticker index, normal)`` of the three stickers of the down-left-back corner."""
    return tuple((i, normal) for i, (corner, normal) in enumerate(stickers()) if corner == (-1, -1, -1))


_PERM_COUNT, _TWIST_COUNT = 5040, 3**7


def _perm_rank(perm: tuple[int, ...]) -> int:
    """Lehmer rank of a permutation of ``range(7)``, in ``[0, 5040)``."""
    rank, items = 0, list(range(7))
    for k, p in enumerate(perm):
        i = items.index(p)
        rank = rank * (7 - k) + i
        items.pop(i)
    return rank


def _twist_rank(twists: tuple[int, ...]) -> int:
    rank = 0
    for t in twists:
        rank = rank * 3 + t
    return rank


def _index(labels: State) -> int:
    pieces, twists = _corner_state(labels)
    return _perm_rank(pieces) * _TWIST_COUNT + _twist_rank(twists)


@lru_cache(maxsize=1)
def _move_tables() -> tuple[np.ndarray, np.ndarray]:
    """How each solver turn maps permutation ranks ``(6, 5040)`` and twist ranks ``(6, 2187)``.

    A turn takes the corner at position ``sources[k]`` to position ``k`` and adds ``twist[k]`` to its twist
    (both read from the turn applied to the solved cube).
    """
    perm_table = np.empty((len(SOLVER_MOVES), _PERM_COUNT), dtype=np.int32)
    twist_table = np.empty((len(SOLVER_MOVES), _TWIST_COUNT), dtype=np.int32)
    all_perms = list(permutations(range(7)))
    all_twists = [tuple(int(d) for d in np.base_repr(r, 3).zfill(7)) for r in range(_TWIST_COUNT)]
    for m, move in enumerate(SOLVER_MOVES):
        sources, added = _corner_state(apply(SOLVED, move))
        for perm in all_perms:
            perm_table[m, _perm_rank(perm)] = _perm_rank(tuple(perm[s] for s in sources))
        for twists in all_twists:
            moved = tuple((twists[s] + a) % 3 for s, a in zip(sources, added))
            twist_table[m, _twist_rank(twists)] = _twist_rank(moved)
    return perm_table, twist_table


@lru_cache(maxsize=1)
def distance_table() -> np.ndarray:
    """Quarter turns (of :data:`SOLVER_MOVES`) from each corner state to solved, -1 where unreachable.

    Shape ``(5040 * 2187,)``, int8, indexed by ``perm_rank * 2187 + twist_rank``; breadth-first from the solved
    state, one layer at a time over numpy arrays.
    """
    perm_table, twist_table = _move_tables()
    distance = np.full(_PERM_COUNT * _TWIST_COUNT, -1, dtype=np.int8)
    frontier = np.array([_index(SOLVED)], dtype=np.int32)
    distance[frontier] = 0
    depth = 0
    while frontier.size:
        depth += 1
        perms, twists = np.divmod(frontier, _TWIST_COUNT)
        for m in range(len(SOLVER_MOVES)):
            reached = perm_table[m][perms] * _TWIST_COUNT + twist_table[m][twists]
            distance[reached[distance[reached] < 0]] = depth
        frontier = np.flatnonzero(distance == depth).astype(np.int32)
    return distance


def optimal_solution(state: State) -> list[str]:
    """A shortest sequence of quarter turns (of U, R and F) that solves ``state``."""
    distance = distance_table()
    labels = relabel(state)
    plan: list[str] = []
    remaining = int(distance[_index(labels)])
    if remaining < 0:
        raise ValueError("not a reachable pocket-cube state")
    while remaining > 0:
        for move in SOLVER_MOVES:
            after = apply(labels, move)
            if distance[_index(after)] == remaining - 1:
                plan.append(move)
                labels, remaining = after, remaining - 1
                break
    return plan


# --------------------------------------------------------------------------- the env
_GAP = 2
"""Pixels between the stickers of a face."""
_FACE_GAP = 8
"""Pixels between the faces of the net."""
_MARGIN = 6


class RubiksCubeEnv(TurnEnv):
    """Restore a scrambled 2x2 Rubik's cube (RAGEN's ``rubikscube``).

    Args:
        mode: ``"text"`` or ``"image"`` (the unfolded cube).
        scramble_depth: random turns that scramble the cube (RAGEN's env: 1), 1 to 100.
        max_steps: steps before truncation (RAGEN: 20).
        solved_reward: paid when the cube is solved (RAGEN: 1).
        sticker_px: pixels per sticker in image mode.
        render_mode: ``None``, ``"ansi"`` or ``"rgb_array"``.
    """

    reset_options = ("scramble",)

    modes = ("text", "image")
    description = "RubiksCube: restore a scrambled 2x2 cube with quarter turns (RAGEN's rubikscube)."

    def __init__(
        self,
        mode: str = "text",
        scramble_depth: int = 1,
        max_steps: int = 20,
        solved_reward: float = 1.0,
        sticker_px: int = 24,
        render_mode: str | None = None,
    ) -> None:
        is_int = isinstance(scramble_depth, (int, np.integer)) and not isinstance(scramble_depth, bool)
        if not is_int or not 1 <= scramble_depth <= MAX_SCRAMBLE:
            raise ValueError(f"scramble_depth must be an int from 1 to {MAX_SCRAMBLE}, got {scramble_depth!r}")
        if not 8 <= sticker_px <= 128:
            raise ValueError(f"sticker_px must be from 8 to 128, got {sticker_px}")
        face = 2 * sticker_px + _GAP
        self.image_shape = (3 * face + 2 * _FACE_GAP + 2 * _MARGIN, 4 * face + 3 * _FACE_GAP + 2 * _MARGIN)
        super().__init__(mode=mode, max_steps=max_steps, image_shape=self.image_shape, render_mode=render_mode)
        self.scramble_depth = int(scramble_depth)
        self.solved_reward = float(solved_reward)
        self.sticker_px = int(sticker_px)
        self.state: State = SOLVED
        self.scramble: list[str] = []

    # ----------------------------------------------------------------- episode
    def _reset(self, rng: np.random.Generator, options: dict[str, Any]) -> None:
        if "scramble" in options:
            self.scramble = parse_moves(options["scramble"])
        else:
            self.scramble = scramble(rng, self.scramble_depth)
            while is_solved(self._scrambled(self.scramble)):  # U D' turns the whole cube: draw again
                self.scramble = scramble(rng, self.scramble_depth)
        self.state = self._scrambled(self.scramble)

    @staticmethod
    def _scrambled(moves: list[str]) -> State:
        state = SOLVED
        for move in moves:
            state = apply(state, move)
        return state

    def _step(self, action: str) -> StepOutcome:
        self.state = apply(self.state, action)
        solved = is_solved(self.state)
        return StepOutcome(self.solved_reward if solved else 0.0, terminated=solved, success=solved)

    def success(self) -> bool:
        return is_solved(self.state)

    def solve(self) -> list[str]:
        """A shortest solution from the current state (quarter turns of U, R and F)."""
        return optimal_solution(self.state)

    def action_budget(self) -> int:
        """An optimal solution takes at most the scramble's length and never more than 14 quarter turns: the
        length of ``scramble_depth``, or of a longer scramble this episode was given."""
        return min(self.max_steps, max(self.scramble_depth, len(self.scramble)), DIAMETER)

    # ----------------------------------------------------------------- views
    def face(self, name: str) -> tuple[str, str, str, str]:
        """The colour letters of one face, row by row as drawn in the net."""
        base = 4 * FACES.index(name)
        return tuple(COLOURS[c] for c in self.state[base : base + 4])  # type: ignore[return-value]

    def text(self) -> str:
        """RAGEN's layout (rubikscube/env.py render): a title, the faces, then, while the cube is unsolved, the
        actions and the closing question. RAGEN's step counter is left out: a rejected action must leave the
        observation as it was (the env contract); the agent's frame says how many actions are left."""
        lines = [IMAGE_CAPTION] if self.is_image_mode else ["=== Rubik's Cube 2x2 State ===", "", self.ansi()]
        if not self.success():
            lines += ["", "Available Actions:", ", ".join(self.action_names()), "", "What is your next move?"]
        return "\n".join(lines)

    def ansi(self) -> str:
        """Each face as two rows of colour letters, RAGEN's order (U, L, F, R, B, D)."""
        lines = []
        for name in FACES:
            a, b, c, d = self.face(name)
            label = f"{FACE_NAMES[name]} ({name}):"
            lines.append(f"{label:<11}[{a}, {b}]")
            lines.append(f"{'':<11}[{c}, {d}]")
        return "\n".join(lines)

    def state_key(self) -> str:
        return "".join(COLOURS[c] for c in self.state)

    def image(self) -> np.ndarray:
        px, face = self.sticker_px, 2 * self.sticker_px + _GAP
        height, width = self.image_shape
        image = Image.new("RGB", (width, height), (40, 40, 40))
        draw = ImageDraw.Draw(image)
        places = {"U": (0, 1), "L": (1, 0), "F": (1, 1), "R": (1, 2), "B": (1, 3), "D": (2, 1)}
        for name, (block_row, block_col) in places.items():
            top = _MARGIN + block_row * (face + _FACE_GAP)
            left = _MARGIN + block_col * (face + _FACE_GAP)
            for k, letter in enumerate(self.face(name)):
                r, c = divmod(k, 2)
                x, y = left + c * (px + _GAP), top + r * (px + _GAP)
                draw.rectangle((x, y, x + px - 1, y + px - 1), fill=COLOUR_RGB[COLOURS.index(letter)])
        return np.asarray(image, dtype=np.uint8)

    def instructions(self) -> str:
        colours = ", ".join(f"{letter} {word}" for letter, word in zip(COLOURS, COLOUR_WORDS))
        if self.is_image_mode:
            seen = ("The image shows the cube unfolded: the Up face on top; the Left, Front, Right and Back faces "
                    "in a row below it; the Down face under the Front face. Each face is drawn as seen from "
                    "outside the cube.")
        else:
            seen = (f"The observation lists each face as two rows of colour letters ({colours}), as seen from "
                    "outside the cube with the Up face above the side faces.")
        return (
            "You are solving a 2x2 Rubik's Cube (pocket cube). Restore it so that each face shows a single "
            f"colour.\n{seen}\n"
            "Actions, in Singmaster notation: U, U', D, D', L, L', R, R', F, F', B, B'. The letter names the face "
            "(Up, Down, Left, Right, Front, Back); a letter alone turns that face 90 degrees clockwise as seen "
            "looking at it, a letter with ' turns it counter-clockwise. Example: R'.\n"
            f"Reward: {self.solved_reward:g} when the cube is solved, 0 otherwise."
        )

    def action_names(self) -> list[str]:
        return list(ACTIONS)

    def state_facts(self) -> StateFacts:
        extra: dict[str, Any] = {
            f"{FACE_NAMES[name]} face": " ".join(self.face(name)) for name in FACES
        }
        extra["faces of one colour"] = sum(len(set(self.face(name))) == 1 for name in FACES)
        return StateFacts(player=None, extra=extra)

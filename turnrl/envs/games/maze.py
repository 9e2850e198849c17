"""Maze2D: walk through a 2-D maze to the target, like VisGym's ``maze_2d``.

The maze is a square grid of odd side whose border is wall: ``difficulty=
"easy"`` is 9x9 and ``"hard"`` 11x11 (VisGym's sizes, border included), or
pass ``size``. Mazes are perfect (exactly one path between any two open
cells), carved from the seed by a recursive backtracker over the cells at odd
coordinates (``generator="backtracker"``, the default) or by Wilson's
loop-erased random walks (``generator="wilson"``, VisGym's generator: every
perfect maze equally likely, so more branches and shorter corner-to-corner
paths than the backtracker's long corridors). As in VisGym, the agent and the
target start in opposite corners of the maze (one of the four corner pairs,
drawn from the seed). ``reset(options={"level": ...})`` plays a given maze
instead (see :func:`parse_level`), which must have a path from the agent to
the target that ``max_steps`` allows.

Image mode draws 25 px a cell with VisGym's colours: grey walls, white paths,
the target a red square and the agent a blue circle. Text mode draws one row
per line: ``#`` wall, ``.`` path, ``A`` agent, ``T`` target, ``*`` agent on
the target.

Actions: ``up``, ``down``, ``left``, ``right``, ``stop``. VisGym's tuple
actions are accepted too, with VisGym's numbering: ``('move', 0)`` right,
``('move', 1)`` up, ``('move', 2)`` left, ``('move', 3)`` down, and
``('stop', 'stop')``. They are read with a regular expression, never
evaluated. Walking into a wall is a valid action that does not move the agent
(``info["action_is_effective"]`` is False).

Reward (``reward_on``): ``"reach"`` pays 1 and ends the episode when the agent
steps onto the target; ``"stop"`` (VisGym's rule) pays only after ``stop``: 1
if the agent stands on the target, else 0. In both, ``stop`` ends the episode.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from turnrl.envs import search
from turnrl.envs.actions import parse_tuple
from turnrl.envs.contract import (
    IMAGE_CAPTION,
    StateFacts,
    StateRewardProfile,
    StepOutcome,
    TurnEnv,
    facts_from_positions,
)
from turnrl.envs.draw import Tile, draw_grid

ACTIONS = ("up", "down", "left", "right", "stop")
MOVES = {"up": (-1, 0), "down": (1, 0), "left": (0, -1), "right": (0, 1)}
VISGYM_MOVES = ("right", "up", "left", "down")
"""VisGym's ``('move', k)`` numbering: index ``k`` -> direction."""
DIFFICULTY_SIZES = {"easy": 9, "hard": 11}
REWARD_RULES = ("reach", "stop")
GENERATORS = ("backtracker", "wilson")
MAX_SIZE = 63

WALL, PATH, AGENT, TARGET, AGENT_ON_TARGET = "#", ".", "A", "T", "*"
TILES = {
    WALL: Tile((169, 169, 169)),
    PATH: Tile((255, 255, 255)),
    TARGET: Tile((255, 0, 0)),
    AGENT: Tile((255, 255, 255), "circle", (0, 0, 255), 0.5),
    AGENT_ON_TARGET: Tile((255, 0, 0), "circle", (0, 0, 255), 0.5),
}

_MAX_ACTION_CHARS = 64


def visgym_action(name: str) -> str:
    """The VisGym tuple string of an action name: ``"up"`` -> ``"('move', 1)"``."""
    if name == "stop":
        return "('stop', 'stop')"
    return f"('move', {VISGYM_MOVES.index(name)})"


def parse_action(action: Any) -> str | None:
    """An action name from a name or a VisGym tuple string; None if it is neither.

    Case and surrounding whitespace or backticks are ignored.
    """
    if not isinstance(action, str) or len(action) > _MAX_ACTION_CHARS:
        return None
    text = action.strip().strip("`").strip().lower()
    if text in MOVES or text == "stop":
        return text
    items = parse_tuple(text)
    if items is not None and len(items) == 2 and items[0] == "move" and items[1] in (0, 1, 2, 3):
        return VISGYM_MOVES[int(items[1])]
    if items == ("stop", "stop"):
        return "stop"
    return None


def random_maze(rng: np.random.Generator, size: int) -> str:
    """A perfect ``size x size`` maze (odd ``size``) as a flat string of ``#`` and ``.``.

    Recursive backtracker (iterative, with a stack) over the cells at odd
    coordinates; the random choices come from one batch of uniforms.
    """
    m = (size - 1) // 2  # cells per side
    grid = [WALL] * (size * size)
    uniforms = rng.random(m * m).tolist()  # one for the start, one per carved cell
    first = int(uniforms[0] * m * m)
    visited = [False] * (m * m)
    visited[first] = True
    stack = [first]
    grid[(2 * (first // m) + 1) * size + 2 * (first % m) + 1] = PATH
    draw = 1
    while stack:
        cell = stack[-1]
        r, c = divmod(cell, m)
        options = [
            (nr * m + nc, (2 * r + 1 + dr) * size + 2 * c + 1 + dc)
            for dr, dc in ((-1, 0), (1, 0), (0, -1), (0, 1))
            for nr, nc in ((r + dr, c + dc),)
            if 0 <= nr < m and 0 <= nc < m and not visited[nr * m + nc]
        ]
        if not options:
            stack.pop()
            continue
        nxt, wall = options[int(uniforms[draw] * len(options))]
        draw += 1
        visited[nxt] = True
        grid[wall] = PATH
        grid[(2 * (nxt // m) + 1) * size + 2 * (nxt % m) + 1] = PATH
        stack.append(nxt)
    return "".join(grid)


def wilson_maze(rng: np.random.Generator, size: int) -> str:
    """A uniformly random perfect ``size x size`` maze (odd ``size``), by Wilson's algorithm, as VisGym draws its
    mazes: from each cell not yet in the maze, a random walk until it meets the maze; the walk's loops are erased
    (each cell remembers only the direction it was last left by) and its path is carved.

    Written here rather than taken from VisGym, whose generator draws from Python's ``random`` and comes with a
    gymnasium fork; the distribution of mazes is the same, the maze of a given seed is not.
    """
    m = (size - 1) // 2  # cells per side
    grid = [WALL] * (size * size)
    steps = ((-1, 0), (1, 0), (0, -1), (0, 1))

    def carve(r: int, c: int) -> None:
        grid[r * size + c] = PATH

    in_maze = [False] * (m * m)
    first = int(rng.integers(m * m))
    in_maze[first] = True
    carve(2 * (first // m) + 1, 2 * (first % m) + 1)
    for start in rng.permutation(m * m).tolist():
        if in_maze[start]:
            continue
        left_by: dict[int, int] = {}
        cell = start
        while not in_maze[cell]:
            r, c = divmod(cell, m)
            options = [k for k, (dr, dc) in enumerate(steps) if 0 <= r + dr < m and 0 <= c + dc < m]
            k = options[int(rng.integers(len(options)))]
            left_by[cell] = k
            cell = (r + steps[k][0]) * m + c + steps[k][1]
        cell = start
        while not in_maze[cell]:
            in_maze[cell] = True
            r, c = divmod(cell, m)
            dr, dc = steps[left_by[cell]]
            carve(2 * r + 1, 2 * c + 1)
            carve(2 * r + 1 + dr, 2 * c + 1 + dc)  # the wall between this cell and the next
            cell = (r + dr) * m + c + dc
    return "".join(grid)


def corner_pair(rng: np.random.Generator, size: int) -> tuple[int, int]:
    """Agent and target cells in opposite corners (VisGym's four placements)."""
    lo, hi = 1, size - 2
    pairs = (((lo, lo), (hi, hi)), ((hi, hi), (lo, lo)), ((hi, lo), (lo, hi)), ((lo, hi), (hi, lo)))
    (ar, ac), (tr, tc) = pairs[int(rng.integers(4))]
    return ar * size + ac, tr * size + tc


def neighbour(grid: str, size: int, cell: int, direction: str) -> int:
    """The cell reached by moving ``direction`` from ``cell``; ``cell`` itself if a wall or the edge blocks."""
    r, c = divmod(cell, size)
    dr, dc = MOVES[direction]
    nr, nc = r + dr, c + dc
    if not (0 <= nr < size and 0 <= nc < size) or grid[nr * size + nc] == WALL:
        return cell
    return nr * size + nc


def shortest_path(grid: str, size: int, start: int, goal: int) -> list[str] | None:
    """Move names of a shortest path from ``start`` to ``goal`` (breadth-first search), or None."""
    return search.shortest_path(
        start, goal, lambda cell: ((direction, neighbour(grid, size, cell, direction)) for direction in MOVES)
    )


def parse_level(level: str | list[str] | tuple[str, ...]) -> tuple[str, int, int, int]:
    """Read a maze drawn with ``#`` walls, ``.`` (or space) paths, ``A`` agent, ``T`` target.

    Returns ``(grid, size, agent, target)``. The grid must be square.
    """
    if isinstance(level, str):
        lines = level.splitlines()
    elif isinstance(level, (list, tuple)) and all(isinstance(line, str) for line in level):
        lines = list(level)
    else:
        raise ValueError(f"a maze level must be a string or a list of row strings, got {type(level).__name__}")
    rows = [line for line in lines if line.strip()]
    size = len(rows)
    if size == 0 or any(len(row) != size for row in rows):
        raise ValueError(f"a maze level must be a non-empty square grid; got row lengths {[len(r) for r in rows]}")
    flat = "".join(rows).replace(" ", PATH)
    unknown = sorted(set(flat) - {WALL, PATH, AGENT, TARGET})
    if unknown:
        raise ValueError(f"unknown maze symbols {unknown}; use # wall, . path, A agent, T target")
    if flat.count(AGENT) != 1 or flat.count(TARGET) != 1:
        raise ValueError("a maze level needs exactly one agent (A) and one target (T)")
    agent, target = flat.index(AGENT), flat.index(TARGET)
    return flat.replace(AGENT, PATH).replace(TARGET, PATH), size, agent, target


class Maze2DEnv(TurnEnv):
    """Walk a 2-D maze to the target (VisGym's maze_2d).

    Args:
        mode: ``"text"`` or ``"image"``.
        difficulty: ``"easy"`` (9x9) or ``"hard"`` (11x11); ignored when ``size`` is given.
        size: side of the maze including its border wall: odd, 5 to 63.
        reward_on: ``"reach"`` (1 on stepping onto the target) or ``"stop"`` (1 only after
            ``stop`` on the target, as VisGym).
        generator: ``"backtracker"`` (recursive backtracker) or ``"wilson"`` (VisGym's: uniform over
            perfect mazes).
        max_steps: steps before truncation.
        cell_px: pixels per cell in image mode (VisGym: 25).
        render_mode: ``None``, ``"ansi"`` or ``"rgb_array"``.
    """

    reset_options = ("level",)

    modes = ("text", "image")
    setting_choices = {"difficulty": tuple(DIFFICULTY_SIZES), "reward_on": REWARD_RULES, "generator": GENERATORS}
    state_reward_profile = StateRewardProfile({"target": 1.0}, {"goal": "target", "exit": "target"})
    corpus_variants = ({}, {"difficulty": "hard"})
    description = "Maze2D: walk a perfect maze to the target; VisGym maze_2d sizes, colours and tuple actions."

    def __init__(
        self,
        mode: str = "text",
        difficulty: str = "easy",
        size: int | None = None,
        reward_on: str = "reach",
        max_steps: int = 100,
        cell_px: int = 25,
        render_mode: str | None = None,
        generator: str = "backtracker",
    ) -> None:
        if difficulty not in DIFFICULTY_SIZES:
            raise ValueError(f"difficulty must be one of {list(DIFFICULTY_SIZES)}, got {difficulty!r}")
        if size is None:
            size = DIFFICULTY_SIZES[difficulty]
        is_int = isinstance(size, (int, np.integer)) and not isinstance(size, bool)
        if not is_int or not 5 <= size <= MAX_SIZE or size % 2 == 0:
            raise ValueError(f"size must be an odd int from 5 to {MAX_SIZE} (border walls included), got {size!r}")
        if reward_on not in REWARD_RULES:
            raise ValueError(f"reward_on must be one of {list(REWARD_RULES)}, got {reward_on!r}")
        if generator not in GENERATORS:
            raise ValueError(f"generator must be one of {list(GENERATORS)}, got {generator!r}")
        if not 4 <= cell_px <= 256:
            raise ValueError(f"cell_px must be from 4 to 256, got {cell_px}")
        size = int(size)
        super().__init__(mode=mode, max_steps=max_steps, image_shape=(size * cell_px,) * 2, render_mode=render_mode)
        self.difficulty = difficulty
        self.size = size
        self.reward_on = reward_on
        self.generator = generator
        self.cell_px = int(cell_px)
        self._grid = ""
        self._agent = self._target = 0
        self._stopped = False
        self._board_text = ""
        self._board_image: np.ndarray | None = None

    # ----------------------------------------------------------------- episode
    def _reset(self, rng: np.random.Generator, options: dict[str, Any]) -> None:
        if "level" in options:
            grid, size, agent, target = parse_level(options["level"])
            if size != self.size:
                raise ValueError(f"level is {size}x{size} but this env has size={self.size}; make one with size={size}")
            path = shortest_path(grid, size, agent, target)
            if path is None:
                raise ValueError("level: walls cut every path from the agent (A) to the target (T), so the episode "
                                 "cannot be won; give a maze with a path between them")
            needed = len(path) + (self.reward_on == "stop")
            if needed > self.max_steps:
                raise ValueError(f"level: its shortest way to the target takes {needed} actions, more than "
                                 f"max_steps={self.max_steps}, so the episode cannot be won; make the env with "
                                 f"max_steps={needed} or more")
        else:
            grid = wilson_maze(rng, self.size) if self.generator == "wilson" else random_maze(rng, self.size)
            agent, target = corner_pair(rng, self.size)
        self._grid, self._agent, self._target = grid, agent, target
        self._stopped = False
        n = self.size
        board = grid[:target] + TARGET + grid[target + 1 :]
        self._board_text = "\n".join(board[r * n : (r + 1) * n] for r in range(n))
        self._board_image = None

    def canonical_action(self, action: Any) -> str | None:
        return parse_action(action)

    def _step(self, action: str) -> StepOutcome:
        if action == "stop":
            self._stopped = True
            on_target = self._agent == self._target
            return StepOutcome(1.0 if on_target else 0.0, terminated=True, success=on_target)
        nxt = neighbour(self._grid, self.size, self._agent, action)
        if nxt == self._agent:
            return StepOutcome(0.0, effective=False, info={"hit_wall": True})
        self._agent = nxt
        if self.reward_on == "reach" and nxt == self._target:
            return StepOutcome(1.0, terminated=True, success=True)
        return StepOutcome(0.0)

    def success(self) -> bool:
        return self._agent == self._target and (self.reward_on == "reach" or self._stopped)

    def solve(self) -> list[str] | None:
        """Shortest path to the target, then ``stop`` when the reward needs one."""
        if self._stopped or (self.reward_on == "reach" and self._agent == self._target):
            return []
        path = shortest_path(self._grid, self.size, self._agent, self._target)
        if path is None:
            return None
        return path + ["stop"] if self.reward_on == "stop" else path

    def action_budget(self) -> int:
        """The open cells of the maze (a shortest path visits each at most once), plus ``stop`` when the
        reward needs one; capped by ``max_steps``. 9x9 (easy): 31, where the longest path takes 28.

        The maze played counts its own cells: a given one may have loops, open cells between the rooms or no
        border, and more of them than a generated maze of its size (a 5x5 snake without a border takes 16
        moves). Before the first reset, a generated maze's count."""
        # A generated maze holds k*k rooms and the k*k-1 passages between them (a perfect maze).
        open_cells = self._grid.count(PATH) if self._grid else ((self.size - 1) // 2) ** 2 * 2 - 1
        return min(self.max_steps, open_cells + (self.reward_on == "stop"))

    # ----------------------------------------------------------------- views
    @property
    def agent(self) -> tuple[int, int]:
        """The agent's cell as ``(row, col)``."""
        return divmod(self._agent, self.size)

    @property
    def target(self) -> tuple[int, int]:
        return divmod(self._target, self.size)

    def text(self) -> str:
        if self.is_image_mode:  # the image is the observation; the text must not give the maze away
            return IMAGE_CAPTION
        return self.ansi()

    def ansi(self) -> str:
        """The maze as text, in any mode."""
        r, c = self.agent
        i = r * (self.size + 1) + c  # +1 for each newline before this row
        symbol = AGENT_ON_TARGET if self._agent == self._target else AGENT
        return self._board_text[:i] + symbol + self._board_text[i + 1 :]

    def image(self) -> np.ndarray:
        px = self.cell_px
        if self._board_image is None:
            board = self._board_text.split("\n")
            self._board_image = draw_grid(board, TILES, px)
        frame = self._board_image.copy()
        r, c = self.agent
        symbol = AGENT_ON_TARGET if self._agent == self._target else AGENT
        frame[r * px : (r + 1) * px, c * px : (c + 1) * px] = draw_grid([[symbol]], TILES, px)
        return frame

    def instructions(self) -> str:
        n = self.size
        if self.is_image_mode:
            legend = (
                "In the image, walls are grey, paths are white, you are the blue circle "
                "and the target is the red square."
            )
        else:
            legend = (
                "The maze is drawn one row per line: # is a wall, . is a path, A is you, T is the target, "
                "* means you stand on the target."
            )
        if self.reward_on == "stop":
            goal = (
                "Walk to the target, then say stop. Stopping on the target gives reward 1; stopping anywhere "
                "else ends the game with 0."
            )
        else:
            goal = "Reaching the target gives reward 1 and ends the game; stop ends the game with 0."
        return (
            f"Maze2D. You are in a {n}x{n} maze. {legend} Actions: up, down, left, right (one cell; walking "
            "into a wall does nothing) and stop. The tuple forms ('move', 0) = right, ('move', 1) = up, "
            f"('move', 2) = left, ('move', 3) = down and ('stop', 'stop') = stop are also accepted. {goal}"
        )

    def action_names(self) -> list[str]:
        return list(ACTIONS)

    def state_facts(self) -> StateFacts:
        return facts_from_positions(self.agent, [("target", self.target)])

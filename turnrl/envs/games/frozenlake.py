"""FrozenLake: walk across a frozen lake to the goal without falling into a hole.

Text symbols (as RAGEN): ``P`` player, ``_`` frozen, ``O`` hole, ``G`` goal,
``X`` player in a hole, ``√`` player on the goal; one row per line, no
separators. ``symbols="grid_coords"`` writes RAGEN's ``CoordFrozenLake`` text
(its ``observation_format: grid_coord``): the coordinates of the start, the
goal, the player and the holes, then that grid. ``symbols="vagen"`` writes
VAGEN's grid: the same symbols, each cell as a space, the symbol, a space and
a tab (``" P \\t _ \\t"``). Actions ``Left``, ``Down``,
``Right``, ``Up`` (gymnasium's order). Reward 1 on reaching the goal, 0
otherwise; the episode terminates in a hole or at the goal. Walking into the
edge of the lake is a valid action that does not move the player.

Maps are drawn from the seed: every cell is frozen with probability
``p_frozen``, the start and the goal are two distinct random cells, and a map
is kept only if the goal is reachable (breadth-first search), so every episode
is solvable (RAGEN's ``p`` is ``p_frozen``; its default 0.9).
``reset(options={"level": "..."})`` plays a given map instead, written with
the symbols above (or gymnasium's ``S``/``F``/``H``/``G``); a given map must
be solvable too (ValueError otherwise).

Slippery ice (``is_slippery=True``) moves the player in the intended direction
with probability ``success_rate`` and to each perpendicular direction with
probability ``(1 - success_rate) / 2``; ``success_rate=None`` is gymnasium's
1/3 each way (RAGEN's ``success_rate`` means the same; its ``success_rate: 1``
on slippery ice always moves as intended, as ``is_slippery=False`` does). The
slip is drawn from the env's seeded generator, so a seed fixes the whole
episode given the actions.

The state is kept flat for speed: the map is one string of ``rows * cols``
cells, the player one index, and moves come from a precomputed table.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import numpy as np

from turnrl.envs import search
from turnrl.envs.contract import (
    IMAGE_CAPTION,
    StateFacts,
    StateRewardProfile,
    StepOutcome,
    TurnEnv,
    check_text_fits,
    facts_from_positions,
)
from turnrl.envs.draw import Tile, draw_grid

ACTIONS = ("Left", "Down", "Right", "Up")
_ACTION_INDEX = {name: i for i, name in enumerate(ACTIONS)}
_DELTAS = ((0, -1), (1, 0), (0, 1), (-1, 0))

FROZEN, HOLE, GOAL = "_", "O", "G"
_PLAYER_ON = {FROZEN: "P", HOLE: "X", GOAL: "√"}
"""Symbol of the player standing on each kind of cell."""
_LEVEL_SYMBOLS = {"P": FROZEN, "S": FROZEN, "_": FROZEN, "F": FROZEN, "O": HOLE, "H": HOLE, "G": GOAL}
"""What each symbol of a given level stands for (RAGEN's or gymnasium's)."""

SYMBOL_STYLES = ("ragen", "coords", "grid_coords", "vagen")

VAGEN_CELLS = {"P": " P \t", "_": " _ \t", "O": " O \t", "G": " G \t", "X": " X \t", "√": " √ \t"}
"""VAGEN's text of each cell, by RAGEN's symbol for it (vagen/env/frozenlake/env.py ``GRID_LOOKUP``): the symbol
between two spaces, then a tab. VAGEN's ``_get_text_representation`` picks the symbols as the grid here does (the
start is frozen ice; the player's cell is ``X`` in a hole, ``√`` on the goal, else ``P``), so its grid is this one
with each symbol written so. Only written: a given map is read in RAGEN's or gymnasium's symbols."""
_TO_VAGEN = str.maketrans(VAGEN_CELLS)

MAX_SIZE = 64
_MAX_MAP_TRIES = 1000

TILES = {
    "_": Tile((200, 230, 250)),
    "O": Tile((25, 45, 100)),
    "G": Tile((80, 190, 90), "diamond", (250, 215, 0)),
    "P": Tile((200, 230, 250), "circle", (220, 40, 40), 0.6),
    "X": Tile((25, 45, 100), "cross", (220, 40, 40)),
    "√": Tile((80, 190, 90), "circle", (220, 40, 40), 0.6),
}
"""Image mode: ice is light blue, holes dark blue, the goal green with a gold
diamond, the player a red circle (a red cross once in a hole)."""
GRID_LINE = (120, 140, 160)
GRID_SYMBOLS = ("Symbols: P is you, _ is frozen ice (safe), O is a hole, G is the goal, X means you fell into a "
                "hole, √ means you reached the goal.")
"""The grid's legend in the instructions."""


@lru_cache(maxsize=64)
def move_table(rows: int, cols: int) -> tuple[tuple[int, int, int, int], ...]:
    """For each flat cell, the cell each action leads to (itself at the edge)."""
    table = []
    for index in range(rows * cols):
        r, c = divmod(index, cols)
        targets = []
        for dr, dc in _DELTAS:
            nr, nc = r + dr, c + dc
            targets.append(nr * cols + nc if 0 <= nr < rows and 0 <= nc < cols else index)
        table.append((targets[0], targets[1], targets[2], targets[3]))
    return tuple(table)


def shortest_path(cells: str, moves: tuple[tuple[int, ...], ...], start: int, goal: int) -> list[int] | None:
    """Action indices of a shortest hole-free walk from ``start`` to ``goal``, or None.

    Neighbours are tried in action order, so the result is deterministic.
    """
    return search.shortest_path(
        start, goal, lambda cell: ((a, nxt) for a, nxt in enumerate(moves[cell]) if cells[nxt] != HOLE)
    )


def random_map(rng: np.random.Generator, size: int, p_frozen: float) -> tuple[str, int, int]:
    """A solvable ``size x size`` map: ``(cells, start, goal)``.

    Rejection sampling: draw holes, start and goal; keep the map if the goal is
    reachable. With a very low ``p_frozen`` that could take long, so after
    ``_MAX_MAP_TRIES`` draws a random monotone path is carved from start to
    goal (a rare fallback that keeps generation bounded).
    """
    n = size * size
    moves = move_table(size, size)
    for _ in range(_MAX_MAP_TRIES):
        frozen = rng.random(n) < p_frozen
        start, goal = (int(k) for k in rng.integers([n, n - 1]))
        goal += goal >= start  # two distinct cells from one draw
        frozen[start] = frozen[goal] = True
        cells = "".join([FROZEN if f else HOLE for f in frozen.tolist()])
        cells = cells[:goal] + GOAL + cells[goal + 1 :]
        if shortest_path(cells, moves, start, goal) is not None:
            return cells, start, goal
    return _carve_path(rng, cells, size, start, goal), start, goal


def _carve_path(rng: np.random.Generator, cells: str, size: int, start: int, goal: int) -> str:
    """Freeze a random monotone staircase of cells from ``start`` to ``goal``."""
    grid = list(cells)
    (r, c), (gr, gc) = divmod(start, size), divmod(goal, size)
    steps = [(1 if gr > r else -1, 0)] * abs(gr - r) + [(0, 1 if gc > c else -1)] * abs(gc - c)
    for k in rng.permutation(len(steps)).tolist():
        r, c = r + steps[k][0], c + steps[k][1]
        if grid[r * size + c] == HOLE:
            grid[r * size + c] = FROZEN
    return "".join(grid)


def parse_level(level: str | list[str] | tuple[str, ...]) -> tuple[str, int, int, int, int]:
    """Read a map written with RAGEN's or gymnasium's symbols.

    Returns ``(cells, rows, cols, start, goal)``. Spaces are ignored; blank
    lines are skipped. Raises ValueError naming the problem.
    """
    if isinstance(level, str):
        lines = level.splitlines()
    elif isinstance(level, (list, tuple)) and all(isinstance(line, str) for line in level):
        lines = list(level)
    else:
        raise ValueError(f"a FrozenLake level must be a string or a list of row strings, got {type(level).__name__}")
    rows = [line.replace(" ", "") for line in lines if line.strip()]
    if not rows:
        raise ValueError("a FrozenLake level must not be empty")
    cols = len(rows[0])
    if any(len(row) != cols for row in rows):
        raise ValueError(f"every row of a FrozenLake level must have the same length; got {[len(r) for r in rows]}")
    flat = "".join(rows)
    unknown = sorted(set(flat) - set(_LEVEL_SYMBOLS))
    if unknown:
        raise ValueError(
            f"unknown FrozenLake symbols {unknown}; use P (or S) start, _ (or F) frozen, O (or H) hole, G goal; "
            "the player must start on a frozen cell"
        )
    starts = [i for i, ch in enumerate(flat) if ch in "PS"]
    goals = [i for i, ch in enumerate(flat) if ch == GOAL]
    if len(starts) != 1 or len(goals) != 1:
        raise ValueError(
            f"a FrozenLake level needs exactly one start (P) and one goal (G); got {len(starts)} and {len(goals)}"
        )
    cells = "".join(_LEVEL_SYMBOLS[ch] for ch in flat)
    return cells, len(rows), cols, starts[0], goals[0]


def _is_number(value: Any) -> bool:
    """Whether ``value`` is a real number (a bool or a string is not)."""
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))


def _check_text_fits(size: int, symbols: str) -> None:
    """Raise ValueError if the longest text observation could exceed the observation space: VAGEN's grid, four
    characters a cell and a newline a row; the coordinate listing of a lake that is all holes but the start and
    the goal (a low ``p_frozen`` or a given map), with the grid after it for ``grid_coords``."""
    if symbols == "ragen":
        return  # the grid: size * (size + 1) characters, at most 4,160
    holes = (size * size - 2) * (6 + 2 * len(str(size - 1)))  # every hole as "(r, c), "
    # The lines around the listing: 64 characters for coords; 160 for grid_coords's seven labelled lines.
    longest = {"vagen": size * (4 * size + 1), "coords": 64 + holes,
               "grid_coords": 160 + holes + size * (size + 1)}[symbols]
    check_text_fits(longest, f"a {size}x{size} lake with symbols={symbols!r}", "use symbols='ragen' or a smaller size")


class FrozenLakeEnv(TurnEnv):
    """Cross a frozen lake to the goal without falling into a hole.

    Args:
        mode: ``"text"`` or ``"image"``.
        size: side of the square lake (2 to 64).
        p_frozen: probability that a cell is frozen, in ``(0, 1]``.
        is_slippery: whether the ice makes the player slip sideways.
        success_rate: probability of moving as intended on slippery ice, in
            ``[0, 1]``; None means gymnasium's 1/3. Only allowed with ``is_slippery``.
        max_steps: steps before truncation.
        symbols: text observation style: ``"ragen"`` (the grid, RAGEN's symbols),
            ``"coords"`` (positions listed as ``(row, column)``, as Sokoban's coords mode; sizes up to 28,
            whose every listing fits an observation) or ``"grid_coords"`` (RAGEN's ``CoordFrozenLake``: the
            zero-indexed coordinates of the start, goal, player and holes, then the grid; sizes up to 27) or
            ``"vagen"`` (VAGEN's grid, character for character: RAGEN's symbols, each cell written as a space,
            the symbol, a space and a tab, rows joined by newlines; the grid that ``agent.prompt_layout=vagen``
            writes VAGEN's prompts around; sizes up to 45).
        cell_px: pixels per cell in image mode.
        render_mode: ``None``, ``"ansi"`` or ``"rgb_array"``.
    """

    reset_options = ("level",)

    modes = ("text", "image")
    setting_choices = {"symbols": SYMBOL_STYLES}
    # VAGEN's weights: goal 0.7, hole 0.3.
    state_reward_profile = StateRewardProfile(
        {"goal": 0.7, "hole": 0.3},
        {"target": "goal", "gift": "goal", "present": "goal", "destination": "goal", "g": "goal",
         "pit": "hole", "water": "hole", "trap": "hole", "o": "hole"},
    )
    corpus_variants = ({}, {"size": 6}, {"size": 8})
    description = "FrozenLake: reach the goal across the ice without falling into a hole (optionally slippery)."

    def __init__(
        self,
        mode: str = "text",
        size: int = 4,
        p_frozen: float = 0.8,
        is_slippery: bool = False,
        success_rate: float | None = None,
        max_steps: int = 100,
        symbols: str = "ragen",
        cell_px: int = 25,
        render_mode: str | None = None,
    ) -> None:
        if symbols not in SYMBOL_STYLES:
            raise ValueError(f"symbols must be one of {list(SYMBOL_STYLES)}, got {symbols!r}")
        if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or not 2 <= size <= MAX_SIZE:
            raise ValueError(f"size must be an int from 2 to {MAX_SIZE}, got {size!r}")
        if not _is_number(p_frozen) or not 0.0 < p_frozen <= 1.0:
            raise ValueError(f"p_frozen must be a number in (0, 1], got {p_frozen!r}")
        if not isinstance(is_slippery, (bool, np.bool_)):  # bool("false") is True
            raise ValueError(f"is_slippery must be True or False, got {is_slippery!r}")
        if success_rate is not None:
            if not _is_number(success_rate):
                raise ValueError(f"success_rate must be a number in [0, 1] or None, got {success_rate!r}")
            if not is_slippery:
                raise ValueError(
                    "success_rate only applies to slippery ice; pass is_slippery=True or success_rate=None"
                )
            if not 0.0 <= success_rate <= 1.0:
                raise ValueError(f"success_rate must be in [0, 1] or None, got {success_rate}")
        if not 4 <= cell_px <= 256:
            raise ValueError(f"cell_px must be from 4 to 256, got {cell_px}")
        _check_text_fits(int(size), symbols)
        super().__init__(mode=mode, max_steps=max_steps, image_shape=(size * cell_px,) * 2, render_mode=render_mode)
        self.size = size = int(size)
        self.p_frozen = float(p_frozen)
        self.is_slippery = bool(is_slippery)
        self.success_rate = success_rate
        self.cell_px = int(cell_px)
        self.symbols = symbols
        self._p_intended = 1.0 / 3.0 if success_rate is None else float(success_rate)
        self._p_left_turn = self._p_intended + (1.0 - self._p_intended) / 2.0
        self._cells = ""
        self._player = self._start = self._goal = 0  # the start is kept for grid_coords's Start line
        self._moves = move_table(size, size)
        self._board_text = ""
        self._board_image: np.ndarray | None = None

    # ----------------------------------------------------------------- episode
    def _reset(self, rng: np.random.Generator, options: dict[str, Any]) -> None:
        if "level" in options:
            cells, rows, cols, start, goal = parse_level(options["level"])
            if (rows, cols) != (self.size, self.size):
                raise ValueError(f"level is {rows}x{cols} but this env has size={self.size}; make one with size={rows}")
            if shortest_path(cells, self._moves, start, goal) is None:
                # Such a map scores 0 whatever the agent does: refused, as generation never draws one.
                raise ValueError("level: holes cut every path from the start (P or S) to the goal (G), so the "
                                 "episode cannot be won; give a map with a hole-free path between them")
        else:
            cells, start, goal = random_map(rng, self.size, self.p_frozen)
        self._cells, self._player, self._start, self._goal = cells, start, start, goal
        n = self.size
        self._board_text = "\n".join(cells[r * n : (r + 1) * n] for r in range(n))
        self._board_image = None

    def _step(self, action: str) -> StepOutcome:
        direction = _ACTION_INDEX[action]
        if self.is_slippery:
            u = self.np_random.random()
            if u >= self._p_intended:
                # Slip to one of the two perpendicular directions.
                direction = (direction - 1) % 4 if u < self._p_left_turn else (direction + 1) % 4
        before = self._player
        self._player = cell = self._moves[before][direction]
        info = {"moved": ACTIONS[direction]}
        kind = self._cells[cell]
        if kind == GOAL:
            return StepOutcome(1.0, terminated=True, success=True, effective=cell != before, info=info)
        return StepOutcome(0.0, terminated=kind == HOLE, effective=cell != before, info=info)

    def success(self) -> bool:
        return self._player == self._goal

    def solve(self) -> list[str] | None:
        """Shortest hole-free action sequence from the current state, or None.

        Optimal only on non-slippery ice; on slippery ice it is the plan an
        agent would follow if no slip happened (re-plan after each step).
        """
        if self._cells[self._player] == HOLE:
            return None
        path = shortest_path(self._cells, self._moves, self._player, self._goal)
        return None if path is None else [ACTIONS[a] for a in path]

    def action_budget(self) -> int:
        """A shortest path visits a cell at most once: ``size**2 - 1`` steps on firm ice; slipping can take
        any number, so slippery ice keeps ``max_steps``."""
        return self.max_steps if self.is_slippery else min(self.max_steps, self.size**2 - 1)

    # ----------------------------------------------------------------- views
    @property
    def player(self) -> tuple[int, int]:
        """The player's cell as ``(row, col)``."""
        return divmod(self._player, self.size)

    def text(self) -> str:
        if self.is_image_mode:  # the image is the observation; the text must not give the board away
            return IMAGE_CAPTION
        return self.ansi()

    def ansi(self) -> str:
        """The board as text in the ``symbols`` style, in any mode."""
        if self.symbols == "coords":
            return self._coords_text()
        if self.symbols == "grid_coords":
            return self._grid_coords_text()
        if self.symbols == "vagen":
            return self._grid_text().translate(_TO_VAGEN)
        return self._grid_text()

    def _grid_text(self) -> str:
        """The lake in RAGEN's symbols, one row per line (the start is plain ice)."""
        r, c = divmod(self._player, self.size)
        i = r * (self.size + 1) + c  # +1 for each newline before this row
        board = self._board_text
        return board[:i] + _PLAYER_ON[self._cells[self._player]] + board[i + 1 :]

    def _coords_text(self) -> str:
        """``Player: (r, c). Goal: (r, c). Holes: (r, c), ...`` (rows from the top, columns from the left)."""
        where = self._position
        holes = ", ".join(where(i) for i, kind in enumerate(self._cells) if kind == HOLE) or "none"
        state = " (in a hole)" if self._cells[self._player] == HOLE else " (on the goal)" if self.success() else ""
        return f"Player: {where(self._player)}{state}. Goal: {where(self._goal)}. Holes: {holes}."

    def _position(self, cell: int) -> str:
        """A cell's ``(row, column)``, counted from the top left."""
        return f"({cell // self.size}, {cell % self.size})"

    def _grid_coords_text(self) -> str:
        """RAGEN's ``grid_coord`` rendering, line for line (frozen_lake/env.py ``_render_text`` and utils.py
        ``collect_entity_coordinates`` / ``format_coordinate_render``): the start (listed for the whole episode,
        as RAGEN's map keeps its ``S``), the goal, the player (on the goal or in a hole said so), the holes row
        by row, then the grid; the header lines end with a space as RAGEN's do."""
        n, where = self.size, self._position
        player = {HOLE: "Player in hole", GOAL: "Player on goal"}.get(self._cells[self._player], "Player")
        holes = [i for i, kind in enumerate(self._cells) if kind == HOLE]
        kinds = (("Start", [self._start]), ("Goal", [self._goal]), (player, [self._player]), ("Holes", holes))
        lines = ["Coordinates: ", f"Board size: {n} rows x {n} cols (zero-indexed)."]
        lines += [f"{label}: {', '.join(map(where, cells))}" for label, cells in kinds if cells]
        return "\n".join(lines + ["Grid Map: ", self._grid_text()])

    def image(self) -> np.ndarray:
        px = self.cell_px
        if self._board_image is None:
            n = self.size
            self._board_image = draw_grid([self._cells[r * n : (r + 1) * n] for r in range(n)], TILES, px)
        frame = self._board_image.copy()
        r, c = divmod(self._player, self.size)
        player = draw_grid([[_PLAYER_ON[self._cells[self._player]]]], TILES, px)
        frame[r * px : (r + 1) * px, c * px : (c + 1) * px] = player
        # Thin cell borders, so that neighbouring holes stay countable for a vision model.
        frame[::px, :] = GRID_LINE
        frame[:, ::px] = GRID_LINE
        return frame

    def instructions(self) -> str:
        if self.is_image_mode:
            legend = (
                "The image shows the lake from above: light blue tiles are frozen and safe, dark blue tiles are "
                "holes, the green tile with a gold diamond is the goal, and you are the red circle "
                "(a red cross means you fell into a hole)."
            )
        elif self.symbols == "coords":
            legend = (
                f"The lake is a {self.size}x{self.size} grid; each observation lists your position, the goal "
                "and the holes as (row, column), row 0 at the top and column 0 at the left."
            )
        elif self.symbols == "grid_coords":
            last = self.size - 1
            legend = (
                "Each observation gives the zero-indexed (row, column) coordinates of the start, the goal, your "
                f"position and the holes, from the top-left corner (0, 0) to the bottom-right corner ({last}, "
                f"{last}), then the lake as a grid with one row per line. {GRID_SYMBOLS}"
            )
        elif self.symbols == "vagen":
            legend = ("The lake is a grid with one row per line, each cell written as a space, its symbol, a space "
                      f"and a tab. {GRID_SYMBOLS}")
        else:
            legend = f"The lake is a grid with one row per line. {GRID_SYMBOLS}"
        slip = ""
        if self.is_slippery:
            p = self._p_intended
            slip = (
                f" The ice is slippery: you move in the chosen direction with probability {p:.2g}, and otherwise "
                f"slide to one of the two perpendicular directions (probability {(1 - p) / 2:.2g} each)."
            )
        return (
            "FrozenLake. Walk across the frozen lake to the goal without falling into a hole. "
            f"{legend} Actions: Left, Down, Right, Up (one cell each; walking into the edge does nothing).{slip} "
            "Reward: 1 when you reach the goal, 0 otherwise; falling into a hole ends the game."
        )

    def action_names(self) -> list[str]:
        return list(ACTIONS)

    def state_facts(self) -> StateFacts:
        n = self.size
        objects = [("goal", divmod(self._goal, n))]
        objects.extend(("hole", divmod(i, n)) for i, kind in enumerate(self._cells) if kind == HOLE)
        return facts_from_positions(self.player, objects)

"""Sudoku: fill the grid so that every row, column and box holds each digit once (RAGEN's Sudoku).

Sizes and difficulty as RAGEN: a 9x9 grid (4x4 also works) with 40% of the
cells empty (``difficulty="easy"``, 32 of 81), 50% (``"medium"``) or 60%
(``"hard"``). Unlike RAGEN's generator, which blanks cells at random, every
puzzle here has exactly one solution: a full grid is drawn from the seed by a
randomised solver, then cells are blanked in a seeded order, each only if the
puzzle keeps a unique solution (checked by the solver, which counts up to two).

Actions (RAGEN's spellings, case-insensitive): ``place 5 at row 2 col 3``
(the canonical form), ``place 5 at (2,3)``, ``place 5 at 2,3``, ``5 at 2,3``,
``(2,3,5)`` and ``2,3,5`` (row, column, digit); rows and columns count from 1.
``erase row 2 col 3`` empties a cell the agent filled (RAGEN has no erase; an
overwrite works there too). Text that reads as none of these, or names a row,
column or digit out of range, is an invalid action. A readable action that
breaks the rules (a digit already in the row, column or box, a given cell, a
cell that already holds that digit, erasing an empty cell) is valid but
changes nothing: it pays ``invalid_reward`` (RAGEN's -0.1) and the next
observation says what was wrong.

Rewards (RAGEN's values): +1 for a digit that matches the solution, +0.5 for a
legal digit that does not (it leads to a dead end: the solution is unique),
+10 when the grid is solved, -0.1 for an invalid or illegal action. RAGEN pays
a placement every time, so overwriting a cell back and forth earns reward
forever; here a placement or an erase pays the change in the grid's worth (1
for each cell that holds its solution digit, 0.5 for each other filled cell),
which is RAGEN's reward for filling an empty cell and sums to zero over any
cycle.

The text observation is RAGEN's grid (``[5]`` a given, `` 5 `` a placed
digit, `` . `` empty) with row and column numbers, the outcome of the last
action and, once at most ten cells are empty, their candidates (RAGEN's
``with_feedback`` rendering). The image mode draws the grid: givens in black,
placed digits in blue.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, NamedTuple

import numpy as np
from PIL import Image, ImageDraw

from turnrl.envs.contract import IMAGE_CAPTION, StateFacts, StepOutcome, TurnEnv
from turnrl.envs.draw import font

SIZES = (4, 9)
EMPTY_FRACTION = {"easy": 0.4, "medium": 0.5, "hard": 0.6}
"""Share of the cells left empty, by difficulty (RAGEN's)."""
MAX_GENERATION_TRIES = 50
MAX_ACTION_CHARS = 256
CANDIDATES_SHOWN_BELOW = 10
"""Candidates of the empty cells are listed once at most this many are left (RAGEN's ``show_valid_numbers``)."""

Grid = tuple[int, ...]
"""A grid as ``size * size`` digits, row-major, 0 for an empty cell."""


@dataclass(frozen=True)
class Geometry:
    """The units (rows, columns, boxes) and peers of each cell of a ``size x size`` grid."""

    size: int
    box: int
    units: tuple[tuple[int, ...], ...]
    peers: tuple[tuple[int, ...], ...]
    """For each cell, the other cells of its row, column and box."""


@lru_cache(maxsize=4)
def geometry(size: int) -> Geometry:
    box = int(round(size**0.5))
    rows = [tuple(r * size + c for c in range(size)) for r in range(size)]
    cols = [tuple(r * size + c for r in range(size)) for c in range(size)]
    boxes = [
        tuple((br + r) * size + bc + c for r in range(box) for c in range(box))
        for br in range(0, size, box)
        for bc in range(0, size, box)
    ]
    units = tuple(rows + cols + boxes)
    peers = tuple(
        tuple(sorted({other for unit in units if cell in unit for other in unit} - {cell}))
        for cell in range(size * size)
    )
    return Geometry(size, box, units, peers)


# --------------------------------------------------------------------------- the solver
def candidates(grid: Grid, size: int, cell: int) -> list[int]:
    """Digits that ``cell`` may hold without repeating one of its row, column or box (empty for a filled cell)."""
    if grid[cell]:
        return []
    used = {grid[p] for p in geometry(size).peers[cell]}
    return [d for d in range(1, size + 1) if d not in used]


def has_conflict(grid: Grid, size: int) -> bool:
    """Whether a digit repeats in a row, column or box."""
    for unit in geometry(size).units:
        digits = [grid[c] for c in unit if grid[c]]
        if len(digits) != len(set(digits)):
            return True
    return False


def _assign(values: list[int], masks: list[int], peers: tuple[tuple[int, ...], ...], cell: int, bit: int) -> None:
    values[cell] = bit.bit_length()
    masks[cell] = 0
    for peer in peers[cell]:
        masks[peer] &= ~bit


def _propagate(values: list[int], masks: list[int], geo: Geometry) -> bool:
    """Fill naked singles (one candidate left) and hidden singles (one place left in a unit) until none is
    left; False on a contradiction (an empty cell without candidates, a digit without a place)."""
    full = (1 << geo.size) - 1
    changed = True
    while changed:
        changed = False
        for cell, mask in enumerate(masks):
            if values[cell]:
                continue
            if mask == 0:
                return False
            if mask & (mask - 1) == 0:
                _assign(values, masks, geo.peers, cell, mask)
                changed = True
        for unit in geo.units:
            placed = 0
            once = twice = 0
            for cell in unit:
                if values[cell]:
                    placed |= 1 << (values[cell] - 1)
                else:
                    twice |= once & masks[cell]
                    once |= masks[cell]
            if (once | placed) != full:
                return False  # a digit has no place left in this unit
            singles = once & ~twice & ~placed
            for bit_index in range(geo.size):
                bit = 1 << bit_index
                if singles & bit:
                    # None when an assignment above took this digit's only cell for another digit.
                    place = next((c for c in unit if masks[c] & bit), None)
                    if place is None:
                        return False
                    _assign(values, masks, geo.peers, place, bit)
                    changed = True
    return True


def _search(
    values: list[int], masks: list[int], geo: Geometry, limit: int, found: list[Grid],
    rng: np.random.Generator | None,
) -> None:
    if not _propagate(values, masks, geo):
        return
    empty = [cell for cell, value in enumerate(values) if not value]
    if not empty:
        found.append(tuple(values))
        return
    cell = min(empty, key=lambda c: masks[c].bit_count())  # fewest candidates first
    bits = [1 << k for k in range(geo.size) if masks[cell] >> k & 1]
    if rng is not None:
        bits = [bits[k] for k in rng.permutation(len(bits)).tolist()]
    for bit in bits:
        child_values, child_masks = values[:], masks[:]
        _assign(child_values, child_masks, geo.peers, cell, bit)
        _search(child_values, child_masks, geo, limit, found, rng)
        if len(found) >= limit:
            return


def solutions(grid: Grid, size: int, limit: int = 2, rng: np.random.Generator | None = None) -> list[Grid]:
    """Up to ``limit`` solutions of ``grid``: backtracking over the cell with the fewest candidates, with
    constraint propagation (naked and hidden singles) at every node. ``rng`` shuffles the order in which a
    cell's digits are tried (to draw a random full grid from an empty one)."""
    geo = geometry(size)
    if len(grid) != size * size or has_conflict(grid, size):
        return []
    full = (1 << size) - 1
    values = list(grid)
    masks = [0] * len(grid)
    for cell, value in enumerate(values):
        if not value:
            used = 0
            for peer in geo.peers[cell]:
                if values[peer]:
                    used |= 1 << (values[peer] - 1)
            masks[cell] = full & ~used
    found: list[Grid] = []
    _search(values, masks, geo, limit, found, rng)
    return found


def random_solution(rng: np.random.Generator, size: int) -> Grid:
    """A full valid grid drawn from ``rng``."""
    (grid,) = solutions((0,) * (size * size), size, limit=1, rng=rng)
    return grid


def generate_puzzle(rng: np.random.Generator, size: int, empty_cells: int) -> tuple[Grid, Grid]:
    """``(puzzle, solution)``: a puzzle with ``empty_cells`` empty cells and exactly one solution.

    Cells are blanked in a random order, each only if the solution stays unique; a grid that cannot lose
    enough cells that way is replaced by a fresh one.
    """
    for _ in range(MAX_GENERATION_TRIES):
        solution = random_solution(rng, size)
        puzzle = list(solution)
        removed = 0
        for cell in rng.permutation(size * size).tolist():
            digit, puzzle[cell] = puzzle[cell], 0
            if len(solutions(tuple(puzzle), size, limit=2)) == 1:
                removed += 1
                if removed == empty_cells:
                    return tuple(puzzle), solution
            else:
                puzzle[cell] = digit
    raise RuntimeError(
        f"no {size}x{size} Sudoku with {empty_cells} empty cells and a unique solution after {MAX_GENERATION_TRIES} "
        "grids; choose an easier difficulty"
    )


def parse_puzzle(puzzle: Any, size: int) -> Grid:
    """A puzzle written as ``size * size`` digits, ``.`` or ``0`` for empty, row by row (whitespace and
    ``|``, ``-``, ``+`` separators are ignored). Raises ValueError naming the problem."""
    if not isinstance(puzzle, str):
        raise ValueError(f"a Sudoku puzzle must be a string of digits and dots, got {type(puzzle).__name__}")
    cells = [ch for ch in puzzle if ch not in " \t\r\n|-+"]
    if len(cells) != size * size:
        raise ValueError(f"a {size}x{size} Sudoku puzzle has {size * size} cells, got {len(cells)}")
    # ASCII digits only: str.isdigit() takes "²", which int() refuses, and "٣", which it reads as 3.
    bad = sorted({ch for ch in cells if ch != "." and not (ch.isascii() and ch.isdigit() and int(ch) <= size)})
    if bad:
        raise ValueError(f"unknown Sudoku symbols {bad}; use digits 1-{size} and . (or 0) for an empty cell")
    return tuple(0 if ch == "." else int(ch) for ch in cells)


# --------------------------------------------------------------------------- actions
class Move(NamedTuple):
    """One parsed action: a placement (``digit`` >= 1) or an erase (``digit`` 0) of a cell (rows and columns
    from 0)."""

    row: int
    col: int
    digit: int

    def text(self) -> str:
        """The canonical spelling (rows and columns from 1)."""
        if self.digit == 0:
            return f"erase row {self.row + 1} col {self.col + 1}"
        return f"place {self.digit} at row {self.row + 1} col {self.col + 1}"


_N = r"(?<!\d)(\d{1,2})(?!\d)"  # a whole number: searched anywhere, "123,4,5" must not read as 23, 4, 5
_SEP = r"\s*,\s*"
_ACTION_PATTERNS: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(pattern), order)
    for pattern, order in (
        (rf"place\s+{_N}\s+(?:at|in)\s+row\s*{_N}\s*,?\s*(?:col|column)\s*{_N}", "drc"),
        (rf"place\s+{_N}\s+(?:at|in)\s+\(\s*{_N}{_SEP}{_N}\s*\)", "drc"),
        (rf"(?:place\s+)?{_N}\s+at\s+{_N}{_SEP}{_N}", "drc"),
        (rf"\(\s*{_N}{_SEP}{_N}{_SEP}{_N}\s*\)", "rcd"),
        (rf"{_N}{_SEP}{_N}{_SEP}{_N}", "rcd"),
        (rf"(?:erase|clear)\s+(?:row\s*)?{_N}\s*,?\s*(?:(?:col|column)\s*)?{_N}", "rc"),
        (rf"(?:erase|clear)\s+(?:at\s+)?\(\s*{_N}{_SEP}{_N}\s*\)", "rc"),
    )
)


def parse_action(action: Any, size: int) -> Move | None:
    """The move an action names, or None if it names none (a non-string, an unknown spelling, a number out
    of range). The first spelling found anywhere in the text counts, as RAGEN's ``re.search`` (its
    ``sudoku/env.py``): ``"I place 5 at row 2 col 3"`` is a move. Case is ignored.

    >>> parse_action("Place 5 at row 2 col 3", 9)
    Move(row=1, col=2, digit=5)
    >>> parse_action("2,3,5", 9) == parse_action("place 5 at (2, 3)", 9)
    True
    """
    if not isinstance(action, str) or len(action) > MAX_ACTION_CHARS:
        return None
    text = action.strip().strip("`").strip().rstrip(".").strip().lower()
    for pattern, order in _ACTION_PATTERNS:
        match = pattern.search(text)  # anywhere in the text, as RAGEN's re.search: "I place 5 at row 2 col 3"
        if match is None:
            continue
        numbers = dict(zip(order, (int(g) for g in match.groups())))
        row, col, digit = numbers["r"], numbers["c"], numbers.get("d", 0)
        if not (1 <= row <= size and 1 <= col <= size and (order == "rc" or 1 <= digit <= size)):
            return None
        return Move(row - 1, col - 1, digit)
    return None


# --------------------------------------------------------------------------- the env
_GIVEN_RGB, _PLACED_RGB, _LINE_RGB = (0, 0, 0), (30, 80, 200), (40, 40, 40)
_MARGIN = 4


class SudokuEnv(TurnEnv):
    """Fill a Sudoku grid (RAGEN's Sudoku; every puzzle has a unique solution).

    Args:
        mode: ``"text"`` or ``"image"``.
        size: side of the grid: 9 (RAGEN's) or 4.
        difficulty: ``"easy"`` (40% of the cells empty, RAGEN's default), ``"medium"`` (50%) or ``"hard"`` (60%).
        max_steps: steps before truncation (RAGEN: 81).
        correct_reward: paid for a digit that matches the solution.
        wrong_reward: paid for a legal digit that does not match it.
        solved_reward: paid when the grid is solved.
        invalid_reward: paid for an unreadable or illegal action.
        cell_px: pixels per cell in image mode.
        render_mode: ``None``, ``"ansi"`` or ``"rgb_array"``.
    """

    reset_options = ("puzzle",)

    modes = ("text", "image")
    setting_choices = {"size": SIZES, "difficulty": tuple(EMPTY_FRACTION)}
    invalid_step_truncates = False  # RAGEN: an unreadable or illegal move returns done=False at any count
    description = "Sudoku: fill a 9x9 grid whose solution is unique (RAGEN's sizes, actions and rewards)."

    def __init__(
        self,
        mode: str = "text",
        size: int = 9,
        difficulty: str = "easy",
        max_steps: int = 81,
        correct_reward: float = 1.0,
        wrong_reward: float = 0.5,
        solved_reward: float = 10.0,
        invalid_reward: float = -0.1,
        cell_px: int = 32,
        render_mode: str | None = None,
    ) -> None:
        if size not in SIZES:
            raise ValueError(f"size must be one of {list(SIZES)}, got {size!r}")
        if difficulty not in EMPTY_FRACTION:
            raise ValueError(f"difficulty must be one of {list(EMPTY_FRACTION)}, got {difficulty!r}")
        if not 12 <= cell_px <= 128:
            raise ValueError(f"cell_px must be from 12 to 128, got {cell_px}")
        side = size * cell_px + 2 * _MARGIN
        super().__init__(mode=mode, max_steps=max_steps, image_shape=(side, side), render_mode=render_mode)
        self.size = int(size)
        self.difficulty = difficulty
        self.empty_cells = int(size * size * EMPTY_FRACTION[difficulty])
        self.correct_reward = float(correct_reward)
        self.wrong_reward = float(wrong_reward)
        self.solved_reward = float(solved_reward)
        self.invalid_action_reward = float(invalid_reward)
        self.cell_px = int(cell_px)
        self.puzzle: Grid = ()
        self.solution: Grid = ()
        self.grid: Grid = ()
        self._feedback = ""

    # ----------------------------------------------------------------- episode
    def _reset(self, rng: np.random.Generator, options: dict[str, Any]) -> None:
        if "puzzle" in options:
            puzzle = parse_puzzle(options["puzzle"], self.size)
            found = solutions(puzzle, self.size, limit=2)
            if len(found) != 1:
                what = "no solution" if not found else "more than one solution"
                raise ValueError(f"the given Sudoku puzzle has {what}; give one with exactly one solution")
            self.puzzle, self.solution = puzzle, found[0]
        else:
            self.puzzle, self.solution = generate_puzzle(rng, self.size, self.empty_cells)
        self.grid = self.puzzle
        self._feedback = ""

    def canonical_action(self, action: Any) -> str | None:
        move = parse_action(action, self.size)
        return None if move is None else move.text()

    def _step(self, action: str) -> StepOutcome:
        move = parse_action(action, self.size)
        assert move is not None  # canonical_action let it through
        cell = move.row * self.size + move.col
        where = f"row {move.row + 1} col {move.col + 1}"
        problem = self._problem(move, cell, where)
        if problem is not None:
            self._feedback = f"Not done: {problem}."
            return StepOutcome(self.invalid_action_reward, effective=False, info={"illegal": problem}, legal=False)
        before = self._worth()
        grid = list(self.grid)
        grid[cell] = move.digit
        self.grid = tuple(grid)
        if move.digit == 0:
            self._feedback = f"Erased {where}."
        else:
            self._feedback = f"Placed {move.digit} at {where}."
        solved = self.grid == self.solution
        reward = self._worth() - before + (self.solved_reward if solved else 0.0)
        if solved:
            self._feedback += " The puzzle is solved."
        correct = move.digit != 0 and move.digit == self.solution[cell]
        return StepOutcome(reward, terminated=solved, success=solved, info={"correct_placement": correct})

    def _problem(self, move: Move, cell: int, where: str) -> str | None:
        """Why ``move`` breaks the rules, or None if it is legal."""
        if self.puzzle[cell]:
            return f"{where} is a given cell"
        if move.digit == 0:
            return f"{where} is already empty" if not self.grid[cell] else None
        if self.grid[cell] == move.digit:
            return f"{where} already holds {move.digit}"
        clashes = self._clashes(cell, move.digit)
        return f"{move.digit} at {where} repeats a digit of its {' and '.join(clashes)}" if clashes else None

    def _clashes(self, cell: int, digit: int) -> list[str]:
        """The units of ``cell`` (row, column, box) that already hold ``digit`` elsewhere."""
        n, box = self.size, geometry(self.size).box
        row, col = divmod(cell, n)
        found = []
        if any(self.grid[row * n + c] == digit for c in range(n) if c != col):
            found.append("row")
        if any(self.grid[r * n + col] == digit for r in range(n) if r != row):
            found.append("column")
        top, left = row - row % box, col - col % box
        box_cells = [(top + r) * n + left + c for r in range(box) for c in range(box)]
        if any(self.grid[c] == digit for c in box_cells if c != cell):
            found.append("box")
        return found

    def _worth(self) -> float:
        """Grid worth: ``correct_reward`` for each filled cell that holds its solution digit, ``wrong_reward``
        for each other filled cell (givens count as correct; only changes matter)."""
        right = sum(1 for value, truth in zip(self.grid, self.solution) if value and value == truth)
        wrong = sum(1 for value, truth in zip(self.grid, self.solution) if value and value != truth)
        return right * self.correct_reward + wrong * self.wrong_reward

    def success(self) -> bool:
        return bool(self.grid) and self.grid == self.solution

    def solve(self) -> list[str]:
        """Erase every digit that is not the solution's, then fill the empty cells, the one with the fewest
        candidates first (a forced cell whenever there is one): the order a person would take."""
        n = self.size
        plan = [Move(*divmod(cell, n), 0).text() for cell, value in enumerate(self.grid)
                if value and value != self.solution[cell]]
        grid = [value if value == self.solution[cell] else 0 for cell, value in enumerate(self.grid)]
        empty = {cell for cell, value in enumerate(grid) if not value}
        while empty:
            cell = min(empty, key=lambda c: (len(candidates(tuple(grid), n, c)), c))
            empty.discard(cell)
            grid[cell] = self.solution[cell]
            plan.append(Move(*divmod(cell, n), grid[cell]).text())
        return plan

    def action_budget(self) -> int:
        """One placement per empty cell of a fresh puzzle."""
        return min(self.max_steps, self.empty_cells)

    # ----------------------------------------------------------------- views
    def board_text(self) -> str:
        """The grid with row and column numbers: ``[5]`` a given, `` 5 `` a placed digit, `` . `` empty."""
        n, box = self.size, geometry(self.size).box
        header = [" "] * (3 + 3 * n + n // box)
        for c in range(n):
            header[3 + 3 * c + c // box + 1] = str(c + 1)  # above the digit of each cell
        lines = ["".join(header).rstrip()]
        rule = "   " + "+".join("-" * (3 * box) for _ in range(n // box))
        for r in range(n):
            if r and r % box == 0:
                lines.append(rule)
            cells = []
            for c in range(n):
                value, given = self.grid[r * n + c], self.puzzle[r * n + c]
                text = f"[{value}]" if given else f" {value} " if value else " . "
                cells.append(("|" if c and c % box == 0 else "") + text)
            lines.append((f"{r + 1:>2} " + "".join(cells)).rstrip())
        return "\n".join(lines)

    def text(self) -> str:
        lines = [IMAGE_CAPTION] if self.is_image_mode else [self.board_text()]
        if self._feedback:
            lines.append(self._feedback)
        empty = [cell for cell, value in enumerate(self.grid) if not value]
        lines.append(f"Empty cells: {len(empty)}.")
        if not self.is_image_mode and 0 < len(empty) <= CANDIDATES_SHOWN_BELOW:
            listed = "; ".join(
                f"row {cell // self.size + 1} col {cell % self.size + 1}: "
                + (" ".join(map(str, candidates(self.grid, self.size, cell))) or "none")
                for cell in empty
            )
            lines.append(f"Candidates: {listed}.")
        return "\n".join(lines)

    def ansi(self) -> str:
        return self.board_text()

    def state_key(self) -> str:
        return "".join(map(str, self.grid))

    def image(self) -> np.ndarray:
        n, px, box = self.size, self.cell_px, geometry(self.size).box
        side = n * px + 2 * _MARGIN
        image = Image.new("RGB", (side, side), (255, 255, 255))
        draw = ImageDraw.Draw(image)
        text_font = font(int(px * 0.7))
        for cell, value in enumerate(self.grid):
            if not value:
                continue
            r, c = divmod(cell, n)
            colour = _GIVEN_RGB if self.puzzle[cell] else _PLACED_RGB
            x, y = _MARGIN + c * px + px / 2, _MARGIN + r * px + px / 2
            draw.text((x, y), str(value), fill=colour, font=text_font, anchor="mm")
        for k in range(n + 1):
            width = 3 if k % box == 0 else 1
            offset = _MARGIN + k * px
            draw.line((offset, _MARGIN, offset, _MARGIN + n * px), fill=_LINE_RGB, width=width)
            draw.line((_MARGIN, offset, _MARGIN + n * px, offset), fill=_LINE_RGB, width=width)
        return np.asarray(image, dtype=np.uint8)

    def instructions(self) -> str:
        n, box = self.size, geometry(self.size).box
        if self.is_image_mode:
            seen = ("The image shows the grid: digits in black are given and cannot change, digits in blue are "
                    "yours, empty squares are empty. Rows count from 1 at the top, columns from 1 at the left.")
        else:
            seen = ("The grid shows given digits as [5] (they cannot change), your digits as 5 and empty cells "
                    "as '.', with row numbers on the left and column numbers on top.")
        return (
            f"You are solving a {n}x{n} Sudoku. Fill every empty cell with a digit from 1 to {n} so that every "
            f"row, every column and every {box}x{box} box holds each digit exactly once. The puzzle has exactly "
            f"one solution.\n{seen}\n"
            "Actions: 'place D at row R col C' puts digit D in row R, column C (also written 'R,C,D'); "
            "'erase row R col C' empties a cell you filled. Example: place 5 at row 2 col 3.\n"
            f"Rewards: +{self.correct_reward:g} for a correct digit, +{self.wrong_reward:g} for a digit that breaks "
            f"no rule but is not the solution's, +{self.solved_reward:g} when the grid is solved, "
            f"{self.invalid_action_reward:g} for an action that breaks a rule or cannot be read."
        )

    def action_names(self) -> list[str] | None:
        return None

    def state_facts(self) -> StateFacts:
        n = self.size
        extra: dict[str, Any] = {
            f"row {r + 1}": " ".join(str(v) if v else "." for v in self.grid[r * n : (r + 1) * n]) for r in range(n)
        }
        extra["empty cells"] = sum(1 for value in self.grid if not value)
        return StateFacts(player=None, extra=extra)


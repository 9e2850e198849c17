"""2048: slide the tiles of a 4x4 board, merging equal ones, to build the 2048 tile (RAGEN's ``game_2048``).

Rules (RAGEN's, the original game's): each action slides every tile as far as
it goes towards one side; two equal tiles that meet merge into one of twice
the value (once per move: ``2 2 2 2`` slid left gives ``4 4 . .``). After a
move that changed the board a new tile appears on a random empty cell: a 2
with probability ``two_prob`` (0.9), else a 4. The game starts with two such
tiles. All chance comes from the env's seeded generator: same seed and
actions, same game.

The episode ends with success when a tile reaches ``target_tile`` (2048, as
RAGEN's success), and without it when no move can change the board. RAGEN
plays on past 2048 until the board is stuck; here the game stops at the
target, which only matters to an agent that gets there.

Rewards (RAGEN's ``use_log_reward``): a move that merges tiles worth ``m`` in
all pays ``0.1 * log2(m + 1)``; a move that merges nothing pays 0; a move that
changes nothing pays ``no_move_reward`` (-0.1; RAGEN's instruction promises
that penalty, but its log reward replaces it by 0). ``reward="score"`` pays
the merged value ``m`` itself (the game's score). A move that changes nothing
is a valid action without effect, like walking into a wall; text that is not
an action name is an invalid action and pays ``invalid_reward`` (-0.1).

Actions: ``Up``, ``Right``, ``Down``, ``Left`` (RAGEN's order). The text
observation is RAGEN's: the rows as lists of numbers (0 for an empty cell),
the moves that would change the board, the goal and the score. The image
draws the board with the game's colours.

How far RAGEN's budget reaches: every move adds a tile worth 2.2 on average,
so a board holding a 2048 tile has taken about 930 moves or more; RAGEN's
recipe stops at 700 actions, where 1024 is the largest tile within reach.

The expert (:meth:`Game2048Env.solve`) is an expectimax player: it looks at
each move, the chance of each new tile and (when few cells are empty, where
the choice matters most) the next moves, and scores boards with the
heuristic of nneonneo's 2048 AI (empty cells, mergeable neighbours, monotone
rows and columns). It re-plans after every new tile, so ``solve()`` returns
one move. No player wins every game; see docs for its measured rate.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Any

import numpy as np
from PIL import Image, ImageDraw

from turnrl.envs.contract import IMAGE_CAPTION, StateFacts, StepOutcome, TurnEnv
from turnrl.envs.draw import font

ACTIONS = ("Up", "Right", "Down", "Left")
REWARDS = ("log", "score")
MIN_SIZE, MAX_SIZE = 2, 8

Board = tuple[tuple[int, ...], ...]
"""Rows of exponents: 0 for an empty cell, ``k`` for the tile ``2**k``."""


# --------------------------------------------------------------------------- the rules
@lru_cache(maxsize=1 << 17)
def slide_row(row: tuple[int, ...]) -> tuple[tuple[int, ...], int]:
    """A row of exponents slid to the left: ``(new row, value of the merged tiles)``; each tile merges once.

    >>> slide_row((1, 1, 1, 1))  # 2 2 2 2 -> 4 4 . . (merged 4 + 4)
    ((2, 2, 0, 0), 8)
    >>> slide_row((0, 2, 0, 2))  # . 4 . 4 -> 8 . . .
    ((3, 0, 0, 0), 8)
    """
    tiles = [v for v in row if v]
    out: list[int] = []
    merged = 0
    k = 0
    while k < len(tiles):
        if k + 1 < len(tiles) and tiles[k] == tiles[k + 1]:
            out.append(tiles[k] + 1)
            merged += 1 << (tiles[k] + 1)
            k += 2
        else:
            out.append(tiles[k])
            k += 1
    return tuple(out + [0] * (len(row) - len(out))), merged


def _transpose(board: Board) -> Board:
    return tuple(zip(*board))


def shift(board: Board, action: str) -> tuple[Board, int]:
    """``board`` after sliding every tile towards ``action``'s side: ``(board, merged value)``."""
    if action == "Left":
        rows = [slide_row(row) for row in board]
        return tuple(r for r, _ in rows), sum(m for _, m in rows)
    if action == "Right":
        rows = [slide_row(row[::-1]) for row in board]
        return tuple(r[::-1] for r, _ in rows), sum(m for _, m in rows)
    columns = _transpose(board)
    if action == "Up":
        moved = [slide_row(col) for col in columns]
        return _transpose(tuple(c for c, _ in moved)), sum(m for _, m in moved)
    if action == "Down":
        moved = [slide_row(col[::-1]) for col in columns]
        return _transpose(tuple(c[::-1] for c, _ in moved)), sum(m for _, m in moved)
    raise ValueError(f"unknown 2048 move {action!r}; use one of {list(ACTIONS)}")


def legal_moves(board: Board) -> list[str]:
    """The moves that change ``board``, in :data:`ACTIONS` order."""
    return [action for action in ACTIONS if shift(board, action)[0] != board]


def empty_cells(board: Board) -> list[tuple[int, int]]:
    return [(r, c) for r, row in enumerate(board) for c, v in enumerate(row) if not v]


def place(board: Board, row: int, col: int, exponent: int) -> Board:
    """``board`` with tile ``2**exponent`` on ``(row, col)``."""
    line = board[row]
    return board[:row] + (line[:col] + (exponent,) + line[col + 1 :],) + board[row + 1 :]


def largest_exponent(size: int, given: int = 0) -> int:
    """The exponent of the largest tile a ``size x size`` board can ever hold, new tiles being 2 or 4 and the
    tiles it starts with at most ``2**given`` (0: none): 17 on 4x4 (131072), 10 on 3x3 (1024), 5 on 2x2 (32);
    ``size**2 + given - 1`` from a given board whose largest tile is ``2**given`` (``given`` > 2).

    A tile ``2**k`` (``k`` above every tile there for free) is made from two of ``2**(k - 1)``; while the first
    waits, the second is made from two of ``2**(k - 2)``, and so on down to two of ``2**m`` where the second
    can come for free: a new tile (``m <= 2``) or one of the board's first tiles (``m <= given``). The board
    then holds ``k - m + 1`` tiles (one of each of ``k - 1, ..., m + 1`` and two of ``m``, as exponents), so
    ``k <= size**2 + m - 1``.
    """
    return size * size + max(given, 2) - 1


MAX_GIVEN_EXPONENT = 100
"""A given board's tiles are at most ``2**100``: above any a game reaches (``2**65`` on 8x8), and the text of
every board played from it fits an observation (tiles of ``2**3000`` overflow its 8,192 characters, and Python
refuses ``str()`` of an int over 4,300 digits)."""


def _shown(value: Any) -> str:
    """``repr(value)`` clipped for an error message; its type where it has none (an int over 4,300 digits, a
    list nested too deep)."""
    try:
        text = repr(value)
    except (ValueError, RecursionError):
        return f"<{type(value).__name__} too large to show>"
    return text if len(text) <= 200 else text[:200] + "..."


def parse_board(board: Any, size: int) -> Board:
    """A board given as ``size`` rows of tile values (0 for empty), e.g. ``[[2, 0, 0, 2], ...]``; ValueError
    naming the problem."""
    if not (isinstance(board, (list, tuple)) and len(board) == size
            and all(isinstance(row, (list, tuple)) and len(row) == size for row in board)):
        raise ValueError(f"a 2048 board is {size} rows of {size} tile values, got {_shown(board)}")
    rows = []
    for row in board:
        exponents = []
        for value in row:
            ok = isinstance(value, (int, np.integer)) and not isinstance(value, bool)
            if not ok or (value != 0 and (value < 2 or value & (value - 1))):
                raise ValueError(f"2048 tiles are 0 (empty) or powers of two from 2, got {_shown(value)}")
            exponent = int(value).bit_length() - 1 if value else 0
            if exponent > MAX_GIVEN_EXPONENT:
                raise ValueError(f"2048 tiles of a given board are at most 2**{MAX_GIVEN_EXPONENT}, got "
                                 f"2**{exponent}: give smaller tiles")
            exponents.append(exponent)
        rows.append(tuple(exponents))
    return tuple(rows)


# --------------------------------------------------------------------------- the expert
# nneonneo's heuristic (github.com/nneonneo/2048-ai): per row or column, reward empty cells and equal
# neighbours, penalize rows that are not monotone and the sum of large tiles.
_LOST_PENALTY = 200_000.0
_CHANCE_CUTOFF = 1e-4
"""A chance branch less likely than this is scored by the heuristic instead of searched."""


@lru_cache(maxsize=1 << 17)
def _row_score(row: tuple[int, ...]) -> float:
    empty = row.count(0)
    merges = counter = previous = 0
    for v in row:
        if v == 0:
            continue
        if v == previous:
            counter += 1
        elif counter:
            merges += 1 + counter
            counter = 0
        previous = v
    if counter:
        merges += 1 + counter
    left = right = 0.0
    for a, b in zip(row, row[1:]):
        if a > b:
            left += a**4 - b**4
        else:
            right += b**4 - a**4
    total = sum(v**3.5 for v in row)
    return _LOST_PENALTY + 270.0 * empty + 700.0 * merges - 47.0 * min(left, right) - 11.0 * total


def heuristic(board: Board) -> float:
    """nneonneo's score of a board: the row score of every row and every column."""
    return sum(_row_score(row) for row in board) + sum(_row_score(col) for col in _transpose(board))


def search_depth(board: Board) -> int:
    """Moves the expert looks ahead: 1 on a roomy board, 2 with fewer than 6 empty cells, 3 with fewer than 3
    (a fuller board is where a bad move loses the game)."""
    empty = sum(row.count(0) for row in board)
    return 1 if empty >= 6 else 2 if empty >= 3 else 3


def best_move(board: Board, two_prob: float = 0.9, depth: int | None = None) -> str | None:
    """The expectimax move for ``board`` (None when no move changes it).

    A move's value is the expected score, over where the next tile appears and whether it is a 2 or a 4,
    of the best move after it, ``depth`` moves deep; branches less likely than ``_CHANCE_CUTOFF`` and the
    last level are scored by :func:`heuristic`. Ties go to the first move in :data:`ACTIONS` order.
    """
    depth = search_depth(board) if depth is None else depth
    seen: dict[tuple[Board, int], float] = {}
    tiles = ((1, two_prob), (2, 1.0 - two_prob))

    def chance(board: Board, moves_left: int, probability: float) -> float:
        if moves_left == 0 or probability < _CHANCE_CUTOFF:
            return heuristic(board)
        key = (board, moves_left)
        if key in seen:
            return seen[key]
        cells = empty_cells(board)
        each = probability / len(cells)
        total = 0.0
        for r, c in cells:
            for exponent, p in tiles:
                if p > 0:
                    total += p * best_value(place(board, r, c, exponent), moves_left, each * p)
        seen[key] = value = total / len(cells)
        return value

    def best_value(board: Board, moves_left: int, probability: float) -> float:
        values = [chance(after, moves_left - 1, probability)
                  for after in (shift(board, action)[0] for action in ACTIONS) if after != board]
        return max(values) if values else 0.0  # a stuck board: the game is lost

    best, choice = -math.inf, None
    for action in ACTIONS:
        after = shift(board, action)[0]
        if after != board:
            value = chance(after, depth - 1, 1.0)
            if value > best:
                best, choice = value, action
    return choice


# --------------------------------------------------------------------------- the env
# The original game's tile colours, by exponent (2 ... 2048; larger tiles share the last).
_TILE_RGB = ((205, 193, 180), (238, 228, 218), (237, 224, 200), (242, 177, 121), (245, 149, 99), (246, 124, 95),
             (246, 94, 59), (237, 207, 114), (237, 204, 97), (237, 200, 80), (237, 197, 63), (237, 194, 46),
             (60, 58, 50))
_BOARD_RGB, _DARK_TEXT, _LIGHT_TEXT = (187, 173, 160), (119, 110, 101), (249, 246, 242)
_GAP = 6


class Game2048Env(TurnEnv):
    """Build the 2048 tile by sliding and merging (RAGEN's ``game_2048``).

    Args:
        mode: ``"text"`` or ``"image"``.
        size: side of the board (RAGEN: 4), 2 to 8.
        target_tile: the tile that wins (RAGEN: 2048), a power of two from 8 that the board can reach
            (:func:`largest_exponent`: up to 1024 on 3x3 from the first two tiles; a given board with larger
            tiles reaches further). One it cannot reach is refused at reset.
        two_prob: probability that a new tile is a 2 (else a 4).
        reward: ``"log"`` (RAGEN's: ``0.1 * log2(merged + 1)``) or ``"score"`` (the merged value).
        no_move_reward: paid for a move that changes nothing.
        invalid_reward: paid for text that is not a move.
        max_steps: steps before truncation (RAGEN's recipe stops at 700 actions).
        cell_px: pixels per cell in image mode.
        render_mode: ``None``, ``"ansi"`` or ``"rgb_array"``.
    """

    reset_options = ("board",)

    modes = ("text", "image")
    setting_choices = {"reward": REWARDS}
    description = "Game2048: slide and merge tiles on a 4x4 board up to 2048 (RAGEN's game_2048)."

    def __init__(
        self,
        mode: str = "text",
        size: int = 4,
        target_tile: int = 2048,
        two_prob: float = 0.9,
        reward: str = "log",
        no_move_reward: float = -0.1,
        invalid_reward: float = -0.1,
        max_steps: int = 2000,
        cell_px: int = 64,
        render_mode: str | None = None,
    ) -> None:
        is_int = isinstance(size, (int, np.integer)) and not isinstance(size, bool)
        if not is_int or not MIN_SIZE <= size <= MAX_SIZE:
            raise ValueError(f"size must be an int from {MIN_SIZE} to {MAX_SIZE}, got {size!r}")
        is_int = isinstance(target_tile, (int, np.integer)) and not isinstance(target_tile, bool)
        if not is_int or target_tile < 8 or target_tile & (target_tile - 1):
            raise ValueError(f"target_tile must be a power of two from 8, got {target_tile!r}")
        if not 0.0 <= two_prob <= 1.0:
            raise ValueError(f"two_prob must be in [0, 1], got {two_prob}")
        if reward not in REWARDS:
            raise ValueError(f"reward must be one of {list(REWARDS)}, got {reward!r}")
        if not 16 <= cell_px <= 256:
            raise ValueError(f"cell_px must be from 16 to 256, got {cell_px}")
        side = size * cell_px + (size + 1) * _GAP
        super().__init__(mode=mode, max_steps=max_steps, image_shape=(side, side), render_mode=render_mode)
        self.size = int(size)
        self.target_tile = int(target_tile)
        self.two_prob = float(two_prob)
        self.reward = reward
        self.no_move_reward = float(no_move_reward)
        self.invalid_action_reward = float(invalid_reward)
        self.cell_px = int(cell_px)
        self.board: Board = ()
        self.score = 0
        self._target_exponent = self.target_tile.bit_length() - 1

    # ----------------------------------------------------------------- episode
    def _reset(self, rng: np.random.Generator, options: dict[str, Any]) -> None:
        self.score = 0
        n = self.size
        if "board" in options:  # a given board must hold the target already, or have a legal move towards it
            board = parse_board(options["board"], n)
            held = max(map(max, board))
            reach = largest_exponent(n, held)
            if self._target_exponent > reach:
                raise ValueError(f"board: target_tile={self.target_tile} can never be made from it on a {n}x{n} "
                                 f"board, where its tiles reach {1 << reach} at most; give a board with larger "
                                 f"tiles, or set target_tile <= {1 << reach}")
            if held < self._target_exponent and not legal_moves(board):
                # Every action would change nothing until max_steps, without a win or an end.
                raise ValueError("board: no move changes it (no tile can slide or merge), so the game is over "
                                 "before it starts; give a board with a legal move")
            self.board = board
            return
        if self._target_exponent > largest_exponent(n):
            # Checked here, not when the env is built: a given board with larger tiles may reach the target.
            largest = 1 << largest_exponent(n)
            raise ValueError(f"target_tile={self.target_tile} can never be made on a {n}x{n} board from its first "
                             f"two tiles, whose largest possible tile is {largest}: set target_tile <= {largest} or "
                             "a larger size, or give a board with larger tiles (reset option 'board')")
        self.board = tuple((0,) * self.size for _ in range(self.size))
        self._spawn(rng)
        self._spawn(rng)

    def _spawn(self, rng: np.random.Generator) -> None:
        cells = empty_cells(self.board)
        if cells:
            r, c = cells[int(rng.integers(len(cells)))]
            self.board = place(self.board, r, c, 1 if rng.random() < self.two_prob else 2)

    def _step(self, action: str) -> StepOutcome:
        after, merged = shift(self.board, action)
        if after == self.board:
            return StepOutcome(self.no_move_reward, effective=False, info={"merged": 0})
        self.board = after
        self.score += merged
        self._spawn(self.np_random)
        won = self.success()
        lost = not won and not legal_moves(self.board)
        if self.reward == "score":
            reward = float(merged)
        else:
            reward = 0.1 * math.log2(merged + 1) if merged else 0.0
        info = {"merged": merged, "score": self.score, "max_tile": self.max_tile()}
        return StepOutcome(reward, terminated=won or lost, success=won, info=info)

    def max_tile(self) -> int:
        top = max(max(row) for row in self.board)
        return 1 << top if top else 0

    def success(self) -> bool:
        return bool(self.board) and max(max(row) for row in self.board) >= self._target_exponent

    def solve(self) -> list[str]:
        """The expectimax move for the current board (one: the next tile decides the one after), or
        ``[]`` once the game is won or stuck."""
        if self.success():
            return []
        move = best_move(self.board, self.two_prob)
        return [] if move is None else [move]

    def action_budget(self) -> int:
        """Every move adds a tile of 2 or more to the board's sum, which holds the target (and smaller
        tiles) when the game is won: ``target_tile`` moves are plenty."""
        return min(self.max_steps, self.target_tile)

    # ----------------------------------------------------------------- views
    def values(self) -> list[list[int]]:
        """The board as tile values, 0 for an empty cell."""
        return [[1 << v if v else 0 for v in row] for row in self.board]

    def text(self) -> str:
        if self.is_image_mode:
            lines = [IMAGE_CAPTION]
        else:
            lines = ["Current 2048 Grid:"]
            lines += [f"Row {r + 1}: [{', '.join(map(str, row))}]" for r, row in enumerate(self.values())]
            lines.append("")
        # RAGEN's listing (game_2048/env.py render): each legal move after its index, then the closing question.
        moves = [f"{ACTIONS.index(move)}({move})" for move in legal_moves(self.board)]
        lines.append(f"Valid Actions: {', '.join(moves) if moves else 'None'}.")
        lines.append(f"Goal: Merge same numbers to reach {self.target_tile}.")
        lines.append(f"Current Score: {self.score}")
        lines.append("What is your next move?")
        return "\n".join(lines)

    def ansi(self) -> str:
        width = len(str(self.max_tile())) if self.max_tile() else 1
        return "\n".join(" ".join(f"{v or '.':>{width}}" for v in row) for row in self.values())

    def state_key(self) -> str:
        """The board alone: the score is history, not state."""
        return self.ansi()

    def image(self) -> np.ndarray:
        px, n = self.cell_px, self.size
        side = n * px + (n + 1) * _GAP
        image = Image.new("RGB", (side, side), _BOARD_RGB)
        draw = ImageDraw.Draw(image)
        for r, row in enumerate(self.board):
            for c, exponent in enumerate(row):
                x, y = _GAP + c * (px + _GAP), _GAP + r * (px + _GAP)
                draw.rectangle((x, y, x + px - 1, y + px - 1), fill=_TILE_RGB[min(exponent, len(_TILE_RGB) - 1)])
                if exponent:
                    label = str(1 << exponent)
                    size = int(px * (0.5 if len(label) <= 2 else 0.4 if len(label) == 3 else 0.3))
                    colour = _DARK_TEXT if exponent <= 2 else _LIGHT_TEXT
                    draw.text((x + px / 2, y + px / 2), label, fill=colour, font=font(size), anchor="mm")
        return np.asarray(image, dtype=np.uint8)

    def instructions(self) -> str:
        n = self.size
        if self.is_image_mode:
            seen = "The image shows the board; each tile carries its number, empty cells are plain."
        else:
            seen = "The observation lists the board row by row, top to bottom; 0 is an empty cell."
        if self.reward == "score":
            pays = "A move pays the value of the tiles it creates by merging"
        else:
            pays = "A move that merges tiles pays 0.1 * log2(1 + the value of the tiles it creates)"
        return (
            f"You are playing 2048 on a {n}x{n} grid. {seen}\n"
            "Each action slides every tile as far as it goes towards one side: Up, Right, Down or Left. Two "
            "equal tiles that meet merge into one tile of twice the value (each tile merges once per move). "
            "After every move that changes the board, a new tile (2, sometimes 4) appears on an empty cell.\n"
            f"Goal: make a {self.target_tile} tile; the game also ends when no move can change the board.\n"
            f"Rewards: {pays}; a move that changes nothing pays {self.no_move_reward:g}. Example: Left."
        )

    def action_names(self) -> list[str]:
        return list(ACTIONS)

    def state_facts(self) -> StateFacts:
        extra: dict[str, Any] = {
            f"row {r + 1}": " ".join(str(v) if v else "." for v in row) for r, row in enumerate(self.values())
        }
        extra.update(score=self.score, largest_tile=self.max_tile(), empty_cells=len(empty_cells(self.board)))
        return StateFacts(player=None, extra=extra)

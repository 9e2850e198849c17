"""Sokoban: push every box onto a target.

Rules and rewards follow gym-sokoban, which RAGEN and VAGEN use: -0.1 per
step, +1 for a box pushed onto a target, -1 for a box pushed off one, +10 when
the last box lands (that step also pays its -0.1 and +1: 10.9 in all). The
text observation is RAGEN's grid (``#`` wall, ``_`` empty, ``O`` target,
``√`` box on target, ``X`` box, ``P`` player, ``S`` player on target), RAGEN's
alternative vocabulary, VAGEN's grid (the same symbols, each cell written as
``" # \\t"``), or a list of coordinates.

Levels come from :mod:`turnrl.envs.games.sokoban.levels`: generated from the seed by
reverse play (always solvable, never already solved, solvable within
``max_steps``) or given as text with ``reset(options={"level": ...})``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import lru_cache
from operator import itemgetter
from typing import Any, ClassVar

import numpy as np

from turnrl.envs.contract import (
    StateFacts,
    StateRewardProfile,
    StepOutcome,
    TurnEnv,
    check_text_fits,
    facts_from_positions,
)
from turnrl.envs.draw import Tile, draw_grid
from turnrl.envs.games.sokoban.levels import (
    ALT_SYMBOLS,
    BOX,
    BOX_ON_TARGET,
    DIRECTIONS,
    FLOOR,
    PLAYER,
    PLAYER_ON_TARGET,
    RAGEN_SYMBOLS,
    Level,
    Vocabulary,
    cell_codes,
    check_level,
    check_room,
    generate_level,
    live_cells,
    neighbour_table,
    parse_level,
    solve,
)

STEP_REWARD = -0.1
BOX_ON_TARGET_REWARD = 1.0
SOLVED_REWARD = 10.0

VOCABULARIES: dict[str, Vocabulary] = {"ragen": RAGEN_SYMBOLS, "alt": ALT_SYMBOLS, "vagen": RAGEN_SYMBOLS}
"""The symbols each grid style means (its legend); ``vagen`` means RAGEN's, written in :data:`VAGEN_CELLS`."""
SYMBOL_STYLES = ("ragen", "alt", "coords", "grid_coords", "vagen")

VAGEN_CELLS = (" # \t", " _ \t", " O \t", " √ \t", " X \t", " P \t", " S \t")
"""VAGEN's text of each cell, by cell code (vagen/env/sokoban/env.py ``GRID_LOOKUP``): RAGEN's symbol between two
spaces, then a tab (VAGEN's comment: a tab separates the columns). Only written: a given level is read in RAGEN's
symbols, as for every style."""
VAGEN_CELL_WIDTH = 4
"""Characters of each of :data:`VAGEN_CELLS`, for the bound on the text's length."""

# Image tiles, by cell code. Targets tint the floor red so that a player or box
# standing on one still shows it; boxes on targets turn green.
_FLOOR_RGB, _TARGET_RGB = (225, 215, 190), (240, 170, 160)
TILES: tuple[Tile, ...] = (
    Tile((70, 70, 80)),  # wall
    Tile(_FLOOR_RGB),  # floor
    Tile(_TARGET_RGB, "ring", (200, 30, 30), scale=0.6),  # target
    Tile(_TARGET_RGB, "square", (40, 160, 60), scale=0.8),  # box on target
    Tile(_FLOOR_RGB, "square", (180, 110, 40), scale=0.8),  # box
    Tile(_FLOOR_RGB, "circle", (40, 80, 220)),  # player
    Tile(_TARGET_RGB, "circle", (40, 80, 220)),  # player on target
)
_TILE_BY_SYMBOL = dict(zip(RAGEN_SYMBOLS.symbols, TILES))


def _outcome_table() -> dict[tuple[int, bool, bool], StepOutcome]:
    """Every possible step result, built once: StepOutcome is frozen, so steps share them.

    Keyed by (boxes-on-target change, solved after the step, player moved).
    """
    table = {}
    for delta in (-1, 0, 1):
        for solved in (False, True):
            for moved in (False, True):
                reward = STEP_REWARD + delta * BOX_ON_TARGET_REWARD + (SOLVED_REWARD if solved else 0.0)
                table[delta, solved, moved] = StepOutcome(reward, terminated=solved, success=solved, effective=moved)
    return table


_OUTCOMES = _outcome_table()
_DIRECTION_INDEX = {name: index for index, name in enumerate(DIRECTIONS)}


class SokobanEnv(TurnEnv):
    """Sokoban with RAGEN's text grid (or an alternative vocabulary, VAGEN's grid, or coordinates) or images.

    Args:
        dim_room: ``(rows, cols)`` of the room, outer walls included (6x6
            has a 4x4 inside, as in gym-sokoban and RAGEN).
        size: shorthand for a square ``dim_room=(size, size)``.
        num_boxes: boxes (and targets) per generated level.
        max_steps: steps per episode before truncation; generated levels
            are always solvable within it.
        mode: ``"text"`` (observation ``{"text": grid}``) or ``"image"``
            (``{"text": status line, "image": HxWx3 uint8}``; the status line
            says how many boxes are on targets, never where things are).
        symbols: how the text observation is written: ``"ragen"`` (``# _ O √ X
            P S``, the default), ``"alt"`` (RAGEN's alternative vocabulary
            ``W . G C B A @``: wall, empty, goal, completed box on a goal,
            box, agent, agent on a goal), ``"coords"`` (the player, boxes,
            targets and walls listed as ``(row, column)``) or ``"grid_coords"``
            (RAGEN's ``CoordSokoban``, its ``observation_format: grid_coord``: the
            coordinates of the targets, boxes and player, then the grid in RAGEN's
            symbols) or ``"vagen"`` (VAGEN's grid, character for character: RAGEN's
            symbols, each cell written as a space, the symbol, a space and a tab,
            as ``" # \\t _ \\t"``, rows joined by newlines; the grid that
            ``agent.prompt_layout=vagen`` writes VAGEN's prompts around; rooms up
            to 45x45 fit an observation).
        cell_px: pixels per cell in images.
        render_mode: ``None``, ``"ansi"`` (the text grid, also in image mode)
            or ``"rgb_array"``.
        search_depth: moves of the backward play that makes a level (RAGEN's and
            gym-sokoban's name): every level is solvable within that many moves.
            None: ``max_steps``. RAGEN's ``LargerSokoban`` (8x8, two boxes) uses 10.

    ``reset(options={"level": text})`` plays a given level written in RAGEN's
    symbols (any size in text mode, the env's ``dim_room`` in image mode);
    a malformed level raises ValueError saying what is wrong. ``solve()``
    gives a fewest-moves plan from the current state (None once a box is
    stuck), ``current_level()`` the state as a :class:`Level`.

    Actions are ``Up``, ``Down``, ``Left``, ``Right`` (case-insensitive).
    Walking into a wall, or pushing a box into a wall or another box, leaves
    the state unchanged and still costs -0.1 (``info["action_is_effective"]``
    is False). An invalid action (not one of the four) is a no-op that also
    costs -0.1 (``invalid_action_reward``), as a no-op step does in gym-sokoban.
    """

    reset_options = ("level",)

    description: ClassVar[str] = (
        "Sokoban: push every box onto a target (gym-sokoban rules; RAGEN grid, coordinates or images)"
    )
    modes: ClassVar[tuple[str, ...]] = ("text", "image")
    setting_choices: ClassVar[dict[str, tuple[Any, ...]]] = {"symbols": SYMBOL_STYLES}
    # VAGEN's weights: box 0.5, target 0.5.
    state_reward_profile: ClassVar[StateRewardProfile | None] = StateRewardProfile(
        {"box": 0.5, "target": 0.5},
        {"crate": "box", "goal": "target", "storage": "target", "spot": "target", "dock": "target"},
    )
    corpus_variants: ClassVar[tuple[dict[str, Any], ...]] = (
        {}, {"size": 8, "num_boxes": 2}, {"symbols": "alt"}, {"symbols": "coords"},
    )
    invalid_action_reward: float = STEP_REWARD

    def __init__(
        self,
        dim_room: tuple[int, int] | None = None,
        size: int | None = None,
        num_boxes: int = 1,
        max_steps: int = 100,
        mode: str = "text",
        symbols: str = "ragen",
        cell_px: int = 25,
        render_mode: str | None = None,
        search_depth: int | None = None,
    ) -> None:
        rows, cols = _room_shape(dim_room, size)
        if not _whole(num_boxes):
            raise ValueError(f"num_boxes must be an int, got {num_boxes!r}")
        if search_depth is not None and (isinstance(search_depth, bool) or not isinstance(search_depth, int)
                                         or search_depth < 1):
            raise ValueError(f"search_depth must be a positive int or None, got {search_depth!r}")
        check_room(rows, cols, num_boxes)
        if symbols not in SYMBOL_STYLES:
            raise ValueError(f"symbols must be one of {list(SYMBOL_STYLES)}, got {symbols!r}")
        # A tile's shapes need a few pixels (one pixel drew nothing PIL accepts), and a frame is allocated for
        # every observation: FrozenLake's and the maze's bounds.
        if not 4 <= cell_px <= 256:
            raise ValueError(f"cell_px must be from 4 to 256, got {cell_px}")
        self.dim_room = (rows, cols)
        self.num_boxes = int(num_boxes)
        self.symbols = symbols
        self.cell_px = int(cell_px)
        _check_text_fits(rows, cols, symbols)
        image_shape = (rows * self.cell_px, cols * self.cell_px)
        super().__init__(mode=mode, max_steps=max_steps, image_shape=image_shape, render_mode=render_mode)
        self.search_depth = search_depth
        self._level_moves = self.max_steps if search_depth is None else min(self.max_steps, search_depth)
        self._vocabulary = VOCABULARIES.get(symbols, RAGEN_SYMBOLS)
        self._symbols = (VAGEN_CELLS if symbols == "vagen" else self._vocabulary.symbols) + ("\n",)
        self._load(generate_level(rows, cols, self.num_boxes, seed=0, max_moves=self._level_moves), generated=True)

    def action_budget(self) -> int:
        """Twice the interior cells per box, capped by ``max_steps``: 32 for 6x6 with one box, where the
        longest fewest-moves solution over 3,000 seeds takes 15 (7x7, two boxes: 100 for at most 45)."""
        inside = (self.dim_room[0] - 2) * (self.dim_room[1] - 2)
        return min(self.max_steps, 2 * inside * self.num_boxes)

    # ----------------------------------------------------------------- episode state
    def _load(self, level: Level, generated: bool = False) -> None:
        """Make ``level`` the current state (flat tables, so a step touches three cells); ``generated`` for a
        level of the generator, solvable from its start."""
        self.initial_level = level
        size = level.rows * level.cols
        self._cols = level.cols
        self._table = neighbour_table(level.rows, level.cols)
        self._walls = level.walls
        target = bytearray(size)
        for cell in level.targets:
            target[cell] = 1
        box = bytearray(size)
        for cell in level.boxes:
            box[cell] = 1
        self._target, self._box = bytes(target), box
        self._player = level.player
        self._on_target = sum(target[cell] for cell in level.boxes)
        # Boxes on dead cells (no push takes them to a target). Generated levels start with none; a given
        # level is checked at once. The table of dead cells is built at the first push, not at every reset.
        self._live: bytes | None = None
        self._dead_boxes = 0 if generated else sum(1 - self._live_cells()[cell] for cell in level.boxes)
        self._num_boxes = len(level.boxes)
        self._codes = codes = cell_codes(level)
        # The text grid is kept as a list of symbols (newlines included) and
        # edited in place, so a step rewrites three entries, not the grid.
        self._slot, pick = _text_layout(level.rows, level.cols)
        self._chars = list(map(self._symbols.__getitem__, pick(codes + _NEWLINE_CODE)))
        self._text: str | None = None
        self._wall_listing: str | None = None

    def _set(self, cell: int, code: int) -> None:
        self._codes[cell] = code
        self._chars[self._slot[cell]] = self._symbols[code]

    def _reset(self, rng: np.random.Generator, options: dict[str, Any]) -> None:
        if "level" in options:
            level = options["level"]
            level = check_level(level) if isinstance(level, Level) else parse_level(level)
            if self.is_image_mode and (level.rows, level.cols) != self.dim_room:
                raise ValueError(
                    f"the level is {level.rows}x{level.cols} but this image-mode env draws "
                    f"{self.dim_room[0]}x{self.dim_room[1]} rooms; "
                    f"make the env with dim_room=({level.rows}, {level.cols})"
                )
            _check_text_fits(level.rows, level.cols, self.symbols)
            generated = False
        else:
            seed = int(rng.integers(0, 2**63 - 1))
            level = generate_level(*self.dim_room, self.num_boxes, seed, max_moves=self._level_moves)
            generated = True
        self._load(level, generated)

    def _step(self, action: str) -> StepOutcome:
        d = _DIRECTION_INDEX[action]
        player = self._player
        nxt = self._table[d][player]
        if nxt < 0 or self._walls[nxt]:
            return _OUTCOMES[0, self._on_target == self._num_boxes, False]
        box, target = self._box, self._target
        delta = 0
        if box[nxt]:
            behind = self._table[d][nxt]
            if behind < 0 or self._walls[behind] or box[behind]:
                return _OUTCOMES[0, self._on_target == self._num_boxes, False]
            box[nxt] = 0
            box[behind] = 1
            delta = target[behind] - target[nxt]
            self._on_target += delta
            live = self._live or self._live_cells()
            self._dead_boxes += live[nxt] - live[behind]
            self._set(behind, BOX_ON_TARGET if target[behind] else BOX)
        self._set(player, FLOOR + target[player])
        self._set(nxt, PLAYER + target[nxt])
        self._player = nxt
        self._text = None
        return _OUTCOMES[delta, self._on_target == self._num_boxes, True]

    # ----------------------------------------------------------------- views
    def text(self) -> str:
        if self.is_image_mode:
            return f"Boxes on targets: {self._on_target} of {self._num_boxes}."
        if self._text is None:
            if self.symbols == "coords":
                self._text = self._coords_text()
            elif self.symbols == "grid_coords":
                self._text = self._grid_coords_text()
            else:
                self._text = "".join(self._chars)
        return self._text

    def grid_text(self) -> str:
        """The current grid in the active style (RAGEN's symbols for ``symbols="coords"``, VAGEN's cells for
        ``symbols="vagen"``)."""
        return "".join(self._chars)

    def _coords_text(self) -> str:
        level, cols = self.initial_level, self._cols
        if self._wall_listing is None:  # walls never move: list them once per level
            self._wall_listing = _listing((cell for cell, wall in enumerate(self._walls) if wall), cols)
        boxes = [cell for cell, here in enumerate(self._box) if here]
        return (
            f"Grid: {level.rows} rows x {cols} columns; (row, column), (0, 0) is the top left.\n"
            f"Player: {_listing([self._player], cols)}\n"
            f"Boxes: {_listing(boxes, cols)}\n"
            f"Targets: {_listing(level.targets, cols)}\n"
            f"Boxes on targets: {self._on_target} of {self._num_boxes}\n"
            f"Walls: {self._wall_listing}"
        )

    def _grid_coords_text(self) -> str:
        """RAGEN's ``grid_coord`` rendering, line for line (sokoban/env.py ``_render_text`` and utils.py
        ``format_coordinate_render``): each kind listed row by row, a kind with none left out, walls never
        listed; the header lines end with a space as RAGEN's do."""
        level, cols, codes = self.initial_level, self._cols, self._codes
        kinds = (
            ("Targets", sorted(level.targets)),
            ("Boxes", [cell for cell, code in enumerate(codes) if code == BOX]),
            ("Boxes on target", [cell for cell, code in enumerate(codes) if code == BOX_ON_TARGET]),
            ("Player", [self._player] if codes[self._player] == PLAYER else []),
            ("Player on target", [self._player] if codes[self._player] == PLAYER_ON_TARGET else []),
        )
        lines = ["Coordinates: ", f"Board size: {level.rows} rows x {cols} cols (zero-indexed)."]
        lines += [f"{label}: {_listing(cells, cols)}" for label, cells in kinds if cells]
        return "\n".join(lines + ["Grid Map: ", self.grid_text()])

    def image(self) -> np.ndarray:
        symbols, cols, codes = RAGEN_SYMBOLS.symbols, self._cols, self._codes
        rows = ["".join(symbols[code] for code in codes[start : start + cols]) for start in range(0, len(codes), cols)]
        return draw_grid(rows, _TILE_BY_SYMBOL, self.cell_px)

    def ansi(self) -> str:
        """The board, even in image mode, where the text is a status line."""
        return self.text() if self.symbols in ("coords", "grid_coords") and not self.is_image_mode else self.grid_text()

    # ----------------------------------------------------------------- agent API
    def instructions(self) -> str:
        if self.is_image_mode:
            observation = (
                "Each observation is an image of the room: dark grey walls, sand floor, red rings on targets, "
                "brown boxes (green once on a target), and the player as a blue circle."
            )
        elif self.symbols == "coords":
            observation = (
                "Each observation lists the player, boxes, targets and walls as (row, column) positions, "
                "row 0 at the top and column 0 at the left."
            )
        elif self.symbols == "grid_coords":
            rows, cols = self.dim_room
            observation = (
                "Each observation gives the zero-indexed (row, column) coordinates of the player, each box and each "
                f"target, from the top-left corner (0, 0) to the bottom-right corner ({rows - 1}, {cols - 1}), then "
                f"the room as a grid of symbols: {self._vocabulary.legend()}."
            )
        elif self.symbols == "vagen":
            observation = (
                "Each observation is the room as a grid of symbols, one row per line, each cell written as a space, "
                f"its symbol, a space and a tab: {self._vocabulary.legend()}."
            )
        else:
            observation = f"Each observation is the room as a grid of symbols: {self._vocabulary.legend()}."
        return (
            "You are playing Sokoban. Push every box onto a target.\n"
            f"{observation}\n"
            "You move one cell per action. Walking into a box pushes it one cell in the same direction if the "
            "cell behind it is empty floor or a target; boxes cannot be pulled, and a box pushed into a corner "
            "cannot be moved out.\n"
            "Actions: Up, Down, Left, Right (Up moves towards row 0).\n"
            "Rewards: -0.1 per step, +1 for a box pushed onto a target, -1 for a box pushed off one, "
            "+10 when every box is on a target."
        )

    def action_names(self) -> list[str]:
        return list(DIRECTIONS)

    def state_facts(self) -> StateFacts:
        level, cols = self.initial_level, self._cols
        objects = [("box", divmod(cell, cols)) for cell, here in enumerate(self._box) if here]
        objects += [("target", divmod(cell, cols)) for cell in level.targets]
        return facts_from_positions(divmod(self._player, cols), objects)

    def success(self) -> bool:
        return self._on_target == self._num_boxes

    def episode_metrics(self) -> Mapping[str, float]:
        """``boxes_on_target``: the share of boxes on targets; ``deadlocked``: 1 while a box sits on a dead cell,
        one from which no push takes it to a target (a corner or a wall without targets: the level is lost,
        however many steps are left; boxes that only block each other are not counted)."""
        return {"boxes_on_target": self._on_target / self._num_boxes, "deadlocked": float(self._dead_boxes > 0)}

    def _live_cells(self) -> bytes:
        level = self.initial_level
        self._live = live_cells(level.rows, level.cols, level.walls, level.targets)
        return self._live

    def current_level(self) -> Level:
        """The current state as a :class:`Level` (e.g. to print or to solve)."""
        level = self.initial_level
        boxes = tuple(cell for cell, here in enumerate(self._box) if here)
        return Level(level.rows, level.cols, level.walls, level.targets, boxes, self._player)

    def solve(self) -> list[str] | None:
        """Fewest-moves solution from the current state; ``[]`` if solved, None if it cannot be solved."""
        moves = solve(self.current_level())
        return None if moves is None else [DIRECTIONS[d] for d in moves]


# ---------------------------------------------------------------------- helpers
_NEWLINE_CODE = bytes([7])  # one past the cell codes: the "\n" entry of ``_symbols``


@lru_cache(maxsize=64)
def _text_layout(rows: int, cols: int) -> tuple[tuple[int, ...], Callable]:
    """Where each cell's symbol sits in the text grid, and a picker of codes in text order.

    The picker takes the cell codes with one extra code appended (index
    ``rows * cols``) that stands for the newline ending each row but the last.
    """
    slot = tuple(cell + cell // cols for cell in range(rows * cols))
    order: list[int] = []
    for row in range(rows):
        order.extend(range(row * cols, (row + 1) * cols))
        order.append(rows * cols)
    order.pop()
    return slot, itemgetter(*order)


def _whole(value: Any) -> bool:
    """Whether ``value`` is an int (a bool is not: ``True`` would read as 1)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _room_shape(dim_room: Any, size: Any) -> tuple[int, int]:
    """Resolve ``dim_room`` / ``size`` to ``(rows, cols)``; 6x6 when neither is given.

    Raises:
        ValueError: ``dim_room`` is not two ints, ``size`` not an int (a float such as 6.5 is refused rather
            than cut to 6), or the two disagree.
    """
    if size is not None and not _whole(size):
        raise ValueError(f"size must be an int (the side of a square room, border included), got {size!r}")
    if dim_room is None:
        side = 6 if size is None else int(size)
        return side, side
    if not (isinstance(dim_room, (tuple, list)) and len(dim_room) == 2 and all(map(_whole, dim_room))):
        raise ValueError(f"dim_room must be two ints (rows, cols), border included, e.g. (6, 6); got {dim_room!r}")
    rows, cols = int(dim_room[0]), int(dim_room[1])
    if size is not None and (rows, cols) != (size, size):
        raise ValueError(f"dim_room={tuple(dim_room)} and size={size} disagree; give one of them")
    return rows, cols


def _check_text_fits(rows: int, cols: int, symbols: str) -> None:
    """Raise ValueError if the longest text observation could exceed the observation space: a grid has a symbol a
    cell (VAGEN's four characters) and a newline a row."""
    listed = 200 + rows * cols * (10 + 2 * len(str(max(rows, cols))))  # every cell listed as "(r, c), "
    grid = rows * (cols * (VAGEN_CELL_WIDTH if symbols == "vagen" else 1) + 1)
    longest = {"coords": listed, "grid_coords": listed + rows * (cols + 1)}.get(symbols, grid)
    check_text_fits(longest, f"a {rows}x{cols} room with symbols={symbols!r}")


def _listing(cells, cols: int) -> str:
    """``"(r, c), (r, c)"`` for cell numbers, or ``"none"``."""
    text = ", ".join(f"({cell // cols}, {cell % cols})" for cell in cells)
    return text or "none"

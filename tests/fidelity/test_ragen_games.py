"""RAGEN's Sudoku and Spatial envs: action reading and the step limit.

Encodes mll-lab-nu/RAGEN at commit 20daedc47558e000f7de912b060646bf2e8026bd: ``ragen/env/sudoku/env.py``
(``parse_action`` tries its patterns with ``re.search`` on the lowered text, so a move inside a sentence
counts; ``step`` returns ``done=False`` for an unreadable move, a given cell or a clash, whatever the step
count, and ``done = solved or num_steps >= max_steps`` only after a placement) and ``ragen/env/spatial/env.py``
(``step`` returns ``done=False`` for an unreadable sequence, whatever the step count).
"""

from __future__ import annotations

from turnrl.envs import make
from turnrl.envs.games.sudoku import Move, parse_action


def test_sudoku_reads_a_move_anywhere_in_the_text():
    assert parse_action("I place 5 at row 2 col 3", 9) == Move(1, 2, 5)
    assert parse_action("ok: 2,3,5 then", 9) == Move(1, 2, 5)
    assert parse_action("123,4,5", 9) is None  # a whole number, not its last two digits


def test_sudoku_does_not_end_on_an_invalid_move_at_the_step_limit():
    env = make("Sudoku", max_steps=2)
    env.reset(seed=0)
    env.step("nonsense")
    _, _, terminated, truncated, info = env.step("still nonsense")
    assert not info["action_is_valid"] and not terminated and not truncated
    given = next(i for i, digit in enumerate(env.grid) if digit)
    row, col = divmod(given, env.size)
    _, _, _, truncated, info = env.step(f"place 1 at row {row + 1} col {col + 1}")  # a given cell: illegal
    assert "illegal" in info and not truncated


def test_spatial_does_not_end_on_an_unreadable_turn_at_the_step_limit():
    env = make("Spatial", max_steps=1)
    env.reset(seed=0)
    _, _, terminated, truncated, info = env.step("no actions here")
    assert not info["action_is_valid"] and not terminated and not truncated
    _, _, _, truncated, info = env.step("Actions: [Observe()]")
    assert info["action_is_valid"] and truncated

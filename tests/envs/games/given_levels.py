"""What a test of a given level asserts: refused, naming why, where it cannot be won; else won by the expert. And
the levels a fuzz test gives: grids of an env's symbols that get past its parser's first checks."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import strategies as st

from turnrl.envs.contract import TurnEnv


def refused_or_won(env: TurnEnv, level: Any, winnable: bool, refusal: str) -> None:
    """``env.reset(options={"level": level})`` raises a ValueError matching ``refusal`` unless ``winnable`` (as a
    plain reference search says); a level it accepts is won by following ``env.solve()``."""
    if not winnable:
        with pytest.raises(ValueError, match=refusal):
            env.reset(options={"level": level})
        return
    env.reset(options={"level": level})
    plan = env.solve()
    assert plan is not None
    for action in plan:
        env.step(action)
    assert env.success()


@st.composite
def square_levels(draw: st.DrawFn, sides: tuple[int, int], ground: str, pieces: list[str]) -> str:
    """A square grid of ``ground`` symbols (a side in ``sides``) with one of ``pieces`` (a start and a goal, mostly)
    placed on distinct cells: a level that gets past its parser's checks to the env's."""
    n = draw(st.integers(*sides))
    cells = draw(st.lists(st.sampled_from(ground), min_size=n * n, max_size=n * n))
    placed = draw(st.sampled_from(pieces))
    for piece, spot in zip(placed, draw(st.lists(st.integers(0, n * n - 1), min_size=3, max_size=3, unique=True))):
        cells[spot] = piece
    return "\n".join("".join(cells[r * n : (r + 1) * n]) for r in range(n))

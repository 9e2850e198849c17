"""The noisy expert's exact outcomes against every path of moves enumerated and weighed by hand."""

from __future__ import annotations

import itertools

import pytest

from benchmarks.sokoban_ceiling import mean_outcome, outcome, p_for, plan, validation_levels
from turnrl.envs.games.sokoban.levels import DIRECTIONS, apply_moves


def enumerated(level, p: float, budget: int) -> tuple[float, float, float]:
    """Every sequence of ``budget`` moves weighed by the policy's chance of playing it. A sequence that solves
    after ``k`` moves stands for the 4 ** (budget - k) sequences sharing its first ``k``: each gets its share."""
    solved = dead = out = 0.0
    for moves in itertools.product(range(len(DIRECTIONS)), repeat=budget):
        grid, chance, played = level, 1.0, 0
        for move in moves:
            if grid.is_solved():
                break
            best = plan(grid)
            if best is None:  # deadlocked: the expert too plays at random
                chance /= len(DIRECTIONS)
            else:
                chance *= (1 - p) / len(DIRECTIONS) + (p if move == best[0] else 0.0)
            grid, played = apply_moves(grid, [move]), played + 1
        chance /= len(DIRECTIONS) ** (budget - played)
        if grid.is_solved():
            solved += chance
        elif plan(grid) is None:
            dead += chance
        else:
            out += chance
    return solved, dead, out


@pytest.fixture(scope="module")
def levels():
    return validation_levels(6, 1, 12)


@pytest.mark.parametrize("p", [0.0, 0.3, 0.9])
def test_the_recursion_is_every_path_weighed(levels, p):
    for level in levels[:6]:
        assert outcome(level, p, 4) == pytest.approx(enumerated(level, p, 4), abs=1e-12)


def test_the_solver_alone_solves_what_the_budget_allows_and_success_rises_with_p(levels):
    for level in levels:
        assert outcome(level, 1.0, 10)[0] == (1.0 if len(plan(level)) <= 10 else 0.0)
    solved = [mean_outcome(levels, p, 10)[0] for p in (0.0, 0.5, 1.0)]
    assert solved == sorted(solved) and solved[0] < solved[2]
    middle = p_for(levels, (solved[0] + solved[2]) / 2, 10)
    assert middle is not None and mean_outcome(levels, middle, 10)[0] == pytest.approx((solved[0] + solved[2]) / 2,
                                                                                         abs=1e-6)
    assert p_for(levels, 1.5, 10) is None

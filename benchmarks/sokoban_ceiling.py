"""What a noisy expert scores on Sokoban's validation levels: the yardstick for the SFT starts and RL runs.

The policy ``mix(p)`` plays the solver's move (the first move of a fewest-moves plan, as the SFT demos'
expert does) with probability ``p`` and otherwise one of the four moves at random, as the demos with
``sft.random_action_share = 1 - p`` do; on a deadlocked grid every move is random. For each ``p`` the script
prints, exactly (a recursion over the grids reachable within the action budget, not sampled), the share of
episodes solved within ``agent.max_actions_per_episode`` moves, ended on a deadlocked grid (no plan left:
the env does not stop there, the episode runs out its moves), or ended still solvable with no moves left;
then the ``p`` at which ``mix(p)`` reaches each ``--targets`` success, and the levels' fewest-moves lengths.

An RL run's success read against this table says how often its policy would have to play the solver's move
to score as it does; ``p = 0`` is a policy that ignores the grid.

    python benchmarks/sokoban_ceiling.py                                   # the Sokoban quickstart's levels
    python benchmarks/sokoban_ceiling.py --targets 0.31 0.61 --budget 10 --episodes 128
    python benchmarks/sokoban_ceiling.py --size 8 --boxes 2 --search-depth 10 --p 1.0 --targets   # LargerSokoban
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import Counter
from collections.abc import Sequence
from functools import cache
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from turnrl.envs import make  # noqa: E402
from turnrl.envs.games.sokoban.levels import DIRECTIONS, Level, apply_moves, solve  # noqa: E402
from turnrl.envs.seeds import SeedSplits  # noqa: E402


@cache
def plan(level: Level) -> tuple[int, ...] | None:
    """The solver's fewest-moves plan from ``level`` (empty when solved), None on a deadlocked grid."""
    moves = solve(level)
    return None if moves is None else tuple(moves)


def outcome(level: Level, p: float, budget: int) -> tuple[float, float, float]:
    """``mix(p)`` from ``level`` with ``budget`` moves: (solved, ended deadlocked, ended solvable, out of moves).

    Written by hand: the exact probabilities by recursion over (grid, moves left), each reached grid's value
    computed once; the three sum to 1.
    """
    memo: dict[tuple[Level, int], tuple[float, float]] = {}

    def solved_and_dead(grid: Level, left: int) -> tuple[float, float]:
        if grid.is_solved():
            return 1.0, 0.0
        moves = plan(grid)
        if moves is None:
            return 0.0, 1.0
        if left == 0:
            return 0.0, 0.0
        key = (grid, left)
        if key not in memo:
            solved = dead = 0.0
            for move in range(len(DIRECTIONS)):
                weight = (1 - p) / len(DIRECTIONS) + (p if move == moves[0] else 0.0)
                if weight:
                    s, d = solved_and_dead(apply_moves(grid, [move]), left - 1)
                    solved, dead = solved + weight * s, dead + weight * d
            memo[key] = (solved, dead)
        return memo[key]

    solved, dead = solved_and_dead(level, budget)
    return solved, dead, 1.0 - solved - dead


def mean_outcome(levels: Sequence[Level], p: float, budget: int) -> tuple[float, float, float]:
    """:func:`outcome` averaged over ``levels`` (one validation episode each)."""
    outcomes = [outcome(level, p, budget) for level in levels]
    return tuple(statistics.fmean(o[i] for o in outcomes) for i in range(3))  # type: ignore[return-value]


def p_for(levels: Sequence[Level], target: float, budget: int) -> float | None:
    """The ``p`` at which ``mix(p)`` solves ``target`` of ``levels`` (success rises with ``p``); None when
    ``target`` lies outside what ``p`` in [0, 1] reaches."""
    low, high = 0.0, 1.0
    if not mean_outcome(levels, low, budget)[0] <= target <= mean_outcome(levels, high, budget)[0]:
        return None
    for _ in range(30):
        middle = (low + high) / 2
        low, high = (middle, high) if mean_outcome(levels, middle, budget)[0] < target else (low, middle)
    return (low + high) / 2


def validation_levels(size: int, boxes: int, episodes: int, search_depth: int | None = None) -> list[Level]:
    """The levels of a run's ``episodes`` validation episodes (seeds from :class:`SeedSplits`)."""
    env = make("Sokoban", size=size, num_boxes=boxes, search_depth=search_depth)
    levels = []
    for seed in SeedSplits().val_seeds(episodes):
        env.reset(seed=seed)
        levels.append(env.current_level())
    return levels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=6)
    parser.add_argument("--boxes", type=int, default=1)
    parser.add_argument("--budget", type=int, default=10, help="agent.max_actions_per_episode")
    parser.add_argument("--episodes", type=int, default=128, help="validation.episodes")
    parser.add_argument("--p", type=float, nargs="+", default=[0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.55, 0.6, 0.7, 0.8,
                                                                0.9, 1.0])
    parser.add_argument("--targets", type=float, nargs="*", default=[0.31, 0.45, 0.61])
    parser.add_argument("--search-depth", type=int, default=None,
                        help="the env's search_depth (RAGEN's LargerSokoban: 10); default: its max_steps")
    args = parser.parse_args()
    levels = validation_levels(args.size, args.boxes, args.episodes, args.search_depth)
    lengths = Counter(len(plan(level) or ()) for level in levels)
    within = sum(n for length, n in lengths.items() if length <= args.budget) / len(levels)
    mean = sum(length * n for length, n in lengths.items()) / len(levels)
    print(f"{len(levels)} validation levels, {args.size}x{args.size}, {args.boxes} box(es); fewest moves: "
          + ", ".join(f"{length}: {lengths[length]}" for length in sorted(lengths))
          + f"; mean {mean:.2f}; {within:.1%} solvable within {args.budget} moves")
    print("\n| p (solver's move) | demos' random share | solved | ended deadlocked | ended solvable, out of moves |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for p in args.p:
        solved, dead, out = mean_outcome(levels, p, args.budget)
        print(f"| {p:.2f} | {1 - p:.2f} | {solved:.3f} | {dead:.3f} | {out:.3f} |")
    print()
    for target in args.targets:
        p = p_for(levels, target, args.budget)
        print(f"success {target:.2f}: " + ("out of reach" if p is None else f"p = {p:.3f}"))


if __name__ == "__main__":
    main()

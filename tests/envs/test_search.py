"""shortest_path against a brute-force reference on small graphs."""

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from turnrl.envs.search import shortest_path


def _grid_successors(walls: set[tuple[int, int]], size: int):
    moves = (("U", -1, 0), ("D", 1, 0), ("L", 0, -1), ("R", 0, 1))

    def successors(cell):
        r, c = cell
        for label, dr, dc in moves:
            nxt = (r + dr, c + dc)
            if 0 <= nxt[0] < size and 0 <= nxt[1] < size and nxt not in walls:
                yield label, nxt

    return successors


def _follow(start, labels, successors):
    state = start
    for label in labels:
        state = dict(successors(state))[label]
    return state


def _brute_force_length(start, goal, successors, limit):
    """Length of the shortest label sequence, by trying every sequence up to ``limit``."""
    for length in range(limit + 1):
        for labels in itertools.product("UDLR", repeat=length):
            state = start
            for label in labels:
                state = dict(successors(state)).get(label)
                if state is None:
                    break
            if state == goal:
                return length
    return None


def test_start_equals_goal_is_empty_path():
    assert shortest_path((0, 0), (0, 0), _grid_successors(set(), 3)) == []


def test_unreachable_goal_is_none():
    walls = {(0, 1), (1, 0), (1, 1)}
    assert shortest_path((0, 0), (2, 2), _grid_successors(walls, 3)) is None


def test_path_is_deterministic_in_successor_order():
    assert shortest_path((0, 0), (1, 1), _grid_successors(set(), 2)) == ["D", "R"]


@settings(max_examples=60, deadline=None)
@given(walls=st.sets(st.tuples(st.integers(0, 2), st.integers(0, 2)), max_size=4))
def test_matches_brute_force_on_3x3_grids(walls):
    walls = walls - {(0, 0), (2, 2)}
    successors = _grid_successors(walls, 3)
    path = shortest_path((0, 0), (2, 2), successors)
    expected = _brute_force_length((0, 0), (2, 2), successors, limit=8)
    if expected is None:
        assert path is None
    else:
        assert len(path) == expected
        assert _follow((0, 0), path, successors) == (2, 2)

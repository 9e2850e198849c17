"""Breadth-first search over a discrete state space, shared by the grid envs' solvers."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable, Iterable
from typing import TypeVar

State = TypeVar("State", bound=Hashable)
Label = TypeVar("Label")


def shortest_path(
    start: State, goal: State, successors: Callable[[State], Iterable[tuple[Label, State]]]
) -> list[Label] | None:
    """Labels of the edges of a shortest path from ``start`` to ``goal``, or None if unreachable.

    ``successors(state)`` yields ``(label, next_state)`` pairs; they are tried
    in the order given, so the path is deterministic.
    """
    if start == goal:
        return []
    parent: dict[State, tuple[State, Label] | None] = {start: None}
    queue = deque([start])
    while queue:
        state = queue.popleft()
        for label, nxt in successors(state):
            if nxt in parent:
                continue
            parent[nxt] = (state, label)
            if nxt == goal:
                path = []
                step = parent[nxt]
                while step is not None:
                    state, label = step
                    path.append(label)
                    step = parent[state]
                return path[::-1]
            queue.append(nxt)
    return None

"""Which sequence's tokens each KV-cache row holds, and finding a row whose tokens a new prompt extends.

A row is free, running (a sequence is generating in it) or idle (it holds the
tokens of a finished sequence, which the next turn of that episode will most
likely extend). A new prompt takes the idle row with the longest cached
prefix of it, else a free row, else the least recently used idle row (its
cache is dropped: that sequence will be prefilled again if it comes back).
"""

from __future__ import annotations

from dataclasses import dataclass, field

PREFIX_KEY_TOKENS = 16
"""Idle rows are indexed by their first tokens; only rows whose first tokens equal the prompt's are compared."""

FREE, RUNNING, IDLE = "free", "running", "idle"


@dataclass
class Row:
    index: int
    state: str = FREE
    tokens: list[int] = field(default_factory=list)
    """The tokens whose keys and values are in this row, in order."""
    last_used: int = 0


@dataclass
class Placement:
    row: int
    reused: int
    """Tokens of the prompt already in the row (not prefilled again)."""
    evicted: bool
    """An idle row's cache was dropped to make room."""


class RowTable:
    def __init__(self, rows: int) -> None:
        self.rows = [Row(i) for i in range(rows)]
        self._by_prefix: dict[tuple[int, ...], set[int]] = {}
        self._clock = 0

    def _key(self, tokens: list[int]) -> tuple[int, ...] | None:
        return tuple(tokens[:PREFIX_KEY_TOKENS]) if len(tokens) >= PREFIX_KEY_TOKENS else None

    def _unindex(self, row: Row) -> None:
        key = self._key(row.tokens)
        if key is not None and key in self._by_prefix:
            self._by_prefix[key].discard(row.index)
            if not self._by_prefix[key]:
                del self._by_prefix[key]

    def place(self, prompt: list[int]) -> Placement | None:
        """Take a row for ``prompt``, reusing the longest cached prefix; None when every row is running."""
        best, best_len = None, 0
        key = self._key(prompt)
        for index in self._by_prefix.get(key, ()) if key is not None else ():
            tokens = self.rows[index].tokens
            # A prompt equal to the cached tokens still needs its last token run, for the next logits.
            usable = min(len(tokens), len(prompt) - 1)
            if usable > best_len and prompt[:usable] == tokens[:usable]:
                best, best_len = self.rows[index], usable
        evicted = False
        if best is None:
            free = [row for row in self.rows if row.state == FREE]
            if free:
                best = free[0]
            else:
                idle = [row for row in self.rows if row.state == IDLE]
                if not idle:
                    return None
                best = min(idle, key=lambda row: row.last_used)
                evicted = True
        self._unindex(best)
        best.state = RUNNING
        best.tokens = list(prompt[:best_len])
        return Placement(best.index, best_len, evicted)

    def release(self, index: int, cached_tokens: list[int]) -> None:
        """A sequence finished in row ``index``; its ``cached_tokens`` stay for a later prompt to extend."""
        row = self.rows[index]
        self._clock += 1
        row.state, row.tokens, row.last_used = IDLE, list(cached_tokens), self._clock
        key = self._key(row.tokens)
        if key is None:
            row.state, row.tokens = FREE, []
        else:
            self._by_prefix.setdefault(key, set()).add(index)

    def clear(self) -> None:
        """Drop every idle row's tokens (the weights changed: cached keys and values are stale)."""
        for row in self.rows:
            if row.state == IDLE:
                self._unindex(row)
                row.state, row.tokens = FREE, []

    def counts(self) -> dict[str, int]:
        states = [row.state for row in self.rows]
        return {state: states.count(state) for state in (FREE, RUNNING, IDLE)}

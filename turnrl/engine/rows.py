"""Which sequence's tokens each KV-cache row holds, and finding a row whose tokens a new prompt extends.

A row is free, running (a sequence is generating in it) or idle (it holds the
tokens of a finished sequence, which the next turn of that episode will most
likely extend). A new prompt takes the idle row with the longest cached
prefix of it, else the lowest row that is free or idle (an idle row's cache
is dropped: that sequence will be prefilled again if it comes back). When the
cache's pages run short, the engine evicts idle rows, those idle longest first
(:meth:`RowTable.idle_rows`).
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
    """The tokens whose keys and values are in this row, in order (of a running row: the reused prefix only, until
    its sequence finishes and :meth:`RowTable.release` records them all)."""
    released: int = 0
    """When it last became idle (a count of releases)."""


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
        self._releases = 0

    def _key(self, tokens: list[int]) -> tuple[int, ...] | None:
        return tuple(tokens[:PREFIX_KEY_TOKENS]) if len(tokens) >= PREFIX_KEY_TOKENS else None

    def _unindex(self, row: Row) -> None:
        key = self._key(row.tokens)
        if key is not None and key in self._by_prefix:
            self._by_prefix[key].discard(row.index)
            if not self._by_prefix[key]:
                del self._by_prefix[key]

    def place(self, prompt: list[int]) -> Placement | None:
        """Take a row for ``prompt`` (:meth:`choose`, then :meth:`take`); None when every row is running."""
        placement = self.choose(prompt)
        if placement is not None:
            self.take(placement, prompt)
        return placement

    def choose(self, prompt: list[int]) -> Placement | None:
        """The row ``prompt`` would take, changing nothing: the one whose cached tokens are its longest prefix,
        else the lowest free or idle row; None when every row is running."""
        best, best_len = None, 0
        key = self._key(prompt)
        for index in self._by_prefix.get(key, ()) if key is not None else ():
            tokens = self.rows[index].tokens
            # A prompt equal to the cached tokens still needs its last token run, for the next logits.
            usable = min(len(tokens), len(prompt) - 1)
            if usable > best_len and self.begins_with(prompt, tokens, usable):
                best, best_len = self.rows[index], usable
        if best is not None:
            return Placement(best.index, best_len, evicted=False)
        # The lowest row that is free or idle: decode computes rows 0 .. highest running, so low rows keep it
        # short. An idle row's cache is given up for it; the sequence that left it (most likely finished, or
        # windowed out of its next prompt) is prefilled again if it comes back.
        open_rows = [row for row in self.rows if row.state != RUNNING]
        if not open_rows:
            return None
        return Placement(open_rows[0].index, 0, evicted=open_rows[0].state == IDLE)

    def take(self, placement: Placement, prompt: list[int]) -> None:
        """Mark ``placement``'s row running ``prompt``, holding the reused prefix only."""
        row = self.rows[placement.row]
        self._unindex(row)
        row.state = RUNNING
        row.tokens = list(prompt[: placement.reused])

    @staticmethod
    def begins_with(prompt: list[int], tokens: list[int], usable: int) -> bool:
        """Whether ``prompt``'s first ``usable`` tokens are ``tokens``'.

        Every idle row of a recipe's episodes shares the index key (one system prompt), and only the episode's own
        row usually matches: the last of those tokens is compared first, which drops the others without copying
        and comparing thousands of tokens each (a VisGym step's 960 prompts placed 7.3-7.8x faster on a CPU,
        ``benchmarks/prompt_inputs.py``).
        """
        return usable == 0 or (prompt[usable - 1] == tokens[usable - 1] and prompt[:usable] == tokens[:usable])

    def release(self, index: int, cached_tokens: list[int]) -> None:
        """A sequence finished in row ``index``; its ``cached_tokens`` stay for a later prompt to extend."""
        row = self.rows[index]
        self._releases += 1
        row.state, row.tokens, row.released = IDLE, list(cached_tokens), self._releases
        key = self._key(row.tokens)
        if key is None:
            row.state, row.tokens = FREE, []
        else:
            self._by_prefix.setdefault(key, set()).add(index)

    def idle_rows(self) -> list[int]:
        """The idle rows, those idle longest first."""
        return [row.index for row in sorted((r for r in self.rows if r.state == IDLE), key=lambda r: r.released)]

    def evict(self, index: int) -> None:
        """Drop an idle row's tokens (its cache pages are given to another sequence)."""
        row = self.rows[index]
        if row.state != IDLE:
            raise ValueError(f"row {index} is {row.state}, not idle: only an idle row's tokens can be evicted")
        self._unindex(row)
        row.state, row.tokens = FREE, []

    def clear(self) -> list[int]:
        """Drop every idle row's tokens (the weights changed: cached keys and values are stale); returns those rows."""
        cleared = self.idle_rows()
        for index in cleared:
            self.evict(index)
        return cleared

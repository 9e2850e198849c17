"""The running sequences' bookkeeping as arrays indexed by cache row, updated once per step for the whole batch.

A decode step samples one token for each running row; appending it, counting
it against the sequence's budget and checking it against the sequence's stop
ids are a few numpy operations on the step's rows, instead of Python per
sequence (at a batch of 256, the per-sequence loop cost more host time than
a GPU's decode step leaves). Texts are searched for stop strings only after a
token that can complete one (:mod:`turnrl.engine.stops`).

Notation: R cache rows, n rows in the step, W generated tokens held per row.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import NamedTuple

import numpy as np


class TokenChecks(NamedTuple):
    """What a step's new tokens mean for their sequences, each Shape (n,) bool."""

    stop_id: np.ndarray
    """The token is one of the sequence's stop ids."""
    spent: np.ndarray
    """The sequence has generated its budget."""
    search: np.ndarray
    """The token can complete one of the sequence's stop strings: its text must be searched."""


SPARE_SETS = 8
"""Sets beyond twice those in use that a :class:`VocabularySets` holds before it drops the unused ones."""


class VocabularySets:
    """Per distinct set (of stop ids, of stop strings), a mask over the vocabulary, and each row's set.

    Sets are shared by the rows that use the same one, so a batch of one setting holds one mask, not one a row.
    The sets that no row refers to any more are dropped once the table has grown to twice the sets in use at the
    last drop (and :data:`SPARE_SETS` more): a server whose requests each bring their own stop strings would
    otherwise grow it by a vocabulary's mask per request, and copy it whole for each new one.

    Args:
        rows: R, the cache rows.
        vocab_size: the masks' length.
        empty: the key of set 0, whose mask is all False (every row's set to start with).
    """

    def __init__(self, rows: int, vocab_size: int, empty: Hashable) -> None:
        self.table = np.zeros((1, vocab_size), dtype=bool)
        """Each set's mask, Shape (sets, vocab); set 0 is ``empty``'s."""
        self.index = np.zeros(rows, dtype=np.int64)
        """Each row's set, Shape (R,)."""
        self._sets: dict[Hashable, int] = {empty: 0}
        self._limit = 1 + SPARE_SETS
        """Sets held before the unused ones are dropped."""

    def assign(self, row: int, key: Hashable, mask: Callable[[], np.ndarray]) -> None:
        """Give ``row`` the set ``key``, making its mask with ``mask()`` (Shape (vocab,) bool) if it is new."""
        if key not in self._sets:
            if len(self._sets) >= self._limit:
                self.index[row] = 0  # its old set is no longer its own
                self._drop_unused()
                self._limit = 2 * len(self._sets) + SPARE_SETS
            self.table = np.concatenate((self.table, mask()[None]))
            self._sets[key] = len(self._sets)
        self.index[row] = self._sets[key]

    def _drop_unused(self) -> None:
        """Keep the sets that some row refers to (set 0 always), renumbered in their order."""
        used = np.union1d([0], self.index)
        renumber = np.zeros(len(self.table), dtype=np.int64)
        renumber[used] = np.arange(len(used))
        kept = set(used.tolist())
        self._sets = {key: int(renumber[i]) for key, i in self._sets.items() if i in kept}
        self.table, self.index = self.table[used], renumber[self.index]


class RunningRows:
    """Generated tokens, logprobs, counters and stop-id sets of the sequences in each row.

    Args:
        rows: R, the cache rows.
        vocab_size: the model's vocabulary (sampled ids are below it; stop ids at or above it never match).
        width: W, generated tokens held per row to start with (doubled when a sequence needs more).
    """

    def __init__(self, rows: int, vocab_size: int, width: int = 256) -> None:
        self.vocab_size = vocab_size
        self.cached = np.zeros(rows, dtype=np.int64)
        """Tokens whose keys and values are in the row: the next decode step's position, Shape (R,)."""
        self.count = np.zeros(rows, dtype=np.int64)
        """Tokens generated, Shape (R,)."""
        self.budget = np.zeros(rows, dtype=np.int64)
        """Tokens the sequence may generate (max_new_tokens, within the row's length), Shape (R,)."""
        self.tokens = np.zeros((rows, width), dtype=np.int64)
        """Generated tokens, Shape (R, W)."""
        self.logprobs = np.zeros((rows, width), dtype=np.float32)
        """Their logprobs, Shape (R, W)."""
        self.stop_ids = VocabularySets(rows, vocab_size, frozenset())
        """Per distinct set of stop ids, which tokens are in it; the empty set has none."""
        self.stop_strings = VocabularySets(rows, vocab_size, ())
        """Per distinct set of stop strings, the tokens that can complete one; no stop strings, none."""

    def start(self, row: int, cached: int, budget: int, stop_ids: tuple[int, ...] = (),
              stop_strings: tuple[str, ...] = (),
              string_candidates: Callable[[tuple[str, ...]], np.ndarray] | None = None) -> None:
        """A sequence takes ``row`` with ``cached`` tokens prefilled and may generate ``budget`` tokens.

        ``string_candidates`` gives the tokens that can complete one of ``stop_strings``, Shape (vocab,) bool
        (:meth:`~turnrl.engine.stops.StopStringFilter.candidates`); without it stop strings are not checked.
        """
        self.cached[row], self.count[row], self.budget[row] = cached, 0, budget
        key = frozenset(t for t in stop_ids if 0 <= t < self.vocab_size)

        def members() -> np.ndarray:
            member = np.zeros(self.vocab_size, dtype=bool)
            member[list(key)] = True
            return member

        self.stop_ids.assign(row, key, members)
        if string_candidates is None:
            self.stop_strings.assign(row, (), lambda: np.zeros(self.vocab_size, dtype=bool))
        else:
            self.stop_strings.assign(row, stop_strings, lambda: string_candidates(stop_strings))

    def record(self, rows: np.ndarray, tokens: np.ndarray, logprobs: np.ndarray) -> TokenChecks:
        """Append a sampled token to each of ``rows``.

        Args:
            rows: Shape (n,) int64, distinct. tokens: Shape (n,) int64, below the vocabulary size.
            logprobs: Shape (n,) float32.
        """
        count = self.count[rows]
        if int(count.max(initial=0)) >= self.tokens.shape[1]:
            self._widen(2 * self.tokens.shape[1])
        self.tokens[rows, count] = tokens
        self.logprobs[rows, count] = logprobs
        self.count[rows] = count + 1
        return TokenChecks(stop_id=self.stop_ids.table[self.stop_ids.index[rows], tokens],
                           spent=count + 1 >= self.budget[rows],
                           search=self.stop_strings.table[self.stop_strings.index[rows], tokens])

    def _widen(self, width: int) -> None:
        grown = np.zeros((self.tokens.shape[0], width), dtype=np.int64)
        grown[:, : self.tokens.shape[1]] = self.tokens
        grown_logprobs = np.zeros((self.tokens.shape[0], width), dtype=np.float32)
        grown_logprobs[:, : self.tokens.shape[1]] = self.logprobs
        self.tokens, self.logprobs = grown, grown_logprobs

    def generated(self, row: int) -> tuple[list[int], list[float]]:
        """The row's generated tokens and their logprobs."""
        count = int(self.count[row])
        return self.tokens[row, :count].tolist(), self.logprobs[row, :count].tolist()

    def tail(self, row: int, length: int) -> list[int]:
        """The row's last ``length`` generated tokens (fewer if it has fewer)."""
        count = int(self.count[row])
        return self.tokens[row, max(0, count - length) : count].tolist()

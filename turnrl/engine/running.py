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

from collections.abc import Callable
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
        self.stop_set = np.zeros(rows, dtype=np.int64)
        """The row's index into :attr:`stop_table`, Shape (R,)."""
        self.tokens = np.zeros((rows, width), dtype=np.int64)
        """Generated tokens, Shape (R, W)."""
        self.logprobs = np.zeros((rows, width), dtype=np.float32)
        """Their logprobs, Shape (R, W)."""
        self.stop_table = np.zeros((1, vocab_size), dtype=bool)
        """Per distinct set of stop ids, which tokens are in it, Shape (sets, vocab); set 0 is empty."""
        self.string_set = np.zeros(rows, dtype=np.int64)
        """The row's index into :attr:`string_table`, Shape (R,)."""
        self.string_table = np.zeros((1, vocab_size), dtype=bool)
        """Per distinct set of stop strings, the tokens that can complete one, Shape (sets, vocab); set 0 (no stop
        strings) has none."""
        self._stop_sets: dict[frozenset[int], int] = {frozenset(): 0}
        self._string_sets: dict[tuple[str, ...], int] = {(): 0}

    def start(self, row: int, cached: int, budget: int, stop_ids: tuple[int, ...] = (),
              stop_strings: tuple[str, ...] = (),
              string_candidates: Callable[[tuple[str, ...]], np.ndarray] | None = None) -> None:
        """A sequence takes ``row`` with ``cached`` tokens prefilled and may generate ``budget`` tokens.

        ``string_candidates`` gives the tokens that can complete one of ``stop_strings``, Shape (vocab,) bool
        (:meth:`~turnrl.engine.stops.StopStringFilter.candidates`); without it stop strings are not checked.
        """
        self.cached[row], self.count[row], self.budget[row] = cached, 0, budget
        key = frozenset(t for t in stop_ids if 0 <= t < self.vocab_size)
        if key not in self._stop_sets:
            member = np.zeros(self.vocab_size, dtype=bool)
            member[list(key)] = True
            self.stop_table = np.concatenate((self.stop_table, member[None]))
            self._stop_sets[key] = len(self._stop_sets)
        self.stop_set[row] = self._stop_sets[key]
        strings = stop_strings if string_candidates is not None else ()
        if strings not in self._string_sets:
            self.string_table = np.concatenate((self.string_table, string_candidates(strings)[None]))  # type: ignore[misc]
            self._string_sets[strings] = len(self._string_sets)
        self.string_set[row] = self._string_sets[strings]

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
        return TokenChecks(stop_id=self.stop_table[self.stop_set[rows], tokens], spent=count + 1 >= self.budget[rows],
                           search=self.string_table[self.string_set[rows], tokens])

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

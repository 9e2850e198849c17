"""What runs next: which waiting sequences are admitted, into which cache rows and pages, how they are prefilled
together, which rows decode, and when a sequence ends.

The scheduler keeps the queue (``waiting``), the sequences generating by row (``running``) and their progress
(:class:`~turnrl.engine.running.RunningRows`), the rows' cached tokens (:class:`~turnrl.engine.rows.RowTable`)
and each row's pages in the cache (:class:`~turnrl.engine.cache.KVCache`'s page accounting: it never reads the
keys and values). It runs no model: the :class:`~turnrl.engine.model_runner.ModelRunner` runs what it plans, and
:class:`~turnrl.engine.llm_engine.Engine` passes plans and sampled tokens between the two.

A sequence takes, when it is admitted, the pages of its prompt and its generation budget, not of ``max_seq_len``,
so that short turns share the budget among many. When the pages run short, the idle rows (finished sequences kept
for their next turn) give theirs up, those idle longest first, and an evicted sequence is prefilled again if it
returns; when running sequences hold them all, new sequences wait. Nothing is dropped.

Sampled tokens are read one step late (the model runner launches step n before the host reads step n-1), so the
scheduler counts each row's tokens in flight: a row whose in-flight token is its last is left out of the next
step, and a launched token of a row that finished since is dropped when read.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from turnrl.engine.cache import KVCache, pages_for
from turnrl.engine.rows import PREFIX_KEY_TOKENS, RowTable
from turnrl.engine.running import RunningRows
from turnrl.engine.sequences import EngineStats, Result, SequenceRecord
from turnrl.engine.stops import StopStringFilter, stop_string_in_tail, tail_tokens

ADMIT_AFTER_STEPS = 8
"""Decode steps a waiting sequence waits at most for others to be prefilled with it."""


@dataclass
class PrefillChunk:
    """Sequences prefilled in one forward call."""

    sequences: list[SequenceRecord]
    """Each runs its uncached prompt tokens."""
    followers: list[tuple[int, SequenceRecord]]
    """(index in ``sequences`` of the sequence whose prompt it repeats, follower): the follower copies that one's
    keys and values into its own row and samples its first token from that one's logits."""


@dataclass
class DecodeBatch:
    """The rows that decode a token this step."""

    rows: np.ndarray
    """Ascending, Shape (n,) int64."""
    positions: np.ndarray
    """Each row's cached tokens: the position its input token takes, Shape (n,) int64."""


def identical_prompts(sequences: list[SequenceRecord]
                      ) -> tuple[list[SequenceRecord], dict[int, list[SequenceRecord]]]:
    """The first of each distinct prompt (with its images), in order, and by ``id`` of each the later sequences with
    the same one. Prompts are compared whole only within a bucket of equal length and first tokens: a pass that
    hashed every prompt would cost the host as much as the prefill's own bookkeeping."""
    leaders: list[SequenceRecord] = []
    followers: dict[int, list[SequenceRecord]] = {}
    buckets: dict[tuple[int, ...], list[SequenceRecord]] = {}
    for sequence in sequences:
        keys = sequence.keys
        bucket = buckets.setdefault((len(keys), *keys[:PREFIX_KEY_TOKENS]), [])
        leader = next((other for other in bucket if other.keys == keys), None)
        if leader is None:
            bucket.append(sequence)
            leaders.append(sequence)
            followers[id(sequence)] = []
        else:
            followers[id(leader)].append(sequence)
    return leaders, followers


def prefill_chunks(sequences: list[SequenceRecord], chunk_tokens: int) -> list[PrefillChunk]:
    """The prefill calls for newly admitted ``sequences``: identical prompts run once (the others follow the first),
    and the rest, shortest uncached part first, fill calls of at most ``chunk_tokens`` padded tokens (a sequence
    longer than that runs alone)."""
    leaders, followers = identical_prompts(sequences)
    pending = sorted(leaders, key=lambda s: len(s.prompt) - s.cached)
    chunks: list[list[SequenceRecord]] = [[]]
    for sequence in pending:
        chunk = chunks[-1]
        width = max([len(s.prompt) - s.cached for s in chunk] + [len(sequence.prompt) - sequence.cached])
        if chunk and width * (len(chunk) + 1) > chunk_tokens:
            chunks.append([])
        chunks[-1].append(sequence)
    return [PrefillChunk(chunk, [(i, f) for i, s in enumerate(chunk) for f in followers[id(s)]])
            for chunk in chunks if chunk]


class Scheduler:
    """The queue, the running sequences and the cache's rows and pages.

    Args:
        cache: the key/value cache, of which only the page accounting is used (``held``, ``free_pages``,
            ``resize``).
        max_len: the longest sequence, prompt and generated tokens.
        prefill_chunk_tokens: the most padded tokens of one prefill call (:func:`prefill_chunks`).
        stats: the counters it adds its admissions, evictions and generated tokens to.
        vocab_size: the model's vocabulary (stop ids at or above it never match).
        decode: token ids to text, for stop strings (None: a sequence with stop strings ends at once with an error).
    """

    def __init__(self, cache: KVCache, max_len: int, prefill_chunk_tokens: int, stats: EngineStats,
                 vocab_size: int, decode: Callable[[list[int]], str] | None = None) -> None:
        rows = cache.rows
        self.cache = cache
        self.max_len = max_len
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.stats = stats
        self.table = RowTable(rows)
        self.waiting: deque[SequenceRecord] = deque()
        self.running: dict[int, SequenceRecord] = {}  # by row
        self.finished: list[Result] = []
        self.progress = RunningRows(rows, vocab_size)
        """The running sequences' tokens, logprobs and counters, by row."""
        self._decode = decode
        self._stop_filter = StopStringFilter(decode, vocab_size) if decode is not None else None
        self._ids = itertools.count()
        self._steps_waited = 0
        self._live = np.zeros(rows, dtype=bool)
        """Rows whose sequence is running (a launched step's row that finished since is dropped when read)."""
        self._in_flight = np.zeros(rows, dtype=np.int64)
        """Tokens sampled for each row that the host has not read yet (0 or 1)."""
        self._running_rows: np.ndarray | None = None
        """The running rows in order; None after the running set changed."""

    # ------------------------------------------------------------------ the queue
    def new_id(self) -> int:
        return next(self._ids)

    def add(self, sequence: SequenceRecord, error: str | None = None) -> None:
        """Queue ``sequence``, or end it at once with ``error`` (the model cannot run it), when it may generate no
        token, or when its prompt is empty or leaves no room in a row."""
        prompt = sequence.prompt
        if error is not None:
            self.finished.append(Result(sequence.id, [], [], "error", error))
        elif sequence.params.max_new_tokens < 1:
            self.finished.append(Result(sequence.id, [], [], "error",
                                        f"max_new_tokens is {sequence.params.max_new_tokens}; give 1 or more"))
        elif not prompt:
            self.finished.append(Result(sequence.id, [], [], "error", "empty prompt"))
        elif sequence.params.stop_strings and self._decode is None:  # unchecked, they would be run past
            self.finished.append(Result(sequence.id, [], [], "error", "stop strings need the engine made with a "
                                        "decode function (token ids to text); give one, or stop on token ids"))
        elif len(prompt) >= self.max_len:
            self.finished.append(Result(
                sequence.id, [], [], "error",
                f"the prompt has {len(prompt)} tokens; the engine holds {self.max_len} a sequence "
                "(raise model.engine.max_seq_len)",
            ))
        else:
            self.waiting.append(sequence)

    def take_finished(self) -> list[Result]:
        """The sequences that ended since the last call."""
        done, self.finished = self.finished, []
        return done

    def abort(self, reason: str) -> list[Result]:
        """End every waiting and running sequence with an error; rows are freed, idle ones too. Returns those and
        the sequences that had ended already and were not yet taken (a refusal, a finish read in the failed step)."""
        self._in_flight[:] = 0
        self._live[:] = False
        aborted = [Result(s.id, [], [], "error", reason) for s in self.waiting]
        aborted += [Result(s.id, *self.progress.generated(row), "error", reason) for row, s in self.running.items()]
        self.waiting.clear()
        for row in list(self.running):
            del self.running[row]
            self._release_row(row, [])
        self._running_rows = None
        self.drop_idle_rows()
        return self.take_finished() + aborted

    # ------------------------------------------------------------------ admission
    def time_to_admit(self) -> bool:
        """Prefill waiting sequences in batches: a prefill call costs about as much for one sequence as for
        many, so while others decode, arrivals wait until they are a quarter of the running batch, or for
        ``ADMIT_AFTER_STEPS`` decode steps at most."""
        if not self.waiting:
            return False
        self._steps_waited += 1
        if not self.running or len(self.waiting) * 4 >= len(self.running) or self._steps_waited > ADMIT_AFTER_STEPS:
            self._steps_waited = 0
            return True
        return False

    def admit(self) -> list[SequenceRecord]:
        """Give waiting sequences, in order, a row and the pages of their prompt and budget; the first that finds
        none (every row running, or running sequences holding the pages) waits, and those behind it."""
        admitted = []
        self.cache.reserve_scratch()  # after the cache's memory was released
        while self.waiting:
            sequence = self.waiting[0]
            placement = self.table.choose(sequence.keys)
            if placement is None:
                break
            if not self._take_pages(placement.row, len(sequence.prompt) + self.budget(sequence)):
                # Running sequences hold the pages: it waits for one to finish, every row left as it was (an idle
                # row it would have taken keeps its episode's tokens).
                self.stats.page_waits += int(not sequence.waited_for_pages)
                sequence.waited_for_pages = True
                break
            self.table.take(placement, sequence.keys)
            self.waiting.popleft()
            sequence.row, sequence.cached, sequence.reused = placement.row, placement.reused, placement.reused
            self.stats.evictions += int(placement.evicted)
            self.stats.reused_tokens += placement.reused
            self.running[sequence.row] = sequence
            admitted.append(sequence)
        for sequence in admitted:
            params = sequence.params
            # A sequence ends at max_new_tokens or when it fills its row, whichever comes first.
            self.progress.start(sequence.row, len(sequence.prompt), self.budget(sequence), params.stop_ids,
                                params.stop_strings,
                                self._stop_filter.candidates if self._stop_filter is not None else None)
            self._live[sequence.row] = True
        if admitted:
            self._running_rows = None
        return admitted

    def budget(self, sequence: SequenceRecord) -> int:
        """Tokens it may generate: ``max_new_tokens``, or what is left of ``max_len`` after its prompt."""
        return min(sequence.params.max_new_tokens, self.max_len - len(sequence.prompt))

    def _take_pages(self, row: int, positions: int) -> bool:
        """Give ``row`` the pages of ``positions`` positions, evicting idle rows (those idle longest first) when the
        pool lacks them; False, evicting none, when running sequences hold too many."""
        missing = pages_for(positions) - self.cache.held(row)
        if missing > self.cache.free_pages:  # rare: the idle rows are looked at only then
            idle = [index for index in self.table.idle_rows() if index != row]
            if missing > self.cache.free_pages + sum(self.cache.held(index) for index in idle):
                return False  # the idle rows keep their tokens for their episodes' next turns
            for index in idle:
                if self.cache.free_pages >= missing:
                    break
                self.table.evict(index)
                self.cache.resize(index, 0)
                self.stats.evictions += 1
                self.stats.page_evictions += 1
        return self.cache.resize(row, positions)

    def _release_row(self, row: int, cached_tokens: list[int]) -> None:
        """The row's sequence has ended (or was not admitted): the row keeps ``cached_tokens`` for a later prompt
        to extend (when the table indexes them) and the pages that hold them; its other pages go back."""
        self.table.release(row, cached_tokens)
        self.cache.resize(row, len(self.table.rows[row].tokens))

    def drop_idle_rows(self) -> None:
        """Forget every idle row's cached tokens and free their pages (the weights changed, or the memory goes)."""
        for index in self.table.clear():
            self.cache.resize(index, 0)

    # ------------------------------------------------------------------ prefill and decode plans
    def prefill_plan(self, admitted: list[SequenceRecord]) -> list[PrefillChunk]:
        return prefill_chunks(admitted, self.prefill_chunk_tokens)

    def prefilled(self, chunk: PrefillChunk) -> None:
        """The chunk's prefill was launched: its sequences' prompts are cached, the followers' copied."""
        for sequence in chunk.sequences:
            sequence.cached = len(sequence.prompt)
        for _, follower in chunk.followers:
            self.stats.shared_tokens += len(follower.prompt) - follower.cached
            follower.cached = len(follower.prompt)

    def running_rows(self) -> np.ndarray:
        """The running rows in order, Shape (n,); the same array until a sequence starts or finishes."""
        if self._running_rows is None:
            self._running_rows = np.array(sorted(self.running), dtype=np.int64)
        return self._running_rows

    def decode_batch(self) -> DecodeBatch | None:
        """The running rows that may still generate a token, each advanced by the token it decodes now; None if
        none may."""
        if not self.running:
            return None
        rows = self.running_rows()
        # A row whose in-flight token is its last (its budget) has nothing more to decode.
        spent = self.progress.count[rows] + self._in_flight[rows] >= self.progress.budget[rows]
        if spent.any():
            rows = rows[~spent]
            if not len(rows):
                return None
        positions = self.progress.cached[rows]
        self.progress.cached[rows] = positions + 1
        return DecodeBatch(rows, positions)

    # ------------------------------------------------------------------ sampled tokens
    def launched(self, rows: np.ndarray) -> None:
        """A token was launched for each of ``rows``; :meth:`record` takes it."""
        self._in_flight[rows] += 1

    def drop_launch(self, rows: np.ndarray) -> None:
        """A launched step that will not be read (every sequence in it has ended): its rows are no longer in
        flight (a row's next sequence would count that token against its budget, and stop one token early or
        never end)."""
        self._in_flight[rows] -= 1

    def record(self, rows: np.ndarray, sampled: np.ndarray) -> None:
        """Record a launched step's tokens and end the sequences they finish; rows that finished since the launch
        are skipped.

        Args:
            rows: the rows launched, Shape (n,). sampled: their tokens and logprobs, Shape (2, n).
        """
        self._in_flight[rows] -= 1
        alive = self._live[rows]
        if not alive.all():
            rows, sampled = rows[alive], sampled[:, alive]
        if not len(rows):
            return
        new_tokens = sampled[0].astype(np.int64)
        checks = self.progress.record(rows, new_tokens, sampled[1].astype(np.float32))
        self.stats.generated_tokens += len(rows)
        stopped = checks.stop_id.copy()
        for i in np.flatnonzero(checks.search & ~stopped).tolist():
            stopped[i] = self._stop_string_found(int(rows[i]))
        for i in np.flatnonzero(stopped | checks.spent).tolist():
            self._finish(int(rows[i]), "stop" if stopped[i] else "length")

    def _stop_string_found(self, row: int) -> bool:
        """Whether the row's generated text now holds one of its stop strings (after a token that can end one)."""
        stop_strings = self.running[row].params.stop_strings
        assert self._decode is not None  # rows are searched only where a decode was given
        tail = self.progress.tail(row, tail_tokens(stop_strings))
        return stop_string_in_tail(tail, stop_strings, self._decode)

    def _finish(self, row: int, reason: str) -> None:
        sequence = self.running.pop(row)
        self._live[row] = False
        generated, logprobs = self.progress.generated(row)
        # The row holds the keys and values of its ``cached`` tokens: all but the last sampled one, or all of them
        # when the next step was launched before this one's tokens were read.
        self._release_row(row, (sequence.keys + generated)[: int(self.progress.cached[row])])
        self._running_rows = None
        self.finished.append(Result(sequence.id, generated, logprobs, reason, reused_tokens=sequence.reused))

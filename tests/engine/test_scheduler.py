"""The scheduler without a model: admission order and timing, prefill chunks under the token budget, pages and the
eviction of idle rows, finishing, and tokens in flight. The cache is a real one of a tiny shape on the CPU (the
scheduler reads only its page accounting); sampled tokens are given by hand."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from turnrl.engine.cache import PAGE_TOKENS, KVCache
from turnrl.engine.images import PromptImages
from turnrl.engine.rows import FREE, IDLE, RUNNING
from turnrl.engine.scheduler import ADMIT_AFTER_STEPS, Scheduler, identical_prompts, prefill_chunks
from turnrl.engine.sequences import EngineStats, SamplingParams, SequenceRecord
from turnrl.engine.weights import DecoderShape

VOCAB = 50
SHAPE = DecoderShape(num_layers=1, num_heads=1, num_kv_heads=1, head_dim=2, vocab_size=VOCAB, rms_eps=1e-6)


def scheduler(rows: int = 4, pages: int = 64, max_len: int = 512, chunk_tokens: int = 4096,
              decode=None) -> Scheduler:
    """A scheduler over a cache of ``pages`` pages of 128 positions, the scratch page among them."""
    cache = KVCache(SHAPE, rows, max_len, pages, torch.float32, torch.device("cpu"))
    cache.reserve_scratch()
    return Scheduler(cache, max_len, chunk_tokens, EngineStats(), VOCAB, decode)


def prompt(length: int, start: int = 0) -> list[int]:
    return [(start + i) % VOCAB for i in range(length)]


def submit(s: Scheduler, tokens: list[int], **params) -> SequenceRecord:
    sequence = SequenceRecord(s.new_id(), tokens, SamplingParams(**params))
    s.add(sequence)
    return sequence


def sampled(tokens: list[int], logprob: float = -0.5) -> np.ndarray:
    return np.array([tokens, [logprob] * len(tokens)], dtype=np.float64)


def admit_and_prefill(s: Scheduler, first: int = 1) -> list[SequenceRecord]:
    """Admit what fits and prefill it: every admitted sequence samples ``first`` as its first token."""
    admitted = s.admit()
    for chunk in s.prefill_plan(admitted):
        s.prefilled(chunk)
        rows = np.array([q.row for q in chunk.sequences] + [f.row for _, f in chunk.followers], dtype=np.int64)
        s.launched(rows)
        s.record(rows, sampled([first] * len(rows)))
    return admitted


def decode_step(s: Scheduler, tokens: dict[int, int] | None = None) -> np.ndarray:
    """Launch and read one decode step; row r samples ``tokens[r]`` (1 when not given). Returns the rows."""
    batch = s.decode_batch()
    assert batch is not None
    s.launched(batch.rows)
    s.record(batch.rows, sampled([(tokens or {}).get(int(r), 1) for r in batch.rows]))
    return batch.rows


def test_waiting_sequences_are_admitted_in_order_until_the_rows_run_out():
    s = scheduler(rows=2)
    sequences = [submit(s, prompt(20, start=i)) for i in range(4)]
    assert [q.id for q in s.admit()] == [0, 1]
    assert [q.row for q in sequences[:2]] == [0, 1] and [q.id for q in s.waiting] == [2, 3]
    assert s.admit() == [] and [q.id for q in s.waiting] == [2, 3]


def test_a_sequence_behind_one_that_waits_for_pages_waits_too():
    """Admission keeps the queue's order: a short prompt does not overtake a long one that lacks pages."""
    s = scheduler(rows=4, pages=5)  # scratch + 4 pages
    running = submit(s, prompt(200), max_new_tokens=100)  # 3 pages
    assert s.admit() == [running]
    long = submit(s, prompt(200, start=7), max_new_tokens=50)  # 2 pages: 1 is free
    short = submit(s, prompt(20, start=9), max_new_tokens=5)  # 1 page: would fit
    assert s.admit() == [] and list(s.waiting) == [long, short]


def test_arrivals_wait_for_a_quarter_of_the_running_batch_or_a_few_steps():
    s = scheduler(rows=16)
    assert not s.time_to_admit()  # nothing waits
    submit(s, prompt(20))
    assert s.time_to_admit()  # nothing runs: admit at once
    for i in range(7):
        submit(s, prompt(20, start=i + 1))
    admit_and_prefill(s)
    assert len(s.running) == 8
    submit(s, prompt(20, start=30))
    assert [s.time_to_admit() for _ in range(ADMIT_AFTER_STEPS + 1)] == [False] * ADMIT_AFTER_STEPS + [True]
    submit(s, prompt(20, start=31))
    assert s.time_to_admit()  # two waiting: a quarter of eight running


def test_prefill_chunks_fit_the_token_budget_shortest_first_and_copies_follow_their_prompt():
    def record(index: int, length: int, start: int) -> SequenceRecord:
        return SequenceRecord(index, prompt(length, start=start), SamplingParams())

    a, b, c = record(0, 30, 0), record(1, 10, 1), record(2, 20, 2)
    b_again = record(3, 10, 1)
    chunks = prefill_chunks([a, b, c, b_again], chunk_tokens=40)
    # b and c pad to 2 x 20 tokens, within 40; a joining them would pad to 3 x 30.
    assert [[q.id for q in chunk.sequences] for chunk in chunks] == [[1, 2], [0]]
    assert [[(i, f.id) for i, f in chunk.followers] for chunk in chunks] == [[(0, 3)], []]
    longer = record(4, 100, 5)
    assert [[q.id for q in chunk.sequences] for chunk in prefill_chunks([longer, b], 40)] == [[1], [4]]


def test_identical_prompts_are_grouped_by_their_whole_tokens_and_images():
    shared = list(range(40))

    def sequence(index, tokens, digest=None):
        images = None if digest is None else PromptImages(
            [torch.zeros(4, 8)], torch.tensor([[1, 2, 2]]), [(2, 3)], np.zeros((3, len(tokens)), dtype=np.int64), 0,
            tokens[:2] + [digest] + tokens[3:])
        return SequenceRecord(index, tokens, SamplingParams(), images)

    sequences = [sequence(0, shared), sequence(1, shared[:-1] + [99]), sequence(2, shared), sequence(3, shared[:30]),
                 sequence(4, shared, digest=-5), sequence(5, shared, digest=-6), sequence(6, shared, digest=-5)]
    leaders, followers = identical_prompts(sequences)
    assert [s.id for s in leaders] == [0, 1, 3, 4, 5]  # same tokens, other pixels: another prompt
    assert {s.id: [f.id for f in followers[id(s)]] for s in leaders} == {0: [2], 1: [], 3: [], 4: [6], 5: []}


def test_a_sequence_that_lacks_pages_evicts_the_rows_idle_longest_first():
    s = scheduler(rows=4, pages=5)  # scratch + 4 pages of 128 positions
    firsts = [submit(s, prompt(40, start=10 * i), max_new_tokens=5, stop_ids=(9,)) for i in range(3)]
    admit_and_prefill(s)
    decode_step(s, {2: 9})  # row 2 stops first: it has been idle longest
    decode_step(s, {0: 9, 1: 9})
    assert [row.state for row in s.table.rows] == [IDLE, IDLE, IDLE, FREE]
    assert s.cache.free_pages == 1 and all(s.cache.held(q.row) == 1 for q in firsts)
    grown = submit(s, prompt(300, start=3), max_new_tokens=10)  # 3 pages: takes row 0, and needs 1 more
    assert admit_and_prefill(s) == [grown] and grown.row == 0
    assert [row.state for row in s.table.rows] == [RUNNING, IDLE, FREE, FREE]
    assert s.stats.evictions == 2  # row 0's tokens for the placement, row 2's for its pages
    assert s.stats.page_evictions == 1
    assert s.cache.held(0) == 3 and s.cache.held(1) == 1 and s.cache.free_pages == 0


def test_running_sequences_holding_the_pages_make_a_new_one_wait_and_evict_nothing():
    """A turn that would not fit even with every other idle row's pages waits, and the idle rows keep their tokens
    for their episodes' next turns."""
    s = scheduler(rows=4, pages=5)  # scratch + 4 pages
    firsts = [submit(s, prompt(40, start=10 * i), max_new_tokens=5, stop_ids=(9,)) for i in range(3)]
    admit_and_prefill(s)
    decode_step(s, {0: 9, 1: 9, 2: 9})  # three idle rows of one page each
    running = submit(s, firsts[0].prompt + [1, 9] + prompt(150, start=3), max_new_tokens=50)  # 2 pages, 1 held
    assert admit_and_prefill(s) == [running] and running.row == 0 and s.cache.free_pages == 0
    waiting = submit(s, firsts[1].prompt + [1, 9] + prompt(300, start=4), max_new_tokens=10)  # 3 pages, 1 held
    assert s.admit() == [] and list(s.waiting) == [waiting]
    assert [row.state for row in s.table.rows] == [RUNNING, IDLE, IDLE, FREE] and s.stats.evictions == 0
    assert s.admit() == [] and s.stats.page_waits == 1  # a sequence that waits is counted once
    assert s.table.rows[1].tokens == firsts[1].prompt + [1] and s.cache.held(1) == s.cache.held(2) == 1


def test_a_stop_id_or_the_budget_ends_a_sequence_and_its_row_keeps_the_cached_tokens():
    s = scheduler()
    stopped = submit(s, prompt(20), max_new_tokens=8, stop_ids=(9,))
    spent = submit(s, prompt(30, start=5), max_new_tokens=2)
    admit_and_prefill(s, first=4)
    assert s.take_finished() == []
    decode_step(s, {stopped.row: 9, spent.row: 6})
    results = {r.id: r for r in s.take_finished()}
    assert (results[stopped.id].token_ids, results[stopped.id].finish_reason) == ([4, 9], "stop")
    assert (results[spent.id].token_ids, results[spent.id].finish_reason) == ([4, 6], "length")
    assert results[stopped.id].logprobs == [-0.5, -0.5]
    # Each row holds its prompt and all but its last token (whose keys were never computed).
    assert s.table.rows[stopped.row].tokens == stopped.prompt + [4]
    assert s.table.rows[spent.row].tokens == spent.prompt + [4]
    assert s.running == {} and s.cache.held(stopped.row) == 1


def test_a_sequence_ends_at_the_row_length():
    s = scheduler(max_len=24)
    sequence = submit(s, prompt(20), max_new_tokens=100)
    admit_and_prefill(s)
    for _ in range(3):
        decode_step(s)
    assert [(r.id, len(r.token_ids), r.finish_reason) for r in s.take_finished()] == [(sequence.id, 4, "length")]


def test_a_row_whose_last_token_is_in_flight_is_not_decoded_again():
    s = scheduler()
    sequence = submit(s, prompt(20), max_new_tokens=2)
    admit_and_prefill(s)
    batch = s.decode_batch()
    assert batch is not None and batch.rows.tolist() == [0] and batch.positions.tolist() == [20]
    s.launched(batch.rows)
    assert s.decode_batch() is None  # its second token, its budget, is in flight
    s.record(batch.rows, sampled([3]))
    assert [(r.id, r.token_ids) for r in s.take_finished()] == [(sequence.id, [1, 3])]


def test_a_token_read_after_its_sequence_stopped_is_dropped_and_its_stop_token_stays_cached():
    """Step n+1 is launched before step n is read: a sequence that stopped at step n decoded one token more, which
    is dropped; the other sequence in step n+1 keeps its token."""
    s = scheduler()
    stopping = submit(s, prompt(20), max_new_tokens=10, stop_ids=(9,))
    going = submit(s, prompt(25, start=3), max_new_tokens=10)
    admit_and_prefill(s)
    step_n = s.decode_batch()
    assert step_n is not None
    s.launched(step_n.rows)
    step_next = s.decode_batch()
    assert step_next is not None and step_next.rows.tolist() == [0, 1]
    s.launched(step_next.rows)
    s.record(step_n.rows, sampled([9, 5]))
    s.record(step_next.rows, sampled([7, 6]))
    results = s.take_finished()
    assert [(r.id, r.token_ids) for r in results] == [(stopping.id, [1, 9])]
    assert s.table.rows[stopping.row].tokens == stopping.prompt + [1, 9]
    assert s.progress.generated(going.row)[0] == [1, 5, 6] and s.stats.generated_tokens == 2 + 2 + 1


def test_a_stop_string_ends_a_sequence_at_the_token_that_completes_it():
    letters = "abcdefghijklmnopqrstuvwxyz"
    s = scheduler(decode=lambda ids: "".join(letters[t % 26] for t in ids))
    sequence = submit(s, prompt(20), max_new_tokens=10, stop_strings=("cd",))
    admit_and_prefill(s, first=2)  # "c"
    decode_step(s, {0: 4})  # "e": no stop
    decode_step(s, {0: 2})  # "c"
    assert s.take_finished() == []
    decode_step(s, {0: 3})  # "d" completes "cd"
    assert [(r.id, r.token_ids, r.finish_reason) for r in s.take_finished()] == [(sequence.id, [2, 4, 2, 3], "stop")]


def test_a_prompt_that_is_empty_or_fills_a_row_ends_at_once_with_the_reason():
    s = scheduler(max_len=64)
    empty = submit(s, [])
    long = submit(s, prompt(64))
    rejected = SequenceRecord(s.new_id(), prompt(10), SamplingParams())
    s.add(rejected, "no images here")
    results = {r.id: r for r in s.take_finished()}
    assert results[empty.id].error == "empty prompt"
    assert "max_seq_len" in (results[long.id].error or "")
    assert results[rejected.id].error == "no images here"
    assert all(r.finish_reason == "error" for r in results.values()) and not s.waiting


def test_abort_ends_every_sequence_with_its_tokens_so_far_and_frees_every_row():
    s = scheduler(rows=1)
    running = submit(s, prompt(20), max_new_tokens=10)
    waiting = submit(s, prompt(20, start=4), max_new_tokens=10)
    admit_and_prefill(s, first=7)
    results = {r.id: r for r in s.abort("failed")}
    assert (results[running.id].token_ids, results[running.id].error) == ([7], "failed")
    assert (results[waiting.id].token_ids, results[waiting.id].error) == ([], "failed")
    assert not s.running and not s.waiting and s.table.rows[0].state == FREE and s.cache.held(0) == 0
    assert s.cache.free_pages == s.cache.max_pages - 1 and s.decode_batch() is None


def test_abort_returns_the_sequences_that_had_ended_too():
    """A refusal (queued as ended at submit) or a finish read just before the failed step is still the caller's to
    take: dropped, a caller polling for it waited for ever."""
    s = scheduler()
    empty = submit(s, [])
    running = submit(s, prompt(20), max_new_tokens=10)
    admit_and_prefill(s)
    results = {r.id: r for r in s.abort("failed")}
    assert results[empty.id].error == "empty prompt" and results[running.id].error == "failed"
    assert s.take_finished() == []


def test_a_sequence_that_may_generate_nothing_is_refused():
    """0 (or fewer) new tokens: refused at once, not prefilled (a negative budget took fewer pages than the prompt
    and left its row's cache unwritten)."""
    s = scheduler()
    zero, negative = submit(s, prompt(20), max_new_tokens=0), submit(s, prompt(200), max_new_tokens=-150)
    results = {r.id: r for r in s.take_finished()}
    assert "max_new_tokens is 0" in results[zero.id].error and "max_new_tokens is -150" in results[negative.id].error
    assert not s.waiting


def test_a_sequence_that_waits_for_pages_leaves_the_idle_row_it_would_take_as_it_was():
    """The row a new prompt would take (the lowest open one: here an idle row of another episode) is taken only once
    the pages are: waiting, it dropped that episode's cached tokens though nothing ran in its place."""
    s = scheduler(rows=2, pages=4, max_len=384)  # the scratch page and 3 of 128 positions
    episode = submit(s, prompt(40), max_new_tokens=2)
    submit(s, prompt(200, start=100), max_new_tokens=50)  # 2 pages, running throughout
    admit_and_prefill(s)
    while not s.take_finished():
        decode_step(s)
    assert s.table.rows[episode.row].state == IDLE
    cached = list(s.table.rows[episode.row].tokens)
    submit(s, prompt(300, start=500), max_new_tokens=10)  # 3 pages: waits for the running one
    assert s.admit() == [] and len(s.waiting) == 1 and s.stats.page_waits == 1
    assert s.table.rows[episode.row].state == IDLE and s.table.rows[episode.row].tokens == cached
    assert s.stats.evictions == 0


def test_a_sequence_takes_the_pages_of_its_prompt_and_budget_only():
    s = scheduler(pages=64)
    sequence = submit(s, prompt(200), max_new_tokens=100)
    s.admit()
    assert s.cache.held(sequence.row) == -(-(200 + 100) // PAGE_TOKENS) == 3


def test_prefill_chunks_pad_to_at_most_the_token_budget():
    three = [SequenceRecord(i, prompt(20, start=i), SamplingParams()) for i in range(3)]
    assert [[q.id for q in chunk.sequences] for chunk in prefill_chunks(three, 40)] == [[0, 1], [2]]
    assert [[q.id for q in chunk.sequences] for chunk in prefill_chunks(three, 39)] == [[0], [1], [2]]


def test_a_later_prefill_chunk_is_filled_to_the_budget_like_the_first():
    records = [SequenceRecord(i, prompt(length, start=i), SamplingParams())
               for i, length in enumerate([10, 10, 10, 20, 20])]
    assert [[q.id for q in chunk.sequences] for chunk in prefill_chunks(records, 40)] == [[0, 1, 2], [3, 4]]


def test_prefill_chunks_order_and_pad_the_uncached_tokens_only():
    records = [SequenceRecord(i, prompt(length, start=i), SamplingParams())
               for i, length in enumerate([100, 15, 30])]
    records[0].cached, records[2].cached = 90, 25  # 10, 15 and 5 tokens to run
    assert [[q.id for q in chunk.sequences] for chunk in prefill_chunks(records, 30)] == [[2, 0], [1]]


def test_a_follower_counts_only_its_uncached_prompt_tokens_as_shared():
    s = scheduler()
    first = [submit(s, prompt(40), max_new_tokens=5, stop_ids=(9,)) for _ in range(2)]
    admit_and_prefill(s)
    decode_step(s, {0: 9, 1: 9})  # two idle rows holding the prompt and its first token
    turn = first[0].prompt + [1, 9] + prompt(20, start=3)
    again = [submit(s, turn, max_new_tokens=5) for _ in range(2)]
    shared = s.stats.shared_tokens
    admit_and_prefill(s)
    assert [q.reused for q in again] == [41, 41]
    assert s.stats.shared_tokens - shared == len(turn) - 41


def test_one_new_token_is_a_budget_a_sequence_may_ask_for():
    s = scheduler()
    sequence = submit(s, prompt(20), max_new_tokens=1)
    admit_and_prefill(s, first=6)
    assert [(r.id, r.token_ids, r.finish_reason) for r in s.take_finished()] == [(sequence.id, [6], "length")]


def test_an_arrival_waits_while_more_than_four_times_as_many_run():
    for running, admits in ((4, True), (5, False)):
        s = scheduler(rows=16)
        for i in range(running):
            submit(s, prompt(20, start=i))
        admit_and_prefill(s)
        submit(s, prompt(20, start=30))
        assert s.time_to_admit() == admits


def test_an_arrival_after_an_admission_that_did_not_ask_waits_the_whole_count():
    """A caller may admit without :meth:`time_to_admit` (a round prefilled in parts): the next arrival still waits
    ``ADMIT_AFTER_STEPS`` decode steps, counted from none."""
    s = scheduler(rows=16)
    for i in range(8):
        submit(s, prompt(20, start=i))
    admit_and_prefill(s)
    submit(s, prompt(20, start=30))
    assert [s.time_to_admit() for _ in range(ADMIT_AFTER_STEPS + 1)] == [False] * ADMIT_AFTER_STEPS + [True]


def test_a_sequence_admitted_while_others_decode_joins_the_next_step():
    s = scheduler()
    submit(s, prompt(20), max_new_tokens=10)
    admit_and_prefill(s)
    assert decode_step(s).tolist() == [0]
    submit(s, prompt(20, start=5), max_new_tokens=10)
    admit_and_prefill(s)
    assert decode_step(s).tolist() == [0, 1]


def test_the_pages_of_every_idle_row_and_the_free_pool_together_admit_a_sequence():
    s = scheduler(rows=2, pages=4, max_len=384)  # the scratch page and 3 of 128 positions
    for i in range(2):
        submit(s, prompt(40, start=10 * i), max_new_tokens=5, stop_ids=(9,))
    admit_and_prefill(s)
    decode_step(s, {0: 9, 1: 9})  # two idle rows of one page each, one page free
    grown = submit(s, prompt(300, start=3), max_new_tokens=50)  # 3 pages: row 0's, the free one and row 1's
    assert admit_and_prefill(s) == [grown] and grown.row == 0
    assert s.table.rows[1].state == FREE and s.cache.held(0) == 3 and s.cache.free_pages == 0


def test_dropping_the_idle_rows_frees_their_pages():
    s = scheduler(rows=2)
    for i in range(2):
        submit(s, prompt(40, start=10 * i), max_new_tokens=5, stop_ids=(9,))
    admit_and_prefill(s)
    decode_step(s, {0: 9, 1: 9})
    s.drop_idle_rows()
    assert [row.state for row in s.table.rows] == [FREE, FREE]
    assert s.cache.held(0) == s.cache.held(1) == 0 and s.cache.free_pages == s.cache.max_pages - 1


def test_after_abort_a_new_sequence_in_a_row_that_had_a_step_in_flight_decodes_its_whole_budget():
    """The aborted step is never read: its token no longer counts against the row."""
    s = scheduler(rows=1)
    submit(s, prompt(20), max_new_tokens=10)
    admit_and_prefill(s)
    batch = s.decode_batch()
    assert batch is not None
    s.launched(batch.rows)
    s.abort("failed")
    submit(s, prompt(20, start=3), max_new_tokens=2)
    admit_and_prefill(s)
    step = s.decode_batch()
    assert step is not None and step.rows.tolist() == [0]
    s.launched(step.rows)
    assert s.decode_batch() is None  # its second token, its budget, is in flight


def test_a_dropped_launch_no_longer_counts_against_the_rows_next_sequence():
    s = scheduler(rows=1)
    submit(s, prompt(20), max_new_tokens=10, stop_ids=(9,))
    admit_and_prefill(s)
    step_n = s.decode_batch()
    assert step_n is not None
    s.launched(step_n.rows)
    step_next = s.decode_batch()
    assert step_next is not None
    s.launched(step_next.rows)
    s.record(step_n.rows, sampled([9]))  # the sequence stops: the step after it is never read
    assert not s.running
    s.drop_launch(step_next.rows)
    submit(s, prompt(20, start=3), max_new_tokens=2)
    admit_and_prefill(s)
    step = s.decode_batch()
    assert step is not None and step.rows.tolist() == [0]
    s.launched(step.rows)
    assert s.decode_batch() is None


def test_a_new_schedulers_counters_are_all_zero():
    assert set(dataclasses.asdict(scheduler().stats).values()) == {0}


def test_a_refused_sequence_reports_no_reused_tokens():
    s = scheduler()
    submit(s, [])
    assert [r.reused_tokens for r in s.take_finished()] == [0]

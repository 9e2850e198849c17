"""The running rows' vectorized bookkeeping against a plain loop over sequences."""

from __future__ import annotations

import numpy as np

from turnrl.engine.running import RunningRows

VOCAB = 50


def test_recorded_tokens_counters_and_stop_checks_equal_a_plain_loop():
    rng = np.random.default_rng(0)
    rows = 6
    state = RunningRows(rows, VOCAB, width=4)  # narrow: the token arrays must widen as sequences grow
    stop_sets = [(3, 7), (), (7,), (3, 7), (99,), (1, 2, 3)]  # 99 is outside the vocabulary: it never matches
    budgets = [5, 9, 3, 12, 7, 10]
    strings = {0: ("a",), 3: ("b", "c")}
    searchable = {("a",): rng.random(VOCAB) < 0.3, ("b", "c"): rng.random(VOCAB) < 0.3}
    for row in range(rows):
        state.start(row, cached=10 + row, budget=budgets[row], stop_ids=stop_sets[row],
                    stop_strings=strings.get(row, ()), string_candidates=searchable.__getitem__)
    plain: dict[int, list[tuple[int, float]]] = {row: [] for row in range(rows)}
    for _ in range(12):
        step_rows = np.sort(rng.choice(rows, size=int(rng.integers(1, rows + 1)), replace=False))
        tokens = rng.integers(0, VOCAB, size=len(step_rows))
        logprobs = rng.standard_normal(len(step_rows)).astype(np.float32)
        checks = state.record(step_rows, tokens, logprobs)
        for i, row in enumerate(step_rows.tolist()):
            plain[row].append((int(tokens[i]), float(logprobs[i])))
            assert checks.stop_id[i] == (tokens[i] in stop_sets[row])
            assert checks.spent[i] == (len(plain[row]) >= budgets[row])
            expected_search = bool(searchable[strings[row]][tokens[i]]) if row in strings else False
            assert checks.search[i] == expected_search
    for row in range(rows):
        generated, logprobs_out = state.generated(row)
        assert generated == [t for t, _ in plain[row]]
        assert logprobs_out == [lp for _, lp in plain[row]]
        assert state.tail(row, 3) == generated[-3:]
    assert state.tokens.shape[1] >= max(len(p) for p in plain.values()) > 4


def test_a_row_taken_again_starts_from_nothing():
    state = RunningRows(2, VOCAB)
    state.start(0, cached=5, budget=4, stop_ids=(1,))
    state.record(np.array([0]), np.array([9]), np.array([-0.5], dtype=np.float32))
    state.start(0, cached=8, budget=2)
    assert state.generated(0) == ([], [])
    checks = state.record(np.array([0]), np.array([1]), np.array([-0.1], dtype=np.float32))
    assert not checks.stop_id[0] and not checks.spent[0]  # the old stop ids and budget are gone
    assert state.cached[0] == 8

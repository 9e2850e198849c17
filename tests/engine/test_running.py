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


def array_bytes(value: object) -> int:
    """The bytes of the numpy arrays ``value`` holds, in its attributes, dicts and lists, however deep."""
    if isinstance(value, np.ndarray):
        return value.nbytes
    if isinstance(value, dict):
        return sum(array_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(array_bytes(v) for v in value)
    return array_bytes(vars(value)) if hasattr(value, "__dict__") else 0


def test_stop_sets_of_finished_sequences_are_dropped_and_the_running_ones_still_match():
    """Each sequence with its own stop ids and stop strings (a server's requests): the tables hold about the sets
    in use, not one a sequence ever started, and every running row's checks stay its own set's."""
    rows, starts = 4, 500
    state = RunningRows(rows, VOCAB)
    masks: dict[tuple[str, ...], np.ndarray] = {}

    def candidates(strings: tuple[str, ...]) -> np.ndarray:
        index = int(strings[0].removeprefix("stop"))
        masks[strings] = np.arange(VOCAB) % 7 == index % 7
        return masks[strings]

    current: dict[int, int] = {}
    baseline = array_bytes(state)
    for i in range(starts):
        row = i % rows
        state.start(row, cached=3, budget=50, stop_ids=(i % VOCAB,), stop_strings=(f"stop{i}",),
                    string_candidates=candidates)
        current[row] = i
        assert array_bytes(state) <= baseline + 2 * (2 * (rows + 1) + 8) * VOCAB  # two tables of bool masks
        all_rows = np.arange(rows)
        for token in (i % VOCAB, (i + 3) % VOCAB):
            checks = state.record(all_rows[: len(current)], np.full(len(current), token),
                                  np.zeros(len(current), dtype=np.float32))
            for r in range(len(current)):
                assert checks.stop_id[r] == (token == current[r] % VOCAB)
                assert checks.search[r] == masks[(f"stop{current[r]}",)][token]
            state.count[:] = 0  # stay within the budget


def test_a_row_without_stop_strings_after_one_with_them_is_never_searched():
    state = RunningRows(1, VOCAB)
    state.start(0, cached=3, budget=5, stop_strings=("a",), string_candidates=lambda s: np.ones(VOCAB, dtype=bool))
    state.start(0, cached=3, budget=5, stop_strings=("a",))  # no candidates given: stop strings are not checked
    assert not state.record(np.array([0]), np.array([4]), np.array([-0.1], dtype=np.float32)).search[0]

"""The row table: prefix matching, and which idle rows give up their cache first."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from turnrl.engine.rows import FREE, IDLE, PREFIX_KEY_TOKENS, RowTable


def test_a_prompt_extending_an_idle_row_takes_it_and_reuses_its_tokens():
    table = RowTable(3)
    first = table.place(list(range(20)))
    assert first is not None and first.row == 0
    table.release(0, list(range(25)))
    again = table.place(list(range(30)))
    assert again is not None and (again.row, again.reused, again.evicted) == (0, 25, False)


def test_idle_rows_are_listed_those_idle_longest_first_and_evicted_one_at_a_time():
    table = RowTable(3)
    for start in (0, 100, 200):
        assert table.place(list(range(start, start + 20))) is not None
    table.release(2, list(range(200, 220)))
    table.release(0, list(range(20)))
    assert table.idle_rows() == [2, 0]
    table.evict(2)
    assert table.rows[2].state == FREE and table.idle_rows() == [0]
    placed = table.place(list(range(200, 230)))  # its tokens are gone: no reuse
    assert placed is not None and placed.reused == 0
    with pytest.raises(ValueError, match="row 1 is running, not idle"):
        table.evict(1)


def test_clear_frees_every_idle_row_and_names_them():
    table = RowTable(2)
    for start in (0, 100):
        assert table.place(list(range(start, start + 20))) is not None
    for start in (0, 100):
        table.release(start // 100, list(range(start, start + 20)))
    assert {row.state for row in table.rows} == {IDLE}
    assert sorted(table.clear()) == [0, 1]
    assert {row.state for row in table.rows} == {FREE}


def plain_reuse(cached: list[list[int]], prompt: list[int]) -> int:
    """The longest cached row whose tokens (all of them, up to the prompt's last token) begin the prompt."""
    best = 0
    for tokens in cached:
        if len(tokens) < PREFIX_KEY_TOKENS or len(prompt) < PREFIX_KEY_TOKENS:
            continue
        usable = min(len(tokens), len(prompt) - 1)
        if prompt[:usable] == tokens[:usable]:
            best = max(best, usable)
    return best


# Rows that share a long head (one system prompt) and then branch, as a group's episodes do; the prompt extends one
# of them, or another branch, or stops short of them.
_shared = st.lists(st.integers(0, 3), min_size=PREFIX_KEY_TOKENS, max_size=PREFIX_KEY_TOKENS + 8)
_tails = st.lists(st.lists(st.integers(0, 3), max_size=12), min_size=1, max_size=6)


@settings(max_examples=300, deadline=None)
@given(_shared, _tails, st.integers(0, 5), st.lists(st.integers(0, 3), max_size=12), st.integers(0, 40))
def test_placement_reuses_the_longest_matching_row_as_a_plain_scan_does(shared, tails, pick, extra, cut):
    table = RowTable(len(tails) + 1)
    cached = [shared + tail for tail in tails]
    for index, tokens in enumerate(cached):
        placed = table.place(tokens)
        assert placed is not None and placed.row == index
    for index, tokens in enumerate(cached):
        table.release(index, tokens)
    prompt = (cached[pick % len(cached)] + extra)[: max(1, len(shared) + cut)]
    placed = table.place(prompt)
    assert placed is not None
    assert placed.reused == plain_reuse(cached, prompt)
    if placed.reused:
        assert prompt[: placed.reused] == cached[placed.row][: placed.reused]


def test_a_running_row_is_never_chosen_even_when_its_reused_tokens_begin_the_prompt():
    table = RowTable(2)
    assert table.place(list(range(20))) is not None
    table.release(0, list(range(25)))
    assert table.place(list(range(30))) is not None  # row 0 runs, holding the 25 tokens it reused
    again = table.place(list(range(30)))
    assert again is not None and (again.row, again.reused) == (1, 0)


def test_a_running_row_holds_the_prefix_it_reused_only():
    table = RowTable(1)
    assert table.place(list(range(20))) is not None
    table.release(0, list(range(25)))
    placed = table.place(list(range(40)))
    assert placed is not None and placed.reused == 25 and table.rows[0].tokens == list(range(25))


def test_an_idle_row_stays_found_when_another_row_of_its_prefix_is_taken():
    table = RowTable(3)
    head = list(range(PREFIX_KEY_TOKENS))
    first, second = head + [90, 91, 92, 93], head + [80, 81, 82, 83]
    for tokens in (first, second):
        assert table.place(tokens) is not None
    table.release(0, first)
    table.release(1, second)
    assert table.place(first + [7]) is not None  # takes row 0, which shares the index key with row 1
    placed = table.place(second + [5])
    assert placed is not None and (placed.row, placed.reused, placed.evicted) == (1, len(second), False)


def test_begins_with_compares_the_first_usable_tokens_only():
    assert RowTable.begins_with([1, 2, 3], [1, 2, 9], 2)
    assert not RowTable.begins_with([1, 2, 3], [1, 5, 3], 3)
    assert not RowTable.begins_with([5], [6], 1)
    assert RowTable.begins_with([1, 2], [3, 4], 0)  # nothing to compare

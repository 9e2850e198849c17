"""The row table: prefix matching, and which idle rows give up their cache first."""

from __future__ import annotations

import pytest

from turnrl.engine.rows import FREE, IDLE, RowTable


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

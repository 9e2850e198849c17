"""The one tuple-action grammar: read without evaluation, fuzzed; canonical spelling."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from turnrl.envs.actions import MAX_TUPLE_ITEMS, parse_tuple, tuple_text


@pytest.mark.parametrize(
    ("text", "items"),
    [("('move', 0)", ("move", 0)), ('( "move" ,0 )', ("move", 0)), ("('stop',)", ("stop",)),
     ("(1.5, -2)", (1.5, -2)), ("('a b', 'c.d-e_f')", ("a b", "c.d-e_f"))],
)
def test_tuple_actions_read_as_plain_values(text, items):
    assert parse_tuple(text) == items


@pytest.mark.parametrize(
    "text",
    ["move, 0", "(move, 0)", "(('a',),)", "('a' + 'b',)", "(" + "1," * (MAX_TUPLE_ITEMS + 1) + ")", "()", "(x)",
     "(__import__('os'),)", "('a\\n',)", "(1e9,)", "(1234567890,)", "[1, 2]", None, 3],
)
def test_anything_else_is_refused_without_evaluation(text):
    assert parse_tuple(text) is None


def test_canonical_spelling_round_trips():
    for items in [("move", 0), ("stop",), ("a", 1.5, -3)]:
        assert parse_tuple(tuple_text(items)) == items
    assert tuple_text(("stop",)) == "('stop',)" and tuple_text(("move", 2)) == "('move', 2)"


@given(st.text(max_size=300))
def test_any_string_in_no_exception_out(text):
    items = parse_tuple(text)
    assert items is None or (1 <= len(items) <= MAX_TUPLE_ITEMS and parse_tuple(tuple_text(items)) == items)

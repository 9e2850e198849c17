"""The safe evaluator: exact values, clear errors, and no exception for any input."""

from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from turnrl.envs.games.countdown.arith import (
    MAX_DEPTH,
    MAX_DIGITS,
    MAX_EXPRESSION_LENGTH,
    ArithResult,
    evaluate,
    tokenize,
    uses_exactly,
)


@pytest.mark.parametrize(
    ("text", "value", "numbers"),
    [
        ("1+2*3", Fraction(7), (1, 2, 3)),
        ("(1+2)*3", Fraction(9), (1, 2, 3)),
        ("10 / 4", Fraction(5, 2), (10, 4)),
        ("2 - 3 - 4", Fraction(-5), (2, 3, 4)),  # left-associative
        ("2 / 3 / 4", Fraction(1, 6), (2, 3, 4)),
        ("(1 / 3) * 3", Fraction(1), (1, 3, 3)),  # exact, no float rounding
        ("-3 + 5", Fraction(2), (3, 5)),
        ("--3", Fraction(3), (3,)),
        ("+7", Fraction(7), (7,)),
        ("100 - (4 + 6) * 9", Fraction(10), (100, 4, 6, 9)),
        ("((((5))))", Fraction(5), (5,)),
        ("7 × 6", Fraction(42), (7, 6)),
        ("8 ÷ 2 − 1", Fraction(3), (8, 2, 1)),
        ("007 + 1", Fraction(8), (7, 1)),
        (" \t12\n* 2 ", Fraction(24), (12, 2)),
        ("0 / 5", Fraction(0), (0, 5)),
    ],
)
def test_values(text, value, numbers):
    result = evaluate(text)
    assert result.ok, result.error
    assert result.value == value
    assert result.numbers == numbers


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "empty"),
        ("   ", "empty"),
        ("1 +", "ends"),
        ("(1 + 2", "missing closing"),
        ("1 + 2)", "unexpected ')'"),
        ("2(3)", "unexpected '('"),
        ("1 / 0", "division by zero"),
        ("1 / (2 - 2)", "division by zero"),
        ("abc", "unexpected character"),
        ("1.5 + 1", "unexpected character '.'"),
        ("1e3", "unexpected character"),
        ("2 ** 3", "expected a number"),
        ("__import__('os')", "unexpected character"),
        ("9" * (MAX_DIGITS + 1), "digits"),
        ("(" * (MAX_DEPTH + 1) + "1" + ")" * (MAX_DEPTH + 1), "nested"),
        ("-" * (MAX_DEPTH + 1) + "1", "nested"),
        ("1+" * MAX_EXPRESSION_LENGTH + "1", "longer than"),
        ("٣ + 1", "unexpected character"),  # non-ASCII digits are not numbers
    ],
)
def test_errors(text, message):
    result = evaluate(text)
    assert not result.ok and result.value is None
    assert message in result.error


@pytest.mark.parametrize("value", [None, 5, 2.5, b"1+2", ["1"], object()])
def test_non_string(value):
    result = evaluate(value)
    assert not result.ok and "string" in result.error


def test_depth_limit_is_reachable():
    assert evaluate("(" * MAX_DEPTH + "1" + ")" * MAX_DEPTH).value == 1


def test_tokenize():
    assert tokenize("12*(3 - 4)") == [12, "*", "(", 3, "-", 4, ")"]


def test_uses_exactly():
    assert uses_exactly((3, 1, 3), [3, 3, 1])
    assert not uses_exactly((3, 1), [3, 3, 1])
    assert not uses_exactly((3, 3, 1, 1), [3, 3, 1])


@settings(max_examples=400, deadline=None)
@given(st.text(max_size=300))
def test_any_text_never_raises(text):
    result = evaluate(text)
    assert isinstance(result, ArithResult)
    assert result.ok == (result.value is not None)


@settings(max_examples=400, deadline=None)
@given(st.text(alphabet="0123456789+-*/() ×÷−", max_size=120))
def test_arithmetic_alphabet_never_raises(text):
    result = evaluate(text)
    assert result.ok == (result.error is None)
    if result.ok:
        assert isinstance(result.value, Fraction)


def _expressions():
    """(text, exact value) pairs from a recursive strategy; values checked independently."""
    leaves = st.integers(0, 999).map(lambda n: (str(n), Fraction(n)))

    def extend(children):
        def build(left, op, right):
            text = f"({left[0]} {op} {right[0]})"
            if op == "+":
                return text, left[1] + right[1]
            if op == "-":
                return text, left[1] - right[1]
            if op == "*":
                return text, left[1] * right[1]
            return text, (left[1] / right[1] if right[1] != 0 else None)

        return st.builds(build, children, st.sampled_from("+-*/"), children).filter(lambda pair: pair[1] is not None)

    return st.recursive(leaves, extend, max_leaves=12)


@settings(max_examples=300, deadline=None)
@given(_expressions())
def test_matches_exact_fractions(pair):
    text, value = pair
    result = evaluate(text)
    assert result.ok, (text, result.error)
    assert result.value == value

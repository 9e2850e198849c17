"""A safe, exact evaluator for the arithmetic answers of Countdown.

Agents answer Countdown with an expression such as ``(100 - 4) / (3 + 5)``.
Evaluating that with Python's ``eval`` would run arbitrary code; this module
instead tokenizes the text and parses it with a small recursive-descent parser
for the grammar::

    expr    := term (("+" | "-") term)*
    term    := unary (("*" | "/") unary)*
    unary   := ("+" | "-") unary | primary
    primary := INTEGER | "(" expr ")"

Arithmetic is exact (:class:`fractions.Fraction`), so ``(1 / 3) * 3`` is
exactly 1 and no float rounding can make a wrong answer right. The input is
bounded (length, digits per number, nesting depth), so no answer can make the
evaluator slow or recurse deeply. :func:`evaluate` never raises: any input,
string or not, gives an :class:`ArithResult`, with ``error`` set when the
expression is malformed or divides by zero.

The unicode operators ``×``, ``÷`` and ``−`` are read as ``*``, ``/`` and
``-`` because models often write them.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Any

MAX_EXPRESSION_LENGTH = 512
"""Longest accepted expression, in characters."""
MAX_DIGITS = 12
"""Most digits in one number literal (keeps products of literals small)."""
MAX_DEPTH = 32
"""Deepest nesting of parentheses and unary signs."""

_OPERATOR_ALIASES = {"×": "*", "÷": "/", "−": "-"}
_SYMBOLS = frozenset("+-*/()")


@dataclass(frozen=True)
class ArithResult:
    """The outcome of evaluating one expression."""

    value: Fraction | None
    """The exact value, or None when the expression is invalid."""
    numbers: tuple[int, ...] = ()
    """The number literals of the expression, in the order they appear."""
    error: str | None = None
    """Why the expression is invalid, or None when it is valid."""

    @property
    def ok(self) -> bool:
        return self.error is None


class _ArithError(ValueError):
    """Raised inside the parser; :func:`evaluate` turns it into a result."""


def tokenize(text: str) -> list[int | str]:
    """Split an expression into integer literals and the symbols ``+-*/()``.

    >>> tokenize("12*(3 - 4)")
    [12, '*', '(', 3, '-', 4, ')']

    Raises:
        _ArithError: on any other character or an over-long number.
    """
    tokens: list[int | str] = []
    i, n = 0, len(text)
    while i < n:
        ch = _OPERATOR_ALIASES.get(text[i], text[i])
        if ch in _SYMBOLS:
            tokens.append(ch)
            i += 1
        elif ch in " \t\r\n":
            i += 1
        elif "0" <= ch <= "9":
            j = i
            while j < n and "0" <= text[j] <= "9":
                j += 1
            if j - i > MAX_DIGITS:
                raise _ArithError(f"number longer than {MAX_DIGITS} digits at position {i}")
            tokens.append(int(text[i:j]))
            i = j
        else:
            raise _ArithError(f"unexpected character {ch!r} at position {i}; allowed: digits, + - * / ( )")
    return tokens


class _Parser:
    """Recursive-descent parser over a token list; evaluates while parsing."""

    def __init__(self, tokens: list[int | str]) -> None:
        self.tokens = tokens
        self.pos = 0
        self.depth = 0
        self.numbers: list[int] = []

    def peek(self) -> int | str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def take(self) -> int | str | None:
        token = self.peek()
        self.pos += 1
        return token

    def enter(self) -> None:
        # Depth counts parentheses and unary signs, the only ways to recurse.
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise _ArithError(f"expression nested deeper than {MAX_DEPTH} levels")

    def expr(self) -> Fraction:
        value = self.term()
        while self.peek() in ("+", "-"):
            op = self.take()
            right = self.term()
            value = value + right if op == "+" else value - right
        return value

    def term(self) -> Fraction:
        value = self.unary()
        while self.peek() in ("*", "/"):
            op = self.take()
            right = self.unary()
            if op == "*":
                value = value * right
            elif right == 0:
                raise _ArithError("division by zero")
            else:
                value = value / right
        return value

    def unary(self) -> Fraction:
        if self.peek() in ("+", "-"):
            op = self.take()
            self.enter()
            value = self.unary()
            self.depth -= 1
            return -value if op == "-" else value
        return self.primary()

    def primary(self) -> Fraction:
        token = self.take()
        if isinstance(token, int):
            self.numbers.append(token)
            return Fraction(token)
        if token == "(":
            self.enter()
            value = self.expr()
            self.depth -= 1
            if self.take() != ")":
                raise _ArithError("missing closing parenthesis")
            return value
        if token is None:
            raise _ArithError("expression ends where a number was expected")
        raise _ArithError(f"expected a number or '(' but found {token!r}")


def evaluate(text: Any) -> ArithResult:
    """Evaluate an arithmetic expression exactly; never raises.

    >>> evaluate("(3 + 5) * 3").value
    Fraction(24, 1)
    >>> evaluate("1 / 0").error
    'division by zero'
    """
    if not isinstance(text, str):
        return ArithResult(None, (), f"expression must be a string, got {type(text).__name__}")
    if len(text) > MAX_EXPRESSION_LENGTH:
        return ArithResult(None, (), f"expression longer than {MAX_EXPRESSION_LENGTH} characters")
    parser = None
    try:
        tokens = tokenize(text)
        if not tokens:
            return ArithResult(None, (), "empty expression")
        parser = _Parser(tokens)
        value = parser.expr()
        if parser.pos != len(tokens):
            raise _ArithError(f"unexpected {tokens[parser.pos]!r} after a complete expression")
    except _ArithError as error:
        numbers = tuple(parser.numbers) if parser is not None else ()
        return ArithResult(None, numbers, str(error))
    return ArithResult(value, tuple(parser.numbers))


def uses_exactly(numbers: tuple[int, ...] | list[int], allowed: tuple[int, ...] | list[int]) -> bool:
    """Whether ``numbers`` is ``allowed`` as a multiset: each given number used exactly once."""
    return sorted(numbers) == sorted(allowed)

"""The tag scanner, the lenient reading of last pairs and the strict structure check, on their own."""

from __future__ import annotations

import ast

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from turnrl.agent.tags import StructureChecker, StructureError, Tag, last_pairs, snippet, tokenize

NAMES = ("think", "answer")
STRUCTURE = (Tag("think"), Tag("answer"))


def check(text: str, outside_text_ok: bool = False) -> list[str]:
    """The structure check's errors, the raised one last (as ResponseFormat reads them)."""
    checker = StructureChecker(text, tokenize(text, NAMES), outside_text_ok)
    try:
        checker.nodes(STRUCTURE, parent=None)
        checker.trailing()
    except StructureError as error:
        checker.errors.append(str(error))
    return checker.errors


def test_only_the_formats_own_names_are_tags():
    text = "x < 5 and <Answer>no</Answer> <answer >no</answer > <think>a</think><answer>Up</answer>"
    assert [(token.show(), text[token.start:token.end]) for token in tokenize(text, NAMES)] == [
        ("<think>", "<think>"), ("</think>", "</think>"), ("<answer>", "<answer>"), ("</answer>", "</answer>")]


def test_the_last_complete_pair_of_each_name_is_read():
    text = "<answer>1<answer>2</answer> <answer>3</answer><think>cut"
    assert last_pairs(text, tokenize(text, NAMES)) == {"answer": "3"}
    nested = "<answer>1<answer>2</answer>"
    assert last_pairs(nested, tokenize(nested, NAMES)) == {"answer": "2"}


@pytest.mark.parametrize("text, errors", [
    ("<think>a</think> <answer>Up</answer>\n", []),
    ("<answer>Up</answer>", ["missing <think>"]),
    ("<think>a</think><answer>Up", ["unclosed <answer>"]),
    ("<think><answer>a</answer></think><answer>Up</answer>", ["<answer> nested inside <think>"]),
    ("<think> </think>so<answer>Up</answer>", ["empty <think>", "text outside the tags: 'so'"]),
    ("<think>a</think><answer>Up</answer></think>", ["unexpected </think> after the last tag"]),
])
def test_the_structure_check_names_what_is_wrong(text, errors):
    assert check(text) == errors


def test_free_text_is_allowed_around_the_tags_where_the_format_says_so():
    assert check("Sure. <think>a</think> then <answer>Up</answer> done", outside_text_ok=True) == []


def test_a_long_excerpt_is_cut_and_quoted():
    assert snippet("  many   words  " * 50).endswith("...'") and len(snippet("x" * 10_000)) == 42


def test_an_excerpt_of_forty_characters_is_quoted_whole_and_one_more_is_cut():
    assert snippet("x" * 40) == "'" + "x" * 40 + "'"
    assert snippet("x" * 41) == "'" + "x" * 37 + "...'"


def test_an_excerpt_is_taken_from_the_first_hundred_and_sixty_characters_only():
    # Blanks collapse after that cut, so a word that starts near character 160 is cut where the text was.
    assert snippet(" " * 155 + "abcdefghij") == "'abcde'"


@given(st.lists(st.sampled_from(["<", ">", "/", "think", "answer", "a", " ", "\n"]), max_size=80).map("".join))
def test_any_text_scans_and_checks_without_raising(text):
    tokens = tokenize(text, NAMES)
    assert all(text[token.start:token.end] == token.show() for token in tokens)
    assert [token.start for token in tokens] == sorted(token.start for token in tokens)
    last_pairs(text, tokens)
    check(text)


ANY_TEXT = st.text(st.characters(exclude_categories=()), max_size=200)
"""Every code point: control characters, line separators, lone surrogates."""
NESTED = st.recursive(
    st.one_of(st.sampled_from(["<think>", "</think>", "<answer>", "</answer>", "<", "/", ">"]), ANY_TEXT),
    lambda inner: st.builds(lambda name, parts: f"<{name}>{''.join(parts)}</{name}>", st.sampled_from(NAMES),
                            st.lists(inner, max_size=4)),
    max_leaves=20,
)


@given(st.one_of(ANY_TEXT, NESTED), st.booleans())
@example("<think>" * 5000 + "</answer>" * 5000, False)
@example("<think>\udfff</think>\u2028<answer>\x00</answer>\x85", False)
def test_text_of_any_characters_and_nesting_scans_and_checks_into_one_line_errors(text, outside_text_ok):
    tokens = tokenize(text, NAMES)
    assert all(text[token.start:token.end] == token.show() for token in tokens)
    assert set(last_pairs(text, tokens)) <= set(NAMES)
    assert all(len(error.splitlines()) == 1 for error in check(text, outside_text_ok))


@given(ANY_TEXT.map(lambda text: text * 50))
def test_an_excerpt_of_any_text_is_one_quoted_line_of_at_most_forty_characters(text):
    quoted = snippet(text)
    assert len(quoted.splitlines()) == 1 and quoted[0] == quoted[-1] and quoted[0] in "'\""
    assert len(ast.literal_eval(quoted)) <= 40  # the excerpt itself: what repr escapes counts once

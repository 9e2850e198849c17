"""Response highlighting and heatmap colours: exact pieces on known responses, and any string is safe."""

from __future__ import annotations

import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from turnrl.viz.highlight import FIELD_CLASSES, Segment, advantage_color, known_tags, response_segments

FAST = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
CLASSES = {f"f-{name}" for name in FIELD_CLASSES} | {"f-other", "f-none"}


def pieces(response: str, fields: frozenset[str] = frozenset()) -> list[tuple[str, str | None, bool]]:
    return [(s.text, s.field, s.is_tag) for s in response_segments(response, fields)]


def test_free_think_response_splits_into_its_fields():
    assert pieces("<think>go up</think><answer>Up</answer>") == [
        ("<think>", "think", True), ("go up", "think", False), ("</think>", "think", True),
        ("<answer>", "answer", True), ("Up", "answer", False), ("</answer>", "answer", True),
    ]


def test_nested_fields_take_the_innermost_name_and_text_outside_tags_has_none():
    segments = pieces("hi <think><observation>box left</observation>so push</think> <answer>Left</answer>")
    assert ("hi ", None, False) in segments
    assert ("box left", "observation", False) in segments
    assert ("so push", "think", False) in segments
    assert (" ", None, False) in segments


def test_stray_and_unclosed_tags_never_break_the_text():
    # A closing tag with no opening one is text of the field around it; an unclosed field runs to the end.
    assert pieces("</answer>x<think>y") == [("</answer>", None, False), ("x", None, False), ("<think>", "think", True),
                                             ("y", "think", False)]
    # Closing an outer field closes the inner one left open.
    assert pieces("<think><reasoning>a</think>b") == [
        ("<think>", "think", True), ("<reasoning>", "reasoning", True), ("a", "reasoning", False),
        ("</think>", "think", True), ("b", None, False),
    ]


def test_only_exact_tags_of_known_or_named_fields_count():
    assert pieces("<Think>a</Think> x < 5 <think >") == [("<Think>a</Think> x < 5 <think >", None, False)]
    assert pieces("<plan>a</plan>") == [("<plan>a</plan>", None, False)]
    assert pieces("<plan>a</plan>", frozenset({"plan"}))[1] == ("a", "plan", False)
    # A field name that is not an identifier is never turned into a pattern.
    assert pieces("<a|b>x</a|b>", frozenset({"a|b", ".*"})) == [("<a|b>x</a|b>", None, False)]
    assert {"think", "answer", "observation", "prediction", "action", "justification"} <= known_tags()


def test_css_class_is_one_of_a_fixed_set():
    assert Segment("x", "think").css_class == "f-think"
    assert Segment("<think>", "think", True).css_class == "f-think tag"
    assert Segment("x", "plan").css_class == "f-other"
    assert Segment("x", None).css_class == "f-none"


@FAST
@given(st.text(alphabet=st.sampled_from(list("<>/ab thinkanswerobsv\n\"'&")), max_size=120),
       st.frozensets(st.text(max_size=12), max_size=4))
def test_segments_join_back_to_the_response_and_classes_stay_fixed(response, fields):
    segments = response_segments(response, fields)
    assert "".join(s.text for s in segments) == response
    assert all(s.text for s in segments)
    for segment in segments:
        name, *tag = segment.css_class.split(" ")
        assert name in CLASSES and tag in ([], ["tag"])


@FAST
@given(st.text(max_size=300), st.frozensets(st.text(max_size=20), max_size=5))
def test_any_text_is_split_without_error(response, fields):
    assert "".join(s.text for s in response_segments(response, fields)) == response


def test_advantage_colors_grow_with_size_and_carry_the_sign():
    strong, weak = advantage_color(2.0, 2.0), advantage_color(0.5, 2.0)
    assert strong == "rgba(214, 39, 40, 0.850)" and weak == "rgba(214, 39, 40, 0.212)"
    assert advantage_color(-4.0, 2.0) == "rgba(31, 119, 180, 0.850)"  # clipped at full strength
    assert advantage_color(1.0, 0.0) == advantage_color(float("nan"), 1.0) == "rgba(0, 0, 0, 0)"


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_advantages_are_all_drawn_clear(value):
    """The scale leaves non-finite advantages out; an infinity was painted at full strength, the colour of the
    file's largest real advantage, while NaN was clear."""
    assert advantage_color(value, 2.0) == "rgba(0, 0, 0, 0)"


@FAST
@given(st.floats(allow_nan=True, allow_infinity=True), st.floats(allow_nan=True, allow_infinity=True))
def test_advantage_color_is_always_a_css_rgba(value, scale):
    assert re.fullmatch(r"rgba\(\d+, \d+, \d+, (0|\d\.\d{3})\)", advantage_color(value, scale))


def reference_segments(response: str) -> list[tuple[str, str | None, bool]]:
    """The nesting rule read plainly: the open fields as a list, searched on each closing tag."""
    out: list[tuple[str, str | None, bool]] = []
    stack: list[str] = []
    position = 0
    for match in re.finditer(r"<(/?)(think|answer|observation)>", response):
        if match.start() > position:
            out.append((response[position:match.start()], stack[-1] if stack else None, False))
        name = match.group(2)
        if not match.group(1):
            stack.append(name)
            out.append((match.group(0), name, True))
        elif name in stack:
            del stack[len(stack) - 1 - stack[::-1].index(name):]
            out.append((match.group(0), name, True))
        else:
            out.append((match.group(0), stack[-1] if stack else None, False))
        position = match.end()
    if position < len(response):
        out.append((response[position:], stack[-1] if stack else None, False))
    return out


@FAST
@given(st.lists(st.sampled_from(["<think>", "</think>", "<answer>", "</answer>", "<observation>", "</observation>",
                                 "x", "Up "]), max_size=40))
def test_nesting_equals_the_plain_reading(parts):
    response = "".join(parts)
    assert pieces(response) == reference_segments(response)


def test_thousands_of_unclosed_tags_split_as_the_stack_says():
    """20,000 unclosed <think> then 20,000 stray </answer> (320,000 characters, a model stuck repeating a tag):
    each closing tag searched the whole stack of open fields (10 s on two cores), where a count of the open names
    answers at once (0.22 s); the split is the same."""
    response = "<think>" * 20_000 + "</answer>" * 20_000
    segments = response_segments(response)
    assert len(segments) == 40_000 and segments[-1].field == "think" and not segments[-1].is_tag

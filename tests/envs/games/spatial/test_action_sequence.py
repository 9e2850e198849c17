"""Spatial action sequences: RAGEN's grammar, leniency, and no exception on any input."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from turnrl.envs.games.spatial.action_sequence import MAX_CHARS, Action, parse_sequence, sequence_text


@pytest.mark.parametrize(
    ("text", "canonical"),
    [
        ("Actions: [Observe()]", "Actions: [Observe()]"),
        ("Actions: [Rotate(90), Observe()]", "Actions: [Rotate(90), Observe()]"),
        ("Actions: [JumpTo(red chair), Rotate(-90), Observe()]",
         "Actions: [JumpTo(red chair), Rotate(-90), Observe()]"),
        ("Actions: [Term(C)]", "Actions: [Term(C)]"),
        ("[term( c )]", "Actions: [Term(C)]"),
        ("I will look. Actions: [ rotate ( 180 ) ,observe() ] done", "Actions: [Rotate(180), Observe()]"),
        ("Actions: [JumpTo(trash_can), Observe()]", "Actions: [JumpTo(trash can), Observe()]"),
        ("Actions: [JumpTo('Air  Conditioner'), Observe()]", "Actions: [JumpTo(air conditioner), Observe()]"),
        ("Rotate(90), Observe()", "Actions: [Rotate(90), Observe()]"),  # the whole text is a list
        ("Actions: Term(B)", "Actions: [Term(B)]"),
        ("Actions: [Term(\"D\")]", "Actions: [Term(D)]"),
        ("Actions: [Term(A.)]", "Actions: [Term(A)]"),
        ("Actions: [Rotate(45), Observe()]", "Actions: [Rotate(45), Observe()]"),  # readable; fails when played
        ("Actions: [JumpTo(unicorn), Observe()]", "Actions: [JumpTo(unicorn), Observe()]"),
    ],
)
def test_readable_sequences(text, canonical):
    actions = parse_sequence(text)
    assert actions is not None and sequence_text(actions) == canonical
    assert parse_sequence(canonical) == actions


@pytest.mark.parametrize(
    "text",
    [
        "", "   ", "not an action", "<answer>?</answer>", "Actions: []", "Actions: [Rotate(90)]",  # no final action
        "Actions: [Observe(), Rotate(90), Observe()]",  # two finals
        "Actions: [Observe(), Rotate(90)]",  # final not last
        "Actions: [Rotate(90), Term(A)]",  # Term not alone
        "Actions: [Term()]", "Actions: [Term(AB)]", "Actions: [Term(1)]",
        "Actions: [Observe(x)]", "Actions: [Rotate(ninety), Observe()]", "Actions: [Rotate(12345), Observe()]",
        "Actions: [Fly(up), Observe()]", "Actions: [JumpTo(), Observe()]", "Actions: [JumpTo(a(b)), Observe()]",
        "Actions: [Observe()", "Actions: Observe())", "Observe() and then something",
        "Actions: [" + "Rotate(90), " * 20 + "Observe()]",  # more than MAX_ACTIONS
        "Actions: [Observe()]" + " " * MAX_CHARS,  # too long
    ],
)
def test_unreadable_sequences(text):
    assert parse_sequence(text) is None


@pytest.mark.parametrize("value", [None, 3, 2.5, b"Actions: [Observe()]", ["Observe()"], {"a": 1}])
def test_non_strings_are_unreadable(value):
    assert parse_sequence(value) is None


def test_action_records():
    actions = parse_sequence("Actions: [JumpTo(sofa), Rotate(-270), Observe()]")
    assert actions == (Action("jump", "sofa"), Action("rotate", degrees=-270), Action("observe"))
    assert [a.is_final for a in actions] == [False, False, True]


CALLS = st.sampled_from(["Observe()", "Term(B)", "Rotate(90)", "Rotate(-7)", "JumpTo(chair)", "JumpTo(x y)",
                         "Term()", "Observe(1)", "()", "(", ")", ",", "[", "]"])


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.text(max_size=300), st.lists(st.one_of(CALLS, st.text(max_size=8)), max_size=12).map("".join),
                 st.lists(CALLS, max_size=6).map(lambda calls: f"Actions: [{', '.join(calls)}]")))
def test_any_text_parses_without_error_and_canonical_forms_are_stable(text):
    actions = parse_sequence(text)
    if actions is None:
        return
    assert actions[-1].is_final and not any(a.is_final for a in actions[:-1])
    assert parse_sequence(sequence_text(actions)) == actions

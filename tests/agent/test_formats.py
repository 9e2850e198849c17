"""Reasoning formats: parsing, error reporting, rendering, instructions, robustness."""

from __future__ import annotations

import functools
import re
import sys
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from turnrl.agent import (
    ParsedResponse,
    Tag,
    format_names,
    get_format,
    normalize_action_tuple,
    turn_format_reward,
)
from turnrl.agent.formats import FormatOptions, ResponseFormat, TaggedFormat

GRID = ["Up", "Down", "Left", "Right"]
KEYWORDS = ["left", "right", "up", "down", "stop"]
TUPLES = ["('move', 0)", "('move', 1)", "('move', 2)", "('move', 3)", "('stop', 'stop')"]

ALL_FORMATS = [
    "no_think",
    "free_think",
    "grounding",
    "worldmodeling",
    "grounding_worldmodeling",
    "ragen",
    "ragen_no_think",
    "visgym_tuple",
    "visgym_keyword",
]
VAGEN = ["no_think", "free_think", "grounding", "worldmodeling", "grounding_worldmodeling"]

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def names_for(fmt_name: str) -> list[str]:
    """The action names an env of the kind each format was made for would give."""
    return {"visgym_tuple": TUPLES, "visgym_keyword": KEYWORDS}.get(fmt_name, GRID)


# --------------------------------------------------------------------------- registry
def test_format_names_lists_every_format():
    assert format_names() == ALL_FORMATS


def test_unknown_format_lists_the_names():
    with pytest.raises(ValueError, match="grounding_worldmodeling"):
        get_format("nope")


@pytest.mark.parametrize("bad", [{"max_actions_per_turn": 0}, {"action_separator": ""}, {"action_separator": "<"}])
def test_bad_settings_raise(bad):
    with pytest.raises(ValueError):
        get_format("free_think", **bad)


@pytest.mark.parametrize(("structure", "why"), [
    ((Tag("answer"), Tag("answer")), "tag names must be present and unique"),
    ((Tag("my plan"), Tag("answer")), "tag names must be identifiers"),
    ((Tag("plan"), Tag("2nd"), Tag("answer")), "tag names must be identifiers"),
])
def test_a_format_whose_tag_names_are_repeated_or_no_identifiers_is_refused(structure, why):
    with pytest.raises(ValueError, match=why):
        ResponseFormat("mine", structure)


def test_a_tag_name_of_one_character_is_an_identifier():
    fmt = ResponseFormat("mine", (Tag("p"), Tag("answer")))
    assert fmt.parse("<p>go</p><answer>Up</answer>", GRID) == ParsedResponse(("Up",), {"p": "go", "answer": "Up"}, True)


def test_tuple_format_rejects_a_comma_separator():
    with pytest.raises(ValueError, match="inside tuple"):
        get_format("visgym_tuple", action_separator=",")


# --------------------------------------------------------------------------- well-formed responses
WELL_FORMED = {
    "no_think": ("<answer>Up, Left</answer>", {"answer": "Up, Left"}),
    "free_think": ("<think>go up then left</think><answer>Up, Left</answer>", {"think": "go up then left"}),
    "grounding": (
        "<think><observation>box below</observation><reasoning>push it</reasoning></think>"
        "<answer>Up, Left</answer>",
        {"observation": "box below", "reasoning": "push it"},
    ),
    "worldmodeling": (
        "<think><reasoning>push it</reasoning><prediction>box on target</prediction></think>"
        "<answer>Up, Left</answer>",
        {"reasoning": "push it", "prediction": "box on target"},
    ),
    "grounding_worldmodeling": (
        "\n<think>\n  <observation>box below</observation>\n  <reasoning>push it</reasoning>\n"
        "  <prediction>box on target</prediction>\n</think>\n<answer> Up , Left </answer>\n",
        {"observation": "box below", "reasoning": "push it", "prediction": "box on target", "answer": "Up , Left"},
    ),
    "ragen": ("<think>go</think><answer>Up || Left</answer>", {"think": "go", "answer": "Up || Left"}),
    "ragen_no_think": ("<answer>Up || Left</answer>", {"answer": "Up || Left"}),
}


@pytest.mark.parametrize("name", list(WELL_FORMED))
def test_well_formed_responses_parse(name):
    text, expected_fields = WELL_FORMED[name]
    parsed = get_format(name, max_actions_per_turn=3).parse(text, GRID)
    assert parsed == ParsedResponse(parsed.actions, parsed.fields, True, (), ())
    assert parsed.actions == ("Up", "Left")
    for key, value in expected_fields.items():
        assert parsed.fields[key] == value


def test_visgym_tuple_well_formed():
    text = (
        "<observation>agent at top</observation><justification>goal is right</justification>"
        "<action>(\"move\",0)</action>"
    )
    parsed = get_format("visgym_tuple").parse(text, TUPLES)
    assert parsed.format_ok and parsed.errors == ()
    assert parsed.actions == ("('move', 0)",)
    assert parsed.fields["justification"] == "goal is right"
    free = get_format("visgym_tuple").parse(text)  # free-form: the normalized tuple itself
    assert free.actions == ("('move', 0)",)


def test_visgym_keyword_free_text_and_last_tag_wins():
    fmt = get_format("visgym_keyword")
    parsed = fmt.parse("I could go <action>left</action> but up is better. <action>UP</action>", KEYWORDS)
    assert parsed.format_ok
    assert parsed.actions == ("up",)
    assert fmt.parse("thinking... no tag yet", KEYWORDS).format_ok is False
    empty_last = fmt.parse("<action>left</action><action> </action>", KEYWORDS)
    assert not empty_last.format_ok and empty_last.actions == ()


# --------------------------------------------------------------------------- malformed responses
MALFORMED = [
    # (format, text, expected error fragment, expected actions)
    ("free_think", "<answer>Up</answer>", "missing <think>", ("Up",)),
    ("free_think", "<think>hmm</think>", "missing <answer>", ()),
    ("free_think", "<answer>Up</answer><think>hmm</think>", "expected <think> but found <answer>", ("Up",)),
    ("free_think", "<think>hmm</think><answer>  </answer>", "empty <answer>", ()),
    ("free_think", "<think></think><answer>Up</answer>", "empty <think>", ("Up",)),
    (
        "free_think",
        "<think>a <answer>Down</answer></think><answer>Up</answer>",
        "<answer> nested inside <think>",
        ("Up",),
    ),
    ("free_think", "<think>hmm</think><answer>Up</ans", "unclosed <answer>", ()),
    ("free_think", "<think>hmm<answer>Up</answer>", "unclosed <think>", ("Up",)),
    ("free_think", "Sure! <think>hmm</think><answer>Up</answer>", "text outside the tags: 'Sure!'", ("Up",)),
    ("free_think", "<think>hmm</think><answer>Up</answer> Done.", "text outside the tags: 'Done.'", ("Up",)),
    ("free_think", "<think>a</think><answer>Up</answer><answer>Down</answer>", "unexpected <answer> after", ("Down",)),
    ("free_think", "<think>a</think></think><answer>Up</answer>", "found </think>", ("Up",)),
    ("free_think", "<think>a</think><answer>Up</answer></answer>", "unexpected </answer> after", ("Up",)),
    ("free_think", "<think>a</think><answer>Up<answer>Down</answer>", "<answer> nested inside <answer>", ("Down",)),
    ("no_think", "<Answer>Up</Answer>", "missing <answer>", ()),
    (
        "grounding_worldmodeling",
        "<think><observation>o</observation><prediction>p</prediction><reasoning>r</reasoning></think>"
        "<answer>Up</answer>",
        "expected <reasoning> but found <prediction>",
        ("Up",),
    ),
    (
        "grounding_worldmodeling",
        "<think><observation>o</observation>so<reasoning>r</reasoning><prediction>p</prediction></think>"
        "<answer>Up</answer>",
        "text inside <think>",
        ("Up",),
    ),
    ("grounding", "<think><observation>o</observation></think><answer>Up</answer>", "missing <reasoning>", ("Up",)),
    ("ragen", "<think>x</think><answer>Up, Left</answer>", "unknown action 'Up, Left'", ()),
    (
        "visgym_tuple",
        "<observation>o</observation><action>('move', 1)</action>",
        "missing <justification>",
        ("('move', 1)",),
    ),
]


@pytest.mark.parametrize("name,text,fragment,actions", MALFORMED)
def test_malformed_responses(name, text, fragment, actions):
    parsed = get_format(name).parse(text, names_for(name))
    assert not parsed.format_ok or name == "ragen"  # ragen case: well-formed tags, wrong separator
    assert any(fragment in error for error in parsed.errors), parsed.errors
    assert parsed.actions == actions


def test_each_missing_tag_is_named_once():
    parsed = get_format("grounding_worldmodeling").parse(
        "<think><observation>o</observation></think><answer>Up</answer>", GRID)
    assert parsed.errors == ("missing <reasoning>", "missing <prediction>")


def test_unknown_names_dropped_and_mixed_case_mapped():
    fmt = get_format("ragen", max_actions_per_turn=5)
    parsed = fmt.parse("<think>x</think><answer>uP || JUMP || left ||  || right</answer>", GRID)
    assert parsed.format_ok  # the tags are fine; action problems are reported separately
    assert parsed.actions == ("Up", "Left", "Right")
    assert parsed.dropped_actions == ("JUMP",)
    assert parsed.errors == ("unknown action 'JUMP'",)


def test_too_many_actions_keeps_the_first():
    parsed = get_format("no_think", max_actions_per_turn=2).parse("<answer>Up, Jump, Down, Left</answer>", GRID)
    assert parsed.actions == ("Up", "Down")
    assert parsed.dropped_actions == ("Jump", "Left")
    assert "too many actions: 3 given, kept the first 2" in parsed.errors


def test_configured_separator():
    fmt = get_format("free_think", action_separator="|", max_actions_per_turn=3)
    assert fmt.parse("<think>x</think><answer>Up|Left</answer>", GRID).actions == ("Up", "Left")


def test_free_form_answer_is_one_action():
    expression = "(10 - 4) * 3, then + 1"
    for name in ("free_think", "ragen"):
        parsed = get_format(name, max_actions_per_turn=3).parse(f"<think>x</think><answer> {expression} </answer>")
        assert parsed.actions == (expression,) and parsed.format_ok
    split = get_format("no_think", action_separator=",", max_actions_per_turn=3).parse("<answer>a, b</answer>")
    assert split.actions == ("a", "b")


def test_strict_mode_takes_no_actions_from_malformed_responses():
    fmt = get_format("grounding_worldmodeling", strict=True)
    parsed = fmt.parse("<think>no sub-tags</think><answer>Up</answer>", GRID)
    assert parsed.actions == () and not parsed.format_ok
    assert any("strict" in error for error in parsed.errors)
    good = fmt.render(["Up"])
    assert fmt.parse(good, GRID).actions == ("Up",)


def test_a_format_built_directly_takes_one_action_from_the_last_answer_of_any_response():
    """``ResponseFormat``'s defaults: one action a turn, free-form answers unsplit, actions read leniently from the
    last complete answer (not RAGEN's first) of a response that need not be well formed, nor may hold free text."""
    fmt = ResponseFormat("mine", (Tag("answer"),))
    assert fmt.parse("<answer>Up, Left</answer>", GRID).actions == ("Up",)
    assert fmt.parse("<answer>a, b</answer>").actions == ("a, b",)
    malformed = fmt.parse("so <answer>Up</answer><answer>Left</answer>", GRID)
    assert not malformed.format_ok and malformed.actions == ("Left",)


def test_non_string_input_is_an_error_not_an_exception():
    parsed = get_format("free_think").parse(None, GRID)  # type: ignore[arg-type]
    assert parsed.actions == () and not parsed.format_ok and parsed.errors


# --------------------------------------------------------------------------- tuples
@pytest.mark.parametrize(
    "raw,canonical",
    [
        ("('move', 0)", "('move', 0)"),
        ('("move",0)', "('move', 0)"),
        ("( 'stop' , 'stop' )", "('stop', 'stop')"),
        ("('move', +3)", "('move', 3)"),
        ("('rotate', -1.50)", "('rotate', -1.5)"),
        ("('stop',)", "('stop',)"),
    ],
)
def test_tuple_normalization(raw, canonical):
    assert normalize_action_tuple(raw) == canonical


@pytest.mark.parametrize(
    "raw",
    [
        "__import__('os')",
        "('move', __import__('os').system('ls'))",
        "(('move', 0), 1)",
        "('move', [0, 1])",
        "('move', 99999999999999999999)",
        "('move', 1e999)",
        "('mo\\'ve', 0)",
        "('move\", 0)",
        "(move, 0)",
        "()",
        "('move', 0",
        "'move', 0",
        "(" + "'a', " * 20 + "'a')",
        "('" + "a" * 300 + "', 0)",
    ],
)
def test_tuple_rejections(raw):
    assert normalize_action_tuple(raw) is None
    parsed = get_format("visgym_tuple").parse(
        f"<observation>o</observation><justification>j</justification><action>{raw}</action>", TUPLES
    )
    assert parsed.actions == () and parsed.dropped_actions
    assert turn_format_reward(parsed) == -0.1


def test_tuple_names_are_matched_case_insensitively_to_the_env_spelling():
    env_names = ["('move',0)", "('STOP','STOP')"]
    parsed = get_format("visgym_tuple").parse(
        "<observation>o</observation><justification>j</justification><action>(\"stop\", \"stop\")</action>", env_names
    )
    assert parsed.actions == ("('STOP','STOP')",)


def test_tuple_format_with_keyword_env_names_passes_tuples_on():
    fmt = get_format("visgym_tuple")
    wrap = "<observation>o</observation><justification>j</justification><action>{}</action>"
    assert fmt.parse(wrap.format('("move",1)'), KEYWORDS).actions == ("('move', 1)",)
    assert fmt.parse(wrap.format("UP"), KEYWORDS).actions == ("up",)
    assert fmt.parse(wrap.format("jump"), KEYWORDS).dropped_actions == ("jump",)
    example = fmt.instructions(KEYWORDS, 1).split("Example:\n", 1)[1]
    assert "<action>('move', 0)</action>" in example


def test_maze2d_accepts_what_the_visgym_formats_parse():
    maze = pytest.importorskip("turnrl.envs.games.maze")
    env = maze.Maze2DEnv()
    env.reset(seed=0)
    names = env.action_names()
    wrap = "<observation>o</observation><justification>j</justification><action>{}</action>"
    cases = [
        ("visgym_tuple", wrap.format("( 'move' ,2 )")),
        ("visgym_tuple", wrap.format('("stop","stop")')),
        ("visgym_keyword", "Going left. <action>Left</action>"),
    ]
    for name, text in cases:
        parsed = get_format(name).parse(text, names)
        assert parsed.format_ok and len(parsed.actions) == 1
        assert env.canonical_action(parsed.actions[0]) is not None


# --------------------------------------------------------------------------- reward
def test_turn_format_reward():
    fmt = get_format("free_think", max_actions_per_turn=2)
    good = fmt.parse("<think>x</think><answer>Up</answer>", GRID)
    sloppy = fmt.parse("ok <think>x</think><answer>Up</answer>", GRID)
    unknown = fmt.parse("<think>x</think><answer>Up, Fly</answer>", GRID)
    nothing = fmt.parse("<think>x</think><answer>Fly</answer>", GRID)
    assert turn_format_reward(good) == 0.5
    assert turn_format_reward(good, format_reward=1.0) == 1.0
    assert turn_format_reward(sloppy) == 0.0
    assert turn_format_reward(unknown) == 0.0
    assert turn_format_reward(unknown, require_valid_actions=False) == 0.5
    assert turn_format_reward(nothing) == -0.1
    assert turn_format_reward(nothing, no_action_penalty=-1.0) == -1.0


# --------------------------------------------------------------------------- instructions
@pytest.mark.parametrize("name", ALL_FORMATS)
def test_instructions_name_the_actions_and_show_a_parsable_example(name):
    fmt = get_format(name, max_actions_per_turn=3)
    names = names_for(name)
    text = fmt.instructions(names, 3)
    for action in names:
        assert action in text
    example = text.split("Example:\n", 1)[1]
    parsed = fmt.parse(example, names)
    assert parsed.format_ok and parsed.actions and not parsed.dropped_actions
    if fmt.separator is not None:
        assert "1 to 3 actions" in text and f'"{fmt.separator}"' in text
    free = fmt.instructions(None, 3).split("Example:\n", 1)[1]
    assert fmt.parse(free).format_ok


def test_instructions_use_given_example_actions():
    text = get_format("free_think").instructions(None, 1, example_actions=["(6 - 2) * 5"])
    assert text.endswith("<answer>(6 - 2) * 5</answer>")


def test_instructions_of_a_format_whose_tags_give_only_hints_show_a_parsable_example():
    """A format of one's own may give a tag a hint and no example text: the prompt still has its example (the
    episode would otherwise fail before its first turn), and a demonstration still asks for real text."""
    fmt = TaggedFormat("plan_answer", (Tag("plan", "your plan."), Tag("answer")))(FormatOptions())
    text = fmt.instructions(GRID, 1)
    assert "- <plan>: your plan." in text
    assert text.split("Example:\n", 1)[1] == "<plan>...</plan><answer>Up</answer>"
    assert fmt.parse(text.split("Example:\n", 1)[1], GRID).format_ok
    with pytest.raises(ValueError, match="<plan> content must be non-blank"):
        fmt.render(["Up"])


# --------------------------------------------------------------------------- render -> parse
# Reasoning / action texts without tag characters, already stripped (parse strips).
FIELD_TEXT = st.text(
    st.characters(exclude_characters="<>", exclude_categories=("Cs",)), min_size=1, max_size=40
).filter(lambda s: s.strip() == s and s)


@pytest.mark.parametrize("name", ALL_FORMATS)
@FAST
@given(data=st.data())
def test_render_parse_round_trip(name, data):
    limit = data.draw(st.integers(1, 4))
    fmt = get_format(name, max_actions_per_turn=limit)
    names = names_for(name)
    count = limit if fmt.separator is not None else 1
    actions = data.draw(st.lists(st.sampled_from(names), min_size=1, max_size=count))
    leaves = [tag.name for top in fmt.structure for tag in top.walk() if not tag.children]
    fields = {tag: data.draw(FIELD_TEXT) for tag in leaves if tag != fmt.answer_tag}
    text = fmt.render(actions, fields)
    parsed = fmt.parse(text, names)
    assert parsed.format_ok, (text, parsed.errors)
    assert parsed.actions == tuple(actions) and parsed.errors == () and parsed.dropped_actions == ()
    for tag, value in fields.items():
        assert parsed.fields[tag] == value


@pytest.mark.parametrize("name", ["free_think", "ragen", "visgym_keyword"])
@FAST
@given(action=FIELD_TEXT)
@example(action="(6 - 2) * 5, then || 1")  # one free-form action may hold any separator
def test_render_parse_round_trip_free_form(name, action):
    fmt = get_format(name)
    parsed = fmt.parse(fmt.render([action]))
    assert parsed.format_ok and parsed.actions == (action,)


# Reasoning texts of any characters: tag-like text that is no format tag (``x < 5``, ``<Answer>``), chat markers,
# control characters, lone surrogates, surrounding blanks.
ANY_FIELD_TEXT = st.one_of(
    st.text(st.characters(exclude_categories=()), min_size=1, max_size=60),
    st.lists(st.sampled_from(["<", ">", "/", "think", "answer", "<|im_end|>", "x < 5", "<Answer>", " ", "\n"]),
             min_size=1, max_size=10).map("".join),
)


@pytest.mark.parametrize("name", ALL_FORMATS)
@FAST
@given(data=st.data())
def test_render_parse_round_trip_with_reasoning_of_any_text(name, data):
    """A demonstration's reasoning may hold any text but a format tag: the parse gives it back (stripped) and
    the answer's actions with it; blank text or a format tag is refused by ``render``."""
    limit = data.draw(st.integers(1, 3))
    fmt = get_format(name, max_actions_per_turn=limit)
    names = names_for(name)
    actions = data.draw(st.lists(st.sampled_from(names), min_size=1, max_size=limit if fmt.separator else 1))
    leaves = [tag.name for top in fmt.structure for tag in top.walk() if not tag.children]
    fields = {tag: data.draw(ANY_FIELD_TEXT) for tag in leaves if tag != fmt.answer_tag}
    pattern = re.compile("|".join(f"</?{tag}>" for tag in fmt.tag_names))
    if any(not value.strip() or pattern.search(value) for value in fields.values()):
        with pytest.raises(ValueError, match="must be non-blank and contain no format tags"):
            fmt.render(actions, fields)
        return
    parsed = fmt.parse(fmt.render(actions, fields), names)
    assert parsed.format_ok and parsed.actions == tuple(actions), parsed.errors
    assert {tag: parsed.fields[tag] for tag in fields} == {tag: value.strip() for tag, value in fields.items()}


def test_render_writes_a_tuple_action_in_canonical_form():
    fields = {"observation": "o", "justification": "j"}
    assert get_format("visgym_tuple").render(['( "move",0 )'], fields).endswith("<action>('move', 0)</action>")


def test_default_options_take_one_action_leniently():
    fmt = TaggedFormat("mine", (Tag("answer"),))(FormatOptions())
    assert fmt.parse("so <answer>Up, Left</answer>", GRID).actions == ("Up",)


def test_a_format_by_name_takes_one_action_a_turn_unless_told_otherwise():
    assert get_format("no_think").parse("<answer>Up, Left</answer>", GRID).actions == ("Up",)


def test_render_rejects_what_cannot_round_trip():
    fmt = get_format("free_think", max_actions_per_turn=2)
    bad = [([], None), (["Up"] * 3, None), ([" Up"], None), (["Up", "a,b"], None), (["Up"], {"think": "<answer>x"})]
    for actions, fields in bad:
        with pytest.raises(ValueError):
            fmt.render(actions, fields)
    with pytest.raises(ValueError):
        get_format("visgym_keyword", max_actions_per_turn=2).render(["left", "up"])


@pytest.mark.parametrize(("name", "separator", "answer"), [
    ("no_think", None, "Up, Left"),
    ("no_think", ";", "Up; Left"),
    ("no_think", "|", "Up | Left"),
    ("no_think", " ", "Up Left"),
    ("ragen_no_think", None, "Up || Left"),
])
def test_render_writes_a_comma_or_semicolon_then_a_space_and_other_separators_between_spaces(name, separator, answer):
    fmt = get_format(name, action_separator=separator, max_actions_per_turn=2)
    assert fmt.render(["Up", "Left"]) == f"<answer>{answer}</answer>"


def test_the_first_five_unknown_actions_are_quoted_and_the_rest_counted():
    parsed = get_format("no_think", max_actions_per_turn=2).parse("<answer>Up, a, b, c, d, e, f, g</answer>", GRID)
    assert parsed.actions == ("Up",) and parsed.dropped_actions == ("a", "b", "c", "d", "e", "f", "g")
    assert parsed.errors == ("unknown action 'a'", "unknown action 'b'", "unknown action 'c'", "unknown action 'd'",
                             "unknown action 'e'", "... and 2 more invalid actions")
    five = get_format("no_think", max_actions_per_turn=2).parse("<answer>a, b, c, d, e, Up</answer>", GRID)
    assert five.errors == ("unknown action 'a'", "unknown action 'b'", "unknown action 'c'", "unknown action 'd'",
                           "unknown action 'e'")


def test_a_tuple_the_env_does_not_name_is_unknown_and_text_that_is_no_tuple_malformed():
    fmt = get_format("visgym_tuple", action_separator=";", max_actions_per_turn=3)
    parsed = fmt.parse("<observation>o</observation><justification>j</justification>"
                       "<action>('jump', 0); jump; ('move',0)</action>", TUPLES)
    assert parsed.actions == ("('move', 0)",) and parsed.dropped_actions == ("('jump', 0)", "jump")
    assert parsed.errors == ("unknown action \"('jump', 0)\"", "malformed action tuple 'jump'")


@pytest.mark.parametrize("name", ["ragen", "ragen_no_think"])
def test_strict_takes_no_actions_from_a_malformed_response_in_ragens_reading_too(name):
    """Found by the fuzz test below: RAGEN's reading took the answer of a malformed response under strict."""
    think = "<think>t</think>" if name == "ragen" else ""
    parsed = get_format(name, strict=True).parse(f"0{think}<answer>Up</answer>")
    assert not parsed.format_ok and parsed.actions == ()
    assert "actions ignored: the response is malformed (strict format)" in parsed.errors
    assert get_format(name).parse(f"0{think}<answer>Up</answer>").actions == ("Up",)  # not strict: RAGEN's own


def test_ragens_reading_names_the_shape_it_found_no_actions_in_and_other_readings_only_the_missing_tag():
    assert get_format("ragen").parse("<think>x</think>", GRID).errors == (
        "missing <answer>", "no <think>...</think><answer>...</answer> found: no actions taken")
    assert get_format("ragen_no_think").parse("", GRID).errors == (
        "missing <answer>", "no <answer>...</answer> found: no actions taken")
    assert get_format("free_think").parse("<think>x</think>", GRID).errors == ("missing <answer>",)


RAGEN_SPECIAL_TOKENS = ["<think>", "</think>", "<answer>", "</answer>", "<|im_start|>", "<|im_end|>"]


def ragen_parse(response: str, enable_think: bool, max_actions: int, names: list[str]) -> tuple[tuple[str, ...], bool]:
    """RAGEN's reading, transcribed: ``ContextManager._parse_response`` (mll-lab-nu/RAGEN, ctx_manager.py), then
    ``EnvStateManager._extract_map_valid_actions`` and its penalty (any action that does not map). Returns the
    actions and whether the turn pays the penalty."""
    pattern = r"<think>(.*?)</think>\s*<answer>(.*?)</answer>" if enable_think else r"<answer>(.*?)</answer>"
    match = re.search(pattern, response, re.DOTALL)
    if not match:
        return (), False
    action_content = match.group(2) if enable_think else match.group(1)
    for special_token in RAGEN_SPECIAL_TOKENS:
        action_content = action_content.replace(special_token, "").strip()
    actions = [action.strip() for action in action_content.split("||") if action.strip()][:max_actions]
    lookup = {name.lower(): name for name in names}
    mapped = tuple(lookup[action.lower()] for action in actions if action.lower() in lookup)
    return mapped, len(mapped) != len(actions)


RAGEN_FRAGMENTS = st.sampled_from(
    [*RAGEN_SPECIAL_TOKENS, "<", "/", ">", "think", "answer", "<ans", "wer>", "|", "Up", "left", "Jump", "||", " ",
     "\n"])


@pytest.mark.parametrize("name", ["ragen", "ragen_no_think"])
@FAST
@given(text=st.one_of(st.text(max_size=60), st.lists(RAGEN_FRAGMENTS, max_size=40).map("".join)),
       limit=st.integers(1, 3))
@example(text="<think>a</think><answer><|im_end|>Up</answer>", limit=1)  # a chat marker written as text
@example(text="<think>a</think><answer><ans<think>wer>Up</answer>", limit=1)  # a tag the removal joins
@example(text="<answer><|im_start|>Left || Up<|im_end|></answer>", limit=2)
def test_ragens_reading_takes_the_actions_ragens_parser_takes(name, text, limit):
    parsed = get_format(name, max_actions_per_turn=limit).parse(text, GRID)
    assert (parsed.actions, parsed.any_invalid) == ragen_parse(text, name == "ragen", limit, GRID)


# --------------------------------------------------------------------------- fuzzing
FRAGMENTS = st.sampled_from(
    [f"<{t}>" for t in ("think", "answer", "observation", "reasoning", "prediction", "justification", "action")]
    + [f"</{t}>" for t in ("think", "answer", "observation", "reasoning", "prediction", "justification", "action")]
    + ["Up", "left", ", ", "||", " ", "\n", "('move', 0)", "(", ")", "'", "<", ">", "</", "x", "Jump", "<ans"]
)
RESPONSES = st.one_of(st.text(max_size=200), st.lists(FRAGMENTS, max_size=30).map("".join))


@pytest.mark.parametrize("name", ALL_FORMATS)
@FAST
@given(text=RESPONSES, with_names=st.booleans(), strict=st.booleans())
def test_parse_never_raises_and_keeps_its_invariants(name, text, with_names, strict):
    fmt = get_format(name, max_actions_per_turn=2, strict=strict)
    names = names_for(name) if with_names else None
    parsed = fmt.parse(text, names)
    assert len(parsed.actions) <= 2
    if names is not None:
        assert set(parsed.actions) <= set(names)
    if parsed.format_ok:
        assert all(parsed.fields.get(tag) for tag in fmt.tag_names)
        assert not any(e.startswith(("missing", "unclosed", "text", "empty", "expected")) for e in parsed.errors)
    else:
        assert parsed.errors
    if strict and not parsed.format_ok:
        assert parsed.actions == ()
    assert isinstance(turn_format_reward(parsed), float)


ANY_TEXT = st.text(st.characters(exclude_categories=()), max_size=200)
"""Every code point: control characters, line and paragraph separators, lone surrogates (an HTTP endpoint's JSON
``"\\udfff"`` decodes to one)."""
TAG_NAMES = ("think", "answer", "observation", "reasoning", "prediction", "justification", "action")
NESTED = st.recursive(
    st.one_of(FRAGMENTS, ANY_TEXT.map(lambda text: text[:8])),
    lambda inner: st.builds(lambda name, parts: f"<{name}>{''.join(parts)}</{name}>", st.sampled_from(TAG_NAMES),
                            st.lists(inner, max_size=4)),
    max_leaves=25,
)
"""Format tags nested in one another to any depth, around text of any characters."""
HOSTILE = st.one_of(
    ANY_TEXT,
    NESTED,
    st.lists(st.one_of(FRAGMENTS, NESTED, ANY_TEXT.map(lambda text: text[:4])), max_size=20).map("".join),
    st.builds(lambda unit, times: unit * times, st.one_of(FRAGMENTS, ANY_TEXT.map(lambda text: text[:4])),
              st.integers(0, 3000)),  # one piece repeated into a long response
)


@pytest.mark.parametrize("name", ALL_FORMATS)
@FAST
@given(text=HOSTILE, with_names=st.booleans(), strict=st.booleans(), limit=st.integers(1, 4),
       separator=st.sampled_from([None, ";", "||", " "]))
@example(text="<answer>Up\udfff</answer>", with_names=False, strict=False, limit=1, separator=None)
@example(text="<think>a\u2028b</think><answer>Up\x00, Left\r\n</answer>", with_names=True, strict=True, limit=2,
         separator=None)
def test_any_text_parses_without_raising_into_actions_and_one_line_errors(name, text, with_names, strict, limit,
                                                                         separator):
    """Any text a policy returns is data: the parse never raises, keeps at most the limit of stripped actions,
    and each error is one line that quotes a bounded excerpt (the next turn's prompt shows them)."""
    if name == "visgym_tuple" and separator == " ":
        separator = None  # a space would split inside a tuple: such a format is refused
    fmt = get_format(name, action_separator=separator, max_actions_per_turn=limit, strict=strict)
    names = names_for(name) if with_names else None
    parsed = fmt.parse(text, names)
    assert len(parsed.actions) <= limit
    assert all(action and action == action.strip() for action in parsed.actions)
    if names is not None:
        assert set(parsed.actions) <= set(names)
    assert parsed.format_ok or parsed.errors
    # An excerpt quotes at most 40 characters, each escaped in at most 10 (``\U0003134b``).
    assert all(len(error.splitlines()) == 1 and len(error) < 600 for error in parsed.errors), parsed.errors
    span = fmt.reasoning_span(text)
    assert span is None or 0 <= span[0] < span[1] <= len(text)


TUPLE_ITEMS = st.one_of(st.integers(-999_999_999, 999_999_999).map(str),
                        st.from_regex(r"[A-Za-z0-9_ .\-]{1,32}", fullmatch=True).map(repr))
TUPLE_TEXTS = st.lists(TUPLE_ITEMS, min_size=1, max_size=9).map(lambda items: f"({', '.join(items)})")


@FAST
@given(text=st.one_of(HOSTILE, TUPLE_TEXTS))
@example(text="(" * 100_000)
@example(text="('move', " + "9" * 100_000 + ")")
def test_any_text_is_a_tuple_action_in_canonical_form_or_none(text):
    canonical = normalize_action_tuple(text)
    assert canonical is None or normalize_action_tuple(canonical) == canonical


@pytest.mark.parametrize(("text", "canonical"), [("('click', 0.00001)", "('click', 0.00001)"),
                                                 ("(-0.0, 1.50, 2.0)", "(-0.0, 1.5, 2.0)"),
                                                 ("(999999999.999999999,)", None)])  # 1e9 as a float
def test_a_tuple_of_any_decimal_the_grammar_reads_normalizes_to_a_tuple_it_reads(text, canonical):
    """A float was written as ``repr`` writes it (``1e-05``, ``1000000000.0``), which the grammar refuses."""
    assert normalize_action_tuple(text) == canonical
    assert canonical is None or normalize_action_tuple(canonical) == canonical


@pytest.mark.parametrize("name", ALL_FORMATS)
@FAST
@given(opening=HOSTILE, message=HOSTILE)
def test_a_templates_opening_of_any_text_gives_a_format_or_says_why_not(name, opening, message):
    """``under_template`` takes the text a chat template's generation prompt ends with: a format reads under it,
    or it is refused with the reason; a message that does not continue the prompt is refused saying so."""
    try:
        fmt = get_format(name).under_template(opening)
    except ValueError as error:
        assert re.search("does not begin with it|would follow the|already read under", str(error)), error
        return
    assert fmt.message_start.startswith(opening)
    assert fmt.continuation(fmt.assistant_text(message)) == message
    try:
        fmt.continuation(message)
    except ValueError as error:
        assert "so its assistant messages start with it" in str(error)


ADVERSARIAL = [  # (head, unit, repeats in about a megabyte, tail)
    ("", "<think>", 150_000, ""),
    ("", "<answer>", 120_000, "</answer>"),
    ("", "<", 1_000_000, ""),
    ("<answer>", "Up,", 330_000, "</answer>"),
    ("<think><observation>", "</observation><observation>", 40_000, ""),
    ("", "</answer><answer>", 60_000, ""),
    ("<action>('move', ", "0", 1_000_000, ")</action>"),
    ("<answer>", "(", 1_000_000, "</answer>"),
]
"""Inputs that would trip a parser with quadratic (or worse) work; ``benchmarks/format_parse.py`` times them."""


def adversarial(index: int, fraction: float) -> str:
    """The ``index``-th adversarial input at ``fraction`` of its megabyte size."""
    head, unit, repeats, tail = ADVERSARIAL[index]
    return head + unit * int(repeats * fraction) + tail


def calls_made(work) -> int:
    """Function calls (Python's and C's, the regex engine's entry points included) that ``work()`` makes."""
    calls = 0

    def count(frame, event, arg):
        nonlocal calls
        calls += event in ("call", "c_call")

    sys.setprofile(count)
    try:
        work()
    finally:
        sys.setprofile(None)
    return calls


@pytest.mark.parametrize("name", ALL_FORMATS)
def test_adversarial_inputs_parse_with_bounded_results(name):
    fmt = get_format(name, max_actions_per_turn=3)
    for index in range(len(ADVERSARIAL)):
        parsed = fmt.parse(adversarial(index, 0.25), names_for(name) if index % 2 else None)
        assert len(parsed.actions) <= 3
        assert all(len(error) < 200 for error in parsed.errors)


@pytest.mark.parametrize("name", ALL_FORMATS)
def test_adversarial_inputs_parse_in_work_linear_in_their_length(name):
    """Counted, not timed (a busy machine makes any time limit flaky): four times the input makes at most about
    four times the function calls, so no Python loop nests over the input (nested loops make sixteen times as
    many). The work inside one call (a regex's backtracking, a search per position) is not counted: the
    megabyte inputs are timed by ``benchmarks/format_parse.py`` instead."""
    fmt = get_format(name, max_actions_per_turn=3)
    for index in range(len(ADVERSARIAL)):
        names = names_for(name) if index % 2 else None
        fmt.parse(adversarial(index, 0.001), names)  # compiles what the parser caches
        small, large = (calls_made(functools.partial(fmt.parse, adversarial(index, f), names)) for f in (0.01, 0.04))
        assert large <= 4.5 * small + 100, f"{ADVERSARIAL[index][1]!r}: {small} calls, then {large} at 4x"


# --------------------------------------------------------------------------- where the reasoning lies
def reasoning(name: str, text: str) -> str | None:
    span = get_format(name).reasoning_span(text)
    return None if span is None else text[span[0] : span[1]]


def test_reasoning_is_the_content_of_the_first_think_pair_without_surrounding_whitespace():
    assert reasoning("ragen", "<think> Box is left.\n</think><answer>Left</answer>") == "Box is left."
    assert reasoning("free_think", "x <think>a</think> <think>b</think><answer>Up</answer>") == "a"
    nested = "<think><observation>I see G.</observation><reasoning>Go.</reasoning></think><answer>Up</answer>"
    assert reasoning("grounding", nested) == "<observation>I see G.</observation><reasoning>Go.</reasoning>"
    assert reasoning("ragen", "<think>cut short") is None  # no closing tag
    assert reasoning("ragen", "<think>  </think><answer>Up</answer>") is None  # blank
    assert reasoning("ragen", "</think><think>") is None


def test_formats_without_think_reason_before_their_answer_or_not_at_all():
    tuple_response = "<observation>Wall.</observation><justification>Turn.</justification><action>('move', 1)</action>"
    assert reasoning("visgym_tuple", tuple_response) == tuple_response[: tuple_response.index("<action>")]
    assert reasoning("visgym_keyword", "I should go left. <action>left</action>") == "I should go left."
    assert reasoning("visgym_keyword", "no action tag") is None
    for name in ("no_think", "ragen_no_think"):
        assert not get_format(name).has_reasoning
        assert reasoning(name, "thinking <answer>Up</answer>") is None
    assert all(get_format(name).has_reasoning for name in ALL_FORMATS if "no_think" not in name)


@pytest.mark.parametrize("name", ALL_FORMATS)
@FAST
@given(text=st.one_of(RESPONSES, HOSTILE))
def test_reasoning_span_never_raises_and_matches_a_regex_reading(name, text):
    fmt = get_format(name)
    span = fmt.reasoning_span(text)
    if "think" in fmt.tag_names:
        match = re.search(r"<think>(.*?)</think>", text, re.DOTALL)  # RAGEN's reading
        expected = match.group(1).strip() if match else ""
    elif fmt.has_reasoning:
        expected = text.split(f"<{fmt.answer_tag}>")[0].strip() if f"<{fmt.answer_tag}>" in text else ""
    else:
        expected = ""
    assert (None if span is None else text[span[0] : span[1]]) == (expected or None)


def test_a_message_that_does_not_begin_with_the_templates_opening_is_refused():
    fmt = get_format("free_think").under_template("<think>\n")
    with pytest.raises(ValueError, match="so its assistant messages start with it"):
        fmt.continuation("<answer>Up</answer>")


def test_a_response_prefix_is_how_every_well_formed_response_begins():
    # RAGEN's prompts end with <think> (<answer> without think); no other built-in format has a prefix.
    assert {name: get_format(name).response_prefix for name in format_names() if get_format(name).response_prefix} == {
        "ragen": "<think>", "ragen_no_think": "<answer>"}
    fmt = get_format("ragen")
    assert fmt.continuation(fmt.assistant_text(" go</think><answer>Up</answer>")) == " go</think><answer>Up</answer>"
    with pytest.raises(ValueError, match="ends the prompt with .<think>., so its assistant messages start with it"):
        fmt.continuation("<answer>Up</answer>")
    with pytest.raises(ValueError, match="response prefix '<think>' must be how every well-formed response begins"):
        replace(get_format("no_think"), response_prefix="<think>")


@pytest.mark.parametrize("name", ["free_think", "grounding", "ragen"])
def test_a_thinking_templates_opening_starts_each_assistant_message_and_the_parser_reads_it(name):
    """Qwen3-Thinking-2507 and the R1 distills end the prompt with <think>\\n: the model writes the rest."""
    fmt = get_format(name).under_template("<think>\n")
    assert fmt.template_opening == "<think>\n" and fmt.response_prefix == ""  # RAGEN's <think> is the template's
    demo = get_format(name).render(["Up"], {"think": "go", "observation": "o", "reasoning": "r"})
    written = fmt.continuation(demo)  # a demo written "<think>go..." is what follows the template's "<think>\\n"
    assert not written.startswith(("<think>", "\n")) and fmt.assistant_text(written) == "<think>\n" + written
    parsed = fmt.parse(fmt.assistant_text(written), ["Up", "Down"])
    assert parsed.format_ok and parsed.actions == ("Up",)
    assert fmt.parse(written, ["Up", "Down"]).format_ok is False  # what was read before: the response alone
    assert fmt.under_template("<think>\n") is fmt and get_format(name).under_template("") == get_format(name)


@pytest.mark.parametrize(("name", "why"), [
    ("no_think", "format 'no_think' .* does not begin with it"),
    ("visgym_tuple", "format 'visgym_tuple' .* does not begin with it"),
    ("ragen_no_think", "format 'ragen_no_think' .* does not begin with it"),
])
def test_a_format_that_cannot_continue_a_templates_opening_is_refused_saying_why(name, why):
    with pytest.raises(ValueError, match=why):
        get_format(name).under_template("<think>\n")


def test_free_text_formats_read_a_templates_opening_as_free_text():
    fmt = get_format("visgym_keyword").under_template("<think>\n")
    parsed = fmt.parse(fmt.assistant_text("Left is open.</think>\n<action>left</action>"), ["left", "right"])
    assert parsed.actions == ("left",) and parsed.format_ok


# --------------------------------------------------------------------------- from a user's package
def test_a_format_from_a_users_package_is_named_module_attr_in_the_config(tmp_path, monkeypatch):
    from turnrl.config import ConfigError, load_config
    from turnrl.training.train_config import TrainConfig

    (tmp_path / "user_format_ext.py").write_text(
        "from turnrl.agent.formats import Tag, TaggedFormat\n\n"
        "plan_answer = TaggedFormat('plan_answer', (Tag('plan', 'your plan.', 'go up'), Tag('answer')))\n"
        "def broken(options):\n"
        "    return 'not a format'\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    agent = load_config(TrainConfig, None, ["agent.format=user_format_ext:plan_answer",
                                            "agent.max_actions_per_turn=2"]).agent
    fmt = get_format(agent.format, action_separator=agent.action_separator,
                     max_actions_per_turn=agent.max_actions_per_turn, strict=agent.strict_format)
    assert fmt.name == "plan_answer" and fmt.tag_names == ("plan", "answer")
    parsed = fmt.parse("<plan>go up twice</plan><answer>Up, Up, Left</answer>", ["Up", "Left"])
    assert parsed.format_ok and parsed.actions == ("Up", "Up")
    assert "user_format_ext:plan_answer" not in format_names()
    with pytest.raises(ConfigError, match="agent.format='user_format_ext:broken': .*built a str"):
        load_config(TrainConfig, None, ["agent.format=user_format_ext:broken"])
    with pytest.raises(ConfigError, match=r"agent.format='free_thinkk' is not allowed; .*did you mean free_think\?"):
        load_config(TrainConfig, None, ["agent.format=free_thinkk"])


@pytest.mark.parametrize(
    ("value", "got"),
    [("turnrl.agent.formats:TaggedFormat", "got the class turnrl.agent.formats:TaggedFormat, not a function or an "
                                           "instance"),
     ("user_wrong_format_ext:two_arguments", r"got user_wrong_format_ext:two_arguments\(options, name\), which cannot "
                                             r"take those arguments \(missing a required argument: 'name'\)")],
)
def test_a_module_attr_that_is_not_a_format_builder_fails_at_config_load_saying_what_is(tmp_path, monkeypatch,
                                                                                          value, got):
    from turnrl.config import ConfigError, load_config
    from turnrl.training.train_config import TrainConfig

    (tmp_path / "user_wrong_format_ext.py").write_text(
        "from turnrl.agent.formats import Tag, TaggedFormat\n\n"
        "def two_arguments(options, name):\n"
        "    return TaggedFormat(name, (Tag('answer'),))(options)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError) as info:
        load_config(TrainConfig, None, [f"agent.format={value}"])
    assert (f"agent.format={value!r}: a response format must be a function or callable object taking (options) and "
            "returning ResponseFormat (turnrl.agent.formats.FormatBuilder); ") in str(info.value)
    info.match(got)

"""The chat templates' helpers: the tags a generation prompt leaves open."""

from __future__ import annotations

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from turnrl.chat.templates import TEMPLATES, open_tags, template_spec


@pytest.mark.parametrize(("text", "opened"), [
    ("<think>\n", ["think"]),  # Qwen3-Thinking-2507, the R1 distills
    ("<think>\n\n</think>\n\n", []),  # Qwen3's enable_thinking=False block
    ("<|im_start|>assistant\n", []),  # control tokens are not tags
    ("<think><observation>", ["think", "observation"]),
    ("<think><observation></think>", []),  # closing a tag closes what is open inside it
    ("</answer><think>", ["think"]),  # a closing tag of nothing open is passed over
    ("<a><b></a><b>", ["b"]),
    ("", []),
])
def test_open_tags_are_the_tags_left_open_outermost_first(text, opened):
    assert open_tags(text) == opened


PIECES = st.sampled_from(["<", ">", "/", "think", "a", "\n", " ", "<think>", "</think>", "<a>", "</a>"])


@given(st.one_of(st.text(max_size=60), st.lists(PIECES, max_size=20).map("".join)))
def test_open_tags_never_raise_and_name_only_tags_the_text_opens(text):
    opened = open_tags(text)
    assert all(f"<{name}>" in text for name in opened)
    assert open_tags(text + "".join(f"</{name}>" for name in reversed(opened))) == []


ANY_TEXT = st.text(st.characters(exclude_categories=()), max_size=60)
"""Every code point: control characters, line separators, lone surrogates."""
NESTED = st.recursive(
    st.one_of(PIECES, ANY_TEXT),
    lambda inner: st.builds(lambda name, parts: f"<{name}>{''.join(parts)}</{name}>",
                            st.from_regex(r"[A-Za-z_][A-Za-z0-9_\-]{0,8}", fullmatch=True),
                            st.lists(inner, max_size=4)),
    max_leaves=20,
)


@given(st.one_of(NESTED, st.lists(st.one_of(NESTED, PIECES), max_size=10).map("".join)))
@example("<think>\udfff<a>\u2028</a>")
def test_open_tags_of_nested_tags_around_any_text_close_to_none(text):
    opened = open_tags(text)
    assert all(f"<{name}>" in text for name in opened)
    assert open_tags(text + "".join(f"</{name}>" for name in reversed(opened))) == []


@given(ANY_TEXT)
@example("chatml\n")
def test_a_template_name_is_one_of_the_templates_or_refused_listing_them(name):
    if name in TEMPLATES:
        assert template_spec(name).name == name
        return
    with pytest.raises(ValueError, match=r"unknown chat template .*; choose one of \['chatml'"):
        template_spec(name)

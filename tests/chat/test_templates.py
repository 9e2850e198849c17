"""The chat templates' helpers: the tags a generation prompt leaves open."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from turnrl.chat.templates import open_tags


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

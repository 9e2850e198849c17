"""RAGEN's response parsing and format penalty.

Encodes mll-lab-nu/RAGEN at commit 20daedc47558e000f7de912b060646bf2e8026bd:
``ragen/llm_agent/ctx_manager.py`` (``ContextManager._parse_response``: the first match of
``<think>(.*?)</think>\\s*<answer>(.*?)</answer>``, or of ``<answer>(.*?)</answer>`` without think; format
tokens removed from the answer; the answer cut to ``max_actions_per_turn`` pieces) and
``ragen/llm_agent/es_manager.py`` (``EnvStateManager.step``: ``format_penalty`` when
``len(valid_actions) != len(actions) or not valid_actions``, valid meaning found in the action lookup,
case-insensitively). The prompt's end: ``ContextManager._build_infer_samples`` appends ``"<think>"`` (``"<answer>"``
without think) to ``apply_chat_template(..., add_generation_prompt=True)``, and ``get_env_inputs`` prepends it to
the decoded response before ``_parse_response``.
"""

from __future__ import annotations

import re

from hypothesis import given, settings
from hypothesis import strategies as st

from turnrl.agent.formats import get_format, turn_format_reward
from turnrl.rollout.context import EpisodeTokens

NAMES = ["Up", "Down", "Left", "Right"]
SPECIAL = ["<think>", "</think>", "<answer>", "</answer>"]


def ragen_parse(response: str, max_actions: int, think: bool = True) -> tuple[list[str], bool]:
    """RAGEN's reading, written as its source reads: (valid actions in lookup order, penalized)."""
    pattern = r"<think>(.*?)</think>\s*<answer>(.*?)</answer>" if think else r"<answer>(.*?)</answer>"
    match = re.search(pattern, response, re.DOTALL)
    actions: list[str] = []
    if match:
        answer = match.group(2) if think else match.group(1)
        for token in SPECIAL:
            answer = answer.replace(token, "").strip()
        actions = [a.strip() for a in answer.split("||") if a.strip()][:max_actions]
    lookup = {name.lower(): name for name in NAMES}
    valid = [lookup[a.lower()] for a in actions if a.lower() in lookup]
    return valid, len(valid) != len(actions) or not valid


def penalty(text: str, max_actions: int = 5, name: str = "ragen") -> float:
    fmt = get_format(name, max_actions_per_turn=max_actions)
    return turn_format_reward(fmt.parse(text, NAMES), format_reward=0.0, no_action_penalty=-0.1,
                              penalize_any_invalid=fmt.ragen_reading)


def test_a_turn_with_any_invalid_action_pays_the_penalty():
    assert penalty("<think>go</think><answer>Up || Jump</answer>") == -0.1  # one valid, one not
    assert penalty("<think>go</think><answer>Up || left</answer>") == 0.0
    # Other formats keep the rule of a penalty only when no action is valid.
    fmt = get_format("free_think", max_actions_per_turn=5)
    assert turn_format_reward(fmt.parse("<think>go</think><answer>Up, Jump</answer>", NAMES)) == 0.0


def test_think_is_required_before_the_answer_and_the_first_match_wins():
    fmt = get_format("ragen", max_actions_per_turn=5)
    assert fmt.parse("<answer>Up</answer>", NAMES).actions == ()  # a bare answer carries no action
    assert penalty("<answer>Up</answer>") == -0.1
    first_then_second = "<think>a</think><answer>Up</answer><think>b</think><answer>Down</answer>"
    assert fmt.parse(first_then_second, NAMES).actions == ("Up",)
    # Text between </think> and <answer> breaks the pair; the first later pair is read.
    assert fmt.parse("<think>a</think> so <answer>Up</answer><think>b</think> <answer>Left</answer>",
                     NAMES).actions == ("Left",)
    assert get_format("ragen_no_think", max_actions_per_turn=2).parse(
        "<answer>Right</answer><answer>Up</answer>", NAMES).actions == ("Right",)


def test_the_answer_is_cut_to_the_limit_before_unknown_names_are_dropped():
    fmt = get_format("ragen", max_actions_per_turn=2)
    parsed = fmt.parse("<think>x</think><answer>Up || Jump || Down</answer>", NAMES)
    assert parsed.actions == ("Up",) and parsed.any_invalid  # Down was past the limit: never considered
    assert penalty("<think>x</think><answer>Up || Down || Jump</answer>", max_actions=2) == 0.0


_PIECES = st.sampled_from(["<think>", "</think>", "<answer>", "</answer>", " ", "\n", "x", "Up", "down", "Jump",
                           " || ", "||", "<think> </think>"])


@settings(max_examples=400, deadline=None)
@given(pieces=st.lists(_PIECES, max_size=14), max_actions=st.integers(1, 3), think=st.booleans())
def test_matches_ragens_regex_reading(pieces, max_actions, think):
    text = "".join(pieces)
    fmt = get_format("ragen" if think else "ragen_no_think", max_actions_per_turn=max_actions)
    parsed = fmt.parse(text, NAMES)
    valid, penalized = ragen_parse(text, max_actions, think)
    assert list(parsed.actions) == valid
    assert (turn_format_reward(parsed, penalize_any_invalid=True) == -0.1) == penalized


def test_the_prompt_ends_with_the_opening_tag_and_the_parser_reads_it_with_the_response(tiny_tokenizer):
    fmt, no_think = get_format("ragen", max_actions_per_turn=5), get_format("ragen_no_think", max_actions_per_turn=5)
    assert (fmt.response_prefix, no_think.response_prefix) == ("<think>", "<answer>")
    # The model continues <think>: its response is well-formed once the prefix is put back, and yields Left.
    response = "I think the box is to my left.</think><answer>Left</answer>"
    parsed = fmt.parse(fmt.assistant_text(response), NAMES)
    assert parsed.format_ok and parsed.actions == ("Left",) and turn_format_reward(parsed) != -0.1
    assert fmt.parse(response, NAMES).actions == ()  # without the prefix RAGEN's pattern finds no <think>
    assert no_think.parse(no_think.assistant_text("Left</answer>"), NAMES).actions == ("Left",)
    # The prompt: the chat template's rendering with the generation prompt, then the tag.
    chat = [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "#_P_#"}]
    for prefix in ("<think>", "<answer>"):
        tokens = EpisodeTokens(tiny_tokenizer, response_prefix=prefix)
        tokens.start(*chat)
        text = tiny_tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) + prefix
        assert tokens.prompt() == tiny_tokenizer(text, add_special_tokens=False)["input_ids"]

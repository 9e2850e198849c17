"""Observation and system prompt texts, and quoted text kept free of control tokens."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from turnrl.agent.prompts import TurnFeedback, neutralized, observation_text, system_prompt

GRID = "P___\n_O__\n___G"


def test_observation_frames_the_state_with_turn_reward_and_budget():
    text = observation_text(GRID, turn=2, actions_left=7, feedback=TurnFeedback(0.0, False))
    assert text == f"Turn 2.\nLast reward: 0.\nState:\n{GRID}\nActions left: 7."


def test_invalid_response_note_lists_problems_and_actions():
    feedback = TurnFeedback(-0.1, True, ("no <answer> tag",))
    text = observation_text(GRID, turn=3, actions_left=5, feedback=feedback, action_names=["Up", "Down"])
    assert "Your last response had no valid action (no <answer> tag)." in text
    assert "Valid actions: Up, Down." in text


def test_without_turn_info_the_message_is_the_state_alone():
    assert observation_text(GRID, turn=1, actions_left=8, turn_info=False) == GRID
    assert observation_text(GRID, turn=2, actions_left=7, feedback=TurnFeedback(0.0, False), turn_info=False) == GRID


def test_without_turn_info_an_invalid_response_is_still_reported():
    feedback = TurnFeedback(-0.1, True, ("no <answer> tag",))
    text = observation_text(GRID, turn=2, actions_left=7, feedback=feedback, action_names=["Up"], turn_info=False)
    assert text == f"Your last response had no valid action (no <answer> tag).\nValid actions: Up.\n{GRID}"


def test_system_prompt_skips_empty_parts():
    assert system_prompt("Play.", "", "Answer in tags.") == "Play.\n\nAnswer in tags."


def test_an_empty_base_prompt_replaces_the_default_rather_than_restoring_it():
    assert system_prompt("", "Reach G.", "Answer in tags.") == "Reach G.\n\nAnswer in tags."
    assert system_prompt("", "", "") == ""
    assert system_prompt(None, "", "").startswith("You are an agent")


def test_an_action_rejected_beside_a_valid_one_gets_its_own_line():
    feedback = TurnFeedback(0.1, False, ("the env rejected 'Up'",), rejected=("the env rejected 'Up'",))
    text = observation_text(GRID, turn=2, actions_left=5, feedback=feedback, action_names=["Up", "Down"])
    assert text == (f"Turn 2.\nLast reward: 0.1.\nYour last response had a rejected action (the env rejected 'Up')."
                    f"\nState:\n{GRID}\nActions left: 5.")


CONTROLS = ("<|im_end|>", "<|im_start|>", "<|image_pad|>", "<|eot_id|>", "<s>", "</s>", "|>|>", "<|<|")


def test_a_quoted_control_token_is_broken_by_a_space():
    assert neutralized("go<|im_end|>\n<|im_start|>system", CONTROLS) == "go< |im_end|>\n< |im_start|>system"
    assert neutralized("no control here", CONTROLS) == "no control here"
    assert neutralized("<|im_end|>", ()) == "<|im_end|>"


def test_breaking_one_control_text_that_completes_another_breaks_that_one_too():
    # "<|<|" breaks to "< |<|", whose "|<|" and "<|" of "<|im_end|>" must not meet again as a control text.
    text = neutralized("<|<|im_end|>", CONTROLS)
    assert not any(control in text for control in CONTROLS)


@given(st.lists(st.one_of(st.sampled_from([*CONTROLS, "<", "|", ">", "/", "s", " "]), st.text(max_size=3)))
       .map("".join))
def test_no_control_text_is_left_and_only_spaces_are_added(text):
    out = neutralized(text, CONTROLS)
    assert not any(control in out for control in CONTROLS)
    assert out.replace(" ", "") == text.replace(" ", "")


@pytest.mark.parametrize("control", ["|", "< x>", "  "])
def test_a_control_text_that_no_space_can_break_is_refused(control):
    with pytest.raises(ValueError, match="cannot be broken by a space"):
        neutralized("text", ("<|im_end|>", control))


ANY_TEXT = st.text(st.characters(exclude_categories=()), max_size=40)


@given(st.data())
def test_any_control_texts_are_broken_in_any_text_or_refused_saying_why(data):
    """Control texts of any characters (a tokenizer's added tokens): each one found in any text is broken, or the
    set is refused because no space can break one of them."""
    controls = data.draw(st.lists(st.one_of(st.sampled_from(CONTROLS), ANY_TEXT.map(lambda text: text[:6])),
                                  max_size=4))
    pieces = st.one_of(ANY_TEXT.map(lambda text: text[:3]), *([st.sampled_from(controls)] if controls else []))
    text = "".join(data.draw(st.lists(pieces, max_size=12)))
    try:
        out = neutralized(text, controls)
    except ValueError as error:
        assert "cannot be broken by a space" in str(error)
        assert any(len(control) < 2 or " " in control[:2] for control in controls)
        return
    assert not any(control in out for control in controls)
    assert out.replace(" ", "") == text.replace(" ", "")

"""Observation and system prompt texts (turnrl's layout and RAGEN's), and quoted text kept free of control tokens."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from turnrl.agent.prompts import (
    TurnFeedback,
    neutralized,
    observation_text,
    ragen_observation_text,
    ragen_reward_text,
    ragen_system_prompt,
    system_prompt,
)

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


# --------------------------------------------------------------------------- RAGEN's layout
# The expected texts are written by hand from mll-lab-nu/RAGEN at 20daedc, ragen/llm_agent/ctx_manager.py:
# ContextManager._build_system_content, _build_format_prompt, _build_turn_state_content (include_warning=True) and
# _build_infer_multi_turn_messages, which appends a turn's state to the user message holding the last "Reward:".
RAGEN_THINK_LINE = ("Always output: <think> [Your thoughts] </think> <answer> [your answer] </answer> with no extra "
                    "text. Strictly follow this format. Max response length: 100 words (tokens).\n")


def test_ragen_system_message_is_its_role_line_then_the_env_text():
    assert ragen_system_prompt("Reach G.") == "You're a helpful assistant. Reach G."
    assert ragen_system_prompt("") == "You're a helpful assistant. "


def test_ragen_system_message_of_an_env_with_named_actions_ends_with_the_separator_line():
    # _init_prefix_lookup: the episode's budget (max_actions_per_traj) and " " + action_sep + " ".
    assert ragen_system_prompt("Push the box.", ["Up", "Down", "Left", "Right"], 10, "||") == (
        "You're a helpful assistant. Push the box.\nYour available actions are:\nUp, Down, Left, Right"
        '\nYou can make up to 10 actions, separated by the action separator " || "\n')


def test_ragen_first_turn_opens_with_a_newline_and_asks_for_the_format():
    text = ragen_observation_text(GRID, turn=1, actions_left=10, think=True, response_length_hint=100)
    assert text == "\nTurn 1:\nState:\nP___\n_O__\n___G\nYou have 10 actions left. " + RAGEN_THINK_LINE


def test_ragen_later_turn_follows_the_last_reward_in_the_same_message():
    text = ragen_observation_text(GRID, turn=2, actions_left=8, think=True, response_length_hint=100,
                                  last_reward=ragen_reward_text(-0.1, 1))
    assert text == "Reward:\n-0.1\n\nTurn 2:\nState:\nP___\n_O__\n___G\nYou have 8 actions left. " + RAGEN_THINK_LINE


def test_ragen_turn_after_an_invalid_response_warns_and_reads_the_int_reward():
    # No valid action: RAGEN steps nothing, so acc_reward stays the int 0 (es_manager.py, _execute_actions).
    text = ragen_observation_text(GRID, turn=3, actions_left=8, think=False, response_length_hint=120,
                                  last_reward=ragen_reward_text(0.0, 0), no_valid_action=True)
    assert text == ("Reward:\n0\n\nTurn 3:\nState:\nP___\n_O__\n___G\n"
                    "No valid action provided previously. Environment state remains the same. Please try again.\n"
                    "You have 8 actions left. Always output: <answer> [your answer] </answer> with no extra text. "
                    "Strictly follow this format. Max response length: 120 words (tokens).\n")


def test_ragen_reward_reads_as_pythons_str_of_its_float_sum():
    assert ragen_reward_text(0.0, 1) == "0.0"
    assert ragen_reward_text(-0.1 + -0.1 + -0.1, 3) == "-0.30000000000000004"
    assert ragen_reward_text(9.9, 1) == "9.9"


def test_a_rollout_in_ragen_layout_holds_ragens_texts(tiny_tokenizer):
    from tests.rollout.test_runner import TokenPolicy, counter_slots, requests_of
    from turnrl.agent.formats import get_format
    from turnrl.config import AgentConfig, SamplingConfig
    from turnrl.rollout.runner import Rollout

    # After the prompt's <think>: a valid inc (reward 0.1), a response with no answer, a valid inc.
    written = [" I count.</think><answer>inc</answer>", " Hmm.</think>", " Again.</think><answer>inc</answer>"]
    policy = TokenPolicy(tiny_tokenizer, lambda request: written[len(request.messages) // 2 - 1])
    (slot,) = counter_slots()
    agent = AgentConfig(format="ragen", max_turns=3, prompt_layout="ragen")
    rollout = Rollout(policy, get_format("ragen"), agent, "Counter")
    (trajectory,) = rollout.run([slot], SamplingConfig(max_new_tokens=16))
    assert slot.env.received == ["inc", "inc"]
    messages = requests_of(policy, slot.env)[-1].messages
    assert [m["content"] for m in messages if m["role"] != "assistant"] == [
        "You're a helpful assistant. Count up with inc; say win to finish.\nYour available actions are:\ninc, win, jam"
        '\nYou can make up to 10 actions, separated by the action separator " || "\n',
        "\nTurn 1:\nState:\ncount=0\nYou have 10 actions left. " + RAGEN_THINK_LINE,
        "Reward:\n0.1\n\nTurn 2:\nState:\ncount=1\nYou have 9 actions left. " + RAGEN_THINK_LINE,
        "Reward:\n0\n\nTurn 3:\nState:\ncount=1\nNo valid action provided previously. Environment state remains "
        "the same. Please try again.\nYou have 9 actions left. " + RAGEN_THINK_LINE,
    ]
    assert trajectory.system_prompt == messages[0]["content"]
    for request in requests_of(policy, slot.env):  # the texts' leading and trailing newlines stay token-exact
        rendered = tiny_tokenizer.apply_chat_template(request.messages, add_generation_prompt=True, tokenize=False)
        assert request.prompt_ids == tiny_tokenizer.encode(rendered + "<think>", add_special_tokens=False)


def test_an_unknown_prompt_layout_is_refused_naming_the_choices():
    from turnrl.config import AgentConfig, ConfigError, load_config
    from turnrl.training.train_config import TrainConfig

    with pytest.raises(ConfigError, match=r"agent.prompt_layout='rage' is not allowed; choose one of "
                                          r"\['turnrl', 'ragen', 'vagen'\]; did you mean ragen\?"):
        load_config(TrainConfig, None, ["agent.prompt_layout=rage"])
    assert load_config(TrainConfig, None, ["agent.prompt_layout=ragen"]).agent.prompt_layout == "ragen"
    with pytest.raises(ConfigError, match=r"agent.prompt_layout='RAGEN' is not allowed; choose one of "
                                          r"\['turnrl', 'ragen', 'vagen'\]"):
        AgentConfig(prompt_layout="RAGEN").validate()  # type: ignore[arg-type]

"""Observation and system prompt texts."""

from turnrl.agent.prompts import TurnFeedback, observation_text, system_prompt

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

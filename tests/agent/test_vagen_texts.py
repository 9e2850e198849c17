"""VAGEN's layout writes VAGEN's texts: each expected string below is what VAGEN's ``prompt.py`` functions, joined as
its ``env.py`` joins them, return (RAGEN-AI/VAGEN at d2b8b30), written out by hand."""

import pytest

from turnrl.agent.vagen_texts import (
    VAGEN_ENVS,
    vagen_observation_text,
    vagen_system_prompt,
    vagen_valid_action_text,
)

SOKOBAN_GUIDE = (
    "You are a Sokoban solver.\n"
    "Sokoban Quick Guide\n"
    "Goal: Push all boxes onto targets.\n"
    "Symbols (If image is provided there are no symbols):\n"
    "# Wall | _ Floor | O Target | X Box | P You | √ Box on Target | S You on Target\n"
    "Rules:\n"
    "1. Push boxes (can't pull).\n"
    "2. Avoid walls.\n"
    "Actions you can take: Left, Down, Right, Up."
)

# FrozenLake's guide ends with a space and a newline, so a blank line comes before the format text.
FROZENLAKE_GUIDE = (
    "You are a FrozenLake solver.\n"
    "FrozenLake Quick Guide\n"
    "Goal: Reach the goal (G).\n"
    "Symbols (If image is provided there are no symbols):\n"
    "_ Frozen | O Hole | G Goal | P Player | X Player fell into hole | √ Player on goal\n"
    "Rules:\n"
    "1. Avoid falling into holes.\n"
    "2. Frozen tiles are slippery, you may move perpendicular to your intended direction.\n"
    "Actions you can take: Left, Down, Right, Up. \n"
)

# A FrozenLake text grid as VAGEN's _render writes it: a cell per symbol and tab, rows joined by newlines.
GRID = " P \t _ \t\n O \t G \t"


def test_sokoban_grounding_worldmodeling_system_prompt():
    text = vagen_system_prompt("Sokoban", "grounding_worldmodeling", max_actions_per_turn=3, separator=",")
    assert text == SOKOBAN_GUIDE + (
        "\nYou can take up to 3 action(s) at a time, separated by ,.\n"
        "You should first give the description of your observation, then your reasoning, then predict the next "
        "state, and finally your answer.\n"
        "For the content you provide within the `<observation>` and `<prediction>` tags, you must strictly describe "
        "the relative position of the `target` and any visible `box` objects **relative to the player**. Your "
        "description/prediction must include **both** a vertical and a horizontal directional relationship for each "
        "object. Use ONLY the terms `above`, `below`, `left`, `right`, or `same` for describing these relationships.\n"
        "Your response should be in the format of:\n"
        "<think><observation>...</observation><reasoning>...</reasoning><prediction>...</prediction></think>"
        "<answer>...</answer>\n"
        "e.g. <think><observation>The box is below and to right of the player and the target is below and to the "
        "right of the player</observation><reasoning>I need to go right then go down to push the box down to the "
        "target</reasoning><prediction>The player will be above the box and target, the target and box will be at "
        "the same row.</prediction></think><answer>Right,Down</answer>"
    )


def test_sokoban_first_observation_in_vision_mode_puts_the_image_after_the_heading():
    before, after = vagen_observation_text("Sokoban", "grounding", first=True, valid_actions=[],
                                           max_actions_per_turn=3, separator=",", image=True)
    assert before == "[Initial Observation]:\n"
    assert after == (
        "\nDecide your next action(s).\n"
        "You can take up to 3 action(s) at a time, separated by ,.\n"
        "You should first give the description of your observation, then your reasoning, and finally your answer.\n"
        "Inside the `<observation>` tags, describe the position of the `target` (red) and each `box`(yellow) "
        "relative to the player. For each object, you must specify **both** its vertical (`above`, `below`, `same`) "
        "and horizontal (`left`, `right`, `same`) direction.\n"
        "Your response should be in the format of:\n"
        "<think><observation>...</observation><reasoning>...</reasoning></think><answer>...</answer>"
    )


def test_sokoban_later_observation_in_vision_mode_names_the_stepped_actions_as_a_list():
    before, after = vagen_observation_text("Sokoban", "no_think", first=False, valid_actions=["Down", "Left"],
                                           max_actions_per_turn=3, separator=",", image=True)
    assert before == ("After your answer, the extracted valid action is ['Down', 'Left'].\n"
                      "After that, the observation is:\n")
    assert after == (
        "\nDecide your next action(s).\n"
        "You can take up to 3 action(s) at a time, separated by ,.\n"
        "You should provide only your answer.\n"
        "Your response should be in the format of:\n"
        "<answer>...</answer>"
    )


def test_the_format_text_of_an_observation_has_no_example():
    before, after = vagen_observation_text("Sokoban", "free_think", first=False, valid_actions=["Up"],
                                           max_actions_per_turn=1, separator="|", image=True)
    assert "e.g." not in before + after
    assert after.endswith("separated by |.\nYou should first give your reasoning, and then your answer.\n"
                          "Your response should be in the format of:\n<think>...</think><answer>...</answer>")


def test_frozenlake_free_think_system_prompt():
    text = vagen_system_prompt("FrozenLake", "free_think", max_actions_per_turn=2, separator="|")
    assert text == FROZENLAKE_GUIDE + (
        "\nYou can take up to 2 action(s) at a time, separated by |.\n"
        "You should first give your reasoning, and then your answer.\n"
        "Your response should be in the format of:\n"
        "<think>...</think><answer>...</answer>\n"
        "e.g. <think>I can see the target is on my down left, I should go down then left to reach the target</think>"
        "<answer>Down|Left</answer>"
    )


def test_frozenlake_no_think_system_prompt():
    text = vagen_system_prompt("FrozenLake", "no_think", max_actions_per_turn=3, separator=",")
    assert text == FROZENLAKE_GUIDE + (
        "\nYou can take up to 3 action(s) at a time, separated by ,.\n"
        "You should provide only your answer.\n"
        "Your response should be in the format of:\n"
        "<answer>...</answer>\n"
        "e.g. <answer>Down,Left</answer>"
    )


def test_frozenlake_text_mode_first_observation_holds_the_grid_and_a_blank_line():
    text = vagen_observation_text("FrozenLake", "grounding", first=True, valid_actions=[], max_actions_per_turn=3,
                                  separator=",", image=False, state_text=GRID)
    # VAGEN's FrozenLake grounding line has no <answer>; kept as it is.
    assert text == (
        "[Initial Observation]:\n P \t _ \t\n O \t G \t\nDecide your next action(s).\n\n"
        "You can take up to 3 action(s) at a time, separated by ,.\n"
        "You should first describe the observation, then your reasoning, and finally your answer.\n"
        "Inside the <observation> tags, describe the position of the target (gift box) and each hole (blue) relative "
        "to the player. For each object, you must specify both its vertical (above, below, same) and horizontal "
        "(left, right, same) direction.\n"
        "Your response should be in the format of:\n"
        "<think><observation>...</observation><reasoning>...</reasoning></think>",
        "",
    )


def test_frozenlake_text_mode_later_observation_after_no_valid_action_writes_an_empty_list():
    text = vagen_observation_text("FrozenLake", "worldmodeling", first=False, valid_actions=[],
                                  max_actions_per_turn=3, separator=",", image=False, state_text=GRID)
    assert text == (
        "After your answer, the extracted valid action is [].\nAfter that, the observation is:\n"
        " P \t _ \t\n O \t G \t\nDecide your next action(s).\n\n"
        "You can take up to 3 action(s) at a time, separated by ,.\n"
        "You should first give your reasoning, then predict the next state, and finally your answer.\n"
        "Inside the <prediction> tags, describe the position of the target (gift box) and each hole (blue) relative "
        "to the player. For each object, you must specify both its vertical (above, below, same) and horizontal "
        "(left, right, same) direction.\n"
        "Your response should be in the format of:\n"
        "<think><reasoning>...</reasoning><prediction>...</prediction></think><answer>...</answer>",
        "",
    )


def test_frozenlake_vision_mode_splits_where_the_placeholder_was():
    before, after = vagen_observation_text("FrozenLake", "no_think", first=False, valid_actions=("Right",),
                                           max_actions_per_turn=3, separator=",", image=True)
    assert before == "After your answer, the extracted valid action is ['Right'].\nAfter that, the observation is:\n"
    assert after.startswith("\nDecide your next action(s).\n\nYou can take up to 3")


@pytest.mark.parametrize(("actions", "expected"), [
    ([], "[]"),
    (["Down"], "['Down']"),
    (("Up", "Left", "Right"), "['Up', 'Left', 'Right']"),
])
def test_valid_actions_read_as_a_python_list(actions, expected):
    assert vagen_valid_action_text(actions) == expected


def test_braces_in_the_separator_or_grid_are_written_as_they_are():
    text, _ = vagen_observation_text("Sokoban", "no_think", first=True, valid_actions=[], max_actions_per_turn=2,
                                     separator="{x}", image=False, state_text="{observation}")
    assert text.startswith("[Initial Observation]:\n{observation}\nDecide your next action(s).\n"
                           "You can take up to 2 action(s) at a time, separated by {x}.")
    system = vagen_system_prompt("Sokoban", "no_think", max_actions_per_turn=2, separator="{x}")
    assert system.endswith("e.g. <answer>Down{x}Down</answer>")


def test_both_envs_offer_turnrls_vagen_formats():
    names = ["free_think", "no_think", "grounding", "worldmodeling", "grounding_worldmodeling"]
    assert sorted(VAGEN_ENVS) == ["FrozenLake", "Sokoban"]
    for env in VAGEN_ENVS.values():
        assert list(env.formats) == names


def test_an_unknown_env_names_the_envs_offered():
    with pytest.raises(ValueError, match=r"env 'Navigation'.*\['FrozenLake', 'Sokoban'\]"):
        vagen_system_prompt("Navigation", "free_think", max_actions_per_turn=3, separator=",")


def test_an_unknown_format_names_the_formats_offered():
    with pytest.raises(ValueError, match=r"format 'ragen' for Sokoban.*'free_think', 'no_think', 'grounding'"):
        vagen_observation_text("Sokoban", "ragen", first=True, valid_actions=[], max_actions_per_turn=3,
                               separator=",", image=True)
    with pytest.raises(ValueError, match="grounding_symbolic"):
        vagen_system_prompt("FrozenLake", "grounding_symbolic", max_actions_per_turn=3, separator=",")

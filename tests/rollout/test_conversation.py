"""The conversation's layouts through a rollout: VAGEN's words around an image, token-exact against the
processor's own render; the actions a turn stepped; a layout refused where its texts are not kept."""

from __future__ import annotations

import numpy as np
import pytest

from tests.rollout.test_images import ScriptedVLM, processor_ids
from turnrl.agent.formats import ParsedResponse, get_format
from turnrl.config import AgentConfig, ConfigError, SamplingConfig
from turnrl.envs import make
from turnrl.models.loading import load_processor
from turnrl.rollout.conversation import Conversation, stepped_actions, user_message
from turnrl.rollout.runner import EpisodeSlot, Rollout
from turnrl.rollout.trajectory import TurnRecord
from turnrl.training.sft import trajectory_messages

SOKOBAN_NO_THINK_TURN = (
    "\nDecide your next action(s).\n"
    "You can take up to 3 action(s) at a time, separated by ,.\n"
    "You should provide only your answer.\n"
    "Your response should be in the format of:\n"
    "<answer>...</answer>"
)


@pytest.fixture(scope="module")
def processor(tiny_vlm_dir):
    return load_processor(tiny_vlm_dir)


def test_a_vagen_layout_rollout_writes_vagens_words_around_each_image_token_exact(processor):
    policy = ScriptedVLM(processor, "<answer>Up,Jump,Down</answer>")
    agent = AgentConfig(format="no_think", max_turns=3, max_actions_per_turn=3, max_actions_per_episode=20,
                        prompt_layout="vagen")
    rollout = Rollout(policy, get_format("no_think", max_actions_per_turn=3), agent, "Sokoban")
    (trajectory,) = rollout.run([EpisodeSlot(env=make("Sokoban", mode="image"), seed=3)],
                                SamplingConfig(max_new_tokens=16))
    assert len(trajectory.turns) == 3
    messages = trajectory_messages(trajectory)
    system = messages[0]["content"]
    assert system.startswith("You are a Sokoban solver.\nSokoban Quick Guide\n")
    assert system.endswith("Your response should be in the format of:\n<answer>...</answer>\ne.g. "
                           "<answer>Down,Down</answer>")
    users = [m["content"] for m in messages if m["role"] == "user"]
    first, later = users[0], users[1]
    assert [part["type"] for part in first] == ["text", "image", "text"]
    assert first[0]["text"] == "[Initial Observation]:\n" and first[2]["text"] == SOKOBAN_NO_THINK_TURN
    # The parser drops the unknown "Jump" and the rest steps (VAGEN's parser stops at it: docs/fidelity.md); the
    # message names what the env took.
    assert later[0]["text"] == ("After your answer, the extracted valid action is ['Up', 'Down'].\n"
                                "After that, the observation is:\n")
    assert later[2]["text"] == SOKOBAN_NO_THINK_TURN
    assert trajectory.turns[1].observation == later[0]["text"] + later[2]["text"]
    assert trajectory.turns[1].image_at == len(later[0]["text"])
    for sample in trajectory.tokens.turn_samples():  # each prompt is the processor's render of the chat so far
        assert sample.prompt_ids == processor_ids(processor, messages[: 2 + 2 * sample.turn], True)


def test_stepped_actions_end_at_the_first_the_env_rejected():
    turn = TurnRecord(0, "", "", [], [], "stop", ParsedResponse((), {}, True), actions=["Up", "Jump", "Left"],
                      actions_valid=[True, False, True])
    assert stepped_actions(turn) == ["Up"]
    assert stepped_actions(TurnRecord(0, "", "", [], [], "stop", ParsedResponse((), {}, True))) == []


def test_a_user_message_puts_its_images_before_the_text_or_where_it_is_told():
    image = np.zeros((2, 2, 3), np.uint8)
    assert user_message("state", []) == {"role": "user", "content": "state"}

    def shape(message):
        return [p["text"] if p["type"] == "text" else "IMAGE" for p in message["content"]]

    assert shape(user_message("state", [image])) == ["IMAGE", "state"]
    assert shape(user_message("see:\ngo", [image], 5)) == ["see:\n", "IMAGE", "go"]
    assert shape(user_message("see:", [image, image], 4)) == ["see:", "IMAGE", "IMAGE"]
    with pytest.raises(ValueError, match="image_at=6 is outside a text of 5 characters"):
        user_message("state", [image], 6)


@pytest.mark.parametrize(("env_id", "format_name", "problem"), [
    ("Maze2D", "no_think", r"no texts for env 'Maze2D'; it has \['FrozenLake', 'Sokoban'\]"),
    ("Sokoban", "ragen", r"no format 'ragen' for Sokoban"),
])
def test_the_vagen_layout_is_refused_where_vagen_has_no_texts(env_id, format_name, problem):
    agent = AgentConfig(format=format_name, prompt_layout="vagen")
    with pytest.raises(ConfigError, match=rf"agent.prompt_layout=vagen: .*{problem}.*agent.prompt_layout=turnrl"):
        Conversation(agent, get_format(format_name), env_id)



RAGEN_COORD_SOKOBAN_SYSTEM = (  # RAGEN 20daedc: "You're a helpful assistant. " + envs.yaml's CoordSokoban
    # env_instruction (a YAML block: a space ends three of its lines) + _init_prefix_lookup's action lines
    "You're a helpful assistant. You are solving the Sokoban puzzle. You are the player and you need to push all "
    "boxes to targets.\nYou are provided with a symbol grid and the zero-indexed coordinates of the player, each "
    "box, and each target. \nCoordinates range from the top-left corner (0, 0) to the bottom-right corner (5, 5). "
    "\nWhen you are exactly next to a box, you can push it by moving in the same direction. \nYou cannot push a box "
    "through a wall, and you cannot pull a box.\nThe answer should be a sequence of actions, like <answer>Right || "
    "Right || Up</answer>.\n\nYour available actions are:\nUp, Down, Left, Right\nYou can make up to 10 actions, "
    'separated by the action separator " || "\n'
)


def test_ragens_coord_sokoban_recipe_writes_ragens_system_message():
    from pathlib import Path

    from turnrl.config import load_config
    from turnrl.training.train_config import TrainConfig

    recipe = Path(__file__).resolve().parents[2] / "configs" / "ragen_coord_sokoban.yaml"
    config = load_config(TrainConfig, recipe)
    fmt = get_format(config.agent.format, max_actions_per_turn=config.agent.max_actions_per_turn)
    env = make(config.env.id, **config.env.settings)
    assert Conversation(config.agent, fmt, config.env.id).system(env, env.action_names()) == RAGEN_COORD_SOKOBAN_SYSTEM


def test_task_instructions_replace_the_envs_and_env_instructions_false_leaves_them_out():
    env = make("Sokoban")
    fmt = get_format("free_think")
    given = Conversation(AgentConfig(task_instructions="Push.\n", format_instructions=False, system_prompt=""),
                         fmt, "Sokoban")
    assert given.system(env, env.action_names()) == "Push."
    left_out = Conversation(AgentConfig(task_instructions="Push.", env_instructions=False, format_instructions=False,
                                        system_prompt="Role."), fmt, "Sokoban")
    assert left_out.system(env, env.action_names()) == "Role."
    assert Conversation(AgentConfig(system_prompt="", format_instructions=False), fmt, "Sokoban").system(
        env, env.action_names()) == env.instructions().strip()


def test_vagen_layout_prompts_that_drop_older_images_keep_their_texts_token_exact(processor):
    from turnrl.rollout.runner import latest_images

    policy = ScriptedVLM(processor, "<answer>Up,Down</answer>")
    agent = AgentConfig(format="no_think", max_turns=3, max_actions_per_turn=3, max_actions_per_episode=20,
                        prompt_layout="vagen", max_images=1)
    rollout = Rollout(policy, get_format("no_think", max_actions_per_turn=3), agent, "Sokoban")
    (trajectory,) = rollout.run([EpisodeSlot(env=make("Sokoban", mode="image"), seed=3)],
                                SamplingConfig(max_new_tokens=16))
    messages = trajectory_messages(trajectory)
    samples = trajectory.tokens.turn_samples()
    assert len(samples) == 3
    for sample in samples:
        shown = latest_images(messages[: 2 + 2 * sample.turn], 1)
        assert sample.prompt_ids == processor_ids(processor, shown, True)
    first_turn_text = [part["type"] for part in latest_images(messages, 1)[1]["content"]]
    assert first_turn_text == ["text", "text"]  # its image left out, both its texts kept


def test_a_config_with_the_vagen_layout_on_an_env_without_its_texts_fails_to_load():
    from turnrl.config import load_config
    from turnrl.training.train_config import TrainConfig

    with pytest.raises(ConfigError, match=r"agent.prompt_layout=vagen: .*no texts for env 'Maze2D'"):
        load_config(TrainConfig, None, ["agent.prompt_layout=vagen", "env.id=Maze2D", "agent.format=no_think"])
    loaded = load_config(TrainConfig, None, ["agent.prompt_layout=vagen", "env.id=Sokoban", "agent.format=no_think"])
    assert loaded.agent.prompt_layout == "vagen"

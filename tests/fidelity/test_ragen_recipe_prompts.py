"""RAGEN's system and first user messages in the Sudoku, 2048 and Rubik's cube recipes (``agent.prompt_layout:
ragen`` with ``agent.task_instructions``).

Encodes mll-lab-nu/RAGEN at commit 20daedc47558e000f7de912b060646bf2e8026bd:

- ``config/envs.yaml``: the ``SimpleSudoku``, ``game_2048`` and ``rubikscube`` entries' ``env_instruction`` (block
  scalars: each line ends with a newline, the last included), ``max_actions_per_traj`` (20, 700, 20) and
  ``max_tokens`` (150, 8192, 96);
- ``ragen/env/sudoku/config.py`` (``SudokuEnvConfig``: no ``action_lookup``, no ``grid_vocab``),
  ``ragen/env/game_2048/config.py`` (``action_lookup`` ``{0: "Up", 1: "Right", 2: "Down", 3: "Left"}``) and
  ``ragen/env/rubikscube/config.py`` (``action_lookup`` ``{1: "U", 2: "U'", ..., 12: "B'"}``), none with a
  ``grid_vocab`` or ``observation_format`` field;
- ``ragen/llm_agent/ctx_manager.py``: ``_init_prefix_lookup`` (the instruction, then for an env config with an
  ``action_lookup`` ``"\\nYour available actions are:\\n"`` + its values joined by ``", "`` + ``"\\nYou can make up
  to {max_actions_per_traj} actions, separated by the action separator \\" || \\"\\n"``), ``_build_system_content``
  (``"You're a helpful assistant. "`` + that), ``_build_format_prompt`` and ``_build_turn_state_content`` (a turn's
  ``\\nTurn N:\\nState:\\n`` + state + ``\\nYou have K actions left. Always output: ...``);
- ``config/base.yaml`` (``action_sep: "||"``, ``enable_think: True``) and ``ragen/env/game_2048/env.py``
  (``render``).

RAGEN's Sudoku and Rubik's cube states read differently from turnrl's (docs/fidelity.md): their user messages are
checked for RAGEN's frame around the env's own text.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from turnrl.agent.formats import get_format
from turnrl.config import load_config
from turnrl.envs import make
from turnrl.envs.contract import AgentEnv
from turnrl.rollout.conversation import Conversation
from turnrl.training.train_config import TrainConfig

CONFIGS = Path(__file__).resolve().parents[2] / "configs"

RAGEN_SIMPLE_SUDOKU_SYSTEM = (
    "You're a helpful assistant. You are solving a Sudoku puzzle. Fill in the grid so that every row, column, and "
    "3x3 box contains the numbers 1-9 without repetition.\n"
    "Initial cells are shown in [brackets] and cannot be modified. Empty cells are shown as dots (.).\n"
    "Place numbers one at a time using the format: <answer>place 5 at row 2 col 3</answer> or "
    "<answer>2,3,5</answer>\n"
    "The environment will provide feedback on valid/invalid moves and show conflicts if any occur.\n"
)
RAGEN_GAME_2048_SYSTEM = (
    "You're a helpful assistant. You are playing the 2048 game on a 4x4 grid. Merge equal tiles by sliding Up, "
    "Right, Down, or Left.\n"
    "If a move is invalid (no tiles move), a small penalty is applied. Respond with a single action.\n"
    "Example: <answer>Up</answer>\n"
    "\nYour available actions are:\n"
    "Up, Right, Down, Left\n"
    'You can make up to 700 actions, separated by the action separator " || "\n'
)
RAGEN_RUBIKSCUBE_SYSTEM = (
    "You're a helpful assistant. You are solving a 2x2 Rubik's Cube (Pocket Cube). The goal is to restore the cube "
    "so that each of the faces consists of a single, unique color.\n"
    "Available actions use standard Singmaster notation for face rotations: U, U', D, D', L, L', R, R', F, F', B, "
    "B'.\n"
    "- Faces: U (Up), D (Down), L (Left), R (Right), F (Front), B (Back).\n"
    "- Modifiers: A letter alone means 90\u00b0 clockwise (e.g., 'R'). A letter with prime (') means 90\u00b0 "
    "counter-clockwise (e.g., \"R'\").\n"
    'Respond with a sequence of actions separated by "||".\n'
    "Example: <answer>U</answer>\n"
    "\nYour available actions are:\n"
    "U, U', D, D', L, L', R, R', F, F', B, B'\n"
    'You can make up to 20 actions, separated by the action separator " || "\n'
)

# game_2048's render of this board (Up and Left move no tile), framed as RAGEN's first turn.
BOARD_2048 = [[2, 4, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]]
RAGEN_GAME_2048_FIRST_TURN = (
    "\nTurn 1:\nState:\n"
    "Current 2048 Grid:\n"
    "Row 1: [2, 4, 0, 0]\n"
    "Row 2: [0, 0, 0, 0]\n"
    "Row 3: [0, 0, 0, 0]\n"
    "Row 4: [0, 0, 0, 0]\n"
    "\n"
    "Valid Actions: 1(Right), 2(Down).\n"
    "Goal: Merge same numbers to reach 2048.\n"
    "Current Score: 0\n"
    "What is your next move?\n"
    "You have 700 actions left. Always output: <think> [Your thoughts] </think> <answer> [your answer] </answer> "
    "with no extra text. Strictly follow this format. Max response length: 8192 words (tokens).\n"
)


def recipe_conversation(recipe: str) -> tuple[TrainConfig, Conversation, AgentEnv]:
    """The recipe's config, its conversation as training builds it, and its env."""
    config = load_config(TrainConfig, CONFIGS / f"{recipe}.yaml")
    fmt = get_format(config.agent.format, action_separator=config.agent.action_separator,
                     max_actions_per_turn=config.agent.max_actions_per_turn)
    env = make(config.env.id, **config.env.settings)
    return config, Conversation(config.agent, fmt, config.env.id), env


@pytest.mark.parametrize(("recipe", "expected"), [
    ("ragen_sudoku", RAGEN_SIMPLE_SUDOKU_SYSTEM),
    ("ragen_2048", RAGEN_GAME_2048_SYSTEM),
    ("ragen_rubiks", RAGEN_RUBIKSCUBE_SYSTEM),
])
def test_the_recipe_writes_ragens_system_message(recipe, expected):
    _, conversation, env = recipe_conversation(recipe)
    assert conversation.system(env, env.action_names()) == expected


def test_the_2048_recipes_first_turn_is_ragens():
    config, conversation, env = recipe_conversation("ragen_2048")
    state = env.reset(seed=0, options={"board": BOARD_2048})[0]["text"]
    message = conversation.user(state, None, turn=1, actions_left=config.agent.max_actions_per_episode)
    assert message.text == RAGEN_GAME_2048_FIRST_TURN


@pytest.mark.parametrize(("recipe", "actions", "words"), [("ragen_sudoku", 20, 150), ("ragen_rubiks", 20, 96)])
def test_the_first_turn_frames_the_envs_state_in_ragens_words(recipe, actions, words):
    config, conversation, env = recipe_conversation(recipe)
    state = env.reset(seed=0)[0]["text"]
    message = conversation.user(state, None, turn=1, actions_left=config.agent.max_actions_per_episode)
    assert message.text == (
        f"\nTurn 1:\nState:\n{state}\nYou have {actions} actions left. Always output: <think> [Your thoughts] "
        "</think> <answer> [your answer] </answer> with no extra text. Strictly follow this format. "
        f"Max response length: {words} words (tokens).\n"
    )

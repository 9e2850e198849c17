"""RAGEN's 2048 and Rubik's cube observation texts.

Encodes mll-lab-nu/RAGEN at commit 20daedc47558e000f7de912b060646bf2e8026bd: ``ragen/env/game_2048/env.py``
(``render``: ``Valid Actions: 0(Up), 1(Right).`` with the action lookup's indices, then the goal, the score and
``What is your next move?``) and ``ragen/env/rubikscube/env.py`` (``render``: ``=== Rubik's Cube 2x2 State ===``,
the faces, ``Available Actions:``, ``U, U', D, D', L, L', R, R', F, F', B, B'`` and ``What is your next move?``
while the game goes on).
"""

from __future__ import annotations

from turnrl.envs import make


def test_2048_lists_moves_by_ragens_index_and_asks_for_the_next():
    env = make("Game2048")
    text = env.reset(seed=0)[0]["text"]
    assert "Valid Actions: 0(Up), 1(Right), 2(Down), 3(Left)." in text
    assert text.endswith("Current Score: 0\nWhat is your next move?")


def test_rubiks_has_ragens_title_action_list_and_question():
    env = make("RubiksCube")
    text = env.reset(seed=0)[0]["text"]
    assert text.startswith("=== Rubik's Cube 2x2 State ===\n")
    assert text.endswith("\n\nAvailable Actions:\nU, U', D, D', L, L', R, R', F, F', B, B'\n\nWhat is your next move?")
    solved = env.reset(options={"scramble": ""})[0]["text"]
    assert "What is your next move?" not in solved  # RAGEN shows the list only while the game goes on

"""``symbols="vagen"``: Sokoban's and FrozenLake's text is VAGEN's grid, character for character.

Source: RAGEN-AI/VAGEN@d2b8b30b4db41073e2b3ecad269f9c1c52522362. ``vagen/env/sokoban/env.py``: ``GRID_LOOKUP``
(0 ``" # \\t"`` wall, 1 ``" _ \\t"`` floor, 2 ``" O \\t"`` target, 3 ``" √ \\t"`` box on target, 4 ``" X \\t"`` box,
5 ``" P \\t"`` player, 6 ``" S \\t"`` player on target) and ``_render``, which turns a player (5) on a target
(``room_fixed == 2``) into 6, then joins the cells of a row with ``""`` and the rows with ``"\\n"``.
``vagen/env/frozenlake/env.py``: ``GRID_LOOKUP`` (``" P \\t"`` player, ``" _ \\t"`` frozen, ``" O \\t"`` hole,
``" G \\t"`` goal, ``" X \\t"`` player in a hole, ``" √ \\t"`` player on the goal) and ``_get_text_representation``
(the start ``S`` becomes frozen ``F``; the player's cell is X on ``H``, √ on ``G``, else P), joined the same way.

The expected grids below are written out by hand from those rules, cell by cell.
"""

from __future__ import annotations

import re

import gymnasium
import pytest
from gymnasium.utils.env_checker import check_env

import turnrl.envs  # noqa: F401  (registers the built-in envs)
from turnrl.envs import check_env as turnrl_check_env
from turnrl.envs.contract import IMAGE_CAPTION
from turnrl.envs.games.frozenlake import FrozenLakeEnv
from turnrl.envs.games.sokoban.sokoban_env import SokobanEnv

WALLS_6 = " # \t # \t # \t # \t # \t # \t"
"""A row of six walls in VAGEN's Sokoban text."""

SOKOBAN_LEVEL = "######\n#PO__#\n#_X√_#\n#____#\n######"
"""A box on the floor, a box on a target, and the player one step left of the other target."""

SOKOBAN_START = (
    f"{WALLS_6}\n"
    " # \t P \t O \t _ \t _ \t # \t\n"
    " # \t _ \t X \t √ \t _ \t # \t\n"
    " # \t _ \t _ \t _ \t _ \t # \t\n"
    f"{WALLS_6}"
)
SOKOBAN_ON_TARGET = (  # after Right: the player stands on the target (VAGEN's 6, " S \t")
    f"{WALLS_6}\n"
    " # \t _ \t S \t _ \t _ \t # \t\n"
    " # \t _ \t X \t √ \t _ \t # \t\n"
    " # \t _ \t _ \t _ \t _ \t # \t\n"
    f"{WALLS_6}"
)

LAKE = "P_O_\n__O_\n____\nO__G"
LAKE_START = " P \t _ \t O \t _ \t\n _ \t _ \t O \t _ \t\n _ \t _ \t _ \t _ \t\n O \t _ \t _ \t G \t"
LAKE_AFTER_RIGHT = " _ \t P \t O \t _ \t\n _ \t _ \t O \t _ \t\n _ \t _ \t _ \t _ \t\n O \t _ \t _ \t G \t"
LAKE_IN_HOLE = " _ \t _ \t X \t _ \t\n _ \t _ \t O \t _ \t\n _ \t _ \t _ \t _ \t\n O \t _ \t _ \t G \t"
LAKE_ON_GOAL = " _ \t _ \t O \t _ \t\n _ \t _ \t O \t _ \t\n _ \t _ \t _ \t _ \t\n O \t _ \t _ \t √ \t"

CELL = re.compile(r" \S \t")


def symbols_of(vagen_text: str) -> str:
    """The one-character grid inside a VAGEN text, after checking that every cell is ``" s \\t"``."""
    rows = vagen_text.split("\n")
    for row in rows:
        assert len(row) % 4 == 0 and all(CELL.fullmatch(row[i : i + 4]) for i in range(0, len(row), 4)), row
    return "\n".join(row[1::4] for row in rows)


# ---------------------------------------------------------------------- Sokoban
def test_sokoban_vagen_text_of_a_given_level_and_of_the_player_on_a_target():
    env = SokobanEnv(dim_room=(5, 6), symbols="vagen", render_mode="ansi")
    obs, _ = env.reset(seed=0, options={"level": SOKOBAN_LEVEL})
    assert obs["text"] == SOKOBAN_START
    obs, reward, terminated, _, info = env.step("Right")
    assert obs["text"] == SOKOBAN_ON_TARGET == env.render() == env.grid_text()
    assert (reward, terminated, info["action_is_effective"]) == (pytest.approx(-0.1), False, True)
    obs, *_ = env.step("Left")  # off the target again: it shows as a target
    assert obs["text"] == SOKOBAN_START


def test_sokoban_vagen_style_keeps_the_game():
    ragen, vagen = SokobanEnv(), SokobanEnv(symbols="vagen")
    for seed in range(10):
        assert symbols_of(vagen.reset(seed=seed)[0]["text"]) == ragen.reset(seed=seed)[0]["text"]
        for action in ("Up", "Left", "Down", "Right"):
            (a, *rest_a), (b, *rest_b) = vagen.step(action), ragen.step(action)
            assert symbols_of(a["text"]) == b["text"] and rest_a == rest_b
        assert vagen.state_facts() == ragen.state_facts()


def test_sokoban_vagen_text_is_the_same_under_a_seed():
    a, b = SokobanEnv(symbols="vagen"), SokobanEnv(symbols="vagen")
    b.reset(seed=99)  # history must not matter
    texts = [[env.reset(seed=7)[0]["text"]] + [env.step(m)[0]["text"] for m in ("Up", "Right", "Down")]
             for env in (a, b)]
    assert texts[0] == texts[1]
    assert a.reset(seed=8)[0]["text"] != texts[0][0]


def test_sokoban_vagen_style_passes_both_checkers_and_image_mode_is_unchanged():
    check_env(gymnasium.make("turnrl/Sokoban-v0", symbols="vagen", render_mode="ansi").unwrapped)
    turnrl_check_env(SokobanEnv(symbols="vagen"), seed=0)
    env = SokobanEnv(dim_room=(5, 6), mode="image", symbols="vagen", render_mode="ansi")
    obs, _ = env.reset(seed=0, options={"level": SOKOBAN_LEVEL})
    assert obs["text"] == "Boxes on targets: 1 of 2." and env.render() == SOKOBAN_START


def test_sokoban_vagen_instructions_say_how_a_cell_is_written():
    text = SokobanEnv(symbols="vagen").instructions()
    assert "each cell written as a space, its symbol, a space and a tab: # wall, _ empty floor, O target, " \
           "√ box on a target, X box, P player, S player on a target." in text


def test_sokoban_vagen_text_bound_counts_four_characters_a_cell():
    SokobanEnv(size=45, symbols="vagen")  # 45 rows of 45 cells and a newline: 8,145 characters at most
    with pytest.raises(ValueError, match="a 46x46 room with symbols='vagen' can need 8510 characters"):
        SokobanEnv(size=46, symbols="vagen")
    # A given level of any size is checked too: 5 rows of 410 cells fit RAGEN's grid (2,055 characters), not VAGEN's.
    wide = "\n".join(["#" * 410, "#PXO" + "_" * 405 + "#"] + ["#" + "_" * 408 + "#"] * 2 + ["#" * 410])
    SokobanEnv().reset(options={"level": wide})
    with pytest.raises(ValueError, match="a 5x410 room with symbols='vagen' can need 8205 characters"):
        SokobanEnv(symbols="vagen").reset(options={"level": wide})


def test_sokoban_unknown_style_lists_the_styles():
    assert SokobanEnv.setting_choices["symbols"] == ("ragen", "alt", "coords", "grid_coords", "vagen")
    with pytest.raises(ValueError, match=re.escape(
            "symbols must be one of ['ragen', 'alt', 'coords', 'grid_coords', 'vagen'], got 'vagan'")):
        SokobanEnv(symbols="vagan")


# ---------------------------------------------------------------------- FrozenLake
def test_frozenlake_vagen_text_at_the_start_in_a_hole_and_on_the_goal():
    env = FrozenLakeEnv(symbols="vagen", render_mode="ansi")
    obs, _ = env.reset(options={"level": LAKE})
    assert obs["text"] == LAKE_START
    obs, *_ = env.step("Right")
    assert obs["text"] == LAKE_AFTER_RIGHT == env.render()  # the start left behind is frozen ice
    obs, reward, terminated, *_ = env.step("Right")
    assert obs["text"] == LAKE_IN_HOLE and (reward, terminated) == (0.0, True)
    env.reset(options={"level": LAKE})
    for action in ("Down", "Down", "Right", "Right", "Right"):
        env.step(action)
    obs, reward, terminated, _, info = env.step("Down")
    assert obs["text"] == LAKE_ON_GOAL and (reward, terminated, info["success"]) == (1.0, True, True)


def test_frozenlake_vagen_text_of_a_start_written_s_mid_lake():
    env = FrozenLakeEnv(symbols="vagen", size=2)
    obs, _ = env.reset(options={"level": ["HG", "SF"]})  # gymnasium's symbols
    assert obs["text"] == " O \t G \t\n P \t _ \t"
    obs, *_ = env.step("Right")
    assert obs["text"] == " O \t G \t\n _ \t P \t"


def test_frozenlake_vagen_style_keeps_the_game_and_its_text_is_the_same_under_a_seed():
    ragen, vagen, again = FrozenLakeEnv(), FrozenLakeEnv(symbols="vagen"), FrozenLakeEnv(symbols="vagen")
    again.reset(seed=99)  # history must not matter
    for seed in range(10):
        text = vagen.reset(seed=seed)[0]["text"]
        assert text == again.reset(seed=seed)[0]["text"]
        assert symbols_of(text) == ragen.reset(seed=seed)[0]["text"]
        assert vagen.state_facts() == ragen.state_facts()
    slippery = [FrozenLakeEnv(symbols="vagen", is_slippery=True) for _ in range(2)]
    texts = [[env.reset(seed=3)[0]["text"]] + [env.step(a)[0]["text"] for a in ("Right", "Down", "Left")]
             for env in slippery]
    assert texts[0] == texts[1]


def test_frozenlake_vagen_image_mode_text_is_still_the_caption():
    env = FrozenLakeEnv(mode="image", symbols="vagen", render_mode="ansi")
    obs, _ = env.reset(options={"level": LAKE})
    assert obs["text"] == IMAGE_CAPTION and env.render() == LAKE_START


def test_frozenlake_vagen_instructions_say_how_a_cell_is_written():
    text = FrozenLakeEnv(symbols="vagen").instructions()
    assert "one row per line, each cell written as a space, its symbol, a space and a tab. Symbols: P is you" in text


def test_frozenlake_vagen_text_bound_counts_four_characters_a_cell():
    env = FrozenLakeEnv(size=45, symbols="vagen")
    level = "P" + "_" * (45 * 45 - 2) + "G"
    obs, _ = env.reset(options={"level": [level[r * 45 : (r + 1) * 45] for r in range(45)]})
    assert len(obs["text"]) == 45 * 181 - 1 and env.observation_space.contains(obs)
    with pytest.raises(ValueError, match="a 46x46 lake with symbols='vagen' can need 8510 characters"):
        FrozenLakeEnv(size=46, symbols="vagen")


def test_frozenlake_unknown_style_lists_the_styles():
    assert FrozenLakeEnv.setting_choices["symbols"] == ("ragen", "coords", "grid_coords", "vagen")
    with pytest.raises(ValueError, match=re.escape(
            "symbols must be one of ['ragen', 'coords', 'grid_coords', 'vagen'], got 'vagan'")):
        FrozenLakeEnv(symbols="vagan")

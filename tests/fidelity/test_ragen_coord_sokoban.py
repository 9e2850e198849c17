"""RAGEN's CoordSokoban observation and recipe.

Encodes mll-lab-nu/RAGEN at commit 20daedc47558e000f7de912b060646bf2e8026bd: ``ragen/env/sokoban/env.py``
(``_render_text('grid_coord')``: ``"Coordinates: \\n"``, the coordinate listing, ``"\\nGrid Map: \\n"``, the grid),
``ragen/env/sokoban/utils.py`` (``collect_entity_coordinates`` / ``format_coordinate_render``: a board-size line,
then targets, boxes, boxes on target, player, player on target, each row-major, a kind with none left out,
walls never listed) and ``config/base.yaml`` (training and validation on ``CoordSokoban``,
``max_actions_per_turn: 2``).
"""

from __future__ import annotations

from pathlib import Path

from turnrl.config import load_config
from turnrl.envs import make
from turnrl.training.train_config import TrainConfig

LEVEL = "#######\n#_√_S_#\n#_X___#\n#######"


def test_grid_coords_is_ragens_coord_sokoban_text():
    env = make("Sokoban", symbols="grid_coords")
    text = env.reset(options={"level": LEVEL})[0]["text"]
    assert text == "\n".join([
        "Coordinates: ",
        "Board size: 4 rows x 7 cols (zero-indexed).",
        "Targets: (1, 2), (1, 4)",
        "Boxes: (2, 2)",
        "Boxes on target: (1, 2)",
        "Player on target: (1, 4)",
        "Grid Map: ",
        LEVEL,
    ])
    text = env.step("Left")[0]["text"]  # the player steps off its target
    assert "Player: (1, 3)\n" in text and "Player on target" not in text


def test_the_current_recipe_trains_on_coordinates_and_the_grid_with_two_actions_a_turn():
    configs = Path(__file__).resolve().parents[2] / "configs"
    current = load_config(TrainConfig, configs / "ragen_coord_sokoban.yaml")
    assert current.env.settings["symbols"] == "grid_coords" and current.agent.max_actions_per_turn == 2
    v1 = load_config(TrainConfig, configs / "ragen_sokoban.yaml")
    assert "symbols" not in v1.env.settings and v1.agent.max_actions_per_turn == 5

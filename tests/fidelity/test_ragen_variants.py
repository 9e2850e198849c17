"""RAGEN's generalization variants: LargerSokoban's level difficulty and FrozenLake's settings.

Encodes mll-lab-nu/RAGEN at commit 20daedc47558e000f7de912b060646bf2e8026bd: ``config/envs.yaml``
(``LargerSokoban``: dim 8x8, 2 boxes, ``search_depth: 10``, ``max_actions_per_traj: 10``; ``FrozenLake``:
``success_rate: 0.8``) and ``ragen/env/frozen_lake/config.py`` (``p: float = 0.9``). The paper's (v1) FrozenLake:
80% frozen, gymnasium's slip (intended move 1/3). gym-sokoban's ``reverse_playing`` bounds the backward play
that makes a level by ``search_depth`` moves, so every LargerSokoban level is solved within 10 moves (RAGEN's
levels: 5.7 moves on average, 99% within 10).
"""

from __future__ import annotations

import statistics

from turnrl.envs import make
from turnrl.envs.games.sokoban.levels import solve
from turnrl.eval_config import VARIANT_SETS


def settings(variant_set: str, name: str) -> dict:
    return next(v.settings for v in VARIANT_SETS[variant_set] if v.name == name)


def test_frozenlake_current_code_and_paper():
    assert settings("ragen", "frozenlake-4x4") == {"size": 4, "p_frozen": 0.9, "is_slippery": True,
                                                   "success_rate": 0.8}
    assert settings("ragen-v1", "frozenlake-4x4") == {"size": 4, "p_frozen": 0.8, "is_slippery": True}


def test_larger_sokoban_levels_are_solved_within_ragens_ten_actions():
    for variant_set in ("ragen", "ragen-v1"):
        assert settings(variant_set, "sokoban-8x8-2boxes")["search_depth"] == 10
    env = make("Sokoban", **settings("ragen", "sokoban-8x8-2boxes"))
    lengths = []
    for seed in range(40):
        env.reset(seed=seed)
        lengths.append(len(solve(env.current_level())))
    assert max(lengths) <= 10  # without the bound about 60% of these levels need more than 10 moves
    assert 4.0 <= statistics.mean(lengths) <= 8.0, lengths  # RAGEN's: 5.7

"""Sokoban: the env (:mod:`.env`) and its level generator and solver (:mod:`.levels`)."""

from turnrl.envs.games.sokoban.sokoban_env import SokobanEnv

__all__ = ["SokobanEnv"]

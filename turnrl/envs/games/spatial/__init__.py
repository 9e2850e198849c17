"""Spatial (RAGEN): the env (:mod:`.env`), its room and views (:mod:`.room`, :mod:`.geometry`), the action
sequences (:mod:`.actions`), the questions (:mod:`.questions`) and what exploring can tell (:mod:`.knowledge`)."""

from turnrl.envs.games.spatial.spatial_env import SpatialEnv

__all__ = ["SpatialEnv"]

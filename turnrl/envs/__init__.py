"""Environments: the built-in suite and the contract they share."""

from turnrl.envs.base import ObjectFact, StateFacts, StepOutcome, TurnEnv, facts_from_positions, relation
from turnrl.envs.registry import env_class, env_names, gym_id, make, register_all
from turnrl.envs.seeds import SeedSplits

register_all()

__all__ = [
    "ObjectFact",
    "SeedSplits",
    "StateFacts",
    "StepOutcome",
    "TurnEnv",
    "env_class",
    "env_names",
    "facts_from_positions",
    "gym_id",
    "make",
    "register_all",
    "relation",
]

"""Environments: the contract (:class:`AgentEnv`), its checker, the registry of the built-in games (which live in
:mod:`turnrl.envs.games`), the Gymnasium image adapter (:class:`GymImageEnv`, ``gym:<id>``) and :func:`make`."""

from turnrl.envs.catalog import AgentEnvWrapper, env_class, env_names, gym_id, make, register_all
from turnrl.envs.check import EnvCheckError, check_env
from turnrl.envs.contract import (
    AgentEnv,
    ObjectFact,
    OptionalMethods,
    StateFacts,
    StepOutcome,
    TurnEnv,
    facts_from_positions,
    optional_methods,
    relation,
)
from turnrl.envs.gym_adapter import GymImageEnv
from turnrl.envs.seeds import SeedSplits

register_all()

__all__ = [
    "AgentEnv",
    "AgentEnvWrapper",
    "EnvCheckError",
    "GymImageEnv",
    "ObjectFact",
    "OptionalMethods",
    "SeedSplits",
    "StateFacts",
    "StepOutcome",
    "TurnEnv",
    "check_env",
    "env_class",
    "env_names",
    "facts_from_positions",
    "gym_id",
    "make",
    "optional_methods",
    "register_all",
    "relation",
]

"""Countdown: the env (:mod:`.env`) and its safe arithmetic evaluator (:mod:`.arith`)."""

from turnrl.envs.games.countdown.countdown_env import CountdownEnv

__all__ = ["CountdownEnv"]

"""Rewards beyond the env's: the seam (named rewards per turn) and the reward functions that come with turnrl."""

from turnrl.rewards.turn_rewards import (
    BUILTIN_REWARDS,
    REWARDS,
    FinishedTurn,
    RewardFn,
    Rewards,
    TurnScores,
    load_reward_fn,
)

__all__ = ["BUILTIN_REWARDS", "REWARDS", "FinishedTurn", "RewardFn", "Rewards", "TurnScores", "load_reward_fn"]

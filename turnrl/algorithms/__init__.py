"""The math of turnrl: advantage estimators, losses and group filters.

Pure functions over padded ``(b, s)`` tensors with masks, vectorized, each
checked against a plain loop reference in ``tests/algorithms``.
"""

from turnrl.algorithms.advantages import (
    GroupStats,
    bilevel_gae,
    broadcast_to_tokens,
    discounted_reverse_cumsum,
    gigpo_advantages,
    group_stats,
    grpo_advantages,
    masked_gae,
    place_rewards,
    reinforce_pp_advantages,
    rloo_advantages,
    turn_gae,
    whiten,
)
from turnrl.algorithms.filters import GroupSelection, select_groups
from turnrl.algorithms.losses import (
    AGGREGATIONS,
    PolicyLossStats,
    ValueLossStats,
    aggregate,
    entropy_bonus,
    kl_in_reward,
    kl_penalty,
    ppo_policy_loss,
    truncated_importance_weights,
    value_loss,
)

__all__ = [
    "AGGREGATIONS",
    "GroupSelection",
    "GroupStats",
    "PolicyLossStats",
    "ValueLossStats",
    "aggregate",
    "bilevel_gae",
    "broadcast_to_tokens",
    "discounted_reverse_cumsum",
    "gigpo_advantages",
    "entropy_bonus",
    "group_stats",
    "grpo_advantages",
    "kl_in_reward",
    "kl_penalty",
    "masked_gae",
    "place_rewards",
    "ppo_policy_loss",
    "truncated_importance_weights",
    "reinforce_pp_advantages",
    "rloo_advantages",
    "select_groups",
    "turn_gae",
    "value_loss",
    "whiten",
]

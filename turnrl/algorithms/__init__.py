"""The math of turnrl: advantage estimators, losses and group filters.

Pure functions over padded ``(b, s)`` tensors with masks, vectorized, each
checked against a plain loop reference in ``tests/algorithms``. The
estimators that ``algorithm.advantage`` names are registered in
:mod:`turnrl.algorithms.estimators`.
"""

from turnrl.algorithms.advantages import (
    GroupStats,
    anchored_share,
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
from turnrl.algorithms.estimators import (
    EpisodeView,
    Estimate,
    EstimatorSpec,
    GiGPOParams,
    NoParams,
    SharedSettings,
    estimator,
    estimator_names,
    get_estimator,
)
from turnrl.algorithms.filters import GroupSelection, seeded_group_scores, select_groups
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
    "EpisodeView",
    "Estimate",
    "EstimatorSpec",
    "GiGPOParams",
    "GroupSelection",
    "GroupStats",
    "NoParams",
    "PolicyLossStats",
    "SharedSettings",
    "ValueLossStats",
    "aggregate",
    "anchored_share",
    "bilevel_gae",
    "broadcast_to_tokens",
    "discounted_reverse_cumsum",
    "entropy_bonus",
    "estimator",
    "estimator_names",
    "get_estimator",
    "gigpo_advantages",
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
    "seeded_group_scores",
    "select_groups",
    "turn_gae",
    "value_loss",
    "whiten",
]

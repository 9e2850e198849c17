"""From a training batch to advantages: the estimators of :mod:`turnrl.algorithms`, wired.

Notation: b samples, s sequence length, e episodes, n sampled tokens of the
longest episode, k sampled tokens of the batch.

Every estimator runs on an :class:`EpisodeView`: one row per episode that
holds only its sampled tokens, in order. In trajectory mode a sample is an
episode; in turn mode an episode's turn samples are laid end to end. The same
episode therefore gets the same advantages in both sample modes: the rewards
and KL penalties of later turns reach earlier turns in turn mode exactly as in
trajectory mode, and each discount means the same in both (``gamma_token``
from one token to the next inside a turn, ``gamma_turn`` from a turn to the
next). Observation tokens are never in the view; the estimators skip tokens
outside their mask anyway, so leaving them out changes nothing.

One small function per estimator family (critic, group, REINFORCE++), chosen
by name from :data:`ESTIMATORS`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from turnrl.algorithms import (
    bilevel_gae,
    broadcast_to_tokens,
    gigpo_advantages,
    grpo_advantages,
    kl_in_reward,
    masked_gae,
    place_rewards,
    reinforce_pp_advantages,
    rloo_advantages,
    turn_gae,
    whiten,
)
from turnrl.training.batch import Batch
from turnrl.training.config import AlgorithmConfig


@dataclass
class EpisodeView:
    """The sampled tokens of a batch, one row per episode (see the module docstring)."""

    rewards: torch.Tensor
    """Shape (e, n), float64: turn rewards placed on turn ends (and the KL penalty when it is in the reward)."""
    values: torch.Tensor | None
    """Shape (e, n): the critic's value of each token, or None."""
    mask: torch.Tensor
    """Shape (e, n), bool: True on the episode's sampled tokens (left-aligned)."""
    turn_end: torch.Tensor
    """Shape (e, n), bool: True at each turn's last sampled token."""
    group: torch.Tensor
    """Shape (e,), long: the group of each episode."""
    sample_index: tuple[torch.Tensor, torch.Tensor]
    """Rows and columns in the batch of every sampled token, each Shape (k,)."""
    view_index: tuple[torch.Tensor, torch.Tensor]
    """Rows and columns in the view of the same tokens, each Shape (k,)."""
    turn_states: torch.Tensor | None = None
    """Shape (e, T), long: the state each turn of the episode started from (see ``Batch.turn_states``),
    -1 for unknown or padding turns; None when the batch has no states."""

    def place(self, per_token: torch.Tensor) -> torch.Tensor:
        """A batch tensor's sampled tokens in the view. Shape (b, s) -> (e, n), zero elsewhere."""
        out = torch.zeros(self.mask.shape, dtype=per_token.dtype, device=per_token.device)
        out[self.view_index] = per_token[self.sample_index]
        return out

    def to_batch(self, per_token: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        """Inverse of :meth:`place`: Shape (e, n) -> ``shape`` (b, s), zero off the sampled tokens."""
        out = torch.zeros(shape, dtype=per_token.dtype, device=per_token.device)
        out[self.sample_index] = per_token[self.view_index]
        return out


def episode_view(batch: Batch, placement: str = "per_turn") -> EpisodeView:
    """Lay each episode's sampled tokens end to end, its samples in turn order.

    Args:
        placement: where turn rewards go, as :func:`~turnrl.algorithms.place_rewards`:
            ``per_turn`` (each turn's last token) or ``episode_end`` (the
            episode's total at its last turn's last token).
    """
    device = batch.input_ids.device
    sampled = batch.loss_mask != 0
    _, episode = torch.unique(batch.episode, return_inverse=True)  # (b,) dense episode ids
    n_episodes = int(episode.max()) + 1
    # Each sample starts where the earlier turns of its episode end.
    order = torch.argsort(episode * (int(batch.turn.max()) + 2) + batch.turn + 1)
    lengths = sampled.sum(1)
    before = lengths[order].cumsum(0) - lengths[order]  # tokens of all earlier samples, sorted
    episode_start = torch.zeros(n_episodes, dtype=torch.long, device=device).scatter_reduce_(
        0, episode[order], before, "amin", include_self=False
    )
    offset = torch.empty_like(before)
    offset[order] = before - episode_start[episode[order]]
    column = offset[:, None] + sampled.long().cumsum(1) - 1  # (b, s): view column of each sampled token
    width = int((offset + lengths).max())

    rows, cols = sampled.nonzero(as_tuple=True)
    view_index = (episode[rows], column[rows, cols])
    mask = torch.zeros(n_episodes, width, dtype=torch.bool, device=device)
    mask[view_index] = True

    # Turn ends in view coordinates, numbered in order within each episode.
    has_end = batch.turn_end_index >= 0
    end_rows, end_turns = has_end.nonzero(as_tuple=True)
    end_positions = batch.turn_end_index[end_rows, end_turns]
    if not bool(sampled[end_rows, end_positions].all()):
        raise ValueError("every turn must end on a sampled token (loss_mask 1 at turn_end_index); "
                         "a turn without sampled tokens cannot carry a reward")
    end_episode = episode[end_rows]
    end_column = column[end_rows, end_positions]
    by_position = torch.argsort(end_episode * width + end_column)
    end_episode, end_column = end_episode[by_position], end_column[by_position]
    end_reward = batch.turn_rewards[end_rows, end_turns][by_position].to(torch.float64)
    first_end = torch.zeros(n_episodes, dtype=torch.long, device=device).scatter_reduce_(
        0, end_episode, torch.arange(len(end_episode), device=device), "amin", include_self=False
    )
    slot = torch.arange(len(end_episode), device=device) - first_end[end_episode]
    n_turns = int(slot.max()) + 1 if len(slot) else 1
    turn_rewards = torch.zeros(n_episodes, n_turns, dtype=torch.float64, device=device)
    turn_rewards[end_episode, slot] = end_reward
    turn_end_index = torch.full((n_episodes, n_turns), -1, dtype=torch.long, device=device)
    turn_end_index[end_episode, slot] = end_column
    turn_end = torch.zeros_like(mask)
    turn_end[end_episode, end_column] = True

    group = torch.zeros(n_episodes, dtype=torch.long, device=device).scatter_(0, episode, batch.group)
    turn_states = None
    if batch.turn_states is not None:
        turn_states = torch.full((n_episodes, n_turns), -1, dtype=torch.long, device=device)
        turn_states[end_episode, slot] = batch.turn_states[end_rows, end_turns][by_position]
    return EpisodeView(
        rewards=place_rewards(turn_rewards, turn_end_index, width, mode=placement),  # type: ignore[arg-type]
        values=None,
        mask=mask,
        turn_end=turn_end,
        group=group,
        sample_index=(rows, cols),
        view_index=view_index,
        turn_states=turn_states,
    )


# --------------------------------------------------------------------------- the estimator families
Estimate = tuple[torch.Tensor, torch.Tensor]


def critic_estimate(view: EpisodeView, config: AlgorithmConfig) -> Estimate:
    """GAE, bi-level GAE or turn-level GAE against the critic's values, whitened when configured."""
    if view.values is None:
        raise ValueError(f"algorithm.advantage={config.advantage} needs the critic's values")
    if config.advantage == "gae":
        advantages, returns = masked_gae(
            view.rewards, view.values, view.mask, config.gamma_token, config.lambda_token,
            turn_end_mask=view.turn_end, gamma_turn=config.gamma_turn, lambda_turn=config.lambda_turn,
        )
    elif config.advantage == "bilevel_gae":
        advantages, returns = bilevel_gae(
            view.rewards, view.values, view.mask, view.turn_end, gamma_turn=config.gamma_turn,
            lambda_turn=config.lambda_turn, gamma_token=config.gamma_token, lambda_token=config.lambda_token,
        )
    else:
        advantages, returns = turn_gae(
            view.rewards, view.values, view.mask, view.turn_end, gamma=config.gamma_turn, lam=config.lambda_turn
        )
    if config.whiten_advantages:
        advantages = whiten(advantages, view.mask)
    return advantages, returns


def group_estimate(view: EpisodeView, config: AlgorithmConfig) -> Estimate:
    """GRPO, Dr.GRPO or RLOO: each episode's total reward against its group; no critic."""
    scores = view.rewards.sum(1)
    if config.advantage == "rloo":
        per_episode = rloo_advantages(scores, view.group)
    else:
        per_episode = grpo_advantages(scores, view.group, norm_by_std=config.advantage == "grpo")
    advantages = broadcast_to_tokens(per_episode, view.mask)
    return advantages, advantages


def reinforce_pp_estimate(view: EpisodeView, config: AlgorithmConfig) -> Estimate:
    """REINFORCE++: discounted returns over the episode's tokens, whitened over the batch."""
    return reinforce_pp_advantages(
        view.rewards, view.mask, config.gamma_token, turn_end_mask=view.turn_end, gamma_turn=config.gamma_turn
    )


def gigpo_estimate(view: EpisodeView, config: AlgorithmConfig) -> Estimate:
    """GiGPO: each turn gets its episode's group advantage plus its step advantage among the group's turns
    that started from the same state; every token of a turn gets the turn's advantage. A turn's reward is
    the sum of the view's rewards on its tokens (the KL penalty included when it is in the reward)."""
    if view.turn_states is None:
        raise ValueError("algorithm.advantage=gigpo needs each turn's env state (turn_states in the batch)")
    turn_of_token = view.turn_end.long().cumsum(1) - view.turn_end.long()  # (e, n): the turn of each token
    n_turns = view.turn_states.shape[1]
    turn_of_token = turn_of_token.clamp(max=n_turns - 1)
    turn_rewards = torch.zeros(view.turn_states.shape, dtype=torch.float64, device=view.mask.device)
    turn_rewards.scatter_add_(1, turn_of_token, torch.where(view.mask, view.rewards.to(torch.float64), 0.0))
    turns = torch.arange(n_turns, device=view.mask.device)
    has_turn = turns[None, :] < view.turn_end.sum(1, keepdim=True)  # each episode's turns are a prefix
    per_turn, _ = gigpo_advantages(
        turn_rewards, has_turn, view.turn_states, view.group, gamma=config.gigpo_gamma,
        step_weight=config.gigpo_step_weight, norm_by_std=config.gigpo_norm_by_std,
    )
    advantages = torch.where(view.mask, per_turn.gather(1, turn_of_token), 0.0)
    return advantages, advantages


ESTIMATORS: dict[str, Callable[[EpisodeView, AlgorithmConfig], Estimate]] = {
    "gae": critic_estimate,
    "bilevel_gae": critic_estimate,
    "turn_gae": critic_estimate,
    "grpo": group_estimate,
    "drgrpo": group_estimate,
    "rloo": group_estimate,
    "reinforce_pp": reinforce_pp_estimate,
    "gigpo": gigpo_estimate,
}
"""Estimator name (``algorithm.advantage``) -> the function that computes it on an :class:`EpisodeView`."""


def anchored_share(turn_states: torch.Tensor, group: torch.Tensor) -> float:
    """The share of known turns whose anchor group (same group, same start state) holds at least two turns:
    the turns GiGPO gives a step advantage. turn_states Shape (b, t), -1 unknown; group Shape (b,)."""
    rows, turns = (turn_states >= 0).nonzero(as_tuple=True)
    if len(rows) == 0:
        return 0.0
    keys = torch.stack([group[rows], turn_states[rows, turns]], dim=1)
    _, inverse, counts = torch.unique(keys, dim=0, return_inverse=True, return_counts=True)
    return float((counts[inverse] > 1).float().mean())


# --------------------------------------------------------------------------- the batch
@dataclass
class Advantages:
    """What the PPO epochs need besides the batch."""

    advantages: torch.Tensor
    """Shape (b, s), float32, zero off the sampled tokens."""
    returns: torch.Tensor
    """Shape (b, s), float32: the critic's targets (the advantages for estimators without a critic)."""
    sample_weights: torch.Tensor | None
    """Shape (b,): each sample's weight in the policy loss, or None for all 1 (see :func:`episode_weights`)."""


def episode_weights(batch: Batch) -> torch.Tensor:
    """Shape (b,): ``mean turns per episode / turns of this sample's episode`` (turn mode).

    A group estimator gives every turn of an episode the episode's advantage.
    Unweighted, an episode of 8 turn samples would count 8 times as much as
    one of 2, and since failed episodes tend to be the long ones (out of
    turns), the batch's advantages would no longer balance: every sampled
    token, format tokens included, would be pushed down a little at each step
    until responses break. With these weights each episode counts once, as in
    the trajectory-level objective; the mean weight per turn sample stays 1.
    """
    _, inverse, turns = torch.unique(batch.episode, return_inverse=True, return_counts=True)
    return (turns.float().mean() / turns.float())[inverse]


def compute_advantages(
    batch: Batch,
    config: AlgorithmConfig,
    values: torch.Tensor | None = None,
    kl: torch.Tensor | None = None,
) -> Advantages:
    """Advantages and value targets for every sampled token of ``batch``.

    Args:
        values: Shape (b, s), the critic's values (critic estimators only).
        kl: Shape (b, s), per-token KL to the reference; subtracted from the
            rewards (times ``config.kl_coef``) when ``config.kl_in_reward``.
    """
    view = episode_view(batch, config.reward_placement)
    if values is not None:
        view.values = view.place(values)
    if kl is not None and config.kl_in_reward:
        view.rewards = kl_in_reward(view.rewards, view.place(kl).to(view.rewards.dtype), config.kl_coef, view.mask)
    advantages, returns = ESTIMATORS[config.advantage](view, config)
    weights = None
    if config.sample_mode == "turn" and ESTIMATORS[config.advantage] in (group_estimate, gigpo_estimate):
        weights = episode_weights(batch).to(batch.loss_mask.device)
    shape = batch.loss_mask.shape
    return Advantages(
        view.to_batch(advantages.float(), shape), view.to_batch(returns.float(), shape), weights
    )

"""From a training batch to advantages: the registered estimators of :mod:`turnrl.algorithms.estimators`, wired.

Notation: b samples, s sequence length, e episodes, n sampled tokens of the longest episode, k sampled tokens of
the batch, E episodes and N samples of a batch.

Every estimator runs on an :class:`~turnrl.algorithms.estimators.EpisodeView`: one row per episode that
holds only its sampled tokens, in order. In trajectory mode a sample is an episode; in turn mode an episode's
turn samples are laid end to end. The same episode therefore gets the same advantages in both sample modes:
the rewards and KL penalties of later turns reach earlier turns in turn mode exactly as in trajectory mode,
and each discount means the same in both (``gamma_token`` from one token to the next inside a turn,
``gamma_turn`` from a turn to the next). Observation tokens are never in the view; the estimators skip tokens
outside their mask anyway, so leaving them out changes nothing.

The estimator that ``algorithm.advantage`` names says what it reads (the critic's values, each turn's state)
and whether its turn samples are weighed per episode (:func:`turn_sample_weights`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from turnrl.algorithms import EpisodeView, kl_in_reward, place_rewards
from turnrl.algorithms.losses import Aggregation
from turnrl.training.algorithm_config import AlgorithmConfig
from turnrl.training.batch import Batch


def episode_view(batch: Batch, placement: str = "per_turn", with_turn_states: bool = False) -> EpisodeView:
    """Lay each episode's sampled tokens end to end, its samples in turn order.

    Args:
        placement: where turn rewards go, as :func:`~turnrl.algorithms.place_rewards`:
            ``per_turn`` (each turn's last token) or ``episode_end`` (the
            episode's total at its last turn's last token).
        with_turn_states: lay out each turn's start state too (``batch.turn_states``, where the batch has them).
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
    if with_turn_states and batch.turn_states is not None:
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


# --------------------------------------------------------------------------- the batch
@dataclass
class Advantages:
    """What the PPO epochs need besides the batch."""

    advantages: torch.Tensor
    """Shape (b, s), float32, zero off the sampled tokens."""
    returns: torch.Tensor
    """Shape (b, s), float32: the critic's targets (the advantages for estimators without a critic)."""
    sample_weights: torch.Tensor | None
    """Shape (b,): each sample's weight in the policy loss, or None for all 1 (see :func:`turn_sample_weights`)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """The estimator's metrics of this batch, under ``actor/`` (e.g. ``actor/gigpo_anchored_turns``)."""


def turn_sample_weights(batch: Batch, aggregation: Aggregation) -> torch.Tensor | None:
    """Shape (b,): weights of turn samples in the policy loss that make it the loss of the same episodes as
    whole-trajectory samples, under the loss's aggregation; None where no weights are needed.

    With ``x`` the per-token loss terms, ``l_it`` the sampled tokens of turn ``t`` of episode ``i`` and
    ``L_i = sum_t l_it``, the trajectory-mode loss (E samples) and the unweighted turn-mode loss (N samples)
    of one batch are:

    - ``token-mean``: ``sum_ij x_ij / sum_i L_i`` in both modes (the same tokens over the same count): no
      weights. Weights would scale whole episodes against each other.
    - ``seq-mean-token-sum``: ``(1/E) sum_ij x_ij`` against ``(1/N) sum_ij x_ij``: the same but for the
      factor ``E/N`` on the whole batch, which the entropy and KL terms share, so the actor's gradient has
      the trajectory mode's direction: no weights.
    - ``seq-mean-token-mean``: ``(1/E) sum_i (1/L_i) sum_j x_ij`` against ``(1/N) sum_it (1/l_it) sum_(j in t)
      x_ij``, where an episode counts once per turn. Weights ``w_it = (N/E) * l_it / L_i`` (mean 1) make the
      turn-mode policy loss the trajectory mode's exactly (the entropy and KL terms stay per turn sample).

    Each equality holds for the whole batch; a mini-batch of turn samples is a random share of it, as one of
    episodes is. Returns None for a batch of one sample per episode. Only estimators that declare
    ``episode_weights`` get these weights; the critic's estimators count each turn sample once, as a step of
    the turn-level MDP.
    """
    _, episode, turns = torch.unique(batch.episode, return_inverse=True, return_counts=True)
    if aggregation != "seq-mean-token-mean" or bool((turns == 1).all()):
        return None
    tokens = batch.loss_mask.sum(1).to(torch.float64)  # (b,) l_it
    episode_tokens = torch.zeros(len(turns), dtype=torch.float64, device=tokens.device).index_add_(0, episode, tokens)
    samples_per_episode = len(batch) / len(turns)  # N / E
    return (samples_per_episode * tokens / episode_tokens[episode]).float()


def compute_advantages(
    batch: Batch,
    config: AlgorithmConfig,
    values: torch.Tensor | None = None,
    kl: torch.Tensor | None = None,
) -> Advantages:
    """Advantages and value targets for every sampled token of ``batch``, from the estimator that
    ``config.advantage`` names.

    Args:
        values: Shape (b, s), the critic's values (critic estimators only).
        kl: Shape (b, s), per-token KL to the reference; subtracted from the
            rewards (times ``config.kl_coef``) when ``config.kl_in_reward``.
    """
    estimator = config.estimator
    view = episode_view(batch, config.reward_placement, with_turn_states="turn_states" in estimator.needs)
    if values is not None:
        view.values = view.place(values)
    if kl is not None and config.kl_in_reward:
        view.rewards = kl_in_reward(view.rewards, view.place(kl).to(view.rewards.dtype), config.kl_coef, view.mask)
    estimate = estimator(view, config.shared_settings, config.params)
    weights = None
    if config.sample_mode == "turn" and "episode_weights" in estimator.needs:
        weights = turn_sample_weights(batch, config.loss_aggregation)
    shape = batch.loss_mask.shape
    return Advantages(
        view.to_batch(estimate.advantages.float(), shape),
        view.to_batch(estimate.returns.float(), shape),
        weights if weights is None else weights.to(batch.loss_mask.device),
        {f"actor/{name}": value for name, value in estimate.metrics.items()},
    )

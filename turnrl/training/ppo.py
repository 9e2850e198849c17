"""The update half of an RL step: advantages from a batch, then PPO epochs.

Notation: b samples, s sequence length, e episodes, t turns.

Everything here wires the pure functions of :mod:`turnrl.algorithms` to a
:class:`~turnrl.training.batch.Batch`; no formula is written twice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator

import torch

from turnrl.algorithms import (
    aggregate,
    bilevel_gae,
    broadcast_to_tokens,
    entropy_bonus,
    grpo_advantages,
    kl_in_reward,
    kl_penalty,
    masked_gae,
    place_rewards,
    ppo_policy_loss,
    reinforce_pp_advantages,
    rloo_advantages,
    turn_gae,
    value_loss,
    whiten,
)
from turnrl.training.batch import Batch
from turnrl.training.config import AlgorithmConfig, OptimConfig
from turnrl.training.forward import ValueModel, token_logprobs


# --------------------------------------------------------------------------- advantages
def episode_scores(batch: Batch, per_sample: torch.Tensor | None = None) -> torch.Tensor:
    """Shape (b,): the total reward of each sample's episode (all turns, also in turn mode).

    Args:
        per_sample: Shape (b,), what each sample adds to its episode's score;
            by default the sum of its turn rewards.
    """
    if per_sample is None:
        per_sample = batch.turn_rewards.sum(1)
    totals = torch.zeros(int(batch.episode.max()) + 1, dtype=per_sample.dtype, device=per_sample.device)
    totals.index_add_(0, batch.episode, per_sample)
    return totals[batch.episode]


def episode_weights(batch: Batch) -> torch.Tensor:
    """Shape (b,): ``mean turns per episode / turns of this sample's episode`` (turn mode).

    A group estimator gives every turn of an episode the episode's advantage.
    Unweighted, an episode of 8 turns would count 8 times as much as one of 2,
    and since failed episodes tend to be the long ones (out of turns), the
    batch's advantages would no longer sum to zero: every sampled token,
    format tokens included, would be pushed down a little at each step until
    responses break. With these weights each episode counts once, as in the
    trajectory-level objective; the mean weight per turn sample stays 1.
    """
    _, inverse, turns = torch.unique(batch.episode, return_inverse=True, return_counts=True)
    return (turns.float().mean() / turns.float())[inverse].to(batch.loss_mask.dtype)


def group_advantages(batch: Batch, scores: torch.Tensor, estimator: str) -> torch.Tensor:
    """Shape (b,): GRPO / Dr.GRPO / RLOO advantage of each sample's episode.

    Groups compare episodes: in turn mode an episode has one sample per turn,
    and counting each turn sample would weigh long episodes more in the group
    mean and std (and make RLOO leave out one turn, not one episode).

    Args:
        scores: Shape (b,), the score of each sample's episode (equal across its samples).
    """
    episodes, inverse = torch.unique(batch.episode, return_inverse=True)
    one_sample = torch.zeros(len(episodes), dtype=torch.long, device=inverse.device)
    one_sample.scatter_(0, inverse, torch.arange(len(batch), device=inverse.device))  # any sample of each episode
    per_episode, groups = scores[one_sample], batch.group[one_sample]
    if estimator == "rloo":
        return rloo_advantages(per_episode, groups)[inverse]
    return grpo_advantages(per_episode, groups, norm_by_std=estimator == "grpo")[inverse]


def turn_lambda_returns(
    batch: Batch, end_values: torch.Tensor, gamma: float, lam: float, placement: str = "per_turn"
) -> torch.Tensor:
    """Turn mode: the lambda-return of each turn across its episode's turns.

    Lays the turn samples out as an ``(e, t)`` grid of turns, each turn one
    "token" with its reward and the critic's value at its last token, and runs
    GAE over it; the result, placed as a sample's end reward, makes the
    in-turn estimator see the credit of the turns that follow.

    Args:
        end_values: Shape (b,): value at each sample's last sampled token.
        placement: ``per_turn`` (each turn's own reward) or ``episode_end``
            (the episode's total at its last turn), as :func:`place_rewards`.

    Returns:
        Shape (b,): ``A_t + V_t`` for each sample's turn.
    """
    episodes, turns = batch.episode, batch.turn
    grid_shape = (int(episodes.max()) + 1, int(turns.max()) + 1)
    rewards = torch.zeros(grid_shape, device=end_values.device)
    values = torch.zeros(grid_shape, device=end_values.device)
    mask = torch.zeros(grid_shape, dtype=torch.bool, device=end_values.device)
    rewards[episodes, turns] = batch.turn_rewards[:, 0]
    values[episodes, turns] = end_values
    mask[episodes, turns] = True
    turn_index = torch.where(mask, torch.arange(grid_shape[1], device=mask.device), -1)
    rewards = place_rewards(rewards, turn_index, grid_shape[1], mode=placement)
    _, returns = masked_gae(rewards, values, mask, gamma=gamma, lam=lam)
    return returns[episodes, turns]


def compute_advantages(
    batch: Batch, values: torch.Tensor | None, config: AlgorithmConfig, kl: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages and value targets for every token of ``batch``.

    Args:
        values: Shape (b, s), the critic's values (critic estimators only).
        kl: Shape (b, s), per-token KL to the reference, folded into the rewards
            when ``config.kl_in_reward``.

    Returns:
        ``advantages`` and ``returns``, both Shape (b, s), zero outside the loss mask.
    """
    mask, ends = batch.loss_mask, batch.turn_end_mask
    seq_len = batch.input_ids.shape[1]
    estimator = config.advantage
    rewards = place_rewards(batch.turn_rewards, batch.turn_end_index, seq_len, mode=config.reward_placement)
    if estimator in ("grpo", "drgrpo", "rloo"):
        if kl is not None and config.kl_in_reward:  # the episode score is then the sum of the KL-folded rewards
            rewards = kl_in_reward(rewards, kl, config.kl_coef, mask)
        seq_adv = group_advantages(batch, episode_scores(batch, rewards.sum(1)), estimator)
        if config.sample_mode == "turn":
            seq_adv = seq_adv * episode_weights(batch)
        advantages = broadcast_to_tokens(seq_adv, mask)
        return advantages, advantages

    if config.sample_mode == "turn":
        if estimator == "reinforce_pp":  # no critic: the discounted return over the episode's later turns
            end_values = torch.zeros(len(batch), device=rewards.device)
            gamma, lam = config.gamma, 1.0
        elif values is None:
            raise ValueError("turn mode credit across turns needs the critic's values")
        else:
            end_values = values.gather(1, batch.turn_end_index[:, :1]).squeeze(1)
            if estimator == "gae":
                gamma, lam = config.gamma, config.lam
            else:
                gamma, lam = config.gamma_turn, config.lambda_turn
        returns = turn_lambda_returns(batch, end_values, gamma, lam, config.reward_placement)
        rewards = place_rewards(returns[:, None], batch.turn_end_index[:, :1], seq_len)
    if kl is not None and config.kl_in_reward:
        rewards = kl_in_reward(rewards, kl, config.kl_coef, mask)

    if estimator == "reinforce_pp":
        return reinforce_pp_advantages(rewards, mask, gamma=config.gamma)
    assert values is not None, f"{estimator} needs the critic's values"
    # In turn mode the end reward already carries the credit of later turns.
    across_turns = (1.0, 1.0) if config.sample_mode == "turn" else (config.gamma_turn, config.lambda_turn)
    if estimator == "gae":
        advantages, returns = masked_gae(rewards, values, mask, gamma=config.gamma, lam=config.lam)
    elif estimator == "bilevel_gae":
        advantages, returns = bilevel_gae(
            rewards, values, mask, ends, gamma_turn=across_turns[0], lambda_turn=across_turns[1],
            gamma_token=config.gamma_token, lambda_token=config.lambda_token,
        )
    else:
        advantages, returns = turn_gae(rewards, values, mask, ends, gamma=across_turns[0], lam=across_turns[1])
    if config.whiten_advantages:
        advantages = whiten(advantages, mask) * mask
    return advantages, returns


# --------------------------------------------------------------------------- forward passes without grad
@torch.no_grad()
def batched_logprobs(model: torch.nn.Module, batch: Batch, micro: int, temperature: float) -> torch.Tensor:
    """Shape (b, s): log-probs of the sampled tokens under ``model``, computed ``micro`` samples at a time."""
    out = torch.zeros_like(batch.loss_mask)
    for rows in _chunks(torch.arange(len(batch)), micro):
        part = batch.select(rows)
        lp, _ = token_logprobs(model, part.input_ids, part.attention_mask, part.loss_mask, temperature)
        out[rows.to(out.device), : lp.shape[1]] = lp
    return out


@torch.no_grad()
def batched_values(critic: ValueModel, batch: Batch, micro: int) -> torch.Tensor:
    """Shape (b, s): the critic's values, zero outside the loss mask."""
    out = torch.zeros_like(batch.loss_mask)
    for rows in _chunks(torch.arange(len(batch)), micro):
        part = batch.select(rows)
        out[rows.to(out.device)] = critic(part.input_ids, part.attention_mask) * part.loss_mask
    return out


def _chunks(index: torch.Tensor, size: int) -> Iterator[torch.Tensor]:
    for start in range(0, len(index), size):
        yield index[start : start + size]


# --------------------------------------------------------------------------- the PPO epochs
@dataclass
class UpdateInputs:
    """What the PPO epochs read, all Shape (b, s)."""

    batch: Batch
    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    returns: torch.Tensor
    old_values: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None


def micro_weight(part: Batch, whole: Batch, aggregation: str) -> float:
    """Share of a micro-batch in its mini-batch's loss, so accumulated gradients equal the mini-batch loss."""
    if aggregation == "token-mean":
        return float(part.loss_mask.sum() / whole.loss_mask.sum().clamp(min=1))
    has_tokens = lambda b: float((b.loss_mask.sum(1) > 0).sum())  # noqa: E731
    return has_tokens(part) / max(has_tokens(whole), 1.0)


def _step_optimizer(
    optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], optim: OptimConfig
) -> tuple[float, bool]:
    """Clip, then step unless the gradient is non-finite or above the skip threshold. Returns (norm, skipped)."""
    norm = float(torch.nn.utils.clip_grad_norm_(params, optim.grad_clip))
    too_big = optim.skip_grad_norm_above is not None and norm > optim.skip_grad_norm_above
    if not math.isfinite(norm) or too_big:
        optimizer.zero_grad(set_to_none=True)
        return norm, True
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm, False


def ppo_epochs(
    actor: torch.nn.Module,
    critic: ValueModel | None,
    inputs: UpdateInputs,
    config: AlgorithmConfig,
    optim: OptimConfig,
    actor_optimizer: torch.optim.Optimizer | None,
    critic_optimizer: torch.optim.Optimizer | None,
    temperature: float,
    generator: torch.Generator,
) -> dict[str, float]:
    """Mini-batch PPO epochs over one rollout batch; returns mean metrics.

    ``actor_optimizer`` None trains only the critic (critic warm-up).
    """
    batch = inputs.batch
    actor_params = [p for p in actor.parameters() if p.requires_grad]
    critic_params = [p for p in critic.parameters() if p.requires_grad] if critic is not None else []
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}

    def record(key: str, value: float) -> None:
        sums[key] = sums.get(key, 0.0) + value
        counts[key] = counts.get(key, 0) + 1

    for _ in range(config.ppo_epochs):
        order = torch.randperm(len(batch), generator=generator)
        for mini in _chunks(order, config.mini_batch_size):
            whole = batch.select(mini)
            for micro in _chunks(mini, config.micro_batch_size):
                part = batch.select(micro)
                weight = micro_weight(part, whole, config.loss_aggregation)
                if actor_optimizer is not None:
                    for key, value in _actor_backward(actor, part, inputs, micro, config, temperature, weight).items():
                        record(key, value)
                if critic is not None and critic_optimizer is not None:
                    for key, value in _critic_backward(critic, part, inputs, micro, config, weight).items():
                        record(key, value)
            if actor_optimizer is not None:
                norm, skipped = _step_optimizer(actor_optimizer, actor_params, optim)
                record("actor/grad_norm", norm)
                record("actor/skipped_steps", float(skipped))
            if critic is not None and critic_optimizer is not None:
                norm, skipped = _step_optimizer(critic_optimizer, critic_params, optim)
                record("critic/grad_norm", norm)
                record("critic/skipped_steps", float(skipped))
    metrics = {key: sums[key] / counts[key] for key in sums}
    for key in ("actor/skipped_steps", "critic/skipped_steps"):
        if key in metrics:
            metrics[key] = sums[key]  # a count, not a mean
    return metrics


def _actor_backward(
    actor: torch.nn.Module, part: Batch, inputs: UpdateInputs, rows: torch.Tensor, config: AlgorithmConfig,
    temperature: float, weight: float,
) -> dict[str, float]:
    index = rows.to(inputs.old_logprobs.device)
    mask = part.loss_mask
    # Entropy is watched even without a bonus: its fall is the first sign of collapse.
    logprobs, entropy = token_logprobs(actor, part.input_ids, part.attention_mask, mask, temperature, with_entropy=True)
    policy_loss, stats = ppo_policy_loss(
        logprobs, inputs.old_logprobs[index], inputs.advantages[index], mask,
        clip_low=config.clip_low, clip_high=config.clip_high, dual_clip=config.dual_clip,
        aggregation=config.loss_aggregation,
    )
    loss = policy_loss
    metrics = {"losses/policy": policy_loss.item(), "actor/clip_frac": float(stats.clip_frac),
               "actor/approx_kl": float(stats.approx_kl), "actor/dual_clip_frac": float(stats.dual_clip_frac)}
    bonus = entropy_bonus(entropy, mask, config.loss_aggregation)
    if config.entropy_coef != 0:
        loss = loss - config.entropy_coef * bonus
    metrics["actor/entropy"] = bonus.item()
    if inputs.ref_logprobs is not None and config.kl_coef > 0:
        kl = kl_penalty(logprobs, inputs.ref_logprobs[index], kind=config.kl_kind)
        kl_term = aggregate(kl, mask, config.loss_aggregation)
        if not config.kl_in_reward:
            loss = loss + config.kl_coef * kl_term
        metrics["actor/kl_ref"] = kl_term.item()
    (loss * weight).backward()
    metrics["losses/actor_total"] = loss.item()
    return metrics


def _critic_backward(
    critic: ValueModel, part: Batch, inputs: UpdateInputs, rows: torch.Tensor, config: AlgorithmConfig, weight: float
) -> dict[str, float]:
    assert inputs.old_values is not None
    index = rows.to(inputs.returns.device)
    values = critic(part.input_ids, part.attention_mask)
    loss, stats = value_loss(
        values, inputs.old_values[index], inputs.returns[index], part.loss_mask,
        clip=config.value_clip, aggregation=config.loss_aggregation,
    )
    (loss * weight).backward()
    return {"losses/value": loss.item(), "critic/clip_frac": float(stats.clip_frac), "critic/error": float(stats.error)}

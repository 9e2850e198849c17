"""Policy, value, KL and entropy losses as pure functions over padded tensors.

Notation: ``b`` batch size, ``s`` sequence length, ``V`` vocabulary size.
Masks are bool or 0/1 ``(b, s)`` tensors; values outside the mask never reach
a result or a gradient, even when they are inf or NaN (padding logprobs often
are): every function masks its inputs before any arithmetic, because a
``torch.where`` on the result alone still lets ``0 * inf = nan`` into the
backward pass.

Every loss reduces its per-token terms with :func:`aggregate`, so the policy
loss, the value loss and the entropy bonus share one aggregation mode.

The policy loss is an extension point: ``algorithm.policy_loss`` names a
:class:`PolicyLoss` in :data:`POLICY_LOSSES` (``ppo``, turnrl's clipped
surrogate) or ``my_package.losses:my_loss`` in a user's package. It gets the
micro-batch's tensors (:class:`PolicyLossInputs`) and the algorithm's settings
(:class:`PolicyLossSettings`); the trainer adds the entropy bonus and the KL
term, and accumulates gradients over micro-batches as the aggregation mode
says (which is why the aggregation modes are a fixed list, not registered).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, Protocol

import torch

from turnrl.registry import Registry, check_callable

__all__ = [
    "AGGREGATIONS",
    "POLICY_LOSSES",
    "Aggregation",
    "KLKind",
    "PolicyLoss",
    "PolicyLossInputs",
    "PolicyLossSettings",
    "PolicyLossStats",
    "ValueLossStats",
    "aggregate",
    "as_policy_loss",
    "entropy_bonus",
    "kl_in_reward",
    "kl_penalty",
    "ppo_loss",
    "ppo_policy_loss",
    "value_loss",
]

Aggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]
KLKind = Literal["k1", "k2", "k3"]
AGGREGATIONS: tuple[str, ...] = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")


def _as_bool(mask: torch.Tensor) -> torch.Tensor:
    return mask if mask.dtype == torch.bool else mask != 0


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, mode: Aggregation = "token-mean") -> torch.Tensor:
    """Reduce per-token terms to a scalar over the masked tokens.

    - ``token-mean``: ``sum_{b,i} m x / sum_{b,i} m`` (every token weighs the same).
    - ``seq-mean-token-mean``: mean over sequences of each sequence's token mean
      (every sequence weighs the same).
    - ``seq-mean-token-sum``: mean over sequences of each sequence's token sum
      (longer sequences weigh more; no length bias towards short answers).

    Sequences without masked tokens are left out of the sequence means; an
    empty mask gives 0, never NaN.

    Args:
        per_token: Shape (b, s). mask: Shape (b, s), bool or 0/1.

    Returns:
        A scalar tensor.
    """
    m = _as_bool(mask)
    x = torch.where(m, per_token, 0)
    if mode == "token-mean":
        return x.sum() / m.sum().clamp(min=1)
    if mode not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {mode!r}")
    n_tokens = m.sum(-1)
    per_seq = x.sum(-1)
    if mode == "seq-mean-token-mean":
        per_seq = per_seq / n_tokens.clamp(min=1)
    has_tokens = n_tokens > 0
    return torch.where(has_tokens, per_seq, 0).sum() / has_tokens.sum().clamp(min=1)


def _masked(mask: torch.Tensor, *tensors: torch.Tensor) -> list[torch.Tensor]:
    """Each tensor with zeros outside ``mask`` (inputs cleaned before any arithmetic)."""
    m = _as_bool(mask)
    return [torch.where(m, x, torch.zeros((), dtype=x.dtype, device=x.device)) for x in tensors]


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return aggregate(x.to(torch.float32), mask, "token-mean")


class PolicyLossStats(NamedTuple):
    """Diagnostics of one policy-loss call: detached scalars, token means over the loss mask."""

    clip_frac: torch.Tensor  # share of tokens where the clipped term won (the ratio left its range)
    approx_kl: torch.Tensor  # KL(old || new) estimate: mean of (r - 1) - log r, r = new/old prob
    dual_clip_frac: torch.Tensor  # share of tokens where the dual clip bounded the loss


def ppo_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    dual_clip: float | None = 3.0,
    aggregation: Aggregation = "token-mean",
    sample_weights: torch.Tensor | None = None,
    ratio_level: str = "token",
    token_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, PolicyLossStats]:
    """Clipped PPO surrogate with asymmetric clipping and dual clip (token ratios, or GSPO's sequence ratio).

    With ``r = exp(logprobs - old_logprobs)`` (log-ratio clamped to [-20, 20] so
    that a stale sample cannot overflow) and advantage ``A``::

        L = max(-A * r, -A * clip(r, 1 - clip_low, 1 + clip_high))
        L = min(L, -A * dual_clip)      where A < 0 (dual clip, Ye et al. 2020)

    The dual clip bounds the loss of a negative-advantage token whose ratio
    has grown large; it needs ``dual_clip > 1``. Defaults are RAGEN's (clip
    0.2 low / 0.28 high, the DAPO "clip-higher" that keeps exploration alive,
    dual clip 3).

    Args:
        logprobs: Shape (b, s), current policy, with gradient.
        old_logprobs: Shape (b, s), the policy that sampled (no gradient needed).
        advantages: Shape (b, s).
        loss_mask: Shape (b, s), bool or 0/1: tokens that are trained.
        aggregation: see :func:`aggregate`.
        sample_weights: Shape (b,), each sample's per-token losses are
            multiplied by its weight before aggregation; None weighs all 1.
        ratio_level: ``token`` (PPO) or ``sequence`` (GSPO): every token of a sample takes the
            sample's length-normalized ratio ``exp(mean_t(logprobs - old_logprobs))``, with the gradient
            of its own log-prob (GSPO-token: ``sg[s] * p / sg[p]``, the same gradient as GSPO's
            sequence objective under token-mean aggregation within a sample).
        token_weights: Shape (b, s), no gradient: each token's loss is multiplied by it (truncated
            importance weights between the sampler and the trainer, :func:`truncated_importance_weights`).

    Returns:
        ``(loss, stats)``: a scalar to minimize and :class:`PolicyLossStats`.
    """
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (or None), got {dual_clip}")
    if ratio_level not in ("token", "sequence"):
        raise ValueError(f"ratio_level must be token or sequence, got {ratio_level!r}")
    logprobs, old_logprobs, advantages = _masked(loss_mask, logprobs, old_logprobs, advantages)
    log_ratio = logprobs - old_logprobs
    if ratio_level == "sequence":
        keep = _as_bool(loss_mask)
        sequence = (log_ratio * keep).sum(1, keepdim=True) / keep.sum(1, keepdim=True).clamp(min=1)
        log_ratio = torch.where(keep, sequence.detach() + logprobs - logprobs.detach(), 0.0)
    log_ratio = log_ratio.clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    dual_active = torch.zeros_like(loss, dtype=torch.bool)
    if dual_clip is not None:
        bound = -advantages * dual_clip
        dual_active = (advantages < 0) & (loss > bound)
        loss = torch.where(dual_active, bound, loss)
    with torch.no_grad():
        stats = PolicyLossStats(
            clip_frac=_masked_mean(clipped > unclipped, loss_mask),
            approx_kl=_masked_mean(ratio - 1.0 - log_ratio, loss_mask),
            dual_clip_frac=_masked_mean(dual_active, loss_mask),
        )
    if sample_weights is not None:
        loss = loss * sample_weights[:, None].to(loss.dtype)
    if token_weights is not None:
        loss = loss * _masked(loss_mask, token_weights.detach())[0].to(loss.dtype)
    return aggregate(loss, loss_mask, aggregation), stats


@dataclass(frozen=True)
class PolicyLossInputs:
    """One micro-batch's tensors, as a :class:`PolicyLoss` reads them."""

    logprobs: torch.Tensor
    """Shape (b, s): the current policy's log-probs of the sampled tokens, with gradient."""
    old_logprobs: torch.Tensor
    """Shape (b, s): the log-probs of the policy that sampled (``algorithm.old_logprobs``), no gradient."""
    advantages: torch.Tensor
    """Shape (b, s): the estimator's advantages."""
    loss_mask: torch.Tensor
    """Shape (b, s), bool or 0/1: the tokens that are trained."""
    sample_weights: torch.Tensor | None = None
    """Shape (b,): each sample's weight in the loss (turn samples weighed as episodes); None: all 1."""
    token_weights: torch.Tensor | None = None
    """Shape (b, s), no gradient: truncated importance weights (``algorithm.tis_cap``); None: all 1."""


@dataclass(frozen=True)
class PolicyLossSettings:
    """The algorithm's settings that a policy loss may read (``algorithm.*``)."""

    clip_low: float = 0.2
    """Ratio clip below 1."""
    clip_high: float = 0.28
    """Ratio clip above 1."""
    dual_clip: float | None = 3.0
    """Dual-clip bound for negative advantages; None disables."""
    aggregation: Aggregation = "token-mean"
    """How per-token terms reduce to the loss (:func:`aggregate`); the trainer's gradient accumulation assumes it."""
    ratio_level: str = "token"
    """``token`` (PPO) or ``sequence`` (GSPO)."""


class PolicyLoss(Protocol):
    """A policy loss: a scalar to minimize for one micro-batch, and its diagnostics (logged under ``actor/``)."""

    def __call__(
        self, inputs: PolicyLossInputs, settings: PolicyLossSettings, /
    ) -> tuple[torch.Tensor, PolicyLossStats]: ...


def as_policy_loss(obj: Any) -> PolicyLoss:
    """What ``algorithm.policy_loss=module:attr`` names, checked to be a :class:`PolicyLoss`.

    Raises:
        TypeError: a class, or a function that cannot take ``(inputs, settings)``, saying what is expected.
    """
    check_callable(obj, PolicyLoss, "a policy loss")
    return obj


POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss", coerce=as_policy_loss)
"""Every policy loss by name; ``algorithm.policy_loss`` takes a name or ``module:attr``."""


@POLICY_LOSSES.register("ppo")
def ppo_loss(inputs: PolicyLossInputs, settings: PolicyLossSettings) -> tuple[torch.Tensor, PolicyLossStats]:
    """The clipped surrogate (:func:`ppo_policy_loss`) with the algorithm's clip, dual clip, aggregation and ratio
    level (``sequence``: GSPO)."""
    return ppo_policy_loss(
        inputs.logprobs, inputs.old_logprobs, inputs.advantages, inputs.loss_mask, clip_low=settings.clip_low,
        clip_high=settings.clip_high, dual_clip=settings.dual_clip, aggregation=settings.aggregation,
        sample_weights=inputs.sample_weights, ratio_level=settings.ratio_level, token_weights=inputs.token_weights,
    )


def truncated_importance_weights(
    trainer_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, loss_mask: torch.Tensor, cap: float
) -> torch.Tensor:
    """Truncated importance weights ``min(exp(trainer - sampler), cap)`` of each sampled token.

    The sampler (a generation engine, another precision) and the trainer compute slightly different
    probabilities for the same tokens; weighting each token's loss by their ratio, capped, corrects the
    policy gradient for sampling from the sampler's distribution (truncated IS, as in Yao et al. 2025).

    Args:
        trainer_logprobs, sampler_logprobs: Shape (b, s). loss_mask: Shape (b, s).
        cap: the largest weight (> 0).

    Returns:
        Shape (b, s), no gradient; 1 off the mask.
    """
    if cap <= 0:
        raise ValueError(f"the importance-weight cap must be positive, got {cap}")
    trainer_logprobs, sampler_logprobs = _masked(loss_mask, trainer_logprobs.detach(), sampler_logprobs)
    weights = torch.exp((trainer_logprobs - sampler_logprobs).clamp(max=20.0)).clamp(max=cap)
    return torch.where(_as_bool(loss_mask), weights, 1.0)


class ValueLossStats(NamedTuple):
    """Diagnostics of one value-loss call: detached scalars, token means over the loss mask."""

    clip_frac: torch.Tensor  # share of tokens where the clipped error was the larger
    error: torch.Tensor  # mean squared error of the unclipped prediction


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    loss_mask: torch.Tensor,
    clip: float | None = 0.5,
    aggregation: Aggregation = "token-mean",
) -> tuple[torch.Tensor, ValueLossStats]:
    """Clipped value loss (PPO2 style)::

        v_clip = old + clip(values - old, -clip, clip)
        L      = 0.5 * max((values - R)^2, (v_clip - R)^2)

    With ``clip=None``, ``L = 0.5 * (values - R)^2``.

    Args:
        values: Shape (b, s), current critic, with gradient.
        old_values: Shape (b, s), the critic when the returns were computed.
        returns: Shape (b, s), targets ``R`` (from the advantage estimator).
        loss_mask: Shape (b, s), bool or 0/1.

    Returns:
        ``(loss, stats)``: a scalar and :class:`ValueLossStats`.
    """
    values, old_values, returns = _masked(loss_mask, values, old_values, returns)
    err = (values - returns) ** 2
    loss = err
    clip_active = torch.zeros_like(err, dtype=torch.bool)
    if clip is not None:
        v_clip = old_values + (values - old_values).clamp(-clip, clip)
        err_clip = (v_clip - returns) ** 2
        # Within the range v_clip is the prediction itself, but ``old + (values - old)`` rounds: compared as
        # floats, a random share of unclipped tokens would count as clipped (and move the loss by an ulp).
        clip_active = ((values - old_values).abs() > clip) & (err_clip > err)
        loss = torch.where(clip_active, err_clip, err)
    with torch.no_grad():
        stats = ValueLossStats(_masked_mean(clip_active, loss_mask), _masked_mean(err, loss_mask))
    return aggregate(0.5 * loss, loss_mask, aggregation), stats


def kl_penalty(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    kind: KLKind = "k3",
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from sampled tokens.

    With ``d = logprobs - ref_logprobs`` (samples from the policy):

    - ``k1 = d``: unbiased, can be negative, high variance.
    - ``k2 = d^2 / 2``: biased, low variance; its gradient is the true KL's.
    - ``k3 = exp(-d) + d - 1``: unbiased, never negative (Schulman's "k3", the
      GRPO KL loss). ``-d`` is clamped to [-20, 20] before the ``exp`` and the
      result to [-10, 10], as veRL does, so one extreme token cannot blow up a
      step.

    Args:
        logprobs, ref_logprobs: Shape (b, s).
        mask: Shape (b, s), bool or 0/1: where given, the KL is 0 outside it and
            nothing there reaches the gradient.

    Returns:
        Shape (b, s), differentiable. Reduce it with :func:`aggregate` for a
        loss term, or subtract it from the rewards with :func:`kl_in_reward`.
    """
    if mask is not None:
        logprobs, ref_logprobs = _masked(mask, logprobs, ref_logprobs)
    d = logprobs - ref_logprobs
    if kind == "k1":
        return d
    if kind == "k2":
        return 0.5 * d * d
    if kind == "k3":
        neg = (-d).clamp(-20.0, 20.0)
        return (torch.exp(neg) - neg - 1.0).clamp(-10.0, 10.0)
    raise ValueError(f"kind must be 'k1', 'k2' or 'k3', got {kind!r}")


def kl_in_reward(
    token_rewards: torch.Tensor, kl: torch.Tensor, coef: float, loss_mask: torch.Tensor
) -> torch.Tensor:
    """Fold a KL penalty into the rewards: ``r_i - coef * kl_i`` on masked tokens.

    The KL is detached (a reward carries no gradient). Feed the result to an
    advantage estimator; the bi-level and turn estimators keep these per-token
    terms inside their turns (see their docs).

    Args:
        token_rewards, kl: Shape (b, s). loss_mask: Shape (b, s), bool or 0/1.

    Returns:
        Shape (b, s).
    """
    return token_rewards - torch.where(_as_bool(loss_mask), coef * kl.detach(), 0)


def entropy_bonus(
    entropy: torch.Tensor, loss_mask: torch.Tensor, aggregation: Aggregation = "token-mean"
) -> torch.Tensor:
    """Mean policy entropy over the trained tokens, with the loss's aggregation.

    A trainer maximizes it: ``loss = policy_loss - entropy_coef * entropy_bonus(...)``
    (RAGEN's default coefficient is 0.001).

    Args:
        entropy: Shape (b, s), e.g. from :func:`turnrl.training.model_passes.token_logprobs`.
        loss_mask: Shape (b, s), bool or 0/1.
    """
    return aggregate(entropy, loss_mask, aggregation)

"""Collapse diagnostics (RAGEN's collapse detection) and the early-stop rules that watch a run.

RAGEN tells two ways an agent's reasoning collapses apart:

- *entropy collapse*: for a given input the model always writes the same reasoning, a low
  conditional entropy ``H(Z|X)``;
- *template collapse*: the reasoning no longer depends on the input, a mutual information
  ``I(X;Z)`` near 0 and a retrieval accuracy near chance.

Both are read off one matrix, the *cross log-probs* ``cross[i, j] = log p(z_i | x_j)``: the
reasoning ``z_i`` of pair ``i`` scored by the policy after prompt ``x_j`` (teacher forcing), for every
pair ``i`` and every prompt ``j`` of the sample. The prompts are weighed uniformly (the batch's
empirical distribution), so with ``c`` prompts

    matched_i  = cross[i, col(i)]                               log p(z_i | x_i)
    marginal_i = log (1/c) sum_j exp cross[i, j]                log p_mix(z_i)
    I(X;Z)     ~ mean_i (matched_i - marginal_i)                mutual information, at most log c
    H(Z|X)     ~ -mean_i matched_i                              conditional entropy
    H(Z)       ~ -mean_i marginal_i                             reasoning entropy
    accuracy   = mean_i [argmax_j cross[i, j] = col(i)]         retrieval accuracy, chance 1/c

``col(i)`` is the column of pair ``i``'s own prompt. Each quantity comes per token (``cross`` holds the
mean log-prob of z's tokens) and per sequence (their sum). These are Monte Carlo estimates: the MI
can dip a little below 0 when the true value is near 0.

The early-stop rules (:class:`SpreadCollapse`, :class:`Streak`) are small state machines over one
number a step: RAGEN's reward-variance collapse, validation success under 1% and steps whose filter
kept nothing.

Notation: n pairs (rows), c prompts (columns).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

__all__ = [
    "RETRIEVAL_KS",
    "SpreadCollapse",
    "Streak",
    "ema",
    "information_metrics",
    "matched_and_marginal",
    "retrieval_metrics",
    "zscore_metrics",
]

RETRIEVAL_KS: tuple[int, ...] = (2, 4, 8)
"""The top-k retrieval accuracies reported besides top-1 (RAGEN's)."""


def _check(cross: torch.Tensor, columns: torch.Tensor) -> None:
    if cross.dim() != 2 or cross.shape[0] == 0 or cross.shape[1] == 0:
        raise ValueError(f"cross log-probs must be a non-empty (n, c) matrix, got shape {tuple(cross.shape)}")
    if columns.shape != (cross.shape[0],):
        raise ValueError(f"columns must have shape ({cross.shape[0]},), got {tuple(columns.shape)}")
    if bool((columns < 0).any()) or bool((columns >= cross.shape[1]).any()):
        raise ValueError(f"columns must index the {cross.shape[1]} prompts")


def matched_and_marginal(cross: torch.Tensor, columns: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each pair's log-prob under its own prompt and under the uniform mixture of all prompts.

    Args:
        cross: Shape (n, c), ``log p(z_i | x_j)``.
        columns: Shape (n,), long: the column of each pair's own prompt.

    Returns:
        ``matched`` Shape (n,): ``cross[i, columns[i]]``; ``marginal`` Shape (n,):
        ``logsumexp_j cross[i, j] - log c``. Both float64.
    """
    _check(cross, columns)
    cross = cross.to(torch.float64)
    rows = torch.arange(cross.shape[0], device=cross.device)
    matched = cross[rows, columns.to(cross.device)]
    marginal = torch.logsumexp(cross, dim=1) - math.log(cross.shape[1])
    return matched, marginal


def information_metrics(cross: torch.Tensor, columns: torch.Tensor) -> dict[str, float]:
    """Mutual information, conditional and reasoning entropy of one cross log-prob matrix.

    Args:
        cross: Shape (n, c). columns: Shape (n,), as in :func:`matched_and_marginal`.

    Returns:
        ``mi`` (mean of matched minus marginal), ``mi_upper_bound`` (log c), ``conditional_entropy``
        (``-mean(matched)``), ``reasoning_entropy`` (``-mean(marginal)``), ``matched_logprob`` and
        ``marginal_logprob`` (the two means).
    """
    matched, marginal = matched_and_marginal(cross, columns)
    matched_mean, marginal_mean = float(matched.mean()), float(marginal.mean())
    return {
        "mi": matched_mean - marginal_mean,
        "mi_upper_bound": math.log(cross.shape[1]),
        "conditional_entropy": -matched_mean,
        "reasoning_entropy": -marginal_mean,
        "matched_logprob": matched_mean,
        "marginal_logprob": marginal_mean,
    }


def retrieval_metrics(
    cross: torch.Tensor, columns: torch.Tensor, classes: torch.Tensor | None = None, ks: Sequence[int] = RETRIEVAL_KS
) -> dict[str, float]:
    """How often a pair's own prompt is the one that makes its reasoning likeliest, against chance.

    Columns of the same class (identical prompts) are one answer: ranking any of them first counts as
    correct, and chance is the share of columns of the pair's class. Top-k looks at the k best columns
    (k capped at min(8, c), as RAGEN does); its chance is ``min(1, k * chance)``. Ties rank the lower
    column first.

    Args:
        cross: Shape (n, c). columns: Shape (n,), long.
        classes: Shape (c,), long: equal ids for identical prompts; None: every column its own.
        ks: the top-k accuracies to report besides top-1.

    Returns:
        ``retrieval_acc``, ``retrieval_chance``, ``retrieval_above_chance`` and, for each k,
        ``retrieval_acc@k``, ``retrieval_chance@k``, ``retrieval_above_chance@k``.
    """
    _check(cross, columns)
    n, c = cross.shape
    classes = torch.arange(c) if classes is None else classes.to(torch.long).cpu()
    if classes.shape != (c,):
        raise ValueError(f"classes must have shape ({c},), got {tuple(classes.shape)}")
    columns = columns.to(torch.long).cpu()
    cross = cross.to(torch.float64).cpu()
    # A stable descending sort ranks the lower column first among equal log-probs.
    ranked = classes[torch.sort(cross, dim=1, descending=True, stable=True).indices]  # (n, c): classes, best first
    own = classes[columns]  # (n,)
    class_size = torch.bincount(classes)[own].to(torch.float64)  # (n,): columns holding the pair's prompt
    chance = float((class_size / c).mean())
    accuracy = float((ranked[:, 0] == own).to(torch.float64).mean())
    metrics = {"retrieval_acc": accuracy, "retrieval_chance": chance, "retrieval_above_chance": accuracy - chance}
    k_max = min(max(ks, default=1), c)
    for k in ks:
        k_eff = min(k, k_max)
        hit = float((ranked[:, :k_eff] == own[:, None]).any(dim=1).to(torch.float64).mean())
        chance_k = min(1.0, chance * k_eff)
        metrics[f"retrieval_acc@{k}"] = hit
        metrics[f"retrieval_chance@{k}"] = chance_k
        metrics[f"retrieval_above_chance@{k}"] = hit - chance_k
    return metrics


def ema(previous: float | None, current: float, decay: float) -> float:
    """An exponential moving average's next value: ``decay * previous + (1 - decay) * current``; the first
    value (``previous`` None) is ``current``."""
    return current if previous is None else decay * previous + (1.0 - decay) * current


def zscore_metrics(
    cross: torch.Tensor, columns: torch.Tensor, eps: float, previous_ema_std: float | None = None,
    ema_decay: float = 0.9,
) -> dict[str, float]:
    """The MI in units of the marginal log-prob's spread, which drifts during training.

    ``marginal_std`` is the population std (divided by n) of the marginals; ``mi_zscore`` is
    ``mean((matched - marginal) / (marginal_std + eps))``. ``marginal_std_ema`` is the moving average of
    ``marginal_std`` *with this measurement in it* (:func:`ema` of ``previous_ema_std``, the average
    before it, None at the first), and ``mi_zscore_ema`` is ``mi_zscore`` over ``marginal_std_ema + eps``:
    RAGEN's ``CollapseDetector`` updates the average, then divides by it.

    Args:
        cross: Shape (n, c). columns: Shape (n,). eps: keeps the division finite.
    """
    matched, marginal = matched_and_marginal(cross, columns)
    gap = matched - marginal
    std = float(marginal.std(correction=0))
    ema_std = ema(previous_ema_std, std, ema_decay)
    return {
        "marginal_std": std,
        "mi_zscore": float((gap / (std + eps)).mean()),
        "marginal_std_ema": ema_std,
        "mi_zscore_ema": float((gap / (ema_std + eps)).mean()),
    }


# --------------------------------------------------------------------------- early-stop rules
@dataclass
class SpreadCollapse:
    """RAGEN's reward-variance early stop: the mean of the first ``baseline_steps`` values is the baseline;
    after it, the rule fires once the last ``window`` values all lie below ``ratio`` times the baseline.

    RAGEN feeds it the mean in-group reward std of each step that trained (10, 10, 0.1). A zero baseline
    never fires (nothing lies below 0).
    """

    baseline_steps: int = 10
    window: int = 10
    ratio: float = 0.1
    first: list[float] = field(default_factory=list)
    """The values the baseline is the mean of (up to ``baseline_steps``)."""
    recent: list[float] = field(default_factory=list)
    """The last ``window`` values after the baseline, oldest first."""

    @property
    def baseline(self) -> float | None:
        return sum(self.first) / len(self.first) if len(self.first) == self.baseline_steps else None

    @property
    def threshold(self) -> float | None:
        """The value every one of the last ``window`` values must lie below (None before the baseline)."""
        baseline = self.baseline
        return None if baseline is None else self.ratio * baseline

    def observe(self, value: float) -> bool:
        """Record one step's value; True when the rule fires."""
        if len(self.first) < self.baseline_steps:
            self.first.append(float(value))
            return False
        self.recent = [*self.recent, float(value)][-self.window :]
        threshold = self.threshold
        assert threshold is not None
        return len(self.recent) == self.window and all(v < threshold for v in self.recent)


@dataclass
class Streak:
    """Fires when ``limit`` observations in a row were hits (``limit`` 0 never fires); a miss resets it."""

    limit: int
    count: int = 0

    def observe(self, hit: bool) -> bool:
        self.count = self.count + 1 if hit else 0
        return self.limit > 0 and self.count >= self.limit

"""Learning-rate factors by step: a linear warm-up, then constant or a cosine decay to a floor; and a scale that
follows each update's KL (rsl_rl's adaptive schedule), written here because torch's schedulers read no metric
but the loss (``ReduceLROnPlateau``)."""

from __future__ import annotations

import math

SCHEDULES = ("constant", "cosine")


def lr_factor(step: int, warmup: int, total: int, schedule: str, floor: float) -> float:
    """The learning rate's multiplier at optimizer step ``step`` (from 0).

    ``(step + 1) / warmup`` during the first ``warmup`` steps; then 1 (``constant``), or a half cosine from 1 at
    step ``warmup`` down to ``floor`` at step ``total`` and after (``cosine``).
    """
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def kl_adaptive_scale(scale: float, kl: float, target: float, low: float, high: float) -> float:
    """The learning rate's scale after an update whose approx KL was ``kl``: ``scale / 1.5`` when ``kl`` exceeded
    ``2 * target``, ``scale * 1.5`` when it was above 0 and under ``target / 2``, else ``scale``; kept within
    ``[low, high]`` (rsl_rl's ``schedule: adaptive``, on a scale of the rate rather than the rate itself)."""
    if kl > 2 * target:
        return max(scale / 1.5, low)
    if 0 < kl < target / 2:
        return min(scale * 1.5, high)
    return scale

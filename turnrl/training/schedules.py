"""Learning-rate factors by step: a linear warm-up, then constant or a cosine decay to a floor."""

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

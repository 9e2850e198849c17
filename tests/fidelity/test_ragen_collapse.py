"""RAGEN's z-scored mutual information over a moving average of the marginal std.

Encodes mll-lab-nu/RAGEN at commit 20daedc47558e000f7de912b060646bf2e8026bd,
``ragen/trainer/collapse_metrics.py``: ``CollapseDetector`` computes ``ema_std = self._update_ema_std(key,
marginal_std)`` (the first value is the std itself, later ones ``decay * ema + (1 - decay) * std``) and only then
``mi_zscore_ema = ((matched - marginal) / (ema_std + std_eps)).mean()``: the average includes this measurement.
"""

from __future__ import annotations

import math

import pytest
import torch

from turnrl.algorithms.collapse import zscore_metrics

EPS, DECAY = 1e-6, 0.9


def plain_measurement(cross: list[list[float]], ema_before: float | None) -> tuple[float, float]:
    """(mi_zscore_ema, ema after) of one measurement, each reasoning's own prompt in its own column."""
    n = len(cross)
    matched = [cross[i][i] for i in range(n)]
    marginal = [math.log(sum(math.exp(x) for x in row) / len(row)) for row in cross]
    mean = sum(marginal) / n
    std = math.sqrt(sum((m - mean) ** 2 for m in marginal) / n)
    ema_after = std if ema_before is None else DECAY * ema_before + (1 - DECAY) * std
    return sum(a - b for a, b in zip(matched, marginal)) / n / (ema_after + EPS), ema_after


def test_the_moving_average_includes_this_measurement():
    generator = torch.Generator().manual_seed(0)
    ema_before: float | None = None
    for scale in (1.0, 3.0, 0.5):  # the spread changes, so before and after differ
        cross = (torch.randn(4, 4, generator=generator, dtype=torch.float64) * scale).tolist()
        expected, ema_after = plain_measurement(cross, ema_before)
        found = zscore_metrics(torch.tensor(cross, dtype=torch.float64), torch.arange(4), EPS, ema_before, DECAY)
        assert found["mi_zscore_ema"] == pytest.approx(expected, rel=1e-9)
        assert found["marginal_std_ema"] == pytest.approx(ema_after, rel=1e-12)
        ema_before = ema_after

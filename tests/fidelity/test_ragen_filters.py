"""RAGEN's rollout filter (StarPO-S), against hand-computed selections.

Encodes mll-lab-nu/RAGEN at commit 20daedc47558e000f7de912b060646bf2e8026bd,
``ragen/trainer/rollout_filter.py``: ``RolloutFilter._select_top_groups`` (linear top-p keeps groups while their
scores sum below ``value * scores.sum() - selection_eps`` with ``selection_eps = 0.01``, and none when that
threshold is met before the first group; top-k keeps ``int(value * num_groups)`` groups, at least 1).
"""

from __future__ import annotations

import torch

from turnrl.algorithms import select_groups

F64 = torch.float64


def top_p(scores: list[float], p: float):
    return select_groups(torch.arange(len(scores)), scores=torch.tensor(scores, dtype=F64),
                         rewards=torch.zeros(len(scores)), strategy="top_p", value=p)


def test_top_k_rounds_the_count_down():
    index = torch.arange(100).repeat_interleave(2)
    rewards = torch.rand(200, generator=torch.Generator().manual_seed(0), dtype=F64)
    assert len(select_groups(index, rewards, strategy="top_k", value=0.29).kept_groups) == 28  # int(28.999...)
    assert len(select_groups(index[:6], rewards[:6], strategy="top_k", value=0.25).kept_groups) == 1  # at least 1


def test_top_p_stops_at_an_absolute_margin_under_p_times_the_sum():
    # Ranked 0.6, 0.5, 0.4 (sum 1.5); p = 0.405: threshold 0.6075 - 0.01 = 0.5975, met by the first group.
    # A share rule (0.6 / 1.5 = 0.4 < 0.405) would keep two.
    assert top_p([0.5, 0.6, 0.4], 0.405).kept_groups.tolist() == [1]
    assert top_p([0.5, 0.6, 0.4], 0.42).kept_groups.tolist() == [0, 1]  # threshold 0.62: 0.6 < 0.62


def test_top_p_keeps_none_when_every_group_spread_is_zero():
    index = torch.arange(4).repeat_interleave(3)
    selection = select_groups(index, torch.ones(12, dtype=F64), strategy="top_p", value=0.9)
    assert selection.kept_groups.tolist() == [] and selection.skip_step  # threshold -0.01 <= 0 at once
    assert top_p([0.004, 0.003], 0.5).kept_groups.tolist() == []  # a sum under the margin: also none
    assert top_p([0.0, 0.0], 1.0).kept_groups.tolist() == [0, 1]  # p = 1 keeps all (RAGEN returns early)

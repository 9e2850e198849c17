"""GiGPO against a plain loop over episodes and turns."""

from __future__ import annotations

import math
import statistics

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.algorithms.reference import ref_anchored_share
from turnrl.algorithms import anchored_share, gigpo_advantages


def reference(rewards, lengths, states, groups, gamma, step_weight, norm, eps=1e-6, episode_stats="episodes"):
    """Plain Python: lists of per-turn rewards and states for each episode. ``episode_stats="turns"`` is
    verl-agent's episode_norm_reward over its step samples: one score per turn, the episode's total."""
    def normalized(value, values):
        if len(values) < 2:
            return 0.0
        deviation = value - statistics.fmean(values)
        return deviation / (statistics.stdev(values) + eps) if norm else deviation

    totals = [sum(rewards[i][: lengths[i]]) for i in range(len(rewards))]
    copies = lengths if episode_stats == "turns" else [1] * len(totals)  # entries of each episode in its group
    episode = [normalized(totals[i], [totals[j] for j in range(len(totals)) if groups[j] == groups[i]
                                      for _ in range(copies[j])])
               for i in range(len(totals))]
    returns = []
    for i, row in enumerate(rewards):
        out, running = [0.0] * len(row), 0.0
        for t in range(lengths[i] - 1, -1, -1):
            running = row[t] + gamma * running
            out[t] = running
        returns.append(out)
    advantages = []
    for i in range(len(rewards)):
        row = []
        for t in range(len(rewards[i])):
            if t >= lengths[i]:
                row.append(0.0)
                continue
            step = 0.0
            if states[i][t] >= 0:
                anchor = [returns[j][u] for j in range(len(rewards)) for u in range(lengths[j])
                          if groups[j] == groups[i] and states[j][u] == states[i][t]]
                step = normalized(returns[i][t], anchor)
            row.append(episode[i] + step_weight * step)
        advantages.append(row)
    return advantages


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), e=st.integers(1, 12), turns=st.integers(1, 5), n_groups=st.integers(1, 3),
       n_states=st.integers(1, 4), norm=st.booleans(), gamma=st.sampled_from([1.0, 0.95, 0.5]),
       episode_stats=st.sampled_from(["episodes", "turns"]))
def test_matches_a_plain_loop(seed, e, turns, n_groups, n_states, norm, gamma, episode_stats):
    generator = torch.Generator().manual_seed(seed)
    rewards = torch.randint(-2, 3, (e, turns), generator=generator).double() / 2
    lengths = torch.randint(1, turns + 1, (e,), generator=generator)
    valid = torch.arange(turns)[None, :] < lengths[:, None]
    states = torch.randint(-1, n_states, (e, turns), generator=generator)
    groups = torch.randint(0, n_groups, (e,), generator=generator)
    got, _ = gigpo_advantages(rewards, valid, states, groups, gamma=gamma, step_weight=0.7, norm_by_std=norm,
                              episode_stats=episode_stats)
    want = reference(rewards.tolist(), lengths.tolist(), states.tolist(), groups.tolist(), gamma, 0.7, norm,
                     episode_stats=episode_stats)
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), atol=1e-9, rtol=1e-9)


def test_a_worked_example():
    # One group of two episodes that both start in state 0; episode 0 reaches the goal from state 1 at
    # its second turn, episode 1 wanders from state 0 back to state 0 and fails.
    rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0]], dtype=torch.float64)
    valid = torch.ones(2, 2, dtype=torch.bool)
    states = torch.tensor([[0, 1], [0, 0]])
    got, step = gigpo_advantages(rewards, valid, states, torch.zeros(2, dtype=torch.long), gamma=0.5,
                                 norm_by_std=False)
    # Episode advantages: totals 1 and 0, mean 0.5 -> +0.5, -0.5.
    # State 0 holds turns (0,0) return 0.5, (1,0) return 0 and (1,1) return 0: mean 1/6.
    # State 1 holds only (0,1): a singleton, step advantage 0.
    torch.testing.assert_close(step, torch.tensor([[0.5 - 1 / 6, 0.0], [-1 / 6, -1 / 6]], dtype=torch.float64))
    torch.testing.assert_close(got, torch.tensor([[0.5 + 1 / 3, 0.5], [-0.5 - 1 / 6, -0.5 - 1 / 6]],
                                                 dtype=torch.float64))


def test_equal_returns_in_an_anchor_give_exactly_zero_and_padding_stays_zero():
    rewards = torch.full((4, 3), 10.1, dtype=torch.float32)
    valid = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    states = torch.zeros(4, 3, dtype=torch.long)
    rewards[~valid] = math.nan  # nothing outside the turns may leak in
    got, step = gigpo_advantages(rewards, valid, states, torch.zeros(4, dtype=torch.long), gamma=1.0)
    assert torch.isfinite(got).all() and bool((got[~valid] == 0).all()) and bool((step[~valid] == 0).all())


def test_verl_agents_episode_statistics_weigh_each_episode_by_its_turns():
    # A group of two: a 1-turn success (total 10) and a 4-turn failure (total 0). Over episodes the mean is 5;
    # verl-agent trains on the 5 turns, each holding its episode's total, so its mean is 10 / 5 = 2.
    rewards = torch.tensor([[10.0, 0, 0, 0], [0, 0, 0, 0]], dtype=torch.float64)
    valid = torch.tensor([[1, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    states = torch.full((2, 4), -1)  # no anchors: the episode advantage alone
    groups = torch.zeros(2, dtype=torch.long)
    by_episode, _ = gigpo_advantages(rewards, valid, states, groups, norm_by_std=False)
    by_turn, _ = gigpo_advantages(rewards, valid, states, groups, norm_by_std=False, episode_stats="turns")
    torch.testing.assert_close(by_episode, torch.tensor([[5.0, 0, 0, 0], [-5.0] * 4], dtype=torch.float64))
    torch.testing.assert_close(by_turn, torch.tensor([[8.0, 0, 0, 0], [-2.0] * 4], dtype=torch.float64))
    scores = torch.tensor([10.0, 0, 0, 0, 0], dtype=torch.float64)  # the std over the five turns, unbiased
    normed, _ = gigpo_advantages(rewards, valid, states, groups, norm_by_std=True, episode_stats="turns")
    torch.testing.assert_close(normed[0, 0], (10.0 - 2.0) / (scores.std() + 1e-6))
    with pytest.raises(ValueError, match="episode_stats"):
        gigpo_advantages(rewards, valid, states, groups, episode_stats="steps")  # type: ignore[arg-type]


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), e=st.integers(1, 10), turns=st.integers(1, 5), n_groups=st.integers(1, 3),
       n_states=st.integers(1, 4))
def test_anchored_share_matches_a_plain_count(seed, e, turns, n_groups, n_states):
    """Unknown and padding turns (-1) left out, a group of one episode, every turn unknown (0)."""
    generator = torch.Generator().manual_seed(seed)
    states = torch.randint(-1, n_states, (e, turns), generator=generator)
    groups = torch.randint(0, n_groups, (e,), generator=generator)
    assert anchored_share(states, groups) == pytest.approx(ref_anchored_share(states, groups), rel=1e-6)  # float32
    assert anchored_share(torch.full((e, turns), -1), groups) == 0.0

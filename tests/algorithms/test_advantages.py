"""Advantage estimators: hand-computed cases, edge cases, and random batches
against the plain loop references in reference.py."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.algorithms import reference as ref
from turnrl.algorithms import (
    bilevel_gae,
    broadcast_to_tokens,
    discounted_reverse_cumsum,
    group_stats,
    grpo_advantages,
    masked_gae,
    place_rewards,
    reinforce_pp_advantages,
    rloo_advantages,
    turn_gae,
    whiten,
)

F64 = torch.float64


def t(rows, dtype=F64):
    return torch.tensor(rows, dtype=dtype)


def close(actual, expected, tol=1e-9):
    torch.testing.assert_close(actual.to(F64), expected.to(F64), rtol=tol, atol=tol)


def random_batch(seed: int, b: int, s: int, p_mask: float = 0.7, p_end: float = 0.15, dtype=F64):
    """Rewards, values, an advantage mask with gaps (and some empty rows), turn ends."""
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.randn(b, s, generator=gen, dtype=dtype)
    values = torch.randn(b, s, generator=gen, dtype=dtype)
    mask = torch.rand(b, s, generator=gen) < p_mask
    if b > 2:
        mask[1] = False  # an empty row
    ends = torch.rand(b, s, generator=gen) < p_end
    return rewards, values, mask, ends


# --- the scan ---------------------------------------------------------------


def loop_scan(x, coef, seg_end):
    out = torch.zeros_like(x)
    for row in range(x.shape[0]):
        acc = 0.0
        for i in reversed(range(x.shape[1])):
            if seg_end is not None and seg_end[row, i]:
                acc = 0.0
            acc = x[row, i].item() + coef * acc
            out[row, i] = acc
    return out


@pytest.mark.parametrize("n", [1, 31, 32, 33, 97, 1100])
@pytest.mark.parametrize("coef", [0.0, 0.9, 1.0])
def test_scan_matches_loop_across_chunk_levels(n, coef):
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(3, n, generator=gen, dtype=F64)
    seg_end = torch.rand(3, n, generator=gen) < 0.05
    seg_end[2] = True  # every position ends a segment: y = x
    close(discounted_reverse_cumsum(x, coef), loop_scan(x, coef, None))
    close(discounted_reverse_cumsum(x, coef, seg_end), loop_scan(x, coef, seg_end))


def test_scan_float32_long_sum_stays_accurate():
    # gamma = lambda = 1 sums thousands of terms: the chunked sum stays close.
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 4096, generator=gen, dtype=F64)
    seg_end = torch.rand(2, 4096, generator=gen) < 0.01
    for seg in (None, seg_end):
        got = discounted_reverse_cumsum(x.float(), 1.0, seg)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.to(F64), loop_scan(x, 1.0, seg), rtol=0, atol=5e-4)


def test_scan_empty():
    assert discounted_reverse_cumsum(torch.zeros(3, 0), 0.9).shape == (3, 0)


# --- place_rewards ----------------------------------------------------------


def test_place_rewards_by_hand():
    turn_rewards = t([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    ends = torch.tensor([[1, 4, -1], [0, 2, 5], [-1, -1, -1]])
    per_turn = place_rewards(turn_rewards, ends, 6)
    close(per_turn, t([[0, 1, 0, 0, 2, 0], [4, 0, 5, 0, 0, 6], [0] * 6]))
    episode = place_rewards(turn_rewards, ends, 6, mode="episode_end")
    close(episode, t([[0, 0, 0, 0, 3, 0], [0, 0, 0, 0, 0, 15], [0] * 6]))
    close(place_rewards(turn_rewards.float(), ends.int(), 6), per_turn)  # int32 indices work too
    with pytest.raises(ValueError):
        place_rewards(turn_rewards, ends, 6, mode="nope")


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), b=st.integers(1, 5), n_turns=st.integers(1, 6), s=st.integers(6, 40))
def test_place_rewards_matches_reference(seed, b, n_turns, s):
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.randn(b, n_turns, generator=gen, dtype=F64)
    ends = torch.randint(-1, s, (b, n_turns), generator=gen)
    for mode in ("per_turn", "episode_end"):
        close(place_rewards(rewards, ends, s, mode), ref.ref_place_rewards(rewards, ends, s, mode))


# --- masked GAE -------------------------------------------------------------


def test_masked_gae_gamma_lambda_one_is_reward_to_go_minus_value():
    rewards = t([[0.0, 0.0, 1.0, 0.0, 2.0]])  # the 1.0 sits outside the mask: ignored
    values = t([[0.5, 0.2, 9.0, 0.1, 0.3]])
    mask = torch.tensor([[True, True, False, True, True]])
    adv, ret = masked_gae(rewards, values, mask, 1.0, 1.0)
    close(adv, t([[1.5, 1.8, 0.0, 1.9, 1.7]]))
    close(ret, t([[2.0, 2.0, 0.0, 2.0, 2.0]]))


def test_masked_gae_by_hand_skips_gaps():
    # gamma = 0.5: the gap at position 1 is skipped, V(next valid) is used.
    rewards = t([[0.0, 5.0, 0.0, 1.0]])
    values = t([[1.0, 100.0, 2.0, 3.0]])
    mask = torch.tensor([[1, 0, 1, 1]])
    adv, _ = masked_gae(rewards, values, mask, 0.5, 0.0)  # lambda 0: one-step TD errors
    close(adv, t([[0.5 * 2 - 1, 0.0, 0.5 * 3 - 2, 1.0 - 3]]))
    adv, _ = masked_gae(rewards, values, mask, 0.5, 1.0)
    d = [0.0, -0.5, -2.0]
    close(adv, t([[d[0] + 0.5 * (d[1] + 0.5 * d[2]), 0.0, d[1] + 0.5 * d[2], d[2]]]))


def test_masked_gae_edge_rows():
    rewards = t([[1.0, 2.0, 3.0], [1.0, 2.0, 3.0], [0.0, 0.0, 4.0]])
    values = t([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    mask = torch.tensor([[0, 0, 0], [0, 1, 0], [1, 1, 1]], dtype=torch.float32)  # 0/1 float mask
    adv, ret = masked_gae(rewards, values, mask, 0.9, 0.9)
    close(adv[0], t([0.0, 0.0, 0.0]))  # empty row
    close(adv[1], t([0.0, 1.0, 0.0]))  # one token: r - V, no bootstrap
    close(ret[1], t([0.0, 2.0, 0.0]))
    assert masked_gae(rewards, values, torch.zeros(3, 3), 0.9, 0.9)[0].abs().sum() == 0


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    b=st.integers(1, 6),
    s=st.integers(1, 90),
    gamma=st.sampled_from([1.0, 0.99, 0.7]),
    lam=st.sampled_from([1.0, 0.95, 0.0]),
)
def test_masked_gae_matches_reference(seed, b, s, gamma, lam):
    rewards, values, mask, _ = random_batch(seed, b, s)
    adv, ret = masked_gae(rewards, values, mask, gamma, lam)
    ref_adv, ref_ret = ref.ref_masked_gae(rewards, values, mask, gamma, lam)
    close(adv, ref_adv)
    close(ret, ref_ret)


def test_masked_gae_long_rows_and_float32():
    rewards, values, mask, _ = random_batch(3, 4, 2000, p_mask=0.6)
    ref_adv, ref_ret = ref.ref_masked_gae(rewards, values, mask, 0.99, 0.95)
    adv, ret = masked_gae(rewards, values, mask, 0.99, 0.95)
    close(adv, ref_adv)
    adv32, _ = masked_gae(rewards.float(), values.float(), mask, 0.99, 0.95)
    assert adv32.dtype == torch.float32
    torch.testing.assert_close(adv32.to(F64), ref_adv, rtol=1e-4, atol=1e-4)
    half, _ = masked_gae(rewards.bfloat16(), values.bfloat16(), mask, 0.99, 0.95)
    assert half.dtype == torch.float32  # half inputs are summed in float32


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    b=st.integers(1, 6),
    s=st.integers(1, 120),
    token=st.sampled_from([(1.0, 1.0), (0.99, 0.95), (0.7, 0.0), (0.0, 1.0)]),
    turn=st.sampled_from([(0.95, 1.0), (0.5, 0.9), (1.0, 0.0), (0.0, 0.5)]),
    p_end=st.sampled_from([0.02, 0.15, 0.6]),
)
def test_masked_gae_with_a_discount_across_turns_matches_reference(seed, b, s, token, turn, p_end):
    rewards, values, mask, ends = random_batch(seed, b, s, p_end=p_end)
    adv, ret = masked_gae(rewards, values, mask, *token, turn_end_mask=ends, gamma_turn=turn[0], lambda_turn=turn[1])
    ref_adv, ref_ret = ref.ref_masked_gae(rewards, values, mask, *token, ends, *turn)
    close(adv, ref_adv)
    close(ret, ref_ret)


def test_masked_gae_discounts_once_per_turn_whatever_the_response_lengths():
    # Two turns of 3 and 1 tokens, reward 1 at the end of the second; V = 0.
    # gamma 1 inside a turn, 0.5 across turns: every token of turn 1 sees 0.5.
    rewards = t([[0.0, 0.0, 0.0, 0.0, 1.0]])
    mask = torch.tensor([[1, 1, 1, 0, 1]])
    ends = torch.tensor([[0, 0, 1, 0, 1]])
    adv, _ = masked_gae(rewards, torch.zeros(1, 5, dtype=F64), mask, 1.0, 1.0, ends, gamma_turn=0.5, lambda_turn=1.0)
    close(adv, t([[0.5, 0.5, 0.5, 0.0, 1.0]]))
    same, _ = masked_gae(rewards, torch.zeros(1, 5, dtype=F64), mask, 0.5, 1.0)  # per-token discount instead
    close(same, t([[0.125, 0.25, 0.5, 0.0, 1.0]]))


def test_masked_gae_across_turns_on_long_rows_with_many_turns():
    rewards, values, mask, ends = random_batch(5, 3, 3000, p_mask=0.6, p_end=0.05)
    adv, _ = masked_gae(rewards, values, mask, 1.0, 0.97, ends, gamma_turn=0.9, lambda_turn=0.95)
    ref_adv, _ = ref.ref_masked_gae(rewards, values, mask, 1.0, 0.97, ends, 0.9, 0.95)
    close(adv, ref_adv, tol=1e-8)
    adv32, _ = masked_gae(rewards.float(), values.float(), mask, 1.0, 0.97, ends, gamma_turn=0.9, lambda_turn=0.95)
    torch.testing.assert_close(adv32.to(F64), ref_adv, rtol=1e-4, atol=1e-4)


# --- bi-level GAE -----------------------------------------------------------

TOY = dict(
    # turn 1 = tokens 0, 1 (end 1); token 2 is an observation; turn 2 = tokens 3, 4 (end 4)
    rewards=t([[0.0, 1.0, 0.0, 0.0, 2.0]]),
    values=t([[0.1, 0.5, 7.0, 0.2, 0.4]]),
    mask=torch.tensor([[True, True, False, True, True]]),
    ends=torch.tensor([[False, True, False, False, True]]),
)


def test_bilevel_gae_two_turns_by_hand():
    g_turn, l_turn, g_tok, l_tok = 0.9, 0.8, 0.7, 0.6
    # turn level: V(e_1) = 0.5, V(e_2) = 0.4
    a2 = 2.0 + 0.0 - 0.4  # 1.6
    a1 = (1.0 + g_turn * 0.4 - 0.5) + g_turn * l_turn * a2  # 0.86 + 1.152 = 2.012
    # token level, inside each turn, from the turn's advantage
    a3 = (g_tok * 0.4 - 0.2) + g_tok * l_tok * a2  # 0.752
    a0 = (g_tok * 0.5 - 0.1) + g_tok * l_tok * a1  # 1.09504
    adv, ret = bilevel_gae(TOY["rewards"], TOY["values"], TOY["mask"], TOY["ends"], g_turn, l_turn, g_tok, l_tok)
    close(adv, t([[a0, a1, 0.0, a3, a2]]))
    close(ret, t([[a0 + 0.1, a1 + 0.5, 0.0, a3 + 0.2, a2 + 0.4]]))
    assert math.isclose(a1, 2.012) and math.isclose(a0, 1.09504)


def test_turn_gae_two_turns_by_hand():
    adv, ret = turn_gae(TOY["rewards"], TOY["values"], TOY["mask"], TOY["ends"], 0.9, 0.8)
    close(adv, t([[2.012, 2.012, 0.0, 1.6, 1.6]]))
    close(ret, t([[2.512, 2.512, 0.0, 2.0, 2.0]]))


def test_bilevel_single_token_turns_and_cut_off_last_turn():
    rewards = t([[1.0, 0.0, 0.5, 0.3]])
    values = t([[0.2, 0.1, 0.4, 0.6]])
    mask = torch.ones(1, 4, dtype=torch.bool)
    ends = torch.tensor([[True, False, True, False]])  # token 3 ends a turn implicitly
    adv, _ = bilevel_gae(rewards, values, mask, ends, 1.0, 1.0, 1.0, 1.0)
    close(adv, ref.ref_bilevel_gae(rewards, values, mask, ends, 1.0, 1.0, 1.0, 1.0)[0])
    # turn ends: 0, 2, 3 (implicit); with gamma = lambda = 1 the turn advantage
    # is the turn-reward-to-go minus the turn value.
    assert math.isclose(adv[0, 3].item(), 0.3 - 0.6)
    assert math.isclose(adv[0, 2].item(), 0.5 + 0.3 - 0.4)
    assert math.isclose(adv[0, 0].item(), 1.0 + 0.5 + 0.3 - 0.2)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    b=st.integers(1, 6),
    s=st.integers(1, 90),
    gammas=st.sampled_from([(1.0, 1.0, 1.0, 1.0), (0.9, 0.8, 0.7, 0.6), (0.99, 0.95, 1.0, 0.95), (0.5, 0.0, 0.9, 0.0)]),
    p_end=st.sampled_from([0.0, 0.1, 0.5, 1.0]),
)
def test_bilevel_and_turn_gae_match_reference(seed, b, s, gammas, p_end):
    rewards, values, mask, ends = random_batch(seed, b, s, p_end=p_end)
    adv, ret = bilevel_gae(rewards, values, mask, ends, *gammas)
    ref_adv, ref_ret = ref.ref_bilevel_gae(rewards, values, mask, ends, *gammas)
    close(adv, ref_adv)
    close(ret, ref_ret)
    adv, ret = turn_gae(rewards, values, mask, ends, gammas[0], gammas[1])
    ref_adv, ref_ret = ref.ref_turn_gae(rewards, values, mask, ends, gammas[0], gammas[1])
    close(adv, ref_adv)
    close(ret, ref_ret)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), b=st.integers(1, 4), s=st.integers(1, 70))
def test_bilevel_reduces_to_masked_gae(seed, b, s):
    rewards, values, mask, _ = random_batch(seed, b, s)
    # One turn per row: only the token level runs.
    no_ends = torch.zeros(b, s, dtype=torch.bool)
    close(bilevel_gae(rewards, values, mask, no_ends, 0.3, 0.2, 0.9, 0.8)[0],
          masked_gae(rewards, values, mask, 0.9, 0.8)[0])
    # Every token a turn: only the turn level runs, and turn GAE is token GAE.
    all_ends = torch.ones(b, s, dtype=torch.bool)
    expected = masked_gae(rewards, values, mask, 0.9, 0.8)
    close(bilevel_gae(rewards, values, mask, all_ends, 0.9, 0.8, 0.1, 0.1)[0], expected[0])
    for got, want in zip(turn_gae(rewards, values, mask, all_ends, 0.9, 0.8), expected):
        close(got, want)


def test_bilevel_long_rows_many_turns():
    rewards, values, mask, ends = random_batch(7, 3, 1500, p_mask=0.5, p_end=0.01)
    for fn, rf, args in (
        (bilevel_gae, ref.ref_bilevel_gae, (0.99, 0.95, 1.0, 0.9)),
        (turn_gae, ref.ref_turn_gae, (0.99, 0.95)),
    ):
        adv, ret = fn(rewards, values, mask, ends, *args)
        ref_adv, ref_ret = rf(rewards, values, mask, ends, *args)
        close(adv, ref_adv)
        close(ret, ref_ret)
        adv32, _ = fn(rewards.float(), values.float(), mask, ends, *args)
        assert adv32.dtype == torch.float32
        torch.testing.assert_close(adv32.to(F64), ref_adv, rtol=1e-4, atol=1e-4)


def test_turn_gae_sums_rewards_inside_a_turn():
    rewards = t([[0.5, 1.0, 0.0, 2.0]])  # a per-token reward inside turn 1
    values = t([[0.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0, 1]])
    ends = torch.tensor([[0, 1, 0, 1]])
    adv, _ = turn_gae(rewards, values, mask, ends, 1.0, 1.0)
    close(adv, t([[3.5, 3.5, 0.0, 2.0]]))


# --- outcome advantages -----------------------------------------------------


def test_grpo_by_hand():
    scores = t([1.0, 0.0, 0.0, 1.0, 5.0, 2.0, 2.0])
    groups = torch.tensor([7, 7, 7, 7, 3, 9, 9])  # any ids; 3 is a singleton, 9 all-equal
    std = math.sqrt(4 * 0.25 / 3)  # unbiased
    expected = [0.5 / (std + 1e-6), -0.5 / (std + 1e-6), -0.5 / (std + 1e-6), 0.5 / (std + 1e-6), 0.0, 0.0, 0.0]
    close(grpo_advantages(scores, groups), t(expected))
    close(grpo_advantages(scores, groups, norm_by_std=False), t([0.5, -0.5, -0.5, 0.5, 0.0, 0.0, 0.0]))
    assert not torch.isnan(grpo_advantages(scores[4:5], groups[4:5])).any()


def test_rloo_by_hand():
    adv = rloo_advantages(t([1.0, 2.0, 3.0, 4.0]), torch.tensor([0, 0, 0, 1]))
    close(adv, t([1 - 2.5, 2 - 2.0, 3 - 1.5, 0.0]))


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), b=st.integers(1, 40), n_groups=st.integers(1, 10))
def test_group_advantages_match_reference(seed, b, n_groups):
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randn(b, generator=gen, dtype=F64).round(decimals=1)  # ties and equal groups
    groups = torch.randint(0, n_groups, (b,), generator=gen) * 3
    for norm in (True, False):
        close(grpo_advantages(scores, groups, 1e-6, norm), ref.ref_grpo(scores, groups, 1e-6, norm), tol=1e-7)
    close(rloo_advantages(scores, groups), ref.ref_rloo(scores, groups))


def test_broadcast_to_tokens():
    out = broadcast_to_tokens(torch.tensor([2.0, -1.0]), torch.tensor([[1, 0, 1], [0, 0, 0]]))
    close(out, t([[2.0, 0.0, 2.0], [0.0, 0.0, 0.0]]))
    assert out.dtype == torch.float32
    mask = torch.rand(4, 9) < 0.5
    seq_adv = torch.randn(4, dtype=F64)
    close(broadcast_to_tokens(seq_adv, mask), ref.ref_broadcast(seq_adv, mask))


def test_whiten_by_hand_and_empty():
    values = t([[1.0, 2.0, 50.0], [3.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    z = math.sqrt(1.5)  # mean 2, population variance 2/3
    close(whiten(values, mask, eps=0.0), t([[-z, 0.0, 0.0], [z, 0.0, 0.0]]))
    close(whiten(values, mask, shift_mean=False, eps=0.0), t([[2 - z, 2.0, 0.0], [2 + z, 0.0, 0.0]]))
    assert whiten(values, torch.zeros(2, 3)).abs().sum() == 0
    # No statistics to take (turn-level GAE's turn ends, none in the batch): zeros, not the values times 1/sqrt(eps).
    for shift_mean in (True, False):
        assert whiten(values, mask, shift_mean=shift_mean, stats_mask=torch.zeros(2, 3)).abs().sum() == 0


def test_whiten_with_turn_statistics_weighs_each_turn_once():
    # A 2-token turn at +1 and an 8-token turn at 0, each turn's advantage on all its tokens. VAGEN's
    # turn-wise GAE whitens over one entry a turn (mean 0.5, std 0.5): +1 and -1. Over tokens (mean 0.2,
    # std 0.4) the short turn would get +2 and the long one -0.5.
    values = t([[1.0] * 2 + [0.0] * 8])
    mask = torch.ones(1, 10, dtype=torch.bool)
    ends = torch.zeros(1, 10, dtype=torch.bool)
    ends[0, [1, 9]] = True
    close(whiten(values, mask, eps=0.0, stats_mask=ends), t([[1.0] * 2 + [-1.0] * 8]))
    close(whiten(values, mask, eps=0.0), t([[2.0] * 2 + [-0.5] * 8]))


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), b=st.integers(1, 5), s=st.integers(1, 60), shift_mean=st.booleans(),
       by_turn=st.booleans(), offset=st.sampled_from([0.0, 1e3]))
def test_whiten_matches_reference(seed, b, s, shift_mean, by_turn, offset):
    """Statistics over every masked entry or over the turn ends only (turn-level GAE's whitening), the mean
    shifted away or kept, empty rows, values far from 0, and an equal value everywhere (zero variance)."""
    values, _, mask, ends = random_batch(seed, b, s)
    values = values + offset
    stats = ends & mask
    if by_turn:  # the last masked token of a row ends its turn
        last = (torch.arange(s) * mask).argmax(1)
        stats[torch.arange(b), last] |= mask.any(1)
    else:
        stats = mask
    for x in (values, torch.full_like(values, 2.5)):
        got = whiten(x, mask, shift_mean=shift_mean, stats_mask=stats if by_turn else None)
        close(got, ref.ref_whiten_with(x, mask, stats, shift_mean), tol=1e-7)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), b=st.integers(1, 5), s=st.integers(1, 60), gamma=st.sampled_from([1.0, 0.9]))
def test_reinforce_pp_matches_reference(seed, b, s, gamma):
    rewards, _, mask, _ = random_batch(seed, b, s)
    adv, ret = reinforce_pp_advantages(rewards, mask, gamma)
    ref_adv, ref_ret = ref.ref_reinforce_pp(rewards, mask, gamma)
    close(ret, ref_ret)
    close(adv, ref_adv, tol=1e-7)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), b=st.integers(1, 5), s=st.integers(1, 80), gammas=st.sampled_from(
    [(1.0, 0.9), (0.99, 0.5), (0.9, 0.0)]))
def test_reinforce_pp_with_a_discount_across_turns_matches_reference(seed, b, s, gammas):
    rewards, _, mask, ends = random_batch(seed, b, s)
    adv, ret = reinforce_pp_advantages(rewards, mask, gammas[0], turn_end_mask=ends, gamma_turn=gammas[1])
    ref_adv, ref_ret = ref.ref_reinforce_pp(rewards, mask, gammas[0], ends, gammas[1])
    close(ret, ref_ret)
    close(adv, ref_adv, tol=1e-7)


def test_reinforce_pp_long_rows_with_many_turns():
    rewards, _, mask, ends = random_batch(11, 3, 3000, p_mask=0.6, p_end=0.03)
    ref_adv, ref_ret = ref.ref_reinforce_pp(rewards, mask, 0.999, ends, 0.9)
    adv, ret = reinforce_pp_advantages(rewards, mask, 0.999, turn_end_mask=ends, gamma_turn=0.9)
    close(ret, ref_ret)
    close(adv, ref_adv, tol=1e-7)
    _, ret32 = reinforce_pp_advantages(rewards.float(), mask, 0.999, turn_end_mask=ends, gamma_turn=0.9)
    torch.testing.assert_close(ret32.to(F64), ref_ret, rtol=1e-4, atol=1e-4)


def test_reinforce_pp_by_hand():
    rewards = t([[0.0, 1.0, 7.0, 2.0]])
    mask = torch.tensor([[1, 1, 0, 1]])  # the 7.0 is outside the mask
    _, ret = reinforce_pp_advantages(rewards, mask, 0.5)
    close(ret, t([[0.5 * (1.0 + 0.5 * 2.0), 1.0 + 0.5 * 2.0, 0.0, 2.0]]))


# --- exact group statistics ---------------------------------------------------


@pytest.mark.parametrize("value", [10.1, 10.8, -0.1, 1e6 + 0.3, 0.0])
@pytest.mark.parametrize("n", [2, 3, 6, 8, 16])
def test_equal_scores_in_float32_get_exactly_zero_advantage(value, n):
    # Sokoban totals such as 10.1 in float32, as collate stores rewards: once gave +0.472 to all 8.
    scores = torch.full((n,), value, dtype=torch.float32)
    groups = torch.zeros(n, dtype=torch.long)
    assert grpo_advantages(scores, groups).abs().max() == 0
    assert grpo_advantages(scores, groups, norm_by_std=False).abs().max() == 0
    assert rloo_advantages(scores, groups).abs().max() == 0
    stats = group_stats(scores, groups)
    assert stats.std.item() == 0
    torch.testing.assert_close(stats.mean, scores[:1])


def test_group_stats_exact_for_equal_groups_beside_varied_ones():
    scores = torch.tensor([10.1, 10.1, 10.1, 0.0, 1.0, 10.8, 10.8], dtype=torch.float32)
    groups = torch.tensor([4, 4, 4, 9, 9, 2, 2])
    stats = group_stats(scores, groups)
    assert stats.std.tolist()[:2] == [0.0, 0.0]  # groups 2 and 4 (ids ascending)
    adv = grpo_advantages(scores, groups)
    assert adv[:3].abs().max() == 0 and adv[5:].abs().max() == 0
    close(adv[3:5], ref.ref_grpo(scores[3:5].double(), groups[3:5], 1e-6), tol=1e-6)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), b=st.integers(1, 40), n_groups=st.integers(1, 6),
       offset=st.sampled_from([0.0, 1e4]))
def test_group_deviation_matches_reference_with_large_offsets(seed, b, n_groups, offset):
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randn(b, generator=gen, dtype=F64) + offset
    groups = torch.randint(0, n_groups, (b,), generator=gen)
    stats = group_stats(scores, groups)
    close(stats.deviation, ref.ref_grpo(scores, groups, 0.0, norm_by_std=False), tol=1e-9)
    # Each group's size, mean and unbiased std (0 for a group of one), groups in ascending id order.
    members = {g: [x for x, h in zip(scores.tolist(), groups.tolist()) if h == g] for g in sorted(set(groups.tolist()))}
    assert stats.group_ids.tolist() == list(members) and stats.size.tolist() == [len(m) for m in members.values()]
    close(stats.mean, t([ref._mean_std(m)[0] for m in members.values()]), tol=1e-9)
    close(stats.std, t([ref._mean_std(m)[1] for m in members.values()]), tol=1e-9)


# --- degenerate shapes ------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(0, 5), (2, 0), (0, 0)])
def test_token_estimators_return_their_input_shape_for_empty_batches_and_sequences(shape):
    zeros, mask = torch.zeros(shape, dtype=F64), torch.ones(shape, dtype=torch.bool)
    results = [
        masked_gae(zeros, zeros, mask, 0.9, 0.8, turn_end_mask=mask, gamma_turn=0.5, lambda_turn=0.7),
        bilevel_gae(zeros, zeros, mask, mask, 0.5, 0.7, 0.9, 0.8),
        turn_gae(zeros, zeros, mask, mask, 0.9, 0.8),
        reinforce_pp_advantages(zeros, mask, 0.9, turn_end_mask=mask, gamma_turn=0.5),
    ]
    for advantages, returns in results:
        assert advantages.shape == returns.shape == shape


def test_turn_estimators_match_the_reference_with_more_rows_than_packed_columns():
    # 40 rows of 6 tokens: the packed width (32 columns) is smaller than the batch
    rewards, values, mask, ends = random_batch(7, 40, 6, p_end=0.4)
    close(turn_gae(rewards, values, mask, ends, 0.9, 0.8)[0],
          ref.ref_turn_gae(rewards, values, mask, ends, 0.9, 0.8)[0])
    close(bilevel_gae(rewards, values, mask, ends, 0.9, 0.8, 0.95, 0.7)[0],
          ref.ref_bilevel_gae(rewards, values, mask, ends, 0.9, 0.8, 0.95, 0.7)[0])


def test_masked_gae_with_equal_discount_products_inside_and_across_turns_matches_the_reference():
    # gamma * lam = gamma_turn * lambda_turn = 0.9, while the TD errors still use gamma 0.9 and gamma_turn 1
    rewards, values, mask, ends = random_batch(11, 4, 30, p_end=0.2)
    got = masked_gae(rewards, values, mask, 0.9, 1.0, turn_end_mask=ends, gamma_turn=1.0, lambda_turn=0.9)
    want = ref.ref_masked_gae(rewards, values, mask, 0.9, 1.0, ends, 1.0, 0.9)
    close(got[0], want[0])
    close(got[1], want[1])


def test_masked_gae_across_turns_when_the_longest_row_fills_the_packed_chunk_but_has_fewer_turns():
    # row 0: 31 tokens in one turn, so its last token sits just before the zero column (32 packed columns);
    # row 1: two turns of two tokens
    gen = torch.Generator().manual_seed(0)
    rewards, values = torch.randn(2, 31, generator=gen, dtype=F64), torch.randn(2, 31, generator=gen, dtype=F64)
    mask = torch.zeros(2, 31, dtype=torch.bool)
    mask[0] = True
    mask[1, :4] = True
    ends = torch.zeros(2, 31, dtype=torch.bool)
    ends[1, 1] = ends[1, 3] = True
    got = masked_gae(rewards, values, mask, 0.95, 0.9, turn_end_mask=ends, gamma_turn=0.5, lambda_turn=0.8)
    close(got[0], ref.ref_masked_gae(rewards, values, mask, 0.95, 0.9, ends, 0.5, 0.8)[0])


def test_masked_gae_without_turn_ends_ignores_the_turn_discounts():
    rewards, values, mask, _ = random_batch(12, 3, 20)
    got = masked_gae(rewards, values, mask, 0.95, 0.9, gamma_turn=0.5, lambda_turn=0.8)
    close(got[0], ref.ref_masked_gae(rewards, values, mask, 0.95, 0.9)[0])

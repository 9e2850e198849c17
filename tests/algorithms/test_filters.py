"""StarPO-S group selection: hand-computed cases and a plain sorting reference."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.algorithms import reference as ref
from turnrl.algorithms import GroupSelection, seeded_group_scores, select_groups

F64 = torch.float64


def grouped(rewards_per_group: list[list[float]], ids: list[int] | None = None):
    """(group_index, rewards) for groups listed as reward lists."""
    ids = ids if ids is not None else list(range(len(rewards_per_group)))
    index = [g for g, rs in zip(ids, rewards_per_group) for _ in rs]
    flat = [r for rs in rewards_per_group for r in rs]
    return torch.tensor(index), torch.tensor(flat, dtype=F64)


# Eight groups of four; the reward std decreases with the group number except
# that groups 2 and 3 tie, and groups 6 and 7 never vary.
EIGHT = [
    [0.0, 4.0, 0.0, 4.0],
    [0.0, 3.0, 0.0, 3.0],
    [0.0, 2.0, 0.0, 2.0],
    [2.0, 0.0, 2.0, 0.0],
    [0.0, 1.0, 0.0, 1.0],
    [0.0, 0.5, 0.0, 0.5],
    [1.0, 1.0, 1.0, 1.0],
    [0.0, 0.0, 0.0, 0.0],
]


def test_default_keeps_top_quarter_by_reward_std():
    index, rewards = grouped(EIGHT)
    sel = select_groups(index, rewards)
    assert isinstance(sel, GroupSelection)
    assert sel.kept_groups.tolist() == [0, 1]
    assert sel.keep_mask.tolist() == [True] * 8 + [False] * 24
    assert sel.kept_ratio == 0.25 and not sel.skip_step
    std = math.sqrt(4 * 4.0 / 3)  # group 0: mean 2, unbiased
    assert math.isclose(sel.scores[0].item(), std)


def test_ties_break_by_smaller_group_id():
    index, rewards = grouped(EIGHT)
    assert select_groups(index, rewards, value=3).kept_groups.tolist() == [0, 1, 2]
    # the same groups under other ids, in another order: the smaller id wins
    index, rewards = grouped(EIGHT[::-1], ids=[17, 16, 15, 14, 13, 12, 11, 10])
    assert select_groups(index, rewards, value=3).kept_groups.tolist() == [10, 11, 12]


def test_top_k_count_and_share():
    index, rewards = grouped(EIGHT)
    assert select_groups(index, rewards, value=1).kept_groups.tolist() == [0]
    assert select_groups(index, rewards, value=0.5).kept_groups.tolist() == [0, 1, 2, 3]
    assert select_groups(index, rewards, value=0.01).kept_groups.tolist() == [0]  # at least one
    assert select_groups(index, rewards, value=1.0).kept_ratio == 1.0
    assert select_groups(index, rewards, value=100).kept_ratio == 1.0
    for bad in (0, -1, 1.5):
        with pytest.raises(ValueError):
            select_groups(index, rewards, value=bad)


def test_top_p_linear_by_hand():
    index = torch.arange(4)
    scores = torch.tensor([1.0, 4.0, 2.0, 3.0], dtype=F64)  # shares 0.1, 0.4, 0.2, 0.3

    def pick(p):
        return select_groups(index, scores=scores, rewards=torch.zeros(4), strategy="top_p", value=p)

    assert pick(0.3).kept_groups.tolist() == [1]
    assert pick(0.5).kept_groups.tolist() == [1, 3]  # 0.4 < 0.5, 0.7 >= 0.5
    assert pick(0.7).kept_groups.tolist() == [1, 3]  # reaching p exactly is enough
    assert pick(0.71).kept_groups.tolist() == [1, 2, 3]
    assert pick(1.0).kept_groups.tolist() == [0, 1, 2, 3]


def test_top_p_linear_all_zero_keeps_none_and_negative_scores_raise():
    index, rewards = grouped([[1.0, 1.0]] * 4)
    selection = select_groups(index, rewards, strategy="top_p", value=0.5)
    assert selection.kept_groups.tolist() == [] and selection.skip_step  # RAGEN: threshold -0.01 is met at once
    with pytest.raises(ValueError):
        select_groups(torch.arange(2), torch.zeros(2), scores=torch.tensor([-1.0, 2.0]), strategy="top_p")
    with pytest.raises(ValueError):
        select_groups(torch.arange(2), torch.zeros(2), strategy="top_p", largest=False)


def test_top_p_softmax_by_hand():
    index = torch.arange(3)
    scores = torch.tensor([0.0, math.log(2.0), math.log(7.0)], dtype=F64)  # softmax: 0.1, 0.2, 0.7
    common = dict(scores=scores, rewards=torch.zeros(3), strategy="top_p", weighting="softmax")
    assert select_groups(index, value=0.7, **common).kept_groups.tolist() == [2]
    assert select_groups(index, value=0.8, **common).kept_groups.tolist() == [1, 2]
    # smallest first: softmax of -score / T
    assert select_groups(index, value=0.5, largest=False, **common).kept_groups.tolist() == [0]


def test_top_p_of_one_keeps_every_group_under_either_weighting():
    # Mean lengths in tokens: a softmax of them puts all weight on the first group, and its cumulative weight
    # never exceeds 1 - 1e-9 before the last groups; RAGEN's top_p >= 1 still keeps every group.
    index = torch.arange(3)
    scores = torch.tensor([300.0, 250.0, 120.0], dtype=F64)
    for weighting in ("linear", "softmax"):
        for value in (1.0, 1.5):
            selection = select_groups(
                index, torch.zeros(3), scores=scores, strategy="top_p", value=value, weighting=weighting
            )
            assert selection.kept_groups.tolist() == [0, 1, 2], (weighting, value)
    assert select_groups(index, torch.zeros(3), scores=scores, strategy="top_p", value=0.99,
                         weighting="softmax").kept_groups.tolist() == [0]


def test_min_p():
    index, rewards = grouped(EIGHT)
    std = [math.sqrt(4 * (x / 2) ** 2 / 3) for x in (4, 3, 2, 2, 1, 0.5, 0, 0)]
    sel = select_groups(index, rewards, strategy="min_p", value=0.5)
    assert sel.kept_groups.tolist() == [g for g, s in enumerate(std) if s >= 0.5 * std[0] - 1e-12]
    assert select_groups(index, rewards, strategy="min_p", value=1.0).kept_groups.tolist() == [0]


def test_zero_variance_groups_and_empty_selection():
    index, rewards = grouped(EIGHT)
    sel = select_groups(index, rewards, strategy="none", drop_zero_variance=True)
    assert sel.kept_groups.tolist() == [0, 1, 2, 3, 4, 5]
    assert sel.kept_ratio == 6 / 8
    assert select_groups(index, rewards, strategy="none").kept_ratio == 1.0
    # a precomputed score that prefers the flat groups: they are still dropped
    scores = torch.tensor([0.0, 0, 0, 0, 0, 0, 5, 6])
    sel = select_groups(index, rewards, scores=scores, value=2, drop_zero_variance=True)
    assert sel.kept_groups.tolist() == [0, 1]  # all candidates tie at 0: smaller ids
    flat_index, flat_rewards = grouped([[1.0, 1.0], [0.0, 0.0], [3.0]])  # incl. a group of one
    skipped = select_groups(flat_index, flat_rewards, drop_zero_variance=True)
    assert skipped.skip_step and skipped.kept_groups.numel() == 0
    assert not skipped.keep_mask.any() and skipped.kept_ratio == 0.0
    kept = select_groups(flat_index, flat_rewards, drop_zero_variance=True, on_empty="keep_all")
    assert not kept.skip_step and kept.keep_mask.all()


def test_inputs_are_validated():
    with pytest.raises(ValueError):
        select_groups(torch.arange(3))  # no rewards, no scores
    with pytest.raises(ValueError):
        select_groups(torch.arange(3), scores=torch.ones(3), drop_zero_variance=True)
    with pytest.raises(ValueError):
        select_groups(torch.arange(3), scores=torch.ones(2))
    with pytest.raises(ValueError):
        select_groups(torch.arange(3), torch.zeros(3), strategy="best")


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    b=st.integers(1, 40),
    n_groups=st.integers(1, 12),
    case=st.sampled_from(
        [
            ("top_k", 0.25), ("top_k", 3), ("top_p", 0.5), ("top_p", 0.9), ("top_p", 1.0),
            ("min_p", 0.3), ("none", 0.0),
        ]
    ),
    weighting=st.sampled_from(["linear", "softmax"]),
    largest=st.booleans(),
    drop_zero=st.booleans(),
    use_scores=st.booleans(),
    temperature=st.sampled_from([1.0, 0.3, 4.0]),
)
def test_select_groups_matches_reference(seed, b, n_groups, case, weighting, largest, drop_zero, use_scores,
                                         temperature):
    strategy, value = case
    if strategy == "top_p" and weighting == "linear":
        largest = True  # linear weights rank by the largest score only
    gen = torch.Generator().manual_seed(seed)
    index = torch.randint(0, n_groups, (b,), generator=gen) * 2 + 1
    rewards = torch.randint(0, 3, (b,), generator=gen).to(F64)  # small ints: ties, flat groups
    n_ids = index.unique().numel()
    scores = torch.randint(0, 4, (n_ids,), generator=gen).to(F64) if use_scores else None
    sel = select_groups(index, rewards, scores, strategy, value, weighting, temperature, largest, drop_zero)
    expected = ref.ref_select(index, rewards, scores, strategy, value, weighting, temperature, largest, drop_zero)
    if not expected:
        assert sel.skip_step
        return
    assert sel.kept_groups.tolist() == expected
    assert sel.keep_mask.tolist() == [g in expected for g in index.tolist()]
    assert math.isclose(sel.kept_ratio, len(expected) / n_ids)


# --------------------------------------------------------------------------- random scores (the control)
def test_seeded_scores_depend_on_the_env_seeds_alone():
    groups = torch.tensor([0, 0, 1, 1, 2, 2])
    seeds = torch.tensor([10, 10, 11, 11, 12, 12])
    scores = seeded_group_scores(seeds, groups)
    assert scores.shape == (3,) and bool(((scores >= 0) & (scores < 1)).all())
    assert torch.equal(scores, seeded_group_scores(seeds, groups))  # the same batch, the same scores
    # The samples in another order, the groups under other ids: each seed keeps its score.
    shuffled = seeded_group_scores(torch.tensor([12, 11, 10, 12, 11, 10]), torch.tensor([7, 5, 3, 7, 5, 3]))
    assert torch.equal(shuffled, scores)
    assert not torch.equal(seeded_group_scores(seeds + 3, groups), scores)


def test_top_k_by_seeded_scores_keeps_each_group_equally_often_whatever_its_rewards():
    """Over 4,000 batches of 4 groups, the kept group of top-1 is uniform (within 4 standard errors), and a
    group whose rewards vary most is kept no more often than the others (it would be always by reward std)."""
    kept = torch.zeros(4)
    groups = torch.arange(4).repeat_interleave(2)
    rewards = torch.tensor([0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])  # group 0 alone varies
    batches = 4000
    for batch in range(batches):
        seeds = (torch.arange(4) + 4 * batch).repeat_interleave(2)
        selection = select_groups(groups, rewards=rewards, scores=seeded_group_scores(seeds, groups), value=1)
        kept[selection.kept_groups] += 1
    share = kept / batches
    assert float((share - 0.25).abs().max()) < 4 * math.sqrt(0.25 * 0.75 / batches)
    assert select_groups(groups, rewards=rewards, value=1).kept_groups.tolist() == [0]


# --------------------------------------------------------------------------- boundaries
def pick(scores: list[float], **kwargs) -> list[int]:
    """Kept group ids of groups 0.. n-1 ranked by ``scores``."""
    n = len(scores)
    return select_groups(torch.arange(n), torch.zeros(n), scores=torch.tensor(scores, dtype=F64),
                         **kwargs).kept_groups.tolist()


def test_top_p_linear_stops_at_the_prefix_whose_sum_equals_the_threshold():
    # sum 4, p = 0.7525: threshold 0.7525 * 4 - 0.01 = 3.0 exactly, reached by the first two groups (2 + 1)
    assert 0.7525 * 4.0 - 0.01 == 3.0
    scores = [2.0, 1.0, 1.0]
    expected = ref.ref_select(torch.arange(3), torch.zeros(3), torch.tensor(scores), "top_p", 0.7525, "linear",
                              1.0, True, False)
    assert pick(scores, strategy="top_p", value=0.7525) == expected == [0, 1]


def test_top_p_softmax_weighs_the_scores_divided_by_the_temperature():
    # softmax(score / 2) of [0, log 2, log 7] is proportional to [1, sqrt 2, sqrt 7]: 0.198, 0.280, 0.523
    scores = [0.0, math.log(2.0), math.log(7.0)]
    common = dict(strategy="top_p", value=0.6, weighting="softmax")
    assert pick(scores, **common) == [2]  # temperature 1: 0.7 >= 0.6
    assert pick(scores, temperature=2.0, **common) == [1, 2]  # 0.523 < 0.6 <= 0.803


def test_top_p_softmax_keeps_one_group_for_p_zero():
    assert pick([1.0, 3.0, 2.0], strategy="top_p", value=0.0, weighting="softmax") == [1]


def test_top_p_softmax_counts_a_prefix_within_the_tolerance_of_p_as_reaching_it():
    # four equal scores weigh 0.25 each; p - 1e-9 is exactly 0.25, the first group's weight
    p = 0.250000001
    assert p - 1e-9 == 0.25
    assert pick([1.0, 1.0, 1.0, 1.0], strategy="top_p", value=p, weighting="softmax") == [0]


def test_min_p_with_smallest_first_keeps_scores_up_to_the_minimum_over_p():
    # min 1, p = 0.5: keep scores <= 2 (the bound itself included)
    scores = [1.0, 2.0, 3.0, 5.0]
    expected = ref.ref_select(torch.arange(4), torch.zeros(4), torch.tensor(scores), "min_p", 0.5, "linear", 1.0,
                              False, False)
    assert pick(scores, strategy="min_p", value=0.5, largest=False) == expected == [0, 1]


def test_min_p_without_candidates_skips_the_step():
    index, rewards = grouped([[1.0, 1.0], [0.0, 0.0]])  # every group flat
    selection = select_groups(index, rewards, strategy="min_p", value=0.5, drop_zero_variance=True)
    assert selection.skip_step and selection.kept_groups.numel() == 0


def test_an_empty_batch_skips_the_step_with_a_kept_ratio_of_zero():
    selection = select_groups(torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=F64))
    assert selection.skip_step and selection.kept_ratio == 0.0


def test_a_group_whose_std_equals_the_zero_variance_tolerance_is_dropped():
    # two rewards 1.414213562373095e-08 apart: an unbiased std of exactly 1e-8
    index, rewards = grouped([[0.0, 1.414213562373095e-08], [0.0, 1.0]])
    selection = select_groups(index, rewards, strategy="none", drop_zero_variance=True)
    assert selection.scores[0].item() == 1e-8
    assert selection.kept_groups.tolist() == [1]

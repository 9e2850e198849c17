"""Collapse diagnostics' math against plain loops over i and j, hand-computed cases, and the early-stop rules."""

from __future__ import annotations

import math
from collections import deque

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from turnrl.algorithms.collapse import (
    SpreadCollapse,
    Streak,
    ema,
    information_metrics,
    matched_and_marginal,
    retrieval_metrics,
    zscore_metrics,
)


# --------------------------------------------------------------------------- plain references
def ref_information(cross: list[list[float]], columns: list[int]) -> dict[str, float]:
    """One pair at a time: log p(z_i|x_i), log of the mean over j of p(z_i|x_j), their means."""
    n, c = len(cross), len(cross[0])
    matched, marginal = [], []
    for i in range(n):
        matched.append(cross[i][columns[i]])
        top = max(cross[i])
        mixture = sum(math.exp(cross[i][j] - top) for j in range(c)) / c
        marginal.append(top + math.log(mixture))
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    return {"mi": mean([m - g for m, g in zip(matched, marginal)]), "mi_upper_bound": math.log(c),
            "conditional_entropy": -mean(matched), "reasoning_entropy": -mean(marginal),
            "matched_logprob": mean(matched), "marginal_logprob": mean(marginal)}


def ref_retrieval(cross: list[list[float]], columns: list[int], classes: list[int], ks=(2, 4, 8)) -> dict[str, float]:
    """Rank the columns of each row (best first, ties: lower column first); a hit is a column of the own class."""
    n, c = len(cross), len(cross[0])
    k_max = min(max(ks), c)
    hits = {k: 0.0 for k in (1, *ks)}
    chance = 0.0
    for i in range(n):
        order = sorted(range(c), key=lambda j: (-cross[i][j], j))
        own = classes[columns[i]]
        for k in hits:
            hits[k] += any(classes[j] == own for j in order[: min(k, k_max)]) / n
        chance += sum(1 for j in range(c) if classes[j] == own) / c / n
    out = {"retrieval_acc": hits[1], "retrieval_chance": chance, "retrieval_above_chance": hits[1] - chance}
    for k in ks:
        chance_k = min(1.0, chance * min(k, k_max))
        out.update({f"retrieval_acc@{k}": hits[k], f"retrieval_chance@{k}": chance_k,
                    f"retrieval_above_chance@{k}": hits[k] - chance_k})
    return out


def ref_zscore(cross: list[list[float]], columns: list[int], eps: float, previous_ema: float | None,
               decay: float = 0.9) -> dict[str, float]:
    info_rows = [ref_information([row], [col]) for row, col in zip(cross, columns)]
    gaps = [r["mi"] for r in info_rows]
    marginal = [r["marginal_logprob"] for r in info_rows]
    mean = sum(marginal) / len(marginal)
    std = math.sqrt(sum((m - mean) ** 2 for m in marginal) / len(marginal))
    ema_std = std if previous_ema is None else decay * previous_ema + (1 - decay) * std  # this std in it
    return {"marginal_std": std, "mi_zscore": sum(g / (std + eps) for g in gaps) / len(gaps),
            "marginal_std_ema": ema_std, "mi_zscore_ema": sum(g / (ema_std + eps) for g in gaps) / len(gaps)}


def ref_spread_collapse(values: list[float], baseline_steps: int, window: int, ratio: float) -> int | None:
    """RAGEN's loop: the index of the value at which the rule fires, None if it never does."""
    first: list[float] = []
    recent: deque[float] = deque(maxlen=window)
    for index, value in enumerate(values):
        if len(first) < baseline_steps:
            first.append(value)
            continue
        recent.append(value)
        base = sum(first) / baseline_steps
        if len(recent) == window and all(v < ratio * base for v in recent):
            return index
    return None


def close(a: dict[str, float], b: dict[str, float]) -> bool:
    return a.keys() == b.keys() and all(math.isclose(a[k], b[k], rel_tol=1e-9, abs_tol=1e-9) for k in a)


# --------------------------------------------------------------------------- hand-made matrices
# p(z_i | x_j): each reasoning twice as likely after its own prompt as after either other one.
HAND = [[0.5, 0.25, 0.25], [0.25, 0.5, 0.25], [0.25, 0.25, 0.5]]


def test_mutual_information_of_a_hand_made_matrix():
    cross = torch.tensor(HAND).log()
    metrics = information_metrics(cross, torch.arange(3))
    # marginal = log((0.5 + 0.25 + 0.25) / 3) = log(1/3); matched = log(0.5)
    assert metrics["mi"] == pytest.approx(math.log(1.5))
    assert metrics["conditional_entropy"] == pytest.approx(math.log(2))
    assert metrics["reasoning_entropy"] == pytest.approx(math.log(3))
    assert metrics["mi_upper_bound"] == pytest.approx(math.log(3))
    assert metrics["mi"] == pytest.approx(metrics["reasoning_entropy"] - metrics["conditional_entropy"])


def test_retrieval_of_a_hand_made_matrix_and_of_prompts_that_are_the_same():
    cross = torch.tensor(HAND).log()
    assert retrieval_metrics(cross, torch.arange(3))["retrieval_acc"] == 1.0
    assert retrieval_metrics(cross, torch.arange(3))["retrieval_chance"] == pytest.approx(1 / 3)
    # Pair 0 claims prompt 1: its own column ranks first, so it misses.
    wrong = retrieval_metrics(cross, torch.tensor([1, 1, 2]))
    assert wrong["retrieval_acc"] == pytest.approx(2 / 3) and wrong["retrieval_acc@2"] == 1.0
    # Prompts 0 and 1 the same: ranking either first is right, and chance is 2/3 for those pairs.
    same = retrieval_metrics(cross, torch.tensor([1, 1, 2]), classes=torch.tensor([0, 0, 1]))
    assert same["retrieval_acc"] == 1.0
    assert same["retrieval_chance"] == pytest.approx((2 / 3 + 2 / 3 + 1 / 3) / 3)
    assert same["retrieval_chance@2"] == 1.0  # min(1, 2 x chance)


def test_a_prompt_free_policy_has_no_mutual_information_and_chance_retrieval():
    # The same log-probs after every prompt: reasoning does not depend on the input (template collapse).
    cross = torch.tensor([[-3.0] * 4, [-1.0] * 4, [-2.0] * 4, [-5.0] * 4])
    metrics = information_metrics(cross, torch.arange(4))
    assert metrics["mi"] == pytest.approx(0.0, abs=1e-12)
    retrieval = retrieval_metrics(cross, torch.arange(4))
    assert retrieval["retrieval_acc"] == 0.25 and retrieval["retrieval_chance"] == 0.25  # ties rank column 0 first


def test_shapes_are_checked():
    with pytest.raises(ValueError, match="columns must have shape"):
        information_metrics(torch.zeros(3, 2), torch.arange(2))
    with pytest.raises(ValueError, match="index the 2 prompts"):
        retrieval_metrics(torch.zeros(2, 2), torch.tensor([0, 2]))
    with pytest.raises(ValueError, match="non-empty"):
        matched_and_marginal(torch.zeros(0, 2), torch.zeros(0, dtype=torch.long))


# --------------------------------------------------------------------------- against the loops
MATRICES = st.integers(1, 6).flatmap(lambda n: st.integers(1, 9).flatmap(lambda c: st.tuples(
    st.lists(st.lists(st.floats(-60, 0, allow_nan=False), min_size=c, max_size=c), min_size=n, max_size=n),
    st.lists(st.integers(0, c - 1), min_size=n, max_size=n),
    st.lists(st.integers(0, 2), min_size=c, max_size=c),
)))


@settings(max_examples=150, deadline=None)
@given(case=MATRICES, ema_std=st.one_of(st.none(), st.floats(0, 5)))
def test_every_metric_equals_its_plain_loop(case, ema_std):
    cross, columns, labels = case
    # Class ids as the caller builds them: 0, 1, 2, ... in order of first appearance.
    ids: dict[int, int] = {}
    classes = [ids.setdefault(label, len(ids)) for label in labels]
    tensor, cols = torch.tensor(cross, dtype=torch.float64), torch.tensor(columns)
    assert close(information_metrics(tensor, cols), ref_information(cross, columns))
    assert close(retrieval_metrics(tensor, cols, torch.tensor(classes)), ref_retrieval(cross, columns, classes))
    assert close(zscore_metrics(tensor, cols, 1e-3, ema_std), ref_zscore(cross, columns, 1e-3, ema_std))
    info = information_metrics(tensor, cols)
    assert info["mi"] <= info["mi_upper_bound"] + 1e-9  # matched <= logsumexp, so the gap is at most log c


def test_float32_matrices_give_the_float64_results_up_to_rounding():
    cross = torch.randn(5, 4, generator=torch.Generator().manual_seed(0)) * 10
    a = information_metrics(cross.float(), torch.arange(4).repeat(2)[:5])
    b = ref_information(cross.tolist(), torch.arange(4).repeat(2)[:5].tolist())
    assert all(math.isclose(a[k], b[k], rel_tol=1e-5, abs_tol=1e-5) for k in a)


def test_ema_starts_at_the_first_value_then_decays():
    assert ema(None, 2.0, 0.9) == 2.0
    assert ema(2.0, 1.0, 0.9) == pytest.approx(0.9 * 2.0 + 0.1 * 1.0)


# --------------------------------------------------------------------------- early-stop rules
def test_spread_collapse_fires_after_ten_steps_below_a_tenth_of_the_first_ten():
    rule = SpreadCollapse()
    values = [1.0] * 10 + [0.05] * 9
    assert not any(rule.observe(v) for v in values)
    assert rule.baseline == 1.0 and rule.threshold == pytest.approx(0.1)
    assert rule.observe(0.09)  # the tenth in a row below 0.1


def test_spread_collapse_needs_the_whole_window_below_and_a_zero_baseline_never_fires():
    rule = SpreadCollapse(baseline_steps=2, window=3, ratio=0.5)
    assert [rule.observe(v) for v in (2.0, 2.0, 0.1, 0.1, 1.5, 0.1, 0.1, 0.1)] == [False] * 7 + [True]
    zero = SpreadCollapse(baseline_steps=1, window=1)
    assert not any(zero.observe(v) for v in (0.0, 0.0, 0.0))


@settings(max_examples=200, deadline=None)
@given(values=st.lists(st.sampled_from([0.0, 0.01, 0.05, 0.2, 1.0, 3.0]), max_size=40),
       baseline_steps=st.integers(1, 5), window=st.integers(1, 5), ratio=st.sampled_from([0.1, 0.5, 1.0]))
def test_spread_collapse_fires_where_ragens_loop_does(values, baseline_steps, window, ratio):
    rule = SpreadCollapse(baseline_steps, window, ratio)
    fired = next((i for i, v in enumerate(values) if rule.observe(v)), None)
    assert fired == ref_spread_collapse(values, baseline_steps, window, ratio)


def test_streak_fires_on_the_limit_th_hit_in_a_row_and_a_miss_resets_it():
    streak = Streak(3)
    assert [streak.observe(h) for h in (True, True, False, True, True, True)] == [False] * 5 + [True]
    assert not any(Streak(0).observe(True) for _ in range(10))


def test_a_streak_of_limit_one_fires_on_the_first_hit():
    streak = Streak(1)
    assert [streak.observe(h) for h in (False, True, True)] == [False, True, True]

"""turnrl's weighted F1 against a plain transcription of VAGEN's procedure.

Source: RAGEN-AI/VAGEN, vagen/env/utils/state_matching.py (``calculate_visual_reasoning_reward_bipartite``,
``calculate_item_similarity``, ``calculate_f1_score``). The transcription below keeps VAGEN's data shapes (lists of
``{"object_id", "vertical_relation", "horizontal_relation"}`` dicts) and its edge cases, including the one where
the weights of the kinds present sum to 0.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.optimize import linear_sum_assignment

from turnrl.envs.contract import facts_from_positions
from turnrl.rewards.matching import Claim, weighted_f1

KINDS = ("goal", "hole", "box")


def vagen_similarity(pred: dict, gt: dict) -> float:
    """Half a point per relation that both state and that is equal."""
    v_match = pred["vertical_relation"] is not None and pred["vertical_relation"] == gt["vertical_relation"]
    h_match = pred["horizontal_relation"] is not None and pred["horizontal_relation"] == gt["horizontal_relation"]
    return (v_match + h_match) / 2.0


def vagen_f1(matched: float, predicted: int, truth: int) -> float:
    if predicted == 0 and truth == 0:
        return 1.0
    precision = matched / predicted if predicted > 0 else 0.0
    recall = matched / truth if truth > 0 else 0.0
    return 0.0 if precision + recall == 0 else 2 * precision * recall / (precision + recall)


def vagen_weighted_f1(predicted: list[dict], truth: list[dict], weights: dict[str, float]) -> float:
    """VAGEN's ``calculate_visual_reasoning_reward_bipartite``, step by step."""
    predicted_by_id: dict[str, list[dict]] = {}
    for item in predicted:
        if item["object_id"] in weights:
            predicted_by_id.setdefault(item["object_id"], []).append(item)
    truth_by_id: dict[str, list[dict]] = {}
    for item in truth:
        if item["object_id"] in weights:
            truth_by_id.setdefault(item["object_id"], []).append(item)
    relevant = set(predicted_by_id) | set(truth_by_id)
    total_weight = sum(weights.get(kind, 0.0) for kind in relevant)
    if total_weight == 0.0:
        return 1.0 if not predicted and not truth and weights else 0.0
    weighted_sum = 0.0
    for kind in relevant:
        pred_items, gt_items, weight = predicted_by_id.get(kind, []), truth_by_id.get(kind, []), weights[kind]
        if weight == 0.0:
            continue
        matched = 0.0
        if pred_items and gt_items:
            matrix = [[vagen_similarity(p, g) for g in gt_items] for p in pred_items]
            rows, cols = linear_sum_assignment([[-value for value in row] for row in matrix])
            matched = sum(matrix[r][c] for r, c in zip(rows, cols))
        weighted_sum += weight * vagen_f1(matched, len(pred_items), len(gt_items))
    return weighted_sum / total_weight


cells = st.tuples(st.integers(0, 4), st.integers(0, 4))
weight_values = st.sampled_from([0.0, 0.3, 0.7, 1.0]) | st.floats(0.0, 10.0)


@given(player=cells, objects=st.lists(st.tuples(st.sampled_from(KINDS), cells), max_size=5),
       claims=st.lists(st.tuples(st.sampled_from(KINDS), st.sampled_from(["above", "below", "same", None]),
                                 st.sampled_from(["left", "right", "same", None])), max_size=5),
       weights=st.dictionaries(st.sampled_from(KINDS), weight_values, max_size=3))
@settings(max_examples=500, deadline=None)
def test_weighted_f1_equals_vagens_procedure(player, objects, claims, weights):
    facts = facts_from_positions(player, list(objects))
    truth = [{"object_id": f.name, "vertical_relation": f.vertical, "horizontal_relation": f.horizontal}
             for f in facts.objects]
    predicted = [{"object_id": name, "vertical_relation": v, "horizontal_relation": h} for name, v, h in claims]
    got = weighted_f1([Claim(name, v, h) for name, v, h in claims], facts, weights).score
    assert got == pytest.approx(vagen_weighted_f1(predicted, truth, weights))


FACTS = facts_from_positions((2, 2), [("goal", (1, 1)), ("hole", (3, 3))])


@pytest.mark.parametrize("claims", [[], [Claim("goal", "below", "right")], [Claim("goal", "above", "left")]])
def test_all_zero_weights_score_0_not_a_free_1(claims):
    """Weights that sum to 0 over the kinds present scored every text 1 (VAGEN: 0), whatever it said."""
    assert weighted_f1(claims, FACTS, {"goal": 0.0, "hole": 0.0}).score == 0.0


def test_a_truth_of_unweighted_kinds_scores_0_and_nothing_at_all_scores_1():
    """Only a board with nothing on it, described as holding nothing, is the free 1 (VAGEN's "both lists empty")."""
    assert weighted_f1([], FACTS, {"key": 1.0}).score == 0.0
    empty = facts_from_positions((2, 2), [])
    assert weighted_f1([], empty, {"goal": 0.7, "hole": 0.3}).score == 1.0
    # a player cell is no object unless the weights score it
    assert weighted_f1([Claim("player", position=(2, 2))], empty, {"goal": 1.0}).score == 1.0
    assert weighted_f1([Claim("player", position=(2, 2))], empty, {"goal": 1.0, "player": 0.0}).score == 0.0

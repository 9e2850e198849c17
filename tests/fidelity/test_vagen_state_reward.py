"""VAGEN's visual reasoning (state) rewards against turnrl's grounding and world-model rewards.

Source: RAGEN-AI/VAGEN@d2b8b30b4db41073e2b3ecad269f9c1c52522362:
vagen/env/utils/state_reward_text_utils.py (``env_state_reward_wrapper``,
``service_state_reward_wrapper_v2`` / ``_v3``), vagen/env/utils/state_matching.py
(``calculate_visual_reasoning_reward_bipartite``, ``calculate_item_similarity``,
``calculate_f1_with_max_matching``), vagen/env/frozenlake/service.py,
vagen/env/sokoban/service.py, vagen/env/utils/top_string_tracker.py. What the source does:

- The ``<observation>`` is scored against the state before the turn, the ``<prediction>``
  against the state after it; reward += 0.5 * grounding + 0.5 * world model.
- Only turns paid the format reward are judged (``is_format_rewarded``: format-correct and
  every action valid); any other turn scores 0 for both.
- FrozenLake: per object kind, Hungarian matching of claims to true objects, similarity
  (vertical match + horizontal match) / 2, F1 = 2PR/(P+R) with P = matched / claims and
  R = matched / true objects, weighted target 0.7 / hole 0.3 over the kinds present in the
  claims or the truth. Example: truth target above-left, holes below-right and above-same;
  claims target above-right, one hole below-right -> target F1 0.5, hole F1 2/3, score
  0.7 * 0.5 + 0.3 * 2/3 = 0.55.
- Sokoban: target and box F1 with exact matches only (both relations equal), weighted
  0.5 / 0.5; a text among the 5 most frequent (counted after adding this batch's texts)
  whose *unweighted* target F1 + box F1 < 0.7 scores -0.1 instead of its F1s.

Deliberate differences (docs/fidelity.md): turnrl judges every well-formed
turn unless ``require_valid_actions: true``; Sokoban's relations get half credit per axis
as FrozenLake's do; the repetition penalty counts texts before this one, compares the
weighted score with 0.7 and is added to the score rather than replacing it.
"""

import pytest

from turnrl.agent.formats import ParsedResponse
from turnrl.envs.contract import facts_from_positions
from turnrl.rewards.turn_rewards import FinishedTurn
from turnrl.rewards.matching import Claim, weighted_f1
from turnrl.rewards.state import RepetitionPenalty, StateReward

PLAYER = (2, 2)
FACTS = facts_from_positions(PLAYER, [("goal", (1, 1)), ("hole", (3, 3)), ("hole", (0, 2))])
GOAL_ONLY = facts_from_positions(PLAYER, [("goal", (1, 1))])
TRUE_TEXT = "The goal is above and to the left of the player."



def test_frozenlake_weighted_bipartite_f1_example():
    claims = [Claim("goal", "above", "right"), Claim("hole", "below", "right")]
    score = weighted_f1(claims, FACTS, {"goal": 0.7, "hole": 0.3})
    assert score.f1 == {"goal": pytest.approx(0.5), "hole": pytest.approx(2 / 3)}
    assert score.score == pytest.approx(0.55)


def test_kind_absent_from_claims_and_truth_is_left_out():
    facts = facts_from_positions(PLAYER, [("goal", (1, 1))])  # no holes on this map
    score = weighted_f1([Claim("goal", "above", "left")], facts, {"goal": 0.7, "hole": 0.3})
    assert score.score == pytest.approx(1.0)  # VAGEN normalizes by the weights of the kinds present


def turn(text, actions=("Up",), valid=(True,), dropped=(), format_ok=True):
    parsed = ParsedResponse(actions, {"observation": text, "prediction": text}, format_ok, (), dropped)
    return FinishedTurn(env_id="FrozenLake", seed=0, turn=0, observation="o", response=text, response_tokens=1,
                        finish_reason="stop", parsed=parsed, actions=actions, actions_valid=valid,
                        env_reward=0.0, format_reward=0.0, terminated=False, success=False,
                        facts_before=GOAL_ONLY, facts_after=GOAL_ONLY)


def test_vagens_gate_judges_only_format_rewarded_turns():
    gated = StateReward("observation", repetition=False, require_valid_actions=True)
    turns = [turn(TRUE_TEXT), turn(TRUE_TEXT, dropped=("Jump",)), turn(TRUE_TEXT, actions=(), valid=()),
             turn(TRUE_TEXT, format_ok=False)]
    assert gated(turns) == [1.0, 0.0, 0.0, 0.0]


def test_default_gate_is_the_format_alone():
    assert StateReward("observation", repetition=False)([turn(TRUE_TEXT, dropped=("Jump",))]) == [1.0]


def test_repetition_penalty_is_turnrls_documented_rule():
    # VAGEN (Sokoban) would score -0.1 on the first sight of a low-scoring text (it joins the top 5 at once)
    # and replace the score; turnrl counts earlier texts only and adds the penalty.
    penalty = RepetitionPenalty(window=1000, top_k=5, threshold=0.7, penalty=-0.1)
    assert penalty("same words", 0.3) == 0.0
    assert 0.3 + penalty("same words", 0.3) == pytest.approx(0.2)

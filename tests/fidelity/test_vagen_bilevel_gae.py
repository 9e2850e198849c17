"""VAGEN's bi-level GAE against turnrl's ``bilevel_gae``.

Source: RAGEN-AI/VAGEN@d2b8b30b4db41073e2b3ecad269f9c1c52522362,
vagen/trainer/ppo/ray_trainer.py (``compute_advantage``, ``BI_LEVEL_GAE``: the loss mask as
the mask of tokens, ``end_of_response_position_mask`` as the reward positions, one ``lam``
for both levels, ``high_level_gamma`` across turns), whose ``compute_bi_level_gae_advantage_return``
lives in VAGEN's verl fork (core_algos.py). What the source does, per row:

1. Turn level, backward over the turn ends e_t: delta_t = r(e_t) + high_level_gamma * V(e_{t+1})
   - V(e_t) (V after the last turn is 0); A_t = delta_t + high_level_gamma * lam * A_{t+1}.
2. The reward at e_t is replaced by the turn's return A_t + V(e_t).
3. Token level, backward over the loss-mask tokens: at a turn end the recursion restarts
   (next value 0, running advantage 0), so A(e_t) = A_t; elsewhere delta_i = r(i) +
   gamma * V(next token) - V(i) and A(i) = delta_i + gamma * lam * A(next token).
   Returns R(i) = A(i) + V(i).
4. The advantages are whitened over the loss mask.

The reference below is that procedure written as loops; turnrl's vectorized estimator
must give the same numbers with ``lambda_turn = lambda_token = lam``.
"""

import pytest
import torch

from turnrl.algorithms import bilevel_gae


def vagen_bilevel(rewards, values, loss_mask, ends, gamma, lam, turn_gamma):
    adv = torch.zeros_like(rewards)
    ret = torch.zeros_like(rewards)
    for b in range(rewards.shape[0]):
        r = rewards[b].clone()
        end_positions = [int(p) for p in ends[b].nonzero()]
        running = 0.0
        for i in reversed(range(len(end_positions))):
            pos = end_positions[i]
            next_value = values[b, end_positions[i + 1]] if i + 1 < len(end_positions) else 0.0
            running = r[pos] + turn_gamma * next_value - values[b, pos] + turn_gamma * lam * running
            adv[b, pos] = running
        for pos in end_positions:
            r[pos] = adv[b, pos] + values[b, pos]
        positions = [int(p) for p in loss_mask[b].nonzero()]
        running = 0.0
        for i in reversed(range(len(positions))):
            pos = positions[i]
            if pos in end_positions:
                next_value, running = 0.0, 0.0
            else:
                next_value = values[b, positions[i + 1]]
            running = r[pos] + gamma * next_value - values[b, pos] + gamma * lam * running
            adv[b, pos] = running
            ret[b, pos] = running + values[b, pos]
    return adv, ret



@pytest.mark.parametrize(("gamma", "lam", "turn_gamma"), [(1.0, 1.0, 0.95), (0.99, 0.9, 0.9), (1.0, 0.95, 1.0)])
def test_matches_vagens_procedure(gamma, lam, turn_gamma):
    torch.manual_seed(0)
    # Two rows of three and two turns, prompt and observation tokens (mask 0) between them.
    loss_mask = torch.tensor([[0, 1, 1, 1, 0, 0, 1, 1, 0, 1, 1, 1, 1, 0],
                              [0, 0, 1, 1, 1, 1, 0, 0, 1, 1, 0, 0, 0, 0]], dtype=torch.bool)
    ends = torch.zeros_like(loss_mask)
    for b, positions in enumerate([(3, 7, 12), (5, 9)]):
        ends[b, list(positions)] = True
    rewards = torch.where(loss_mask, torch.randn(loss_mask.shape) * 0.01, torch.zeros(loss_mask.shape))  # a KL term
    rewards[ends] += torch.tensor([0.5, 0.0, 10.9, 0.5, 1.0])
    values = torch.randn(loss_mask.shape)
    expected_adv, expected_ret = vagen_bilevel(rewards, values, loss_mask, ends, gamma, lam, turn_gamma)
    adv, ret = bilevel_gae(rewards, values, loss_mask, ends, gamma_turn=turn_gamma, lambda_turn=lam,
                           gamma_token=gamma, lambda_token=lam)
    assert torch.allclose(adv[loss_mask], expected_adv[loss_mask], atol=1e-5)
    assert torch.allclose(ret[loss_mask], expected_ret[loss_mask], atol=1e-5)
    assert not adv[~loss_mask].any()

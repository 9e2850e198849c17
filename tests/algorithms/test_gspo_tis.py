"""GSPO's sequence ratio and truncated importance weights against plain references."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.algorithms.reference import ref_gspo_loss, ref_tis_weight
from turnrl.algorithms import ppo_policy_loss, truncated_importance_weights


def batch(seed: int = 0, b: int = 4, s: int = 6):
    generator = torch.Generator().manual_seed(seed)
    logprobs = (torch.randn(b, s, generator=generator, dtype=torch.float64) * 0.3 - 1).requires_grad_()
    old = logprobs.detach() + torch.randn(b, s, generator=generator, dtype=torch.float64) * 0.05
    lengths = torch.randint(1, s + 1, (b,), generator=generator)
    mask = torch.arange(s)[None, :] < lengths[:, None]
    advantages = torch.randn(b, 1, generator=generator, dtype=torch.float64).expand(b, s).clone()
    return logprobs, old, advantages, mask


def gspo_reference(logprobs, old, advantages, mask, low, high):
    """GSPO's sequence objective: each sample's clipped surrogate on s = exp(mean(log ratio)), counted once
    per token of the sample (token-mean over the batch)."""
    total, tokens = 0.0, int(mask.sum())
    for row in range(logprobs.shape[0]):
        keep = mask[row]
        ratio = torch.exp((logprobs[row][keep] - old[row][keep]).mean())
        a = advantages[row][keep][0]
        surrogate = torch.maximum(-a * ratio, -a * ratio.clamp(1 - low, 1 + high))
        total = total + surrogate * int(keep.sum())
    return total / tokens


@pytest.mark.parametrize("clip", [(0.2, 0.28), (3e-4, 4e-4)])
def test_sequence_ratio_loss_and_gradient_equal_gspos_sequence_objective(clip):
    for seed in range(5):
        logprobs, old, advantages, mask = batch(seed)
        loss, _ = ppo_policy_loss(logprobs, old, advantages, mask, clip_low=clip[0], clip_high=clip[1],
                                  dual_clip=None, ratio_level="sequence")
        (grad,) = torch.autograd.grad(loss, logprobs)
        reference = gspo_reference(logprobs, old, advantages, mask, *clip)
        (want,) = torch.autograd.grad(reference, logprobs)
        torch.testing.assert_close(loss, reference)
        torch.testing.assert_close(grad, want)


def test_token_and_sequence_ratios_agree_when_every_token_has_the_same_ratio():
    logprobs, _, advantages, mask = batch(1)
    old = logprobs.detach() - 0.01
    token, _ = ppo_policy_loss(logprobs, old, advantages, mask, dual_clip=None)
    sequence, _ = ppo_policy_loss(logprobs, old, advantages, mask, dual_clip=None, ratio_level="sequence")
    torch.testing.assert_close(token, sequence)


def test_truncated_importance_weights_match_a_loop_and_ignore_what_is_off_the_mask():
    trainer = torch.tensor([[-1.0, -2.0, float("nan")], [-0.5, -3.0, -1.0]])
    sampler = torch.tensor([[-1.5, -1.0, -1.0], [-0.5, -0.2, float("inf")]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    weights = truncated_importance_weights(trainer, sampler, mask, cap=1.5)
    want = [[min(math.exp(0.5), 1.5), math.exp(-1.0), 1.0], [1.0, math.exp(-2.8), 1.0]]
    torch.testing.assert_close(weights, torch.tensor(want))
    with pytest.raises(ValueError, match="positive"):
        truncated_importance_weights(trainer, sampler, mask, cap=0.0)


def test_token_weights_scale_each_tokens_loss():
    logprobs, old, advantages, mask = batch(2)
    weights = torch.rand(logprobs.shape, dtype=torch.float64) + 0.5
    weighted, _ = ppo_policy_loss(logprobs, old, advantages, mask, dual_clip=None, token_weights=weights)
    ratio = torch.exp(logprobs - old)
    per_token = torch.maximum(-advantages * ratio, -advantages * ratio.clamp(0.8, 1.28))
    torch.testing.assert_close(weighted, (per_token * weights * mask).sum() / mask.sum())


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), b=st.integers(1, 5), s=st.integers(1, 20),
       spread=st.sampled_from([0.01, 0.3, 3.0]), clip=st.sampled_from([(0.2, 0.28), (3e-4, 4e-4)]),
       dual=st.sampled_from([None, 3.0]))
def test_sequence_ratio_under_sequence_means_is_the_papers_objective_and_gradient(seed, b, s, spread, clip, dual):
    """Under ``seq-mean-token-mean`` the GSPO-token loss is GSPO's sequence objective itself (one term a sequence,
    Eq. 5-7) and its gradient the paper's Eq. 10, per token ``-A s / |y|`` over the sequences; rows without tokens,
    advantages of both signs and sequence ratios far outside the clip range included."""
    generator = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, s, generator=generator, dtype=torch.float64) * 4
    new = old + torch.randn(b, s, generator=generator, dtype=torch.float64) * spread
    advantages = torch.randn(b, 1, generator=generator, dtype=torch.float64).expand(b, s).clone()
    mask = torch.rand(b, s, generator=generator) < 0.7
    mask[torch.rand(b, generator=generator) < 0.25] = False
    logprobs = new.clone().requires_grad_()
    loss, _ = ppo_policy_loss(logprobs, old, advantages, mask, *clip, dual, "seq-mean-token-mean",
                              ratio_level="sequence")
    loss.backward()
    want, grad = ref_gspo_loss(new, old, advantages, mask, *clip, dual)
    torch.testing.assert_close(loss, torch.tensor(want, dtype=torch.float64), rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(logprobs.grad, grad, rtol=1e-9, atol=1e-12)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), b=st.integers(1, 5), s=st.integers(1, 20),
       spread=st.sampled_from([0.05, 2.0, 40.0]), cap=st.sampled_from([0.5, 1.0, 2.0, 1e12]))
def test_truncated_importance_weights_match_the_loop_on_wide_differences(seed, b, s, spread, cap):
    """Far apart log-probs (a difference of 40 nats is clamped to 20 before the exp), caps below and above 1, empty
    rows: the trainer's log-probs carry no gradient into the weights."""
    generator = torch.Generator().manual_seed(seed)
    sampler = -torch.rand(b, s, generator=generator, dtype=torch.float64) * 5
    trainer = (sampler + torch.randn(b, s, generator=generator, dtype=torch.float64) * spread).requires_grad_()
    mask = torch.rand(b, s, generator=generator) < 0.7
    mask[torch.rand(b, generator=generator) < 0.25] = False
    weights = truncated_importance_weights(trainer, sampler, mask, cap)
    want = [[ref_tis_weight(x, y, cap) if m else 1.0 for x, y, m in zip(xs, ys, ms)]
            for xs, ys, ms in zip(trainer.tolist(), sampler.tolist(), mask.tolist())]
    torch.testing.assert_close(weights, torch.tensor(want, dtype=torch.float64), rtol=1e-12, atol=0)
    assert not weights.requires_grad

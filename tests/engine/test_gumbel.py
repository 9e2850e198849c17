"""The one-pass Triton sampler against the torch definitions (Triton's interpreter on a CPU)."""

from __future__ import annotations

import pytest
import torch

from turnrl.engine.attention import triton_available
from turnrl.engine.gumbel import sample_one_pass

pytestmark = pytest.mark.skipif(not triton_available(), reason="Triton is not installed")


def tempered_log_softmax(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    scale = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    return torch.log_softmax(logits.double() / scale.double()[:, None], dim=-1)


def test_logprobs_are_the_tempered_log_softmax_across_vocabulary_splits():
    """A 10,000-token vocabulary over several programs per row, rows at several temperatures and greedy."""
    torch.manual_seed(0)
    logits = torch.randn(4, 10_000) * 4
    temperature = torch.tensor([1.0, 0.0, 0.6, 1.7])
    tokens, logprobs = sample_one_pass(logits, temperature)
    expected = tempered_log_softmax(logits, temperature).gather(1, tokens[:, None])[:, 0]
    torch.testing.assert_close(logprobs.double(), expected, atol=1e-5, rtol=1e-5)
    assert tokens[1] == logits[1].argmax()


def test_greedy_rows_take_the_first_of_equal_maxima_as_argmax_does():
    logits = torch.zeros(3, 5000)
    logits[0, [7, 4000]] = 2.0  # in different blocks
    logits[1, [2100, 2101]] = 3.0  # in one block
    logits[2, [4999]] = 1.0
    tokens, _ = sample_one_pass(logits, torch.zeros(3))
    assert tokens.tolist() == [7, 2100, 4999]


def test_half_precision_logits_are_read_in_float32():
    torch.manual_seed(1)
    logits = (torch.randn(2, 3000) * 3).to(torch.float16)
    tokens, logprobs = sample_one_pass(logits, torch.ones(2))
    expected = tempered_log_softmax(logits.float(), torch.ones(2)).gather(1, tokens[:, None])[:, 0]
    torch.testing.assert_close(logprobs.double(), expected, atol=1e-5, rtol=1e-5)


def test_samples_follow_the_softmax():
    """500 rows of the same logits (seeded): the token frequencies are within sampling noise of the softmax (a
    total variation of about 0.045 is typical at this size; always the argmax, or uniform draws, give over 0.4)."""
    logits = torch.tensor([0.0, 1.0, 2.0, -1.0, 0.5, 3.0, -5.0, 1.5]).repeat(500, 1)
    torch.manual_seed(2)
    for temperature in (1.0, 3.0):
        tokens, _ = sample_one_pass(logits, torch.full((500,), temperature))
        frequencies = torch.bincount(tokens, minlength=8).double() / 500
        assert (frequencies - torch.softmax(logits[0].double() / temperature, 0)).abs().sum() / 2 < 0.08


def test_torch_seed_fixes_the_samples():
    logits = torch.randn(6, 2500)
    torch.manual_seed(5)
    first = sample_one_pass(logits, torch.ones(6))[0]
    torch.manual_seed(5)
    again = sample_one_pass(logits, torch.ones(6))[0]
    torch.manual_seed(6)
    other = torch.stack([sample_one_pass(logits, torch.ones(6))[0] for _ in range(3)])
    assert torch.equal(first, again)
    assert not all(torch.equal(first, row) for row in other)

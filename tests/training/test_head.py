"""The scoring head against plain logits: values and gradients, chunked or not, with a vocabulary limit."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.models.test_loading import scalar_kernels
from turnrl.models.loading import load_model
from turnrl.training.head import (
    ScoringHead,
    chosen_logprobs,
    chunk_logit_grads,
    chunk_scores,
    install_scoring_head,
)


def reference(states, weight, targets, temperature, vocab_limit):
    """Whole logits in float64 over the rows below the limit (the others are no tokens): log-softmax, gathered,
    and the entropy."""
    logits = states.double() @ weight[:vocab_limit].double().T / temperature
    log_p = torch.log_softmax(logits, dim=-1)
    return log_p.gather(-1, targets[:, None]).squeeze(-1), -(log_p.exp() * log_p).sum(-1)


def _inputs(n=13, h=8, v=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    states = torch.randn(n, h, generator=g, dtype=torch.float64) * 2
    weight = torch.randn(v, h, generator=g, dtype=torch.float64)
    return states, weight, g


@pytest.mark.parametrize("chunk", [1, 4, 13, 100])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("vocab_limit", [40, 29])
def test_values_and_gradients_equal_the_whole_logits(chunk, temperature, vocab_limit):
    states, weight, g = _inputs()
    targets = torch.randint(0, vocab_limit, (13,), generator=g)
    grad_lp, grad_ent = torch.randn(13, generator=g, dtype=torch.float64), torch.randn(13, generator=g,
                                                                                       dtype=torch.float64)
    a_states, a_weight = states.clone().requires_grad_(), weight.clone().requires_grad_()
    lp, ent = chosen_logprobs(a_states, a_weight, targets, temperature, vocab_limit, chunk)
    ((lp * grad_lp).sum() + (ent * grad_ent).sum()).backward()
    b_states, b_weight = states.clone().requires_grad_(), weight.clone().requires_grad_()
    ref_lp, ref_ent = reference(b_states, b_weight, targets, temperature, vocab_limit)
    ((ref_lp * grad_lp).sum() + (ref_ent * grad_ent).sum()).backward()
    # The head computes in float32 (its logits), the reference in float64.
    torch.testing.assert_close(lp.double(), ref_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent.double(), ref_ent, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(a_states.grad, b_states.grad, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(a_weight.grad, b_weight.grad, atol=1e-5, rtol=1e-4)


def test_a_long_sequence_in_many_chunks_equals_the_whole_logits():
    """3,000 scored tokens in 12 chunks (the last one short), values and gradients."""
    states, weight, g = _inputs(n=3000, h=8, v=50, seed=3)
    targets = torch.randint(0, 50, (3000,), generator=g)
    grad_lp, grad_ent = torch.randn(3000, generator=g, dtype=torch.float64), torch.randn(3000, generator=g,
                                                                                           dtype=torch.float64)
    a_states, a_weight = states.clone().requires_grad_(), weight.clone().requires_grad_()
    lp, ent = chosen_logprobs(a_states, a_weight, targets, 0.9, None, chunk=256)
    ((lp * grad_lp).sum() + (ent * grad_ent).sum()).backward()
    b_states, b_weight = states.clone().requires_grad_(), weight.clone().requires_grad_()
    ref_lp, ref_ent = reference(b_states, b_weight, targets, 0.9, 50)
    ((ref_lp * grad_lp).sum() + (ref_ent * grad_ent).sum()).backward()
    torch.testing.assert_close(lp.double(), ref_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent.double(), ref_ent, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(a_states.grad, b_states.grad, atol=1e-5, rtol=1e-4)
    # The weight's gradient sums 3,000 tokens' float32 terms.
    torch.testing.assert_close(a_weight.grad, b_weight.grad, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("greedy", [0.0, 1e-6])
def test_a_greedy_temperature_scores_at_temperature_one(greedy):
    """Greedy sampling has no distribution of its own: its tokens are scored under the plain softmax."""
    states, weight, g = _inputs()
    targets = torch.randint(0, 40, (13,), generator=g)
    lp, ent = chosen_logprobs(states, weight, targets, greedy)
    ref_lp, ref_ent = reference(states, weight, targets, 1.0, 40)
    torch.testing.assert_close(lp.double(), ref_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent.double(), ref_ent, atol=1e-5, rtol=1e-5)


def test_rows_past_the_limit_get_no_probability_and_no_gradient():
    states, weight, g = _inputs()
    targets = torch.randint(0, 29, (13,), generator=g)
    a_weight = weight.clone().requires_grad_()
    lp, ent = chosen_logprobs(states, a_weight, targets, vocab_limit=29)
    (lp.sum() + ent.sum()).backward()
    assert torch.isfinite(lp).all() and torch.isfinite(ent).all()
    assert torch.equal(a_weight.grad[29:], torch.zeros_like(a_weight.grad[29:]))
    # The rows past the limit change nothing: the same as a head of 29 rows.
    lp29, ent29 = chosen_logprobs(states, weight[:29], targets)
    torch.testing.assert_close(lp, lp29)
    torch.testing.assert_close(ent, ent29)


def test_a_peaked_distribution_has_finite_entropy_gradient():
    """Logits so far apart that most probabilities underflow to 0: no NaN (0 log 0 is 0)."""
    states = torch.tensor([[1.0, 0.0]], dtype=torch.float64)
    weight = torch.tensor([[1e4, 0.0], [0.0, 1.0], [-1e4, 0.0]], dtype=torch.float64, requires_grad=True)
    lp, ent = chosen_logprobs(states, weight, torch.tensor([0]))
    (lp + ent).sum().backward()
    assert torch.isfinite(weight.grad).all()
    assert float(ent.detach()) == pytest.approx(0.0, abs=1e-6)


def test_bf16_states_compute_the_product_in_bf16_like_the_plain_head():
    states, weight, g = _inputs(n=6, h=16, v=50)
    targets = torch.randint(0, 50, (6,), generator=g)
    lp, _ = chosen_logprobs(states.bfloat16(), weight.float(), targets)
    logits = torch.nn.functional.linear(states.bfloat16(), weight.bfloat16()).float()
    expected = torch.log_softmax(logits, -1).gather(-1, targets[:, None]).squeeze(-1)
    torch.testing.assert_close(lp, expected, atol=1e-5, rtol=1e-5)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(0, 9), v=st.integers(2, 30), chunk=st.integers(1, 10), data=st.data())
def test_any_shape_matches_the_reference(n, v, chunk, data):
    limit = data.draw(st.integers(1, v))
    states, weight, g = _inputs(n=n, h=5, v=v, seed=n * 31 + v)
    targets = torch.randint(0, limit, (n,), generator=g)
    lp, ent = chosen_logprobs(states, weight, targets, 1.0, limit, chunk)
    ref_lp, ref_ent = reference(states, weight, targets, 1.0, limit)
    torch.testing.assert_close(lp.double(), ref_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent.double(), ref_ent, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("vocab_limit", [40, 29])
def test_the_chunk_functions_equal_the_whole_logits(temperature, vocab_limit):
    """:func:`chunk_scores` and :func:`chunk_logit_grads` (the compiled path's arithmetic, run eagerly here)
    against autograd through the float64 reference, a chunk's logits in, float32 out."""
    states, weight, g = _inputs()
    targets = torch.randint(0, vocab_limit, (13,), generator=g)
    grad_lp, grad_ent = torch.randn(13, generator=g, dtype=torch.float64), torch.randn(13, generator=g,
                                                                                       dtype=torch.float64)
    logits = (states @ weight.T).requires_grad_()
    lp, ent, lse = chunk_scores(logits.detach(), targets, temperature, vocab_limit)
    grad = chunk_logit_grads(logits.detach(), targets, lse, ent, grad_lp.float(), grad_ent.float(), temperature,
                             vocab_limit, torch.float32)
    log_p = torch.log_softmax(logits[:, :vocab_limit] / temperature, dim=-1)
    ref_lp, ref_ent = log_p.gather(-1, targets[:, None]).squeeze(-1), -(log_p.exp() * log_p).sum(-1)
    ((ref_lp * grad_lp).sum() + (ref_ent * grad_ent).sum()).backward()
    assert lp.dtype == ent.dtype == lse.dtype == grad.dtype == torch.float32
    torch.testing.assert_close(lp.double(), ref_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent.double(), ref_ent, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), torch.logsumexp(logits[:, :vocab_limit] / temperature, -1),
                               atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad.double(), logits.grad, atol=1e-5, rtol=1e-4)
    assert torch.equal(grad[:, vocab_limit:], torch.zeros_like(grad[:, vocab_limit:]))


def test_the_chunk_functions_give_a_peaked_distribution_finite_values():
    logits = torch.tensor([[1e4, 1.0, -1e4]])
    lp, ent, lse = chunk_scores(logits, torch.tensor([0]), 1.0, 3)
    grad = chunk_logit_grads(logits, torch.tensor([0]), lse, ent, torch.ones(1), torch.ones(1), 1.0, 3,
                             torch.float32)
    assert torch.isfinite(lp).all() and torch.isfinite(grad).all()
    assert float(ent) == pytest.approx(0.0, abs=1e-6)


@pytest.mark.usefixtures(scalar_kernels.__name__)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_scoring_equals_the_eager_one(dtype):
    """``compiled=True`` (``model.compile``): the chunk functions through torch.compile, chunks of 5, 5 and 3
    tokens (one graph: shapes are dynamic), a temperature and a vocabulary limit; float32 states against the
    float64 reference, bf16 states (a bf16 product, as under autocast) against the eager path reading the same
    bf16 logits."""
    states, weight, g = _inputs()
    targets = torch.randint(0, 29, (13,), generator=g)
    grad_lp, grad_ent = torch.randn(13, generator=g), torch.randn(13, generator=g)
    results = []
    for compiled in (True, False):
        a_states, a_weight = states.to(dtype).requires_grad_(), weight.float().requires_grad_()
        lp, ent = chosen_logprobs(a_states, a_weight, targets, 0.7, 29, chunk=5, compiled=compiled)
        ((lp * grad_lp).sum() + (ent * grad_ent).sum()).backward()
        results.append((lp, ent, a_states.grad, a_weight.grad))
    (lp, ent, grad_states, grad_weight), eager = results
    assert grad_states.dtype == dtype and grad_weight.dtype == torch.float32
    if dtype == torch.float32:
        b_states, b_weight = states.clone().requires_grad_(), weight.clone().requires_grad_()
        ref_lp, ref_ent = reference(b_states, b_weight, targets, 0.7, 29)
        ((ref_lp * grad_lp.double()).sum() + (ref_ent * grad_ent.double()).sum()).backward()
        expected = (ref_lp, ref_ent, b_states.grad, b_weight.grad)
        for got, want in zip((lp, ent, grad_states, grad_weight), expected, strict=True):
            torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-4)
    else:  # the same bf16 logits both ways; the logits' gradient, summed in another order, rounds to bf16
        torch.testing.assert_close(lp, eager[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ent, eager[1], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(grad_states, eager[2], atol=1e-2, rtol=1e-2)
        torch.testing.assert_close(grad_weight, eager[3], atol=1e-2, rtol=1e-2)


def test_installed_head_keeps_logits_and_ties(tiny_model_dir):
    model = load_model(tiny_model_dir)
    embeddings = model.get_input_embeddings().weight
    ids = torch.tensor([[1, 2, 3, 4]])
    before = model(input_ids=ids).logits
    head = install_scoring_head(model, vocab_limit=100)
    assert isinstance(model.get_output_embeddings(), ScoringHead) and not head.compiled
    assert head.weight is embeddings  # a tied head stays tied
    torch.testing.assert_close(model(input_ids=ids).logits, before)
    hidden = model.base_model(input_ids=ids).last_hidden_state[0]
    lp, _ = head(hidden[:-1], targets=ids[0, 1:])
    expected = torch.log_softmax(before[0, :-1, :100].double(), -1).gather(-1, ids[0, 1:, None]).squeeze(-1)
    torch.testing.assert_close(lp.double(), expected, atol=1e-5, rtol=1e-5)
    assert install_scoring_head(model, vocab_limit=100, compiled=True) is head and head.compiled

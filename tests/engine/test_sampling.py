"""Top-k / top-p filtering and sampling against plain references."""

from __future__ import annotations

import math

import torch

from turnrl.config import GREEDY_BELOW_TEMPERATURE
from turnrl.engine.sampling import filter_top_k_top_p, logprobs_before_suppression, sample_tokens, sample_untruncated
from turnrl.engine.sequences import SamplingParams


def reference_keep(logits: list[float], top_k: int, top_p: float) -> set[int]:
    """The tokens a plain loop keeps: the top k, then the smallest set of the most likely of them reaching top_p
    of their own (renormalised) mass."""
    order = sorted(range(len(logits)), key=lambda i: -logits[i])
    if top_k > 0:
        order = order[:top_k]
    total = sum(math.exp(logits[i]) for i in order)
    kept, mass = [], 0.0
    for i in order:
        if kept and mass >= top_p:
            break
        kept.append(i)
        mass += math.exp(logits[i]) / total
    return set(kept)


def test_filter_keeps_what_a_plain_loop_keeps():
    generator = torch.Generator().manual_seed(0)
    for _ in range(50):
        logits = torch.log_softmax(torch.randn(3, 12, generator=generator) * 2, -1)
        top_k = torch.randint(0, 6, (3,), generator=generator)
        top_p = torch.rand(3, generator=generator) * 0.9 + 0.1
        filtered = filter_top_k_top_p(logits, top_k, top_p)
        for row in range(3):
            kept = {i for i in range(12) if filtered[row, i] > float("-inf")}
            assert kept == reference_keep(logits[row].tolist(), int(top_k[row]), float(top_p[row]))
            assert torch.equal(filtered[row][list(kept)], logits[row][list(kept)])


def test_filter_keeps_what_transformers_warpers_keep():
    """Top-k then top-p, each as the transformers backend applies it (``generate``'s warpers, in its order): the
    nucleus is taken of what top-k kept. Settings where the two orders part ways are among the draws."""
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    generator = torch.Generator().manual_seed(1)
    parted = 0
    for _ in range(200):
        logits = torch.randn(1, 16, generator=generator) * 2
        top_k = int(torch.randint(1, 8, (1,), generator=generator))
        top_p = float(torch.rand(1, generator=generator)) * 0.9 + 0.05
        expected = TopPLogitsWarper(top_p)(None, TopKLogitsWarper(top_k)(None, logits.clone()))
        filtered = filter_top_k_top_p(logits, torch.tensor([top_k]), torch.tensor([top_p]))
        assert torch.equal(filtered.isinf(), expected.isinf())
        whole_vocabulary = TopPLogitsWarper(top_p)(None, logits.clone()).isinf() | TopKLogitsWarper(top_k)(
            None, logits.clone()).isinf()
        parted += int(not torch.equal(whole_vocabulary, expected.isinf()))
    assert parted > 10  # the nucleus of the whole vocabulary keeps more tokens in these draws


def test_a_row_without_truncation_keeps_every_token_when_batched_with_a_truncating_row():
    """A large vocabulary's float32 cumulative mass reaches 1 before its last tokens: a row with top_p 1 (and no
    top-k), filtered because another row of its batch truncates, still keeps all of them."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 151_936, generator=generator) * 3
    filtered = filter_top_k_top_p(logits, torch.tensor([0, 20]), torch.tensor([1.0, 0.9]))
    assert torch.equal(filtered[0], logits[0])
    assert int((~filtered[1].isinf()).sum()) <= 20


def test_samples_follow_the_tempered_distribution_and_report_its_logprob():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).expand(20000, 4)
    temperature = torch.full((20000,), 0.5)
    torch.manual_seed(0)
    tokens, logprobs = sample_tokens(logits, temperature, torch.zeros(20000, dtype=torch.long), torch.ones(20000),
                                     truncate=False)
    expected = torch.softmax(logits[0] / 0.5, -1)
    frequencies = torch.bincount(tokens, minlength=4).float() / 20000
    torch.testing.assert_close(frequencies, expected, atol=0.01, rtol=0)
    torch.testing.assert_close(logprobs, expected.log()[tokens])


def test_truncated_sampling_never_leaves_the_kept_set_and_scores_untruncated():
    logits = torch.tensor([[2.0, 1.9, 0.0, -1.0]]).expand(5000, 4)
    torch.manual_seed(0)
    tokens, logprobs = sample_tokens(logits, torch.ones(5000), torch.full((5000,), 2), torch.ones(5000))
    assert set(tokens.tolist()) == {0, 1}
    torch.testing.assert_close(logprobs, torch.log_softmax(logits[0], -1)[tokens])


def test_greedy_rows_take_the_argmax_scored_at_temperature_one():
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, 0.0, 0.0]])
    tokens, logprobs = sample_tokens(logits, torch.tensor([0.0, 0.0]), torch.zeros(2, dtype=torch.long),
                                     torch.ones(2))
    assert tokens.tolist() == [1, 0]
    torch.testing.assert_close(logprobs, torch.log_softmax(logits, -1)[[0, 1], [1, 0]])


def test_a_temperature_below_the_greedy_bound_is_greedy_and_finite():
    """1e-40 would make every tempered logit infinite (a NaN softmax): it is greedy, scored at temperature 1."""
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, 0.0, 0.0]])
    tiny = torch.tensor([1e-40, 9e-6])
    expected = torch.log_softmax(logits, -1)[[0, 1], [1, 0]]
    for tokens, logprobs in (sample_tokens(logits, tiny, torch.zeros(2, dtype=torch.long), torch.ones(2)),
                             sample_untruncated(logits, tiny)):
        assert tokens.tolist() == [1, 0]
        torch.testing.assert_close(logprobs, expected)
    # The same token scored with a suppressed column: the normalizer at temperature 1 too.
    kept, suppressed = logits[:, :2], logits[:, 2:]
    kept_logprobs = torch.log_softmax(kept, -1)[[0, 1], [1, 0]]
    whole = logprobs_before_suppression(kept_logprobs, kept[[0, 1], [1, 0]], suppressed, tiny)
    torch.testing.assert_close(whole, expected)


def test_a_nucleus_reached_exactly_keeps_no_further_token():
    """Four equally likely tokens: the first two hold exactly half the mass, so top_p 0.5 keeps those two only."""
    filtered = filter_top_k_top_p(torch.zeros(1, 4), torch.zeros(1, dtype=torch.long), torch.tensor([0.5]))
    assert int((~filtered.isinf()).sum()) == 2


def test_a_nucleus_of_no_mass_keeps_the_most_likely_token_of_every_row():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 5.0], [4.0, 1.0, 0.0]])
    filtered = filter_top_k_top_p(logits, torch.zeros(3, dtype=torch.long), torch.zeros(3))
    assert [[i for i in range(3) if filtered[row, i] > float("-inf")] for row in range(3)] == [[1], [2], [0]]


def test_the_greedy_bound_itself_samples_at_that_temperature():
    """Greedy is below the bound: a temperature equal to it is sampled and scored at it (here the argmax takes all
    the tempered mass, a logprob of 0), not scored at temperature 1."""
    logits = torch.tensor([[0.0, 3.0, 1.0]])
    bound = torch.tensor([GREEDY_BELOW_TEMPERATURE])
    for tokens, logprobs in (sample_tokens(logits, bound, torch.zeros(1, dtype=torch.long), torch.ones(1)),
                             sample_untruncated(logits, bound)):
        assert tokens.tolist() == [1] and logprobs.tolist() == [0.0]
    whole = logprobs_before_suppression(torch.tensor([0.0]), logits[:, 1], logits[:, 2:], bound)
    assert whole.tolist() == [0.0]


def test_logprobs_before_suppression_are_the_whole_vocabularys_tempered_logprobs():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 10, generator=generator) * 2
    temperature = torch.tensor([0.5, 1.0, 2.0, 0.7])
    tokens = torch.tensor([0, 3, 5, 6])
    kept, suppressed = logits[:, :7], logits[:, 7:]
    rows = torch.arange(4)
    kept_logprobs = torch.log_softmax(kept / temperature[:, None], -1)[rows, tokens]
    whole = logprobs_before_suppression(kept_logprobs, kept[rows, tokens], suppressed, temperature)
    torch.testing.assert_close(whole, torch.log_softmax(logits / temperature[:, None], -1)[rows, tokens])


def test_default_sampling_params_truncate_nothing():
    params = SamplingParams()
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(0))
    filtered = filter_top_k_top_p(logits, torch.full((2,), params.top_k), torch.full((2,), params.top_p))
    assert torch.equal(filtered, logits)

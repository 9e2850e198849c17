"""The two-pass (inverse CDF) Triton sampler against the torch definitions (Triton's interpreter on a CPU).

The interpreter runs a program in milliseconds whatever its size: the tests keep few programs (rows x splits).
On a CPU, :func:`~turnrl.engine.attention.multiprocessors` stands in 8 multiprocessors: 32 programs in all, so a
row of a small batch splits into blocks of 2048 columns.
"""

from __future__ import annotations

import pytest
import torch

from turnrl.engine import sampler_kernels
from turnrl.engine.sampler_kernels import _sample_rows, _split_partials, _splits, sample_two_pass

pytestmark = pytest.mark.cpu_triton

CPU = torch.device("cpu")
LARGEST_UNIFORM = 1 - 2**-24
"""The largest float32 below 1: the largest value ``torch.rand`` draws."""


def tempered_log_softmax(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    scale = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    return torch.log_softmax(logits.double() / scale.double()[:, None], dim=-1)


def sample_at(logits: torch.Tensor, uniform: torch.Tensor, temperature: float = 1.0,
              inflate_first_split: float = 1.0, per_split: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One row's samples at given uniforms: the first kernel once on the row (Shape (vocab,)), the second once per
    uniform (Shape (n,)) on the same partials, the n rows reading the one row (stride 0). ``inflate_first_split``
    scales the first split's sum of exponentials, as if rounding had made it larger than the scan finds;
    ``per_split`` sets the columns per split (None: the kernels' own choice)."""
    row = logits[None]
    temperatures = torch.tensor([temperature])
    split_max, split_sum, split_argmax, per_split = _split_partials(row, temperatures, per_split)
    split_sum[:, 0] *= inflate_first_split
    n = uniform.shape[0]
    return _sample_rows(row.expand(n, -1), temperatures.expand(n).contiguous(), uniform.float().contiguous(),
                        split_max.expand(n, -1).contiguous(), split_sum.expand(n, -1).contiguous(),
                        split_argmax.expand(n, -1).contiguous(), per_split)


def sparse_row(vocab: int, logits: dict[int, float]) -> torch.Tensor:
    """Shape (vocab,): -inf but at the given columns."""
    row = torch.full((vocab,), float("-inf"))
    row[list(logits)] = torch.tensor(list(logits.values()))
    return row


def test_logprobs_are_the_tempered_log_softmax_across_vocabulary_splits():
    """A 10,000-token vocabulary over five programs per row, rows at several temperatures and greedy."""
    assert _splits(4, 10_000, CPU) == (5, 2048)
    torch.manual_seed(0)
    logits = torch.randn(4, 10_000) * 4
    temperature = torch.tensor([1.0, 0.0, 0.6, 1.7])
    tokens, logprobs = sample_two_pass(logits, temperature)
    expected = tempered_log_softmax(logits, temperature).gather(1, tokens[:, None])[:, 0]
    assert tokens.dtype == torch.int64 and logprobs.dtype == torch.float32
    torch.testing.assert_close(logprobs.double(), expected, atol=1e-5, rtol=1e-5)
    assert tokens[1] == logits[1].argmax()


def test_splits_are_two_blocks_unless_the_gpu_would_be_left_idle(monkeypatch):
    """The second kernel scans one split serially: short splits, one block where two would leave fewer than four
    programs a multiprocessor (an H100's 132)."""
    monkeypatch.setattr(sampler_kernels, "multiprocessors", lambda device: 132)
    assert _splits(256, 151_936, CPU) == (38, 4096)
    assert _splits(64, 151_936, CPU) == (38, 4096)
    assert _splits(8, 151_936, CPU) == (75, 2048)
    assert _splits(1, 1000, CPU) == (1, 2048)


def test_greedy_rows_take_the_first_of_equal_maxima_as_argmax_does(monkeypatch):
    """Three splits of two blocks each (a GPU of one multiprocessor): ties across splits, blocks, sub-blocks of one
    lane, lanes."""
    monkeypatch.setattr(sampler_kernels, "multiprocessors", lambda device: 1)
    assert _splits(8, 9000, CPU) == (3, 4096)
    logits = torch.zeros(8, 9000)
    logits[0, [7, 5000]] = 2.0  # in different splits
    logits[1, [2100, 2101]] = 3.0  # in one sub-block
    logits[2, [600, 88]] = 1.0  # one lane, different sub-blocks
    logits[3, [2053, 5]] = 1.0  # one lane, different blocks of a split
    logits[4, [8192, 4096]] = 1.0  # the first columns of two splits
    logits[5, 8999] = 1.0  # the last column
    logits[6] = float("-inf")  # suppressed tokens around the max
    logits[6, [4200, 6000]] = -3.0
    tokens, logprobs = sample_two_pass(logits, torch.zeros(8))
    assert tokens.tolist() == [7, 2100, 88, 5, 4096, 8999, 4200, 0]
    assert torch.equal(tokens, logits.argmax(dim=1))
    expected = torch.log_softmax(logits.double(), dim=-1).gather(1, tokens[:, None])[:, 0]
    torch.testing.assert_close(logprobs.double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_logits_are_read_in_float32(dtype):
    torch.manual_seed(1)
    logits = (torch.randn(2, 3000) * 3).to(dtype)
    temperature = torch.tensor([0.8, 0.0])
    tokens, logprobs = sample_two_pass(logits, temperature)
    expected = tempered_log_softmax(logits.float(), temperature).gather(1, tokens[:, None])[:, 0]
    torch.testing.assert_close(logprobs.double(), expected, atol=1e-5, rtol=1e-5)
    assert tokens[1] == logits[1].float().argmax()


@pytest.mark.parametrize("per_split", [2048, 4096])
def test_tokens_are_the_inverse_cdf_of_the_uniforms(per_split):
    """Uniforms over [0, 1) on a row of several splits (of one block, or two scanned in turn; a split's worth
    suppressed, and every third column): the float64 inverse CDF's token wherever the uniform is not within
    rounding of a step of the CDF, never a suppressed one, nondecreasing in the uniform."""
    torch.manual_seed(3)
    logits = torch.randn(12_000) * 2
    logits[::3] = float("-inf")
    logits[4096:8192] = float("-inf")
    uniform = torch.cat([torch.linspace(0, 1, 200)[:-1], torch.tensor([LARGEST_UNIFORM])])
    for temperature in (1.0, 0.7):
        tokens, logprobs = sample_at(logits, uniform, temperature, per_split=per_split)
        log_softmax = torch.log_softmax(logits.double() / temperature, dim=0)
        cdf = log_softmax.exp().cumsum(0)
        expected = torch.searchsorted(cdf, uniform.double(), right=True)
        clear = (cdf[None, :] - uniform.double()[:, None]).abs().min(dim=1).values > 1e-5
        assert clear.sum() > 150
        assert torch.equal(tokens[clear], expected[clear])
        assert torch.isfinite(logits[tokens]).all()
        assert (tokens.diff() >= 0).all()
        torch.testing.assert_close(logprobs.double(), log_softmax[tokens], atol=1e-5, rtol=1e-5)


def test_all_the_mass_on_one_token_of_the_last_split():
    """The last split's token, at the extreme uniforms, whether the rest is suppressed or underflows to 0."""
    uniform = torch.tensor([0.0, 0.3, LARGEST_UNIFORM])
    for rest in (float("-inf"), -200.0):
        logits = torch.full((10_000,), rest)
        logits[9000] = 5.0
        tokens, logprobs = sample_at(logits, uniform)
        assert tokens.tolist() == [9000] * 3
        torch.testing.assert_close(logprobs, torch.zeros(3))


def test_the_mass_at_the_end_of_a_split():
    """Uniforms dense about the CDF's step at the first split's last column: that column below the step, the
    next split's first token with mass above it, nothing else; past the total (1.0, more than ``torch.rand``
    draws), the row's last column with mass, not a suppressed split after it."""
    logits = sparse_row(10_000, {0: 0.3, 2047: 1.0, 2050: 0.5, 5999: -0.2})
    cdf = torch.softmax(logits.double(), dim=0).cumsum(0)
    step = cdf[2047].float()
    offsets = torch.arange(-64, 65) * 2**-24
    tokens, _ = sample_at(logits, torch.cat([step + offsets, torch.tensor([0.0, LARGEST_UNIFORM, 1.0])]))
    near, extremes = tokens[:-3], tokens[-3:]
    assert set(near.tolist()) == {2047, 2050}
    assert (near.diff() >= 0).all()
    assert (near[offsets < -1e-6] == 2047).all() and (near[offsets > 1e-6] == 2050).all()
    assert extremes.tolist() == [0, 5999, 5999]


def test_a_target_past_the_mass_the_scan_finds_takes_the_splits_last_column_with_mass():
    """The first split's partial sum inflated by 1% (as rounding might, a little): a uniform landing in the
    surplus takes the split's last column with mass, not a suppressed column nor one past the split."""
    logits = sparse_row(6000, {0: 0.3, 2047: 1.0, 2050: 0.5})
    weights = torch.tensor([0.3, 1.0]).exp().sum()
    total = 1.01 * weights + torch.tensor(0.5).exp()
    tokens, logprobs = sample_at(logits, torch.tensor([1.005 * weights / total]), inflate_first_split=1.01)
    assert tokens.tolist() == [2047]
    assert torch.isfinite(logprobs).all()


def total_variation(tokens: torch.Tensor, probabilities: torch.Tensor) -> float:
    frequencies = torch.bincount(tokens, minlength=probabilities.shape[0]).double() / tokens.shape[0]
    return ((frequencies - probabilities).abs().sum() / 2).item()


def test_samples_follow_the_softmax():
    """400 rows of the same logits (seeded), half at temperature 1 and half at 3, in one batch (the interpreter's time
    is its programs, one per row here): each half's token frequencies are within sampling noise of its tempered
    softmax. At 200 draws a total variation of 0.05-0.07 is typical and 0.18 is exceeded once in 200,000; always the
    argmax, uniform draws (at temperature 1) or the other half's temperature give 0.3 to 0.75, over 0.18 in every
    one of 50,000 draws. A temperature off by half of itself is caught here only at times (at temperature 1, one draw
    in six): the inverse-CDF and log-prob tests above check the tempered distribution exactly."""
    logits = torch.tensor([0.0, 1.0, 2.0, -1.0, 0.5, 3.0, -5.0, 1.5]).repeat(400, 1)
    temperatures = torch.tensor([1.0, 3.0]).repeat_interleave(200)
    torch.manual_seed(2)
    tokens, _ = sample_two_pass(logits, temperatures)
    for half, temperature in ((slice(0, 200), 1.0), (slice(200, 400), 3.0)):
        assert total_variation(tokens[half], torch.softmax(logits[0].double() / temperature, 0)) < 0.18


@pytest.mark.slow  # 14 s; one split's samples against the softmax, and each split's inverse CDF, by default
def test_samples_follow_the_softmax_across_splits(monkeypatch):
    """200 rows of six splits each (a GPU of many multiprocessors), heavy tokens spread over them (at both ends of
    a split too), the rest of a split's mass in one bucket, the fourth split suppressed: the bucket frequencies
    pass a chi-square test against the tempered softmax (ten degrees of freedom: 35.6 is exceeded once in
    10,000 draws)."""
    monkeypatch.setattr(sampler_kernels, "multiprocessors", lambda device: 10_000)
    rows, vocab, temperature = 200, 12_000, 1.3
    assert _splits(rows, vocab, CPU) == (6, 2048)
    heavy = torch.tensor([100, 2047, 2048, 5000, 9000, 11_999])
    row = torch.zeros(vocab)
    row[heavy] = temperature * torch.tensor([2000.0, 1000, 3000, 4000, 1500, 2500]).log()
    row[6144:8192] = float("-inf")
    # Buckets: each heavy token alone, then the rest of each split.
    bucket = torch.arange(vocab) // 2048 + len(heavy)
    bucket[heavy] = torch.arange(len(heavy))
    torch.manual_seed(4)
    tokens, _ = sample_two_pass(row.repeat(rows, 1), torch.full((rows,), temperature))
    assert torch.isfinite(row[tokens]).all()
    counts = torch.bincount(bucket[tokens], minlength=12).double()
    expected = rows * torch.zeros(12, dtype=torch.float64).index_add_(
        0, bucket, torch.softmax(row.double() / temperature, 0))
    kept = expected > 0
    assert kept.sum() == 11 and counts[~kept].sum() == 0
    assert ((counts - expected)[kept] ** 2 / expected[kept]).sum() < 35.6


def test_torch_seed_fixes_the_samples():
    logits = torch.randn(6, 2500)
    torch.manual_seed(5)
    first = sample_two_pass(logits, torch.ones(6))[0]
    torch.manual_seed(5)
    again = sample_two_pass(logits, torch.ones(6))[0]
    torch.manual_seed(6)
    other = torch.stack([sample_two_pass(logits, torch.ones(6))[0] for _ in range(3)])
    assert torch.equal(first, again)
    assert not all(torch.equal(first, row) for row in other)


def test_logits_with_a_strided_vocabulary_are_made_contiguous():
    torch.manual_seed(7)
    logits = torch.randn(3000, 2).T
    temperature = torch.tensor([0.0, 0.0])
    tokens, logprobs = sample_two_pass(logits, temperature)
    assert torch.equal(tokens, logits.argmax(dim=1))
    expected = tempered_log_softmax(logits, temperature).gather(1, tokens[:, None])[:, 0]
    torch.testing.assert_close(logprobs.double(), expected, atol=1e-5, rtol=1e-5)

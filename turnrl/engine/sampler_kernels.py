"""Sampling without top-k / top-p by the inverse CDF: two Triton kernels, no per-element random numbers (GPU).

The engine's earlier sampler, one Triton kernel reading each row once (Gumbel-max), took 166 us of an H100's decode
step at batch 256 and a 151,936-token vocabulary (bf16), where reading the logits takes ~23 us: it was bound by
the arithmetic of a Philox random number and two logs per element (the Gumbel noise), and ~10 small torch kernels
finished its job. A row needs only one random number: draw u uniform, and take the first token whose cumulative
probability exceeds u. These two kernels took 77 us together in the same step, 45 us with short splits
(``benchmarks/sampler.py``).

The first kernel reads each row once, one slice (a split) per program: per split the max and sum of exponentials
of the tempered logits (the log-normalizer) and the argmax. The second kernel, one program per row, combines the
splits, picks the split holding the u-quantile from their weights, and scans that split alone (a fraction of the
row) for the token, with a cumulative sum per block. It also computes the logprob, so nothing is left to torch but
the ``torch.rand`` of the uniforms.

The same distribution as the torch sampler (the tempered, untruncated softmax), greedy rows the plain argmax (first
index of the max) scored at temperature 1, the logprob under the tempered, untruncated distribution; the
uniforms come from torch's generator, so that ``torch.manual_seed`` fixes what a fixed batch samples.
"""

from __future__ import annotations

import torch

from turnrl.engine.attention import multiprocessors, triton

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _split_partials_kernel(
        Logits, Temperature, Max, SumExp, Argmax,
        stride, vocab, per_split, splits,
        LANES: tl.constexpr,
    ):
        """Grid (rows, splits): the max, the sum of exponentials relative to it, and the argmax (first index of
        the max) of the tempered logits of one split of a row, each Shape (rows, splits)."""
        row = tl.program_id(0)
        split = tl.program_id(1)
        temperature = tl.load(Temperature + row)
        scale = tl.where(temperature <= 0, 1.0, temperature)
        begin = split * per_split
        end = tl.minimum(begin + per_split, vocab)
        logits_row = Logits + row.to(tl.int64) * stride
        lanes = tl.arange(0, LANES)

        # Per-lane state, reduced across lanes once at the end: no reduction inside the loop.
        lane_max = tl.full((LANES,), float("-inf"), tl.float32)
        lane_sum = tl.zeros((LANES,), tl.float32)
        # A lane that sees only -inf keeps the split's first column: the argmax of an all -inf split, as torch's.
        lane_arg = tl.full((LANES,), 0, tl.int32) + begin
        for start in range(begin, end, 4 * LANES):
            cols0 = start + lanes
            cols1 = cols0 + LANES
            cols2 = cols1 + LANES
            cols3 = cols2 + LANES
            x0 = tl.load(logits_row + cols0, mask=cols0 < end, other=float("-inf")).to(tl.float32) / scale
            x1 = tl.load(logits_row + cols1, mask=cols1 < end, other=float("-inf")).to(tl.float32) / scale
            x2 = tl.load(logits_row + cols2, mask=cols2 < end, other=float("-inf")).to(tl.float32) / scale
            x3 = tl.load(logits_row + cols3, mask=cols3 < end, other=float("-inf")).to(tl.float32) / scale
            # The four sub-blocks in column order, a strictly greater value only replacing the argmax: the first of
            # equal maxima stays.
            new_max = lane_max
            lane_arg = tl.where(x0 > new_max, cols0, lane_arg)
            new_max = tl.maximum(new_max, x0)
            lane_arg = tl.where(x1 > new_max, cols1, lane_arg)
            new_max = tl.maximum(new_max, x1)
            lane_arg = tl.where(x2 > new_max, cols2, lane_arg)
            new_max = tl.maximum(new_max, x2)
            lane_arg = tl.where(x3 > new_max, cols3, lane_arg)
            new_max = tl.maximum(new_max, x3)
            # One rescaling of the running sum per four columns (five exponentials, not eight). A lane that has seen
            # only -inf keeps a sum of 0 (with a finite reference: -inf - -inf is NaN).
            reference = tl.where(new_max == float("-inf"), 0.0, new_max)
            lane_sum = (lane_sum * tl.exp(lane_max - reference) + tl.exp(x0 - reference) + tl.exp(x1 - reference)
                        + tl.exp(x2 - reference) + tl.exp(x3 - reference))
            lane_max = new_max

        top = tl.max(lane_max, axis=0)
        # Lanes that have seen only -inf hold a sum of 0 (a finite reference again, for an all -inf split).
        total = tl.sum(lane_sum * tl.exp(lane_max - tl.where(top == float("-inf"), 0.0, top)), axis=0)
        # The first column among the lanes holding the max (an all -inf split: its first column).
        argmax = tl.min(tl.where(lane_max == top, lane_arg, vocab), axis=0)
        out = row * splits + split
        tl.store(Max + out, top)
        tl.store(SumExp + out, total)
        tl.store(Argmax + out, argmax)

    @triton.jit
    def _choose_split(split_max, weight, split_ids, greedy, uniform, splits):
        """The split holding the row's token (greedy: the max's split; first of equal maxima, the lower split), and
        the mass of the splits before it. Shapes (SPLITS_PAD,) in, scalars out."""
        top = tl.max(split_max, axis=0)
        greedy_split = tl.min(tl.where(split_max == top, split_ids, splits), axis=0)
        cumulative = tl.cumsum(weight, axis=0)
        # Its max is the total the uniform scales: the very sums the comparison below sees.
        target = uniform * tl.max(cumulative, axis=0)
        # The first split past the target, one with mass: a parallel scan's sums, each rounded its own way, need
        # not be nondecreasing where a weight is 0. Past all of them (float rounding leaving the target at the
        # total), the last split with mass, never an empty one.
        sampled = tl.min(tl.where((cumulative > target) & (weight > 0), split_ids, splits), axis=0)
        sampled = tl.minimum(sampled, tl.max(tl.where(weight > 0, split_ids, 0), axis=0))
        # The mass before the split (target - before may round a hair below 0: the scan takes no column without
        # mass).
        before = tl.max(tl.where(split_ids < sampled, cumulative, 0.0), axis=0)
        return tl.where(greedy, greedy_split, sampled), target - before

    @triton.jit
    def _sample_rows_kernel(
        Logits, Temperature, Uniform, Max, SumExp, Argmax, Tokens, Logprobs,
        stride, vocab, per_split, splits,
        SPLITS_PAD: tl.constexpr, SCAN: tl.constexpr,
    ):
        """Grid (rows,): a row's token (the first column whose cumulative probability exceeds its uniform, or the
        argmax for greedy rows) and its logprob, from the row's split partials Shape (rows, splits)."""
        row = tl.program_id(0)
        temperature = tl.load(Temperature + row)
        greedy = temperature <= 0
        scale = tl.where(greedy, 1.0, temperature)
        logits_row = Logits + row.to(tl.int64) * stride
        split_ids = tl.arange(0, SPLITS_PAD)
        inside = split_ids < splits
        split_max = tl.load(Max + row * splits + split_ids, mask=inside, other=float("-inf"))
        split_sum = tl.load(SumExp + row * splits + split_ids, mask=inside, other=0.0)
        # An all -inf split has a sum of 0: it weighs 0, never chosen. (A finite reference for an all -inf row:
        # -inf - -inf is NaN.)
        top = tl.max(split_max, axis=0)
        top = tl.where(top == float("-inf"), 0.0, top)
        weight = split_sum * tl.exp(split_max - top)
        log_normalizer = top + tl.log(tl.sum(weight, axis=0))
        split, target = _choose_split(split_max, weight, split_ids, greedy, tl.load(Uniform + row), splits)
        # The split's argmax: the greedy token, and the sampled one's fallback (a column with the most mass).
        split_argmax = tl.load(Argmax + row * splits + split)

        begin = split * per_split
        end = tl.where(greedy, begin, tl.minimum(begin + per_split, vocab))  # greedy rows scan nothing
        cols = tl.arange(0, SCAN)
        start = begin
        running = 0.0
        token = vocab
        last = split_argmax
        # Blocks in column order until one holds the target's column: on average half the split is read.
        while (start < end) & (token == vocab):
            columns = start + cols
            valid = columns < end
            x = tl.load(logits_row + columns, mask=valid, other=float("-inf")).to(tl.float32) / scale
            mass = tl.exp(x - top)
            cumulative = running + tl.cumsum(mass, axis=0)
            # mass > 0: a column that can be sampled, even where the scan's rounding leaves a column without mass a
            # hair above the one before it, or the target a hair below 0.
            token = tl.min(tl.where((cumulative > target) & (mass > 0), columns, vocab), axis=0)
            # Rounding (the partials summed in another order) may leave the target past the split's last mass.
            last = tl.maximum(last, tl.max(tl.where(mass > 0, columns, -1), axis=0))
            running = tl.max(cumulative, axis=0)
            start += SCAN
        token = tl.where(greedy, split_argmax, tl.where(token < vocab, token, last))
        logit = tl.load(logits_row + token).to(tl.float32) / scale
        tl.store(Tokens + row, token.to(tl.int64))
        tl.store(Logprobs + row, logit - log_normalizer)


LANES = 512
BLOCK = 4 * LANES
"""Columns the first kernel's program reads per iteration: four sub-blocks of ``LANES``."""
SCAN = 2048
"""Columns the second kernel scans per iteration, with one cumulative sum."""


def _splits(rows: int, vocab: int, device: torch.device) -> tuple[int, int]:
    """Splits per row and columns per split (a whole number of blocks).

    The second kernel scans one split of its row serially, so splits are short: two blocks, or one where two-block
    splits would leave fewer than four programs a multiprocessor (a small batch). At batch 256 on an H100 (151,936
    columns, bf16) that took the two kernels from 77 to 45 us: with three long splits a row (as many as filled the
    GPU), the scan of 51,200 columns was half of it.
    """
    blocks = triton.cdiv(vocab, BLOCK)
    blocks_per_split = 2 if rows * triton.cdiv(blocks, 2) >= 4 * multiprocessors(device) else 1
    per_split = blocks_per_split * BLOCK
    return triton.cdiv(vocab, per_split), per_split


def _split_partials(logits: torch.Tensor, temperature: torch.Tensor, per_split: int | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """The first kernel: per split of each row, the max of the tempered logits, the sum of exponentials relative
    to it, and the argmax, each Shape (b, splits) (float32, float32, int32); and the columns per split.

    Args:
        logits: Shape (b, vocab), the vocab dim contiguous.
        temperature: Shape (b,) float32, contiguous.
        per_split: columns per split, a multiple of :data:`BLOCK` (None: :func:`_splits`'s).
    """
    rows, vocab = logits.shape
    if per_split is None:
        splits, per_split = _splits(rows, vocab, logits.device)
    else:
        splits = triton.cdiv(vocab, per_split)
    split_max = torch.empty(rows, splits, dtype=torch.float32, device=logits.device)
    split_sum = torch.empty_like(split_max)
    split_argmax = torch.empty(rows, splits, dtype=torch.int32, device=logits.device)
    _split_partials_kernel[(rows, splits)](
        logits, temperature, split_max, split_sum, split_argmax,
        logits.stride(0), vocab, per_split, splits, LANES=LANES,
    )
    return split_max, split_sum, split_argmax, per_split


def _sample_rows(logits: torch.Tensor, temperature: torch.Tensor, uniform: torch.Tensor, split_max: torch.Tensor,
                 split_sum: torch.Tensor, split_argmax: torch.Tensor, per_split: int,
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The second kernel: each row's token and logprob from its split partials (:func:`_split_partials`'s).

    Args:
        logits: Shape (b, vocab), the vocab dim contiguous.
        temperature: Shape (b,) float32, contiguous.
        uniform: Shape (b,) float32 in [0, 1): the row's quantile (unused by greedy rows).

    Returns:
        tokens Shape (b,) long, logprobs Shape (b,) float32.
    """
    rows, vocab = logits.shape
    splits = split_max.shape[1]
    tokens = torch.empty(rows, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(rows, dtype=torch.float32, device=logits.device)
    _sample_rows_kernel[(rows,)](
        logits, temperature, uniform, split_max, split_sum, split_argmax, tokens, logprobs,
        logits.stride(0), vocab, per_split, splits, SPLITS_PAD=triton.next_power_of_2(splits), SCAN=SCAN,
    )
    return tokens, logprobs


def sample_two_pass(logits: torch.Tensor, temperature: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`~turnrl.engine.sampling.sample_untruncated` by the inverse CDF (no ``generator``: torch's global one
    draws the uniforms).

    Args:
        logits: raw logits, Shape (b, vocab), any float dtype, the vocab dim contiguous.
        temperature: per row, Shape (b,) float32; 0 is greedy (scored at temperature 1).

    Returns:
        tokens Shape (b,) long, logprobs Shape (b,) float32.
    """
    if triton is None:
        raise RuntimeError("sample_two_pass needs Triton; install a CUDA build of torch, or set "
                           "model.engine.triton=false")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    temperature = temperature.float().contiguous()
    # Drawn before the launches, from torch's generator: torch.manual_seed fixes the samples.
    uniform = torch.rand(logits.shape[0], device=logits.device)
    return _sample_rows(logits, temperature, uniform, *_split_partials(logits, temperature))

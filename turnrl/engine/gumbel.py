"""Sampling without top-k / top-p in one pass over the logits: a Triton kernel (GPU).

:func:`~turnrl.engine.sampling.sample_untruncated` in torch reads a step's (b, vocab) logits three times even
compiled (the log-normalizer's two reductions, then the Gumbel argmax): at batch 256 and a 151,936-token
vocabulary that was 0.39 ms of a 2.7 ms decode step on an H100. Here each program reads one slice of a row once,
keeping per lane (reduced across lanes once, at the end) the running max and sum of exponentials (the
log-normalizer) and the best Gumbel-perturbed logit; a few torch operations on the (b, splits) partial results
finish the job.

The same distribution as the torch sampler (Gumbel-max: argmax of tempered logits minus log(E), E ~ Exp(1),
here E = -log(U) with U uniform from Triton's Philox), greedy rows the plain argmax (first index of the max), the
logprob under the tempered, untruncated distribution; the random stream is another one, seeded from torch's
generator, so that ``torch.manual_seed`` fixes what a fixed batch samples.
"""

from __future__ import annotations

import torch

from turnrl.engine.attention import multiprocessors, triton

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _lane_update(lane_max, lane_sum, lane_best, lane_token, lane_logit, Logits, cols, end, scale, greedy, uniform):
        """Fold one sub-block into each lane's running state: its max and sum of exponentials, and its best
        Gumbel-perturbed logit (token and tempered logit). Lanes see their columns in increasing order, and only a
        strictly better value replaces the best: the first of equal maxima stays."""
        inside = cols < end
        logits = tl.load(Logits + cols, mask=inside, other=float("-inf")).to(tl.float32) / scale
        new_max = tl.maximum(lane_max, logits)
        # A lane that has seen only -inf keeps a sum of 0 (with a finite reference: -inf - -inf is NaN).
        reference = tl.where(new_max == float("-inf"), 0.0, new_max)
        lane_sum = lane_sum * tl.exp(lane_max - reference) + tl.exp(logits - reference)
        perturbed = tl.where(greedy, logits, logits - tl.log(-tl.log(uniform)))
        better = inside & (perturbed > lane_best)
        return (new_max, lane_sum, tl.where(better, perturbed, lane_best), tl.where(better, cols, lane_token),
                tl.where(better, logits, lane_logit))

    @triton.jit
    def _gumbel_partials_kernel(
        Logits, Temperature, Seed, Max, SumExp, Best, BestToken, BestLogit,
        stride, vocab, per_split, splits,
        LANES: tl.constexpr,
    ):
        row = tl.program_id(0)
        split = tl.program_id(1)
        temperature = tl.load(Temperature + row)
        greedy = temperature <= 0
        scale = tl.where(greedy, 1.0, temperature)
        seed = tl.load(Seed)
        begin = split * per_split
        end = tl.minimum(begin + per_split, vocab)
        logits_row = Logits + row.to(tl.int64) * stride
        lanes = tl.arange(0, LANES)

        # Per-lane state, reduced across lanes once at the end: no reduction inside the loop.
        lane_max = tl.full((LANES,), float("-inf"), tl.float32)
        lane_sum = tl.zeros((LANES,), tl.float32)
        lane_best = tl.full((LANES,), float("-inf"), tl.float32)
        lane_token = tl.zeros((LANES,), tl.int32)
        lane_logit = tl.full((LANES,), float("-inf"), tl.float32)
        for start in range(begin, end, 4 * LANES):
            # One Philox call gives four uniforms: one for each of the four sub-blocks of this block.
            u0, u1, u2, u3 = tl.rand4x(seed, row.to(tl.int64) * vocab + start + lanes)
            lane_max, lane_sum, lane_best, lane_token, lane_logit = _lane_update(
                lane_max, lane_sum, lane_best, lane_token, lane_logit, logits_row, start + lanes, end, scale, greedy,
                u0)
            lane_max, lane_sum, lane_best, lane_token, lane_logit = _lane_update(
                lane_max, lane_sum, lane_best, lane_token, lane_logit, logits_row, start + LANES + lanes, end, scale,
                greedy, u1)
            lane_max, lane_sum, lane_best, lane_token, lane_logit = _lane_update(
                lane_max, lane_sum, lane_best, lane_token, lane_logit, logits_row, start + 2 * LANES + lanes, end,
                scale, greedy, u2)
            lane_max, lane_sum, lane_best, lane_token, lane_logit = _lane_update(
                lane_max, lane_sum, lane_best, lane_token, lane_logit, logits_row, start + 3 * LANES + lanes, end,
                scale, greedy, u3)

        top = tl.max(lane_max, axis=0)
        total = tl.sum(tl.where(lane_max == float("-inf"), 0.0, lane_sum * tl.exp(lane_max - top)), axis=0)
        best = tl.max(lane_best, axis=0)
        # The first token among equal best values, as torch.argmax's.
        token = tl.min(tl.where(lane_best == best, lane_token, vocab), axis=0)
        logit = tl.max(tl.where(lane_token == token, lane_logit, float("-inf")), axis=0)
        out = row * splits + split
        tl.store(Max + out, top)
        tl.store(SumExp + out, total)
        tl.store(Best + out, best)
        tl.store(BestToken + out, token.to(tl.int64))
        tl.store(BestLogit + out, logit)


LANES = 512
BLOCK = 4 * LANES
"""Columns a program reads per iteration: four sub-blocks of ``LANES``."""


def sample_one_pass(logits: torch.Tensor, temperature: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`~turnrl.engine.sampling.sample_untruncated` (no ``generator``: torch's global one seeds it).

    Args:
        logits: raw logits, Shape (b, vocab), any float dtype, the vocab dim contiguous.
        temperature: per row, Shape (b,) float32; 0 is greedy (scored at temperature 1).

    Returns:
        tokens Shape (b,) long, logprobs Shape (b,) float32.
    """
    if triton is None:
        raise RuntimeError("sample_one_pass needs Triton; install a CUDA build of torch, or set "
                           "model.engine.triton=false")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    rows, vocab = logits.shape
    device = logits.device
    # Enough programs to fill the GPU (four per multiprocessor) at any batch; each at least one block.
    splits = max(1, min(triton.cdiv(vocab, BLOCK), triton.cdiv(4 * multiprocessors(device), rows)))
    per_split = triton.cdiv(triton.cdiv(vocab, splits), BLOCK) * BLOCK
    splits = triton.cdiv(vocab, per_split)
    seed = torch.randint(0, 2**31 - 1, (1,), device=device)
    partial = torch.empty(4, rows, splits, dtype=torch.float32, device=device)
    best_token = torch.empty(rows, splits, dtype=torch.int64, device=device)
    _gumbel_partials_kernel[(rows, splits)](
        logits, temperature.float().contiguous(), seed, partial[0], partial[1], partial[2], best_token, partial[3],
        logits.stride(0), vocab, per_split, splits, LANES=LANES,
    )
    row_max, sum_exp, best, best_logit = partial
    top = row_max.max(dim=1, keepdim=True).values
    log_normalizer = top[:, 0] + torch.log((sum_exp * torch.exp(row_max - top)).sum(dim=1))
    winner = best.argmax(dim=1, keepdim=True)
    tokens = best_token.gather(1, winner)[:, 0]
    return tokens, best_logit.gather(1, winner)[:, 0] - log_normalizer

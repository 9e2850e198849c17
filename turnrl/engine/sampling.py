"""Sampling one token per sequence, with the logprob PPO needs.

The logprob of a sampled token is taken under ``softmax(logits / temperature)``
before top-k / top-p truncation, as the transformers backend reports it: that
is the distribution the trainer's logprobs are compared with.
"""

from __future__ import annotations

import torch

from turnrl.config import GREEDY_BELOW_TEMPERATURE


def filter_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) the tokens outside each row's top-k, then outside the nucleus (top-p) of what top-k kept.

    The nucleus is measured on the top-k tokens' renormalised distribution, as transformers' warpers (the other
    backend) and vLLM chain the two: measured on the whole vocabulary it would keep more tokens than they do.
    A row with ``top_p`` 1 is not cut by mass at all: float32 rounding brings the cumulative mass to 1 before
    the last tokens of a large vocabulary, and a row that asked for no nucleus must keep them whatever rows it is
    batched with.

    Args:
        logits: tempered logits, Shape (b, vocab).
        top_k: tokens kept per row, Shape (b,); 0 keeps all.
        top_p: nucleus mass per row, Shape (b,); 1 keeps all.

    Returns:
        Shape (b, vocab): ``logits`` with the dropped tokens at -inf. The most likely token is always kept.
    """
    vocab = logits.shape[-1]
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    rank = torch.arange(vocab, device=logits.device).expand_as(sorted_logits)
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).unsqueeze(-1)
    sorted_logits = sorted_logits.masked_fill(rank >= k, float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs  # mass of the strictly more likely tokens
    drop = (mass_before >= top_p.unsqueeze(-1)) & (top_p < 1.0).unsqueeze(-1)
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def sample_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    generator: torch.Generator | None = None,
    truncate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row and its logprob under the tempered, untruncated distribution.

    Args:
        logits: raw logits, Shape (b, vocab), any float dtype (read in float32).
        temperature: per row, Shape (b,); 0 (or below ``GREEDY_BELOW_TEMPERATURE``) is greedy (scored at
            temperature 1).
        top_k: per row, Shape (b,); 0 disables.
        top_p: per row, Shape (b,); 1 disables.
        generator: a seeded generator on the logits' device; None draws from torch's global one (the engine
            does, so that a run's step seed fixes what it samples).
        truncate: apply top-k / top-p; False skips the sort over the vocabulary when no row needs it
            (:func:`sample_untruncated`, which the engine compiles on a GPU).

    Returns:
        tokens Shape (b,) long, logprobs Shape (b,) float32.
    """
    if not truncate:
        return sample_untruncated(logits, temperature, generator)
    tempered, greedy = _tempered(logits, temperature)
    log_normalizer = torch.logsumexp(tempered, dim=-1)
    tokens = _gumbel_argmax(filter_top_k_top_p(tempered, top_k, top_p), greedy, generator)
    return tokens, tempered.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - log_normalizer


def sample_untruncated(
    logits: torch.Tensor, temperature: torch.Tensor, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`sample_tokens` without top-k / top-p: every step of it is elementwise or a row reduction.

    Compiled, the float32 cast, the temperature, the log-normalizer and the Gumbel argmax become a couple of
    passes over the (b, vocab) logits instead of about ten.
    """
    tempered, greedy = _tempered(logits, temperature)
    log_normalizer = torch.logsumexp(tempered, dim=-1)
    tokens = _gumbel_argmax(tempered, greedy, generator)
    return tokens, tempered.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - log_normalizer


def _tempered(logits: torch.Tensor, temperature: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 ``logits / temperature`` (greedy rows at temperature 1), and which rows are greedy, Shape (b,)."""
    greedy = temperature < GREEDY_BELOW_TEMPERATURE
    scale = torch.where(greedy, torch.ones_like(temperature), temperature).unsqueeze(-1)
    return logits.float() / scale, greedy


def _gumbel_argmax(candidates: torch.Tensor, greedy: torch.Tensor, generator: torch.Generator | None
                   ) -> torch.Tensor:
    """Sampled tokens of softmax(candidates) per row, the argmax for greedy rows, Shape (b,).

    Gumbel-max: argmax(logits + G) with G = -log(E), E ~ Exp(1), samples from softmax(candidates) with one
    random draw per entry and no normalisation; -inf entries can never win. A greedy row's candidates are
    its logits (temperature 1), so one argmax serves both kinds of row.
    """
    noise = torch.empty_like(candidates).exponential_(generator=generator).log_()
    return torch.argmax(torch.where(greedy.unsqueeze(-1), candidates, candidates - noise), dim=-1)


def logprobs_before_suppression(
    logprobs: torch.Tensor,
    token_logits: torch.Tensor,
    suppressed_logits: torch.Tensor,
    temperature: torch.Tensor,
) -> torch.Tensor:
    """The sampled tokens' logprobs under the whole vocabulary, from their logprobs with some tokens suppressed.

    A VLM never samples its vision tokens (they are masked to -inf before sampling), and its logprobs are
    reported, like top-k/top-p truncation, under the untruncated tempered softmax. The two differ only by the
    normalizer: ``lse_all = logaddexp(lse_kept, lse_suppressed)``, and ``lse_kept`` is the token's tempered logit
    minus its suppressed logprob; so a few gathered columns give it, with no second pass over the logits.

    Args:
        logprobs: the sampled tokens' logprobs with the suppressed tokens removed, Shape (n,).
        token_logits: the sampled tokens' logits, Shape (n,).
        suppressed_logits: the suppressed tokens' logits, before masking, Shape (n, s).
        temperature: Shape (n,); 0 or below ``GREEDY_BELOW_TEMPERATURE`` (greedy) counts as 1.

    Returns:
        Shape (n,), float32.
    """
    greedy = temperature < GREEDY_BELOW_TEMPERATURE
    scale = torch.where(greedy, torch.ones_like(temperature), temperature).float()
    tempered = token_logits.float() / scale
    kept = tempered - logprobs.float()
    suppressed = torch.logsumexp(suppressed_logits.float() / scale.unsqueeze(-1), dim=-1)
    return tempered - torch.logaddexp(kept, suppressed)

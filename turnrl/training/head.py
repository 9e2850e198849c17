"""The LM head as the trainer uses it: log-probs and entropies of chosen tokens, never the whole logits.

Notation: n scored tokens, h hidden size, v rows of the head (the embedding's vocabulary), c a chunk of rows.

A head of 152k rows turns each scored token into 152k float32 logits: 4,096 tokens make 2.5 GB, and autograd
keeps the log-softmax of every chunk for the backward pass, so a micro-batch of 16k tokens held about 20 GB of
logits. :class:`ScoringHead` computes, chunk by chunk, only what the loss reads (the chosen token's log-prob
and the entropy, through the log-sum-exp), keeps ``(n,)`` tensors for the backward pass and recomputes each
chunk's logits there. Peak memory is one chunk's logits, forward and backward.

No library of the field does this for log-probs *and* entropy under a temperature and a vocabulary limit
(fused linear cross-entropy kernels return a mean loss only), so it is written here, in plain torch.

Eagerly, the arithmetic on a chunk's logits is a dozen kernels that each read and write the whole (c, v) float32
block: at 2,048 tokens and 152k rows about 13 GB of memory traffic forward and 22 GB backward, where the
chunk's bf16 logits are 0.6 GB. Compiled (``compiled``: the trainer's ``model.compile``), the forward's
statistics are one or two reductions over the bf16 logits and the backward's gradient one elementwise kernel
that reads them and writes the bf16 gradient (:func:`chunk_scores`, :func:`chunk_logit_grads`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from turnrl.config import is_greedy

DEFAULT_CHUNK = 2048
"""Scored tokens per chunk. At a 152k vocabulary one chunk's float32 logits take 1.2 GB, and a pass holds two
such buffers; a (2048 x h) @ (h x 152k) product still runs near the GPU's peak."""

_LOG_P_FLOOR = -1e4
"""Log-probs are clamped to it: exp(-1e4) is exactly 0 in float32 (as is any p below about exp(-104)), so
nothing changes for real rows, while the -inf of the rows past the vocabulary limit turn into a finite number:
``p * log p`` and ``p * (log p + H) * g`` are then 0 there, not NaN."""


def _compute_dtype(states: torch.Tensor) -> torch.dtype:
    """The dtype ``head(states)`` would multiply in: autocast's where it is on (bf16 runs), else the states'."""
    device = states.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else states.dtype


def _chunk_log_probs(
    states: torch.Tensor, weight: torch.Tensor, scale: float, vocab_limit: int, dtype: torch.dtype
) -> torch.Tensor:
    """``log_softmax(states @ weight.T / scale)`` over the rows below ``vocab_limit``, in float32 (the eager path).

    The product runs in ``dtype`` (see :func:`_compute_dtype`; ``weight`` is in it already), then in float32, in
    place on one float32 copy of the product. Rows at or past ``vocab_limit`` get probability 0 (and the log-prob
    floor).

    Returns:
        ``log_p`` Shape (c, v) float32.
    """
    log_p = F.linear(states.to(dtype), weight).float()
    if scale != 1.0:
        log_p.div_(scale)
    if vocab_limit < log_p.shape[-1]:
        log_p[:, vocab_limit:] = float("-inf")
    lse = torch.logsumexp(log_p, dim=-1)
    return log_p.sub_(lse[:, None]).clamp_(min=_LOG_P_FLOOR)


def _scaled_logits(logits: torch.Tensor, scale: float, vocab_limit: int) -> torch.Tensor:
    """``logits / scale`` in float32 with the rows at or past ``vocab_limit`` at -inf. Shape (c, v)."""
    columns = torch.arange(logits.shape[-1], device=logits.device)
    return torch.where(columns < vocab_limit, logits.float() / scale, float("-inf"))


def chunk_scores(
    logits: torch.Tensor, targets: torch.Tensor, scale: float, vocab_limit: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The chosen tokens' log-probs, the entropies and the log-sum-exps of a chunk's logits, as pure functions
    of them (the form :func:`torch.compile` fuses into reductions that read the logits, never a float32 copy).

    Args:
        logits: Shape (c, v), a chunk's product in the compute dtype.
        targets: Shape (c,).

    Returns:
        ``logprobs``, ``entropy`` and ``lse``, each Shape (c,) float32.
    """
    z = _scaled_logits(logits, scale, vocab_limit)
    lse = torch.logsumexp(z, dim=-1)
    log_p = (z - lse[:, None]).clamp(min=_LOG_P_FLOOR)
    logprobs = log_p.gather(-1, targets[:, None]).squeeze(-1)
    entropy = -(log_p.exp() * log_p).sum(-1)
    return logprobs, entropy, lse


def chunk_logit_grads(
    logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, entropy: torch.Tensor,
    grad_logprobs: torch.Tensor, grad_entropy: torch.Tensor, scale: float, vocab_limit: int, dtype: torch.dtype,
) -> torch.Tensor:
    """The loss's gradient with respect to a chunk's logits, from the chunk's ``lse`` and ``entropy`` (as
    :func:`chunk_scores` returns them) and the gradients of its log-probs and entropies, in ``dtype``.

    With ``z = logits / scale`` and ``p = softmax(z)``: d logprob / d z = onehot - p and d entropy / d z =
    -p (log p + H), so d loss / d z = onehot g_lp - p (g_lp + g_H (log p + H)); divided by ``scale`` for the
    logits.

    Args:
        logits: Shape (c, v); targets, lse, entropy, grad_logprobs, grad_entropy: Shape (c,).

    Returns:
        Shape (c, v) in ``dtype``.
    """
    z = _scaled_logits(logits, scale, vocab_limit)
    log_p = (z - lse[:, None]).clamp(min=_LOG_P_FLOOR)
    grad = -log_p.exp() * (grad_logprobs[:, None] + grad_entropy[:, None] * (log_p + entropy[:, None]))
    columns = torch.arange(logits.shape[-1], device=logits.device)
    grad = grad + torch.where(columns == targets[:, None], grad_logprobs[:, None], 0.0)
    return (grad / scale).to(dtype)


@functools.cache
def _compiled(function: Callable[..., Any]) -> Callable[..., Any]:
    """:func:`chunk_scores` or :func:`chunk_logit_grads` compiled, once a process (shapes dynamic: chunks of any
    length share a graph)."""
    return torch.compile(function, dynamic=True)


class _ChosenLogprobs(torch.autograd.Function):
    """Log-probs of ``targets`` and the entropies, over chunks of rows; the backward pass recomputes logits."""

    @staticmethod
    def forward(
        ctx: Any, states: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, scale: float,
        vocab_limit: int, chunk: int, compiled: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n, dtype = states.shape[0], _compute_dtype(states)
        logprobs = torch.empty(n, dtype=torch.float32, device=states.device)
        entropy = torch.empty(n, dtype=torch.float32, device=states.device)
        lse = torch.empty(n, dtype=torch.float32, device=states.device) if compiled else None
        with torch.autocast(states.device.type, enabled=False):  # the dtypes are explicit
            weight_in_dtype = weight.to(dtype)  # once a call, not once a chunk (float32 weights: 1.2 GB at 152k x 2k)
            for start in range(0, n, chunk):
                part = slice(start, start + chunk)
                if lse is not None:
                    logits = F.linear(states[part].to(dtype), weight_in_dtype)
                    logprobs[part], entropy[part], lse[part] = _compiled(chunk_scores)(
                        logits, targets[part], scale, vocab_limit)
                    continue
                log_p = _chunk_log_probs(states[part], weight_in_dtype, scale, vocab_limit, dtype)
                logprobs[part] = log_p.gather(-1, targets[part, None]).squeeze(-1)
                entropy[part] = -log_p.exp().mul_(log_p).sum(-1)
        ctx.save_for_backward(states, weight, targets, entropy, lse)
        ctx.scale, ctx.vocab_limit, ctx.chunk, ctx.dtype = scale, vocab_limit, chunk, dtype
        return logprobs, entropy

    @staticmethod
    def backward(ctx: Any, grad_logprobs: torch.Tensor, grad_entropy: torch.Tensor) -> tuple[Any, ...]:
        states, weight, targets, entropy, lse = ctx.saved_tensors
        dtype = ctx.dtype
        grad_states = torch.empty_like(states) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
            if ctx.needs_input_grad[1] else None
        weight_in_dtype = weight.to(dtype)
        for start in range(0, states.shape[0], ctx.chunk):
            part = slice(start, start + ctx.chunk)
            if lse is not None:  # compiled
                logits = F.linear(states[part].to(dtype), weight_in_dtype)
                grad = _compiled(chunk_logit_grads)(
                    logits, targets[part], lse[part], entropy[part], grad_logprobs[part], grad_entropy[part],
                    ctx.scale, ctx.vocab_limit, dtype)
                del logits
            else:
                grad = _eager_logit_grads(states[part], weight_in_dtype, targets[part], entropy[part],
                                          grad_logprobs[part], grad_entropy[part], ctx.scale, ctx.vocab_limit, dtype)
            if grad_states is not None:
                grad_states[part] = grad @ weight_in_dtype
            if grad_weight is not None:
                # In place into the float32 sum: no float32 copy of the (v, h) product (2.3 GiB at 152k x 4096).
                grad_weight += grad.T @ states[part].to(dtype)
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_states, grad_weight, None, None, None, None, None


def _eager_logit_grads(
    states: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, entropy: torch.Tensor,
    grad_logprobs: torch.Tensor, grad_entropy: torch.Tensor, scale: float, vocab_limit: int, dtype: torch.dtype,
) -> torch.Tensor:
    """:func:`chunk_logit_grads` of the chunk ``states @ weight.T``, in place on one float32 copy of the logits
    (two float32 blocks at the peak), the log-sum-exp computed again."""
    log_p = _chunk_log_probs(states, weight, scale, vocab_limit, dtype)
    p = log_p.exp()
    inner = log_p.add_(entropy[:, None]).mul_(grad_entropy[:, None]).add_(grad_logprobs[:, None])
    grad = p.mul_(inner).neg_()
    del inner, log_p
    grad.scatter_add_(-1, targets[:, None], grad_logprobs[:, None])
    if scale != 1.0:
        grad.div_(scale)
    return grad.to(dtype)


def chosen_logprobs(
    states: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    vocab_limit: int | None = None,
    chunk: int = DEFAULT_CHUNK,
    compiled: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of ``targets`` and entropies under ``softmax(states @ weight.T / temperature)``.

    Args:
        states: Shape (n, h), the hidden state before each scored token.
        weight: Shape (v, h), the LM head's weight.
        targets: Shape (n,), the scored tokens.
        temperature: the sampling temperature (greedy ones, 0 or below 1e-5, are treated as 1).
        vocab_limit: rows at or past it are not tokens (a checkpoint's padding rows, or the rows past a small
            tokenizer): they get probability 0, as in sampling. None: every row.
        chunk: scored tokens per chunk (peak memory: one chunk's float32 logits).
        compiled: the arithmetic on each chunk's logits through :func:`torch.compile` (see the module's
            docstring); the first call of a process compiles.

    Returns:
        ``logprobs`` and ``entropy``, each Shape (n,) float32, differentiable with respect to ``states`` and
        ``weight``.
    """
    scale = 1.0 if is_greedy(temperature) else temperature
    limit = weight.shape[0] if vocab_limit is None else min(vocab_limit, weight.shape[0])
    return _ChosenLogprobs.apply(states, weight, targets, scale, limit, max(chunk, 1), compiled)


class ScoringHead(nn.Linear):
    """An LM head (``nn.Linear`` without bias) that also scores chosen tokens without materializing logits.

    ``head(hidden)`` returns logits as any LM head (generation uses it); ``head(states, targets=...)`` returns
    :func:`chosen_logprobs`. Scoring through the module's own ``forward`` keeps FSDP's hooks in the loop: the
    head's weight is gathered and its gradient reduced as for any module.
    """

    vocab_limit: int | None = None
    """Rows at or past it get probability 0 when scoring (see :func:`chosen_logprobs`)."""

    compiled: bool = False
    """Score through :func:`torch.compile`'s kernels (see :func:`chosen_logprobs`)."""

    def forward(
        self,
        hidden: torch.Tensor,
        targets: torch.Tensor | None = None,
        temperature: float = 1.0,
        chunk: int = DEFAULT_CHUNK,
    ) -> Any:
        if targets is None:
            return super().forward(hidden)
        return chosen_logprobs(hidden, self.weight, targets, temperature, self.vocab_limit, chunk, self.compiled)


def install_scoring_head(model: Any, vocab_limit: int | None, compiled: bool = False) -> ScoringHead:
    """Replace the LM head of a transformers causal LM or VLM by a :class:`ScoringHead` holding the same
    weight (a head tied to the input embeddings stays tied); returns it.

    Args:
        vocab_limit: the number of rows that are tokens (``len(tokenizer)``); None: every row.
        compiled: score through compiled kernels (``model.compile``; see :func:`chosen_logprobs`).
    """
    head = model.get_output_embeddings()
    if not isinstance(head, nn.Linear) or head.bias is not None:
        raise TypeError(f"the LM head of {type(model).__name__} is a {type(head).__name__}; the trainer scores "
                        "through a bias-free nn.Linear head")
    if not isinstance(head, ScoringHead):
        scoring = ScoringHead(head.in_features, head.out_features, bias=False, device="meta")
        scoring.weight = head.weight
        model.set_output_embeddings(scoring)
        head = scoring
    head.vocab_limit = vocab_limit
    head.compiled = compiled
    return head

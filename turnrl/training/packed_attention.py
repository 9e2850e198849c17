"""The trainer's attention: PyTorch's SDPA, and on packed rows SDPA over each sequence on its own.

transformers builds a block-diagonal mask for packed rows under ``sdpa``: a (t, t) mask that SDPA computes
whole (16k packed tokens cost as much attention as one 16k-token sequence, and its masked kernels are the
slow ones), where each sequence needs only its own causal triangle. ``flex_attention`` skips the masked
blocks but compiles for minutes at the first shapes; ``flash_attention_2`` needs a package built for the
machine. So this registers ``turnrl_sdpa`` with transformers: without sequence bounds it is ``sdpa`` exactly
(the same function, the same mask), and with them (``sequence_bounds``, passed by
:func:`~turnrl.training.model_passes.states_before` for packed rows) it runs SDPA's causal kernel (flash on a
GPU) on each sequence's queries, keys and values in turn, and no mask is built (:func:`packed_forward`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

ATTENTION = "turnrl_sdpa"
"""The ``attn_implementation`` name the trainer loads its models with (``model.attention=sdpa``)."""

BOUNDS = "sequence_bounds"
"""The forward keyword that carries packed sequences' bounds to :func:`packed_sdpa`."""


def packed_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    sequence_bounds: list[tuple[int, int]] | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention, per sequence when ``sequence_bounds`` is given.

    Args:
        query: Shape (1, heads, t, d); key, value: Shape (1, kv_heads, t, d).
        sequence_bounds: each packed sequence's [start, end) in the row, in order, covering it.

    Returns:
        The attention output, Shape (1, t, heads, d), and no weights.
    """
    # A VLM's forward hands its keywords to the vision tower too, whose attention is not causal: the bounds are
    # the decoder's (transformers marks its attention modules causal, as sdpa reads it).
    if sequence_bounds is None or not getattr(module, "is_causal", False):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    if sequence_bounds[-1][1] != query.shape[2]:
        raise ValueError(f"the packed sequences end at {sequence_bounds[-1][1]}, the row has {query.shape[2]} tokens")
    kwargs.pop("is_causal", None)
    parts = [
        sdpa_attention_forward(module, query[:, :, start:end], key[:, :, start:end], value[:, :, start:end], None,
                               is_causal=True, **kwargs)[0]
        for start, end in sequence_bounds
    ]
    return torch.cat(parts, dim=1), None


PACKED = "turnrl_sdpa_packed"
"""The same attention under a name without a mask function: transformers builds no mask for it (during a packed
forward pass, :func:`packed_forward`)."""

AttentionInterface.register(ATTENTION, packed_sdpa)
AttentionInterface.register(PACKED, packed_sdpa)
AttentionMaskInterface.register(ATTENTION, sdpa_mask)


def implementation(name: str) -> str:
    """The ``attn_implementation`` of ``model.attention``: ``sdpa`` is :data:`ATTENTION`; others as named."""
    return ATTENTION if name == "sdpa" else name


def packs(model_config: Any) -> bool:
    """Whether a model with this (text) config attends packed rows per sequence (``model.attention=sdpa``)."""
    return model_config._attn_implementation == ATTENTION


@contextmanager
def packed_forward(text_config: Any) -> Iterator[None]:
    """For the forward pass of packed rows: no mask built (transformers would build the (t, t) block-diagonal
    one from the restarting positions, which :func:`packed_sdpa` does not read). A layer recomputed for
    gradient checkpointing after this returns calls :func:`packed_sdpa` again with the same (absent) mask."""
    text_config._attn_implementation = PACKED
    try:
        yield
    finally:
        text_config._attn_implementation = ATTENTION

"""The trainer's attention: PyTorch's SDPA, and on packed rows SDPA over each sequence on its own.

transformers builds a block-diagonal mask for packed rows under ``sdpa``: a (t, t) mask that SDPA computes
whole (16k packed tokens cost as much attention as one 16k-token sequence, and its masked kernels are the
slow ones), where each sequence needs only its own causal triangle. ``flex_attention`` skips the masked
blocks but compiles for minutes at the first shapes; ``flash_attention_2`` needs a package built for the
machine. So this registers ``turnrl_sdpa`` with transformers: without sequence bounds it is ``sdpa`` exactly
(the same function, the same mask), and with them (``sequence_bounds``, passed by
:func:`~turnrl.training.model_passes.states_before` for packed rows) it runs SDPA's causal kernel (flash on a
GPU) on each sequence's queries, keys and values in turn, and no mask is built (:func:`packed_forward`).

``turnrl_sdpa_cudnn`` (``model.packed_attention=cudnn``) is the same with each sequence on cuDNN's attention
kernel, which on a Hopper GPU runs causal attention at 1.5-1.7 times flash's speed at a VLM step's shapes
(docs/benchmarks.md). cuDNN builds a plan on the host for every new shape (about 0.17 s forward and backward),
and every sequence of a run has a new length, so each sequence is attended at its length rounded up to a
multiple of :data:`CUDNN_BUCKET` (:func:`bucketed`): a run meets one shape per bucket, planned once.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from turnrl.config import ModelConfig

ATTENTION = "turnrl_sdpa"
"""The ``attn_implementation`` name the trainer loads its models with (``model.attention=sdpa``)."""

CUDNN_ATTENTION = "turnrl_sdpa_cudnn"
"""The same, packed sequences attended by cuDNN's kernel (``model.packed_attention=cudnn``)."""

CUDNN_BUCKET = 128
"""The multiple of tokens each packed sequence is attended at under :data:`CUDNN_ATTENTION`: cuDNN's key tiles
are 128 wide, so no tile is partly past a sequence (cuDNN's Hopper backward has had NaN bugs in such tiles), and
a run meets at most one shape per 128 tokens of length."""

CUDNN_BACKENDS = (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION)
"""The kernels :data:`CUDNN_ATTENTION` attends with, the first that takes a sequence."""

BOUNDS = "sequence_bounds"
"""The forward keyword that carries packed sequences' bounds to :func:`packed_sdpa`."""


def packed_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    sequence_bounds: list[tuple[int, int]] | None = None,
    backends: tuple[SDPBackend, ...] = (),
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention, per sequence when ``sequence_bounds`` is given.

    Args:
        query: Shape (1, heads, t, d); key, value: Shape (1, kv_heads, t, d).
        sequence_bounds: each packed sequence's [start, end) in the row, in order, covering it.
        backends: the SDPA kernels each sequence is attended by at its :func:`bucketed` length, the first that
            takes it (:data:`CUDNN_ATTENTION`: cuDNN's, flash's where cuDNN refuses a shape; on a CPU, flash's);
            none: SDPA's choice, at the sequence's own length.

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
    parts = []
    for start, end in sequence_bounds:
        if not backends:
            q, k, v = (x[:, :, start:end] for x in (query, key, value))
            parts.append(sdpa_attention_forward(module, q, k, v, None, is_causal=True, **kwargs)[0])
            continue
        q, k, v = (bucketed(x, start, end) for x in (query, key, value))
        with sdpa_kernel(list(backends), set_priority=True):
            parts.append(sdpa_attention_forward(module, q, k, v, None, is_causal=True, **kwargs)[0][:, :end - start])
    return torch.cat(parts, dim=1), None


def bucketed(x: torch.Tensor, start: int, end: int, bucket: int = CUDNN_BUCKET) -> torch.Tensor:
    """The sequence at ``[start, end)`` of a packed row's queries, keys or values, its length rounded up to a
    multiple of ``bucket``.

    The tokens past the sequence are read in place from the row (the next sequence's), or, where the row ends
    first, the sequence is copied and zero-padded. Under causal attention no query of the sequence reads a key
    past it, and the extra queries' outputs are dropped, so they get no gradient and send none back: the
    sequence's outputs and every gradient are its own. The result is laid out tokens outermost, as a
    projection's view of the row is, whatever the row's length, so cuDNN, which plans each layout apart, meets
    one shape per bucket; a row laid out heads outermost, whose head stride changes with its length, is copied.

    Args:
        x: Shape (1, heads, t, d), the head dim contiguous.

    Returns:
        Shape (1, heads, padded, d), with strides that depend on ``heads``, ``padded`` and ``d`` alone.
    """
    length = end - start
    padded = -(-length // bucket) * bucket
    heads, dim = x.shape[1], x.shape[3]
    tokens_outer = x.stride(1) == dim and x.stride(2) == heads * dim
    if tokens_outer and start + padded <= x.shape[2]:
        # Selected and unsqueezed, not sliced: a slice keeps the row's batch stride, which changes with every
        # packed row's length and is part of cuDNN's plan key.
        return x[0, :, start:start + padded].unsqueeze(0)
    copied = F.pad(x[0, :, start:end].transpose(0, 1), (0, 0, 0, 0, 0, padded - length))
    return copied.transpose(0, 1).unsqueeze(0)


PACKED = {ATTENTION: "turnrl_sdpa_packed", CUDNN_ATTENTION: "turnrl_sdpa_cudnn_packed"}
"""Each trainer attention under a name without a mask function: transformers builds no mask for it (during a
packed forward pass, :func:`packed_forward`)."""

for name, function in ((ATTENTION, packed_sdpa),
                       (CUDNN_ATTENTION, functools.partial(packed_sdpa, backends=CUDNN_BACKENDS))):
    AttentionInterface.register(name, function)
    AttentionInterface.register(PACKED[name], function)
    AttentionMaskInterface.register(name, sdpa_mask)


def implementation(name: str, packed_kernel: str = "flash") -> str:
    """The ``attn_implementation`` of ``model.attention``: ``sdpa`` is :data:`ATTENTION`, or
    :data:`CUDNN_ATTENTION` for packed rows on cuDNN (``packed_kernel``, :func:`packed_kernel`'s); others as
    named."""
    if name != "sdpa":
        return name
    return CUDNN_ATTENTION if packed_kernel == "cudnn" else ATTENTION


def packed_kernel(choice: str, device: torch.device) -> str:
    """``model.packed_attention`` for a run on ``device``: ``auto`` is ``cudnn`` on a Hopper GPU (compute
    capability 9.x, where it was measured faster) with cuDNN, else ``flash``.

    Raises:
        ValueError: ``cudnn`` asked for without a CUDA GPU and cuDNN.
    """
    usable = device.type == "cuda" and torch.backends.cudnn.is_available()
    if choice == "cudnn" and not usable:
        raise ValueError(f"model.packed_attention=cudnn needs a CUDA GPU with cuDNN; this run is on {device}: "
                         "set model.packed_attention=auto or flash")
    if choice == "auto":
        return "cudnn" if usable and torch.cuda.get_device_capability(device)[0] == 9 else "flash"
    return choice


def run_attention(model: ModelConfig, device: torch.device) -> str:
    """The ``attn_implementation`` a run's training models load with on ``device``: ``model.attention``, and
    for ``sdpa`` the kernel ``model.packed_attention`` resolves to there (:func:`packed_kernel`)."""
    return implementation(model.attention, packed_kernel(model.packed_attention, device))


def packs(model_config: Any) -> bool:
    """Whether a model with this (text) config attends packed rows per sequence (``model.attention=sdpa``)."""
    return model_config._attn_implementation in PACKED


@contextmanager
def packed_forward(text_config: Any) -> Iterator[None]:
    """For the forward pass of packed rows: no mask built (transformers would build the (t, t) block-diagonal
    one from the restarting positions, which :func:`packed_sdpa` does not read). A layer recomputed for
    gradient checkpointing after this returns calls :func:`packed_sdpa` again with the same (absent) mask."""
    name = text_config._attn_implementation
    text_config._attn_implementation = PACKED[name]
    try:
        yield
    finally:
        text_config._attn_implementation = name

"""A Qwen-VL vision tower's attention in one SDPA call a layer, in place of transformers' call per chunk.

The vision towers of Qwen2-VL, Qwen2.5-VL and Qwen3-VL attend within chunks of patches: each image in their
full-attention layers, and each 8x8-patch window in Qwen2.5-VL's windowed ones. Under ``sdpa`` transformers
calls SDPA once per chunk and reads the chunks' lengths to the host in every layer, so a batch of rollout images
costs thousands of small calls a layer (Qwen2.5-VL-3B's tower over 100 images of 20 windows: 28 windowed
blocks x 2,000 windows, about 56,000 calls a forward pass). Under a flash implementation it hands the chunks'
bounds (``cu_seq_lens_q``) to one call instead, but flash-attn is a package built for each machine, and
PyTorch's own variable-length attention changed its signature between releases. So this registers
:data:`VISION_ATTENTION` with transformers, a name with ``flash`` in it (what transformers reads to pass the
bounds), whose one call pads the chunks into a batch, masks the padded keys and runs SDPA once
(:func:`chunked_attention`): the same attention, computed for each chunk on its own, in one kernel.
:func:`use_chunked_attention` puts a tower on it (the loader does so for every VLM it loads).

The call needs the chunks' shortest and longest lengths on the host. A read from the device waits for all the
work queued before it, after which the device idles while Python launches the next block's kernels; a tower
passes the same bounds tensor to every block of a kind, so :func:`chunk_extremes` reads each bounds tensor once
(two reads a forward pass of Qwen2.5-VL's tower, windows and whole images, instead of one a block).

On a GPU the call keeps off cuDNN's attention (:data:`TOWER_BACKENDS`). cuDNN builds a plan on the host for each
new shape, and a tower's shapes change with the number of images in a call: in a profiled rollout of
Qwen2.5-VL-3B's shape (64 episodes of Maze2D frames, docs/benchmarks.md) the GPU waited 0.23 s in five turns
while the host was inside this call's SDPA, more than on any other line of the prefill. The trainer turns cuDNN
attention off for its whole process (:func:`~turnrl.training.precision.skip_cudnn_attention`); the engine in an
evaluation or a policy server has no such switch, and a tower should not depend on one.
"""

from __future__ import annotations

import threading
from contextlib import nullcontext
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

VISION_ATTENTION = "turnrl_chunked_sdpa_flash_api"
"""The vision tower's ``_attn_implementation`` (transformers passes chunk bounds to names holding ``flash``)."""

TOWER_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
"""The SDPA kernels a tower's attention may run on a GPU, in SDPA's own order of preference: all but cuDNN's."""

_EXTREMES: dict[int, tuple[torch.Tensor, int, int, int]] = {}
"""Bounds tensors read lately, by ``id``: the tensor itself (held, so that its ``id`` is not reused), its in-place
version when read, and its shortest and longest chunk."""
_EXTREMES_HELD = 8
_EXTREMES_LOCK = threading.Lock()
"""An asynchronous run's rollout thread and trainer run towers at once."""


def chunk_extremes(bounds: torch.Tensor) -> tuple[int, int]:
    """The shortest and longest chunk of ``bounds`` (Shape (c + 1,), c >= 1, cumulative), read to the host once per
    tensor: the same tensor, unchanged in place, is answered from what its first read found."""
    with _EXTREMES_LOCK:
        held = _EXTREMES.get(id(bounds))
    if held is not None and held[0] is bounds and held[1] == bounds._version:
        return held[2], held[3]
    lengths = bounds[1:] - bounds[:-1]
    shortest, longest = (int(n) for n in torch.stack(torch.aminmax(lengths)).tolist())
    note_extremes(bounds, shortest, longest)
    return shortest, longest


def note_extremes(bounds: torch.Tensor, shortest: int, longest: int) -> None:
    """Remember the shortest and longest chunk of ``bounds`` (known without reading the device, as the tower's
    precomputed layouts know them: :mod:`turnrl.models.vision_layout`), for :func:`chunk_extremes` to answer.
    A tensor made under ``torch.inference_mode`` has no version to tell a change in place by: it is not kept."""
    if bounds.is_inference():
        return
    with _EXTREMES_LOCK:
        _EXTREMES.pop(id(bounds), None)
        if len(_EXTREMES) >= _EXTREMES_HELD:
            del _EXTREMES[next(iter(_EXTREMES))]  # the oldest: a finished forward pass's
        _EXTREMES[id(bounds)] = (bounds, bounds._version, shortest, longest)


def chunk_layout(bounds: torch.Tensor, tokens: int, longest: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each token goes in a batch of chunks padded to the longest, and which keys are real.

    Args:
        bounds: Shape (c + 1,), the chunks' cumulative bounds (0 first, ``tokens`` last).
        tokens: t, the tokens of all chunks.
        longest: the longest chunk's tokens.

    Returns:
        ``slots``: Shape (t,), each token's row in the padded batch flattened to (c * longest);
        ``real``: Shape (c, longest), True where a chunk has a token.
    """
    lengths = bounds[1:] - bounds[:-1]
    chunk_of_token = torch.repeat_interleave(torch.arange(lengths.shape[0], device=bounds.device), lengths,
                                             output_size=tokens)
    slots = torch.arange(tokens, device=bounds.device) - bounds[:-1][chunk_of_token] + chunk_of_token * longest
    real = torch.arange(longest, device=bounds.device)[None, :] < lengths[:, None]
    return slots, real


def chunked_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    cu_seq_lens_q: torch.Tensor | None = None,
    cu_seq_lens_k: torch.Tensor | None = None,
    is_causal: bool = False,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention within each chunk of a vision tower's patches, one SDPA call for all chunks.

    Chunks of one length (images of one size, whole windows) are a reshape of the tokens, attended without a
    mask (SDPA's flash kernel on a GPU); otherwise they are padded to the longest and the padded keys masked.

    Args:
        query, key, value: Shape (1, heads, t, d), the chunks' patches one after another.
        cu_seq_lens_q: Shape (c + 1,), the chunks' bounds; the keys' (``cu_seq_lens_k``) must be the same.
            Without bounds the tokens are one chunk (transformers' ``sdpa``).

    Returns:
        The attention output, Shape (1, t, heads, d), and no weights.
    """
    if cu_seq_lens_q is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      is_causal=is_causal, **kwargs)
    if is_causal or attention_mask is not None or (cu_seq_lens_k is not None and cu_seq_lens_k is not cu_seq_lens_q
                                                   and not torch.equal(cu_seq_lens_k, cu_seq_lens_q)):
        raise ValueError("chunked vision attention takes non-causal self-attention within chunks, without a mask")
    heads, tokens, width = query.shape[1], query.shape[2], query.shape[3]
    bounds = cu_seq_lens_q.long()
    chunks = bounds.shape[0] - 1
    if tokens == 0 or chunks == 0:
        return query.new_zeros(1, tokens, heads, width), None
    shortest, longest = chunk_extremes(cu_seq_lens_q)
    gqa = key.shape[1] != heads
    backends = sdpa_kernel(TOWER_BACKENDS) if query.device.type == "cuda" else nullcontext()
    if shortest == longest:
        def batched(states: torch.Tensor) -> torch.Tensor:  # (1, h, t, d) -> (chunks, h, longest, d)
            return states[0].view(states.shape[1], chunks, longest, width).transpose(0, 1)

        with backends:
            output = F.scaled_dot_product_attention(batched(query), batched(key), batched(value), dropout_p=dropout,
                                                    scale=scaling, enable_gqa=gqa)
        return output.transpose(1, 2).reshape(1, tokens, heads, width), None
    slots, real = chunk_layout(bounds, tokens, longest)

    def padded(states: torch.Tensor) -> torch.Tensor:  # (1, h, t, d) -> (chunks, h, longest, d)
        rows = states[0].transpose(0, 1)
        batch = rows.new_zeros(chunks * longest, rows.shape[1], width).index_copy(0, slots, rows)
        return batch.view(chunks, longest, rows.shape[1], width).transpose(1, 2)

    # The first key of an empty chunk (a padded zero) stays visible so that no softmax row is all masked; an empty
    # chunk has no token to read its output.
    visible = (real | (torch.arange(longest, device=real.device) == 0))[:, None, None, :]
    with backends:
        output = F.scaled_dot_product_attention(padded(query), padded(key), padded(value), attn_mask=visible,
                                                dropout_p=dropout, scale=scaling, enable_gqa=gqa)
    output = output.transpose(1, 2).reshape(chunks * longest, heads, width).index_select(0, slots)
    return output.unsqueeze(0), None


AttentionInterface.register(VISION_ATTENTION, chunked_attention)


def use_chunked_attention(vision_config: Any) -> None:
    """Switch a vision tower's config to :func:`chunked_attention` where it names an SDPA implementation (a
    flash, flex or eager choice is left as it is). The tower's attention modules read it at each call."""
    if "sdpa" in (vision_config._attn_implementation or "sdpa"):
        vision_config._attn_implementation = VISION_ATTENTION

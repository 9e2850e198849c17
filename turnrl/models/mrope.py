"""Qwen2-VL's 3D rotary (M-RoPE) positions of a prompt whose images fill runs of placeholder tokens.

Text tokens count up by one, an image's tokens take (temporal, height, width) positions from where the text
before it ends, and the text after it resumes past the image's larger side. Qwen2-VL, Qwen2.5-VL and Qwen3-VL
place images alike (Qwen2.5-VL's temporal spacing, ``second_per_grid_ts``, spaces video frames apart, and
Qwen3-VL's text resumes past an image's larger spatial side, not counting frames; an image is one frame).
The engine's prefill and the trainer's packed rows both place image tokens by these functions.

Notation: n prompt tokens, m images.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import numpy as np
import torch


def placeholder_spans(prompt: Sequence[int], image_token_id: int) -> list[tuple[int, int]]:
    """The runs of ``image_token_id`` in ``prompt``, [start, end) each, in order."""
    tokens = np.asarray(prompt, dtype=np.int64)
    is_image = np.concatenate(([False], tokens == image_token_id, [False]))
    edges = np.flatnonzero(is_image[1:] != is_image[:-1])
    return [(int(start), int(end)) for start, end in zip(edges[::2], edges[1::2])]


def check_image_spans(spans: Sequence[tuple[int, int]], grids: torch.Tensor, merge_size: int) -> None:
    """Check that ``spans`` (each image's placeholder tokens, [start, end)) and ``grids`` (each image's patch grid
    (t, h, w), Shape (m, 3)) describe the same images: one grid a run, each grid whole ``merge_size`` x
    ``merge_size`` groups of patches, each run as long as its grid's t x (h / merge_size) x (w / merge_size).

    Raises:
        ValueError: saying which image differs and how. Unchecked, a one-token image's position would spread
            silently over a longer run, an image cut mid-way would fail inside numpy's broadcasting, and a grid of
            part groups (6 // 4 = 1 token) would pass the count and fail the batch's one tower call.
    """
    if len(spans) != len(grids):
        raise ValueError(f"the prompt has {len(spans)} runs of image placeholders and {len(grids)} image grids "
                         "(image_grid_thw rows): build both from the same messages")
    for index, ((start, end), grid) in enumerate(zip(spans, grids.tolist())):
        t, h, w = grid
        if min(t, h, w) < 1 or h % merge_size or w % merge_size:
            raise ValueError(f"image {index}'s grid {grid} is not whole {merge_size} x {merge_size} groups of "
                             "patches: make the model inputs with the model's own processor")
        tokens = t * (h // merge_size) * (w // merge_size)
        if end - start != tokens:
            raise ValueError(f"image {index} has {end - start} placeholder tokens, and its grid {grid} makes "
                             f"{tokens}: a sequence cut inside an image, or another image's grid (cut sequences "
                             "between images)")


def mrope_positions(length: int, spans: Sequence[tuple[int, int]], grids: torch.Tensor, merge_size: int
                    ) -> tuple[np.ndarray, int]:
    """Qwen2-VL's 3D rotary positions of a prompt of ``length`` tokens whose images fill ``spans``.

    Args:
        spans: each image's placeholder tokens, [start, end). grids: each image's patch grid (t, h, w), Shape (m, 3);
            its tokens are t x (h / merge_size) x (w / merge_size), row-major.

    Returns:
        The positions, Shape (3, length) int64, and the delta of the tokens after the prompt.

    Raises:
        ValueError: the spans and the grids do not describe the same images (:func:`check_image_spans`).
    """
    check_image_spans(spans, grids, merge_size)
    positions = np.zeros((3, length), dtype=np.int64)
    next_position, cursor = 0, 0
    for (start, end), grid in zip(spans, grids.tolist()):
        text = start - cursor
        positions[:, cursor:start] = next_position + np.arange(text)
        next_position += text
        t, h, w = grid[0], grid[1] // merge_size, grid[2] // merge_size
        positions[:, start:end] = next_position + image_offsets(t, h, w)
        next_position += max(t, h, w)
        cursor = end
    positions[:, cursor:] = next_position + np.arange(length - cursor)
    delta = int(positions.max(initial=-1)) + 1 - length
    return positions, delta


@lru_cache(maxsize=256)
def image_offsets(t: int, h: int, w: int) -> np.ndarray:
    """The (temporal, height, width) offsets of an image's ``t x h x w`` tokens, row-major, Shape (3, t * h * w),
    read-only. Kept by size: a prompt that keeps every turn's frame places its earlier images again at every turn
    (a VisGym step's 960 prompts hold about 7,700 images, of one or a few sizes)."""
    offsets = np.stack(np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")).reshape(3, -1)
    offsets.flags.writeable = False
    return offsets


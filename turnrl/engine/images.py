"""A VLM prompt's images, as the engine's prefill and KV reuse need them (Qwen2-VL, Qwen2.5-VL, Qwen3-VL).

A prompt holds one run of image placeholder tokens per image (``<|image_pad|>``
repeated once per visual token), and the model inputs of those images in order
(``pixel_values`` concatenated along dim 0, ``image_grid_thw`` one row each):
:func:`prompt_images` checks that they agree and derives

- the M-RoPE positions of every prompt token (:func:`~turnrl.models.mrope.mrope_positions`); a token
  sampled after the prompt is at its index plus the prompt's ``delta``.
- the prompt's match keys: its tokens with each image's placeholders replaced
  by the image's digest, so that a cached row is reused only by a prompt with
  the same images, not merely the same placeholders. The digests come with the
  prompt when its images were encoded by :class:`~turnrl.models.vision.ImageEncoder`
  (hashed once from each image); otherwise they are hashed here from the pixel
  values, which at every turn of a long multi-turn rollout re-hashes every
  earlier image: most of a 3B VLM rollout's time when it was done for all
  prompts (docs/benchmarks.md).

It also holds :class:`KeptFeatures`: the features of the images a rollout encoded, kept by digest for the
trainer's step (which would otherwise encode the same images again).

Notation: n prompt tokens, m images.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from turnrl.engine.weights import ImageFeatures
from turnrl.models.mrope import mrope_positions, placeholder_spans
from turnrl.models.vision import content_digest


@dataclass
class PromptImages:
    """The images of one prompt."""

    pixel_values: list[torch.Tensor]
    """Each image's patches, Shape (patches_i, patch_dim)."""
    grids: torch.Tensor
    """Each image's (temporal, height, width) patch grid, Shape (m, 3)."""
    spans: list[tuple[int, int]]
    """Each image's placeholder tokens, [start, end) in the prompt."""
    positions: np.ndarray
    """M-RoPE positions of the prompt's tokens, Shape (3, n)."""
    delta: int
    """A token at index i after the prompt is at position i + delta on all three axes."""
    keys: list[int]
    """The prompt's tokens with each image's placeholders replaced by the image's digest (a negative number)."""


def image_digest(pixel_values: torch.Tensor, grid: torch.Tensor) -> int:
    """The digest of one image from its model inputs: the pixel values' bytes (bf16 read as int16, which numpy
    lacks) and its grid."""
    pixels = pixel_values.detach().cpu().contiguous()
    if pixels.dtype == torch.bfloat16:
        pixels = pixels.view(torch.int16)
    return content_digest([grid.to(torch.int64).numpy(), pixels.numpy()])


def prompt_images(prompt: Sequence[int], model_inputs: dict[str, Any] | None, image_token_id: int,
                  merge_size: int, digests: Sequence[int] | None = None) -> PromptImages:
    """The images of ``prompt`` from its ``model_inputs`` (``pixel_values``, ``image_grid_thw``) and, if given,
    ``digests``: each image's digest as its encoder made it (:attr:`~turnrl.models.vision.EncodedImage.digest`);
    None hashes the pixel values (:func:`image_digest`).

    Raises:
        ValueError: the placeholders and the images (or the digests) do not agree (with what each says); the
            placeholders and the grids are checked first, as the positions are placed
            (:func:`~turnrl.models.mrope.check_image_spans`).
    """
    spans = placeholder_spans(prompt, image_token_id)
    inputs = model_inputs or {}
    grids = inputs.get("image_grid_thw")
    pixels = inputs.get("pixel_values")
    grids = torch.zeros(0, 3, dtype=torch.long) if grids is None else torch.as_tensor(grids).reshape(-1, 3).cpu()
    positions, delta = mrope_positions(len(prompt), spans, grids, merge_size)  # checks them against the grids
    patches = grids.prod(-1).tolist()
    pixel_values: list[torch.Tensor] = []
    if spans:
        if pixels is None:
            raise ValueError("the prompt has images but its model inputs have no pixel_values")
        pixels = torch.as_tensor(pixels)
        if sum(patches) != len(pixels):
            raise ValueError(f"pixel_values has {len(pixels)} patches, the grids make {sum(patches)}")
        pixel_values = list(torch.split(pixels, patches))
    if digests is None:
        digests = [image_digest(image, grid) for image, grid in zip(pixel_values, grids)]
    elif len(digests) != len(spans) or any(not isinstance(d, int) or d >= 0 for d in digests):
        raise ValueError(f"the prompt has {len(spans)} images and {len(digests)} image digests (negative integers, "
                         "one an image, as the image encoder makes them): send the encoder's, or none")
    keys = list(prompt)
    for (start, end), digest in zip(spans, digests):
        keys[start:end] = [int(digest)] * (end - start)
    return PromptImages(pixel_values, grids, spans, positions, delta, keys)


class KeptFeatures:
    """The features of the images the engine encodes, one copy of each in host memory, by digest.

    A training step runs its own forward passes over the images its rollout showed; with a frozen vision tower
    their features are the ones the engine computed at prefill, so the trainer takes them
    (:meth:`~turnrl.engine.llm_engine.Engine.take_image_features`) instead of encoding every image again. Each
    prefill call's new images are copied to pinned host memory without waiting for the device (the copy runs
    behind the prefill's own work); :meth:`take` waits for the last copy. An image encoded again (its row was
    freed, or another episode shows it) is kept once.
    """

    def __init__(self) -> None:
        self._images: dict[int, ImageFeatures] = {}
        self._copied: torch.cuda.Event | None = None

    def __len__(self) -> int:
        return len(self._images)

    def keep(self, digests: Sequence[int], counts: Sequence[int], features: ImageFeatures) -> None:
        """Keep the images not yet kept.

        Args:
            digests: each image's digest, in the order of ``features``' rows.
            counts: each image's placeholder tokens, its rows of ``features``.
            features: the call's images' features, each tensor Shape (sum(counts), hidden).
        """
        starts = np.concatenate([[0], np.cumsum(counts)]).tolist()
        new: dict[int, int] = {}  # digest -> its first image in the call
        for index, digest in enumerate(digests):
            if digest not in self._images and digest not in new:
                new[digest] = index
        if not new:
            return
        device = features.merged.device
        rows = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in new.values()]).to(device)
        sizes = [counts[i] for i in new.values()]
        merged, *deepstack = [_to_host(tensor.index_select(0, rows)).split(sizes)
                              for tensor in (features.merged, *features.deepstack)]
        for j, digest in enumerate(new):
            self._images[digest] = ImageFeatures(merged[j], [level[j] for level in deepstack])
        if device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()

    def take(self) -> dict[int, ImageFeatures]:
        """Every image kept since the last call, by digest, its copies done; the store is left empty."""
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None
        images, self._images = self._images, {}
        return images


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` (a fresh tensor no one else holds) in host memory: copied to pinned memory without waiting from
    a GPU (the caller records when the copy is done), itself on a CPU."""
    if tensor.device.type != "cuda":
        return tensor
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    return host

"""A frozen vision tower's image features, computed once a step and reused by every pass of the step.

Notation: n images, p patches of those images, k tokens the tower hands the decoder for them (p / merge**2),
h the decoder's width.

An RL step runs a VLM's forward over the same images several times: the logprob check, the reference, the
critic's values, then every PPO epoch of the actor and the critic. With the tower frozen
(``model.train_vision=false``, the default) an image's features are the same in every one of them, so
:class:`ImageFeatures` encodes each image the first time a pass of the step meets it and hands the stored
features to every later pass. Images are known by :data:`IMAGE_KEYS`: their content digests where the
rollout made them (an image shown again, in a later turn's prompt or in another episode of the group, is
encoded once), else their place in the batch.

Why the tower's ``forward`` is swapped rather than the model given its features: transformers' Qwen-VL models
encode images inside their own forward (``get_image_features`` calls the tower on the pixel values, then the
features are placed at the image tokens, and Qwen3-VL's deepstack features go to the first decoder layers).
Newer transformers releases take precomputed encoder outputs (``mm_encoder_outputs``, in 5.24), 5.17 does
not, and calling the tower outside the model's forward would run it without the weights FSDP gathers there. So for
the duration of one pass :meth:`ImageFeatures.serving` gives the tower a ``forward`` that encodes only the
images not yet stored (with the tower's own forward, under ``no_grad``) and returns every image's features
from the store, in the form the tower returns them. The store is kept in host memory (a step's features at the
VisGym recipe's size are gigabytes with Qwen3-VL's deepstack levels, which no memory estimate counts); a pass
moves its own images' features to the device, a small copy beside the tower's work it saves.

Under FSDP too: a frozen tower is held whole by every process, not sharded
(:func:`~turnrl.training.parallel.fsdp2.shard_model`), so its forward runs no collective and a process whose pass
finds every image stored skips it while the others encode. Each process keeps the features of the images its own
rows show.

Which copy of the tower encodes an image: the rollout's, where the engine played the step on this process
(the local backend; ``model.rollout_image_features``): its prefill already encoded every image the episodes
showed and kept a host copy of each (:class:`~turnrl.engine.images.KeptFeatures`), which seeds the store, so
no pass of the step runs the tower at all. Else the copy of the first pass that meets the image (the actor's
logprob check, else the reference's or the critic's pass). They are frozen copies of the same weights: the
features differ only by rounding where a copy is held in another dtype (the reference in bf16) or runs other
kernels (the engine's tower, in bf16). Every pass of a step reads the same stored features, so the ratio of
the first PPO epoch's first update is still 1 wherever the old log-probs are recomputed. Backends that roll out
in other processes (Ray, the pool, the asynchronous thread's other GPU, each ``torchrun`` process's share) keep
encoding in the step's first pass: their features would cross processes, and the rows a process trains are
not those it played. A trained tower (``model.train_vision=true``) is never
served: its features change with every optimizer step and need their gradients, so every pass encodes as
before (:meth:`ImageFeatures.serving` refuses a tower with trainable weights).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from transformers.utils import ModelOutput

from turnrl.models.loading import vision_tower

IMAGE_KEYS = "image_keys"
"""The model input that names each image of a sample (Shape (n,), long): its content digest (negative, see
:func:`~turnrl.models.vision.content_digest`) or its place in the batch (from 0). Never passed to a model."""


@dataclass
class TowerOutput(ModelOutput):
    """What a Qwen-VL vision tower's forward returns, as transformers' models read it."""

    pooler_output: Any = None
    """Shape (k, h): the merged tokens of every image, in order (the model splits them per image)."""
    deepstack_features: list[torch.Tensor] | None = None
    """Qwen3-VL: each deepstack level's tokens, each Shape (k, h); None for towers without them."""
    last_hidden_state: torch.Tensor | None = None
    """The tower's unmerged last states: not kept (no model reads them when the features are given)."""


@dataclass(frozen=True)
class StoredImage:
    """One image's features."""

    tokens: torch.Tensor
    """Shape (k_i, h), in host memory: what the decoder reads at the image's placeholder tokens."""
    deepstack: tuple[torch.Tensor, ...]
    """Qwen3-VL's deepstack features, one Shape (k_i, h) a level; empty for other towers."""


class ImageFeatures:
    """The features of one step's images, each encoded once by a frozen vision tower (see the module's text)."""

    def __init__(self, rollout: Mapping[int, tuple[torch.Tensor, Sequence[torch.Tensor]]] | None = None) -> None:
        """``rollout``: the features the rollout's engine already computed, by digest: each image's tokens,
        Shape (k_i, h), and its deepstack levels (see the module's text); stored as if a pass had encoded them."""
        self._images = {int(key): StoredImage(tokens, tuple(deepstack))
                        for key, (tokens, deepstack) in (rollout or {}).items()}
        self.from_rollout = len(self._images)
        """Images whose features the rollout handed over."""
        self.encoded = 0
        """Images encoded this step."""
        self.served = 0
        """Images handed to a pass from the store without encoding them again."""

    def holds(self, keys: torch.Tensor) -> bool:
        """Whether every image of ``keys`` (Shape (n,)) is stored: a pass then needs none of their pixels."""
        return all(int(key) in self._images for key in keys.tolist())

    @contextmanager
    def serving(self, model: Any, keys: torch.Tensor) -> Iterator[None]:
        """Within the block, ``model``'s vision tower answers from the store, encoding the images it lacks.

        Args:
            model: the VLM (or its base model) whose forward runs in the block.
            keys: Shape (n,): the :data:`IMAGE_KEYS` of the images of the block's forward, in the order of its
                ``pixel_values`` and ``image_grid_thw``.

        Raises:
            ValueError: ``model`` has no vision tower, or its tower has trainable weights.
        """
        tower: Any = vision_tower(model)
        if tower is None:
            raise ValueError("image features are served to a VLM's vision tower; this model has none")
        if any(parameter.requires_grad for parameter in tower.parameters()):
            raise ValueError("a trained vision tower (model.train_vision=true) must encode its images in every "
                             "pass: stored features would carry no gradient")
        encode = tower.forward
        merge = int(tower.spatial_merge_size)
        order = [int(key) for key in keys.tolist()]

        def forward(hidden_states: torch.Tensor, grid_thw: torch.Tensor, **kwargs: Any) -> TowerOutput:
            return self._features(encode, hidden_states, grid_thw, order, merge, kwargs)

        shadowed = tower.__dict__.get("forward")  # a forward bound to this module itself (a compiled one)
        tower.forward = forward
        try:
            yield
        finally:
            if shadowed is None:
                del tower.forward
            else:
                tower.forward = shadowed

    def _features(self, encode: Any, pixel_values: torch.Tensor, grids: torch.Tensor, keys: Sequence[int],
                  merge: int, kwargs: dict[str, Any]) -> TowerOutput:
        """Every image's features in ``keys`` order, encoding those not stored from their rows of
        ``pixel_values`` (Shape (p, d), the images' patches in order; empty when all are stored)."""
        grids = grids.reshape(-1, 3)
        if len(keys) != len(grids):
            raise ValueError(f"{len(keys)} image keys for {len(grids)} images (image_grid_thw): build both from "
                             "the same samples")
        patches = grids.prod(-1).tolist()
        first: dict[int, int] = {}  # each missing image's first place in this pass
        for index, key in enumerate(keys):
            if key not in self._images and key not in first:
                first[key] = index
        if first:
            self._encode(encode, pixel_values, grids, patches, first, merge, kwargs)
        self.served += len(keys) - len(first)
        stored = [self._images[key] for key in keys]
        levels = len(stored[0].deepstack) if stored else 0
        device = pixel_values.device
        return TowerOutput(
            pooler_output=torch.cat([image.tokens for image in stored]).to(device),
            deepstack_features=[torch.cat([image.deepstack[level] for image in stored]).to(device)
                                for level in range(levels)] if levels else None,
        )

    def _encode(self, encode: Any, pixel_values: torch.Tensor, grids: torch.Tensor, patches: list[int],
                first: dict[int, int], merge: int, kwargs: dict[str, Any]) -> None:
        """Encode the images at ``first``'s places with the tower's own forward and store their features."""
        if not len(pixel_values):
            raise ValueError("a pass without pixel values met images whose features are not stored")
        starts = [0]
        for count in patches:
            starts.append(starts[-1] + count)
        places = list(first.values())
        rows = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in places]).to(pixel_values.device)
        with torch.no_grad():
            output = encode(pixel_values[rows], grid_thw=grids[places], **kwargs)
        sizes = [patches[i] // merge**2 for i in places]
        tokens = output.pooler_output.cpu().split(sizes)  # one copy to the host, then views of it
        deepstack = [level.cpu().split(sizes) for level in (output.get("deepstack_features") or [])]
        for j, key in enumerate(first):
            self._images[key] = StoredImage(tokens[j], tuple(level[j] for level in deepstack))
        self.encoded += len(first)

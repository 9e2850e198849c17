"""A Qwen-VL vision tower's layout of a call's images, made on the host from their patch grids and kept by them.

Besides the pixels, a Qwen-VL tower's forward derives from the images' patch grids (Shape (m, 3)): each patch's
rotary position ids, the cumulative bounds of the images (and of Qwen2.5-VL's windows) with the longest of them,
Qwen2.5-VL's window order, and Qwen3-VL's resampling of its position-embedding table. From grids on the GPU, as a
forward makes them by default, each is a loop over the images with reads to the host (``tolist``, the longest
chunk's ``.item()``), so the device drains and then idles while Python builds them, once for every prefill of a
rollout: in a traced `vlm-3b` rollout about 12 ms of host time a call of 64 images, the device waiting
(docs/benchmarks.md). transformers' towers take each of them precomputed under its name
(``transformers.vision_utils``, whose functions pop them from the forward's keyword arguments). So
:class:`TowerLayouts` makes them with those same functions from a host copy of the grids, keeps them by the grids
(a rollout's prefills meet few distinct lists of image sizes), copies them to the device without waiting (pinned
memory), and tells the chunked attention the chunks' extremes (:func:`~turnrl.models.vision_attention.note_extremes`),
which it would otherwise read from the device. The values are transformers' own, computed on the host: the integer
ones are equal to what the tower makes itself; Qwen3-VL's interpolation weights are float32 arithmetic on the host
instead of the device (equal to rounding).

A tower whose config is not in :data:`LAYOUTS`, or a transformers release without ``vision_utils``, gets nothing
precomputed and makes its own layout from the grids.
"""

from __future__ import annotations

import importlib
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from turnrl.models.devices import to_device
from turnrl.models.vision_attention import note_extremes

vision_utils: Any
try:
    vision_utils = importlib.import_module("transformers.vision_utils")
except ImportError:  # transformers releases before the precomputed vision inputs: towers make their own
    vision_utils = None


@dataclass(frozen=True)
class LayoutKind:
    """What a tower's forward takes precomputed, beside the patch position ids and the images' bounds."""

    windows: bool = False
    """Qwen2.5-VL: the window order and the windows' bounds (``window_index``, ``cu_window_seqlens``)."""
    interpolation: bool = False
    """Qwen3-VL: the position-embedding table's resampling to each grid (``interp_indices``, ``interp_weights``)."""


LAYOUTS: dict[str, LayoutKind] = {
    "qwen2_vl_vision": LayoutKind(),
    "qwen2_5_vl_vision": LayoutKind(windows=True),
    "qwen3_vl_vision": LayoutKind(interpolation=True),
}
"""Layouts by the tower config's ``model_type``."""


def _extremes(bounds: torch.Tensor) -> tuple[int, int]:
    """The shortest and longest chunk of cumulative ``bounds`` (Shape (c + 1,), on the host)."""
    lengths = bounds[1:] - bounds[:-1]
    return int(lengths.min()), int(lengths.max())


@dataclass(frozen=True)
class KeptLayout:
    """One list of grids' layout on the device, and the extremes of its bounds tensors."""

    inputs: dict[str, Any]
    extremes: tuple[tuple[torch.Tensor, int, int], ...]


def host_layout(tower: Any, kind: LayoutKind, grids: torch.Tensor) -> dict[str, Any]:
    """The precomputed inputs of ``tower``'s forward for images of these grids, on the host.

    Args:
        tower: the vision tower (its config, and Qwen3-VL's interpolation settings, are read).
        grids: the images' (temporal, height, width) patch grids, Shape (m, 3), on the host.

    Returns:
        The forward's keyword arguments: tensors on the host, and the longest chunks as ints.
    """
    merge = int(tower.config.spatial_merge_size)
    layout: dict[str, Any] = {"position_ids": vision_utils.get_vision_position_ids(grids, merge)}
    cu_seqlens = vision_utils.get_vision_cu_seqlens(grids)
    layout["cu_seqlens"] = cu_seqlens
    layout["max_seqlen"] = _extremes(cu_seqlens)[1]
    if kind.windows:
        window_index, cu_window_seqlens = vision_utils.get_vision_window_index(
            grids, spatial_merge_size=merge, window_size=int(tower.window_size), patch_size=int(tower.patch_size))
        layout["window_index"] = window_index
        layout["cu_window_seqlens"] = cu_window_seqlens
        layout["max_window_seqlen"] = _extremes(cu_window_seqlens)[1]
    if kind.interpolation:
        indices, weights = vision_utils.get_vision_interpolation_indices_and_weights(
            grids, num_grid_per_side=int(tower.num_grid_per_side), mode=tower.interpolation_mode,
            align_corners=tower.interpolation_align_corners, spatial_merge_size=merge)
        layout["interp_indices"] = indices
        layout["interp_weights"] = weights
    return layout


class TowerLayouts:
    """The precomputed inputs of one vision tower's forward, kept by the images' grids (at most ``held`` lists of
    grids, the least recently used dropped first), on the tower's device."""

    def __init__(self, tower: Any | None, held: int = 64) -> None:
        self.tower = tower
        self.kind = (LAYOUTS.get(tower.config.model_type) if tower is not None and vision_utils is not None
                     else None)
        self.held = held
        self._kept: OrderedDict[bytes, KeptLayout] = OrderedDict()
        self._lock = threading.Lock()  # an asynchronous run's rollout thread and a policy server's requests

    @property
    def enabled(self) -> bool:
        """Whether this tower's layouts are precomputed (else it makes its own)."""
        return self.kind is not None

    def inputs(self, grids: torch.Tensor, device: torch.device) -> dict[str, Any]:
        """The forward's precomputed keyword arguments for images of ``grids`` (Shape (m, 3), on the host), their
        tensors on ``device``; empty when not :attr:`enabled`."""
        if self.kind is None:
            return {}
        grids = grids.to("cpu", torch.int64).contiguous()
        key = grids.numpy().tobytes() + str(device).encode()
        with self._lock:
            kept = self._kept.get(key)
            if kept is not None:
                self._kept.move_to_end(key)
        if kept is None:
            host = host_layout(self.tower, self.kind, grids)
            inputs = {name: to_device(value, device) if isinstance(value, torch.Tensor) else value
                      for name, value in host.items()}
            kept = KeptLayout(inputs, tuple((inputs[name], *_extremes(host[name]))
                                            for name in ("cu_seqlens", "cu_window_seqlens") if name in host))
            with self._lock:
                self._kept[key] = kept
                while len(self._kept) > self.held:
                    self._kept.popitem(last=False)
        for bounds, shortest, longest in kept.extremes:
            note_extremes(bounds, shortest, longest)
        return dict(kept.inputs)

"""Where a model runs and in which dtype: ``model.device`` and ``model.dtype`` resolved to torch's; and host
values copied to the device without waiting for it.

``auto`` picks the GPU when there is one (and bf16 on it), else the CPU in float32. Every stage that
places a model (training, rollout workers, policies loaded by path) resolves the settings here.
"""

from __future__ import annotations

import numpy as np
import torch

from turnrl.config import ConfigError


def resolve_device(name: str) -> torch.device:
    """``auto``: the GPU when there is one, else the CPU; any other name as torch reads it (``cuda:1``).

    Raises:
        ConfigError: a GPU asked for that this process cannot see (torch fails later, at the first tensor moved,
            with a traceback).
    """
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"model.device={name!r}, but this process sees no GPU (a CPU build of torch, no driver, or "
                          "CUDA_VISIBLE_DEVICES empty); use model.device=auto or cpu")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ConfigError(f"model.device={name!r}, but this process sees {torch.cuda.device_count()} GPU(s), "
                          f"cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    return device


def indexed(device: torch.device) -> torch.device:
    """``device`` with its index: a bare ``cuda`` is the process's current GPU (``cuda:N``), what a thread that
    makes it current (``torch.cuda.set_device``, per thread) must be given; other devices as they are."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto``: bf16 on a GPU, float32 elsewhere; else ``float32``, ``bfloat16`` or ``float16``."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def to_device(values: np.ndarray | torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host ``values`` on ``device`` without waiting for the device: through pinned memory on a GPU. A copy from
    pageable memory waits for all the work queued before it, which undid the overlap of host and device work
    (the engine's steps; the update's passes, each selecting its rows with a host index)."""
    tensor = torch.from_numpy(values) if isinstance(values, np.ndarray) else values
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def cat_to_device(parts: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Host tensors ``parts`` joined along dim 0 on ``device``, without waiting for it: on a GPU they are joined
    straight into pinned memory (one host copy, where ``to_device(torch.cat(parts))`` makes two), and copied over
    while the device works. The prefill's pixel values, tens of megabytes a call, were a copy from pageable
    memory that waited for the device."""
    if device.type != "cuda" or any(part.device.type != "cpu" for part in parts):
        return torch.cat(parts).to(device)
    rows = sum(part.shape[0] for part in parts)
    joined = torch.empty((rows, *parts[0].shape[1:]), dtype=parts[0].dtype, pin_memory=True)
    torch.cat(parts, out=joined)
    return joined.to(device, non_blocking=True)

"""Torch's CUDA allocator for a run: its settings (expandable segments), the margin of a GPU that the memory
estimate leaves it, the share of a card a run may take, and a phase's peak.

The estimate itself (:mod:`turnrl.training.memory`) counts what a run holds; this is what holds it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping

import torch

from turnrl.training.train_config import TrainConfig

GIB = 2**30

ALLOC_CONF_VARIABLES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
"""Where torch reads its allocator's settings, the first one set winning (the second is the older name)."""

CUDA_CONTEXT_BYTES = 1.05 * GIB
"""What a process holds on its GPU outside torch's allocator (the CUDA context, the libraries' handles and
kernels), at most: the one-H200 3B row (PPO + critic, StarPO-S, compiled, one process; docs/benchmarks.md), run
without expandable segments, ran out of memory with 131.6 GiB allocated and 7.15 GiB reserved but unallocated
of the card's 139.8 GiB, so everything else the process held was at most the 1.05 GiB left."""

FRAGMENTATION_SHARE = 0.052
"""The share of the GPU's memory that torch's allocator holds but cannot hand out without expandable segments:
the 7.15 GiB reserved but unallocated of that run (5.1% of 139.8 GiB), rounded up. With expandable segments
(freed pages are unmapped and mapped again where they are asked for) the same command ran at a peak of 132.1
GiB allocated against an estimate of 132.7, so no share is counted for them; their page rounding is within
the 7.7 GiB that run left free, not measured apart."""


def allocator_settings(config: TrainConfig, environ: Mapping[str, str]) -> tuple[str, str | None]:
    """The settings torch's CUDA allocator gets and the variable of ``environ`` that set them: the first of
    :data:`ALLOC_CONF_VARIABLES` set (any value: the user's choice wins), else ``run.cuda_alloc_conf`` (None)."""
    variable = next((name for name in ALLOC_CONF_VARIABLES if name in environ), None)
    return (environ[variable], variable) if variable is not None else (config.run.cuda_alloc_conf, None)


def expandable_segments(settings: str) -> bool:
    """Whether allocator settings (``key:value,key:value``, torch's format) turn expandable segments on."""
    pairs = (item.split(":", 1) for item in settings.replace(" ", "").split(",") if ":" in item)
    return any(key == "expandable_segments" and value == "True" for key, value in pairs)


def allocator_margin(device_bytes: float, expandable: bool) -> float:
    """Bytes of a GPU of ``device_bytes`` that the estimate must leave free: the CUDA context and, without
    expandable segments, the allocator's fragmentation (:data:`CUDA_CONTEXT_BYTES`, :data:`FRAGMENTATION_SHARE`)."""
    return CUDA_CONTEXT_BYTES + (0.0 if expandable else FRAGMENTATION_SHARE * device_bytes)


def run_margin(config: TrainConfig, device_bytes: float, environ: Mapping[str, str] = os.environ) -> float:
    """:func:`allocator_margin` for the allocator settings a run of ``config`` gets in ``environ``."""
    return allocator_margin(device_bytes, expandable_segments(allocator_settings(config, environ)[0]))


def set_allocator_settings(config: TrainConfig, environ: MutableMapping[str, str] = os.environ) -> str | None:
    """Before CUDA starts in this process: ``PYTORCH_CUDA_ALLOC_CONF`` set to ``run.cuda_alloc_conf`` (expandable
    segments, as torchtitan and verl set it) unless the user set the allocator's settings. Torch reads them once,
    when CUDA starts; expandable segments let freed memory be mapped again where it is asked for, where the
    default allocator's cached blocks can leave gigabytes it cannot reuse (docs/benchmarks.md).

    Returns:
        The line that says which settings the run has and why; None on a CPU run, or with no settings.
    """
    if config.model.device == "cpu":
        return None
    settings, variable = allocator_settings(config, environ)
    if variable is not None:
        return f"CUDA allocator: {variable}={settings} from the environment (it wins over run.cuda_alloc_conf)"
    if not settings:
        return None
    if torch.cuda.is_initialized():
        return (f"CUDA allocator: run.cuda_alloc_conf={settings} not applied: CUDA had started in this process "
                "(set PYTORCH_CUDA_ALLOC_CONF before it starts)")
    environ["PYTORCH_CUDA_ALLOC_CONF"] = settings
    return (f"CUDA allocator: PYTORCH_CUDA_ALLOC_CONF={settings} (run.cuda_alloc_conf; set the variable to "
            "choose otherwise)")


def cap_gpu_memory(share: float, device: torch.device) -> None:
    """Cap torch's allocator on ``device`` to ``share`` of the card's memory (``run.gpu_share``): past it the
    run gets torch's out-of-memory error, not its neighbours on the card. Torch takes the card by index, and
    a run's device is often plain ``cuda`` (the current card)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    torch.cuda.set_per_process_memory_fraction(share, index)


def start_phase(device: torch.device) -> None:
    """Start measuring a phase's peak memory (the allocator's peak since now)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def phase_peak_gib(device: torch.device) -> float | None:
    """The most memory torch held allocated on ``device`` since :func:`start_phase`, in GiB (None on a CPU)."""
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None

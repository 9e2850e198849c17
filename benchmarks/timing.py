"""Shared timing: a call rate for the env benchmarks whose calls take milliseconds (physics skills, SVG renders),
and the device wait and mean call time of the GPU benchmarks."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the env benchmarks time without torch
    import torch


def rate(call: Callable[[int], object], seconds: float, least: int = 3) -> float:
    """Calls per second of ``call(i)`` over about ``seconds`` (at least ``least`` calls), after one warm-up call."""
    call(0)
    count, start = 0, time.perf_counter()
    while count < least or time.perf_counter() - start < seconds:
        call(count + 1)
        count += 1
    return count / (time.perf_counter() - start)


def synchronize(device: torch.device) -> None:
    """Wait for ``device``'s queued work (a CUDA device's; a CPU's is done when its call returns)."""
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


def mean_milliseconds(call: Callable[[], object], device: torch.device, repeats: int, warmup: int) -> float:
    """Mean milliseconds of ``call()`` over ``repeats`` calls after ``warmup`` uncounted ones (compiles,
    autotuning, the allocator), the device's queued work waited for at both ends."""
    for _ in range(warmup):
        call()
    synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        call()
    synchronize(device)
    return (time.perf_counter() - start) / repeats * 1e3

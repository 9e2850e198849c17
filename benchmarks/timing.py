"""Shared timing for the env benchmarks whose calls take milliseconds (physics skills, SVG renders)."""

from __future__ import annotations

import time
from collections.abc import Callable


def rate(call: Callable[[int], object], seconds: float, least: int = 3) -> float:
    """Calls per second of ``call(i)`` over about ``seconds`` (at least ``least`` calls), after one warm-up call."""
    call(0)
    count, start = 0, time.perf_counter()
    while count < least or time.perf_counter() - start < seconds:
        call(count + 1)
        count += 1
    return count / (time.perf_counter() - start)

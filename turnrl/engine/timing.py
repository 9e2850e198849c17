"""Device time of the engine's prefill and decode work, so that a call's time splits into device work and host
overhead (the rest of the wall time: Python between kernels, waiting for results), and what a roofline of that
work needs beyond the engine's counters (:class:`~turnrl.engine.sequences.EngineStats`): the vision tower's FLOPs
over the images it encoded, which depend on each image's size.

Off unless enabled (two events a step, a few microseconds of host time against milliseconds of device work): a
policy turns it on, so that each rollout's metrics split its generation time (``timing/prefill_device_s``,
``timing/decode_device_s``). On a GPU the spans are CUDA events on the current stream, added up once their end
has passed (a step never waits for one); on a CPU, where operators run as they are called, they are wall time.
While on, each span is also a profiler range named ``engine.prefill`` or ``engine.decode``, so that a
``torch.profiler`` trace can tell which phase launched each kernel (``benchmarks/vlm_rollout.py --kernels``).
"""

from __future__ import annotations

import time

import torch


def causal_pairs(cached: int, new: int) -> int:
    """Query-key pairs of causal attention when ``new`` tokens are prefilled after ``cached`` ones: token i of the
    new ones (from 0) attends to the cached tokens and to new tokens 0 .. i, ``new x cached + new (new + 1) / 2``."""
    return new * cached + new * (new + 1) // 2


class DeviceTimer:
    """Seconds of device work per phase (``prefill``, ``decode``) while :attr:`enabled`, and the images encoded."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.enabled = False
        self.seconds: dict[str, float] = {"prefill": 0.0, "decode": 0.0}
        self.images = 0
        """Images the prefill ran through the vision tower while enabled."""
        self.vision_flops = 0.0
        """The vision tower's forward FLOPs over those images."""
        self._open: tuple[str, torch.cuda.Event | float] | None = None
        self._range: torch.profiler.record_function | None = None
        self._pending: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []

    def reset(self) -> None:
        self.collect()
        self.seconds = dict.fromkeys(self.seconds, 0.0)
        self.images = 0
        self.vision_flops = 0.0

    def encoded(self, images: int, flops: float) -> None:
        """The prefill runs ``images`` through the vision tower, ``flops`` of its forward (counted while enabled:
        the caller need not compute them otherwise)."""
        if self.enabled:
            self.images += images
            self.vision_flops += flops

    def start(self, phase: str) -> None:
        """The device work of ``phase`` begins (queued after everything queued so far)."""
        if not self.enabled:
            return
        self._range = torch.profiler.record_function(f"engine.{phase}")
        self._range.__enter__()
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._open = (phase, event)
        else:
            self._open = (phase, time.perf_counter())

    def stop(self) -> None:
        """The device work begun by :meth:`start` is all queued."""
        if self._open is None:
            return
        phase, begin = self._open
        self._open = None
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None
        if isinstance(begin, torch.cuda.Event):
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._pending.append((phase, begin, end))
        else:
            self.seconds[phase] += time.perf_counter() - begin

    def collect(self, wait: bool = True) -> None:
        """Add up the finished spans: all of them, waiting for their end events, or (``wait=False``, as each engine
        step does) those already done. A step that waited for the decode step it had just launched would undo the
        overlap of host and device work that it measures."""
        pending = []
        for phase, begin, end in self._pending:
            if wait:
                end.synchronize()
            elif not end.query():
                pending.append((phase, begin, end))
                continue
            self.seconds[phase] += begin.elapsed_time(end) / 1000
        self._pending = pending

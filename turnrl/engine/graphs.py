"""CUDA graphs of the engine's calls.

A decode step is captured per batch bucket, and a small prefill call per bucket of sequences and new tokens
(:data:`~turnrl.engine.model_runner.PREFILL_GRAPH_TOKENS`): a graph replays its kernels with no Python between them,
which for a small call is most of its time. A call's inputs are copied into the graph's own input tensors; its
outputs are the graph's output tensors, rewritten by the next replay.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from turnrl.models.devices import to_device


def capture(call: Callable[[], torch.Tensor], device: torch.device, pool: Any) -> tuple[torch.cuda.CUDAGraph,
                                                                                         torch.Tensor]:
    """``call`` captured in a CUDA graph (after two warm-up runs, which compile what it compiles); returns the graph
    and the output it rewrites on each replay."""
    # On this device's own stream: torch.cuda.graph's default capture stream is made once, on the device current at
    # its first use (another engine's GPU), and a capture on a stream of another device records nothing.
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(2):
            call()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
        output = call()
    return graph, output


class DecodeGraph:
    """One decode step of ``batch`` rows: ``step(tokens, positions)`` -> logits, captured.

    Args:
        scratch: the cache's scratch position: warm-up and capture write there, so nothing cached changes.
    """

    def __init__(self, step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], batch: int, scratch: int,
                 device: torch.device, pool: Any) -> None:
        self.tokens = torch.zeros(batch, dtype=torch.long, device=device)
        self.positions = torch.full((batch,), scratch, dtype=torch.long, device=device)
        self.graph, self.logits = capture(lambda: step(self.tokens, self.positions), device, pool)

    def run(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        self.tokens.copy_(tokens)
        self.positions.copy_(positions)
        self.graph.replay()
        return self.logits


PrefillCall = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""(tokens, positions, write positions, rows, last indices) -> the logits after each sequence's last new token."""


class PrefillGraph:
    """A prefill call of at most ``batch`` sequences of at most ``width`` new tokens, captured.

    A call's inputs are padded to the graph's: padding tokens write to the scratch column, and padding sequences
    are a token at position 0 of row 0 (read, never written: their writes go to scratch too).
    """

    def __init__(self, prefill: PrefillCall, batch: int, width: int, scratch: int, device: torch.device,
                 pool: Any) -> None:
        self.scratch = scratch
        self.inputs = torch.zeros(3, batch, width, dtype=torch.long, device=device)
        """Tokens, positions, write positions."""
        self.inputs[2] = scratch
        self.sequences = torch.zeros(2, batch, dtype=torch.long, device=device)
        """Each sequence's row and the index of its last new token."""
        tokens, positions, write_pos = self.inputs
        rows, last = self.sequences
        self.graph, self.logits = capture(lambda: prefill(tokens, positions, write_pos, rows, last), device, pool)

    def run(self, tokens: np.ndarray, positions: np.ndarray, write_pos: np.ndarray, rows: np.ndarray,
            last: np.ndarray) -> torch.Tensor:
        """Logits of the graph's batch, Shape (batch, vocab): the call's sequences first."""
        _, batch, width = self.inputs.shape
        b, t = tokens.shape
        packed = np.zeros((3, batch, width), dtype=np.int64)
        packed[2] = self.scratch
        packed[:, :b, :t] = (tokens, positions, write_pos)
        sequences = np.zeros((2, batch), dtype=np.int64)
        sequences[:, :b] = (rows, last)
        self.inputs.copy_(to_device(packed, self.inputs.device))
        self.sequences.copy_(to_device(sequences, self.inputs.device))
        self.graph.replay()
        return self.logits

"""Reward shaping that needs nothing but the response: DAPO's soft overlong penalty."""

from __future__ import annotations

from collections.abc import Sequence

from turnrl.rewards.turn_rewards import FinishedTurn


class OverlongPenalty:
    """DAPO's soft overlong punishment, per turn.

    With ``L`` the turn's sampled tokens, ``max_tokens`` the sampling limit and
    ``buffer`` the soft zone before it::

        0                                  if L <= max_tokens - buffer
        (max_tokens - buffer - L) / buffer if max_tokens - buffer < L <= max_tokens
        -1                                 if L > max_tokens

    A response cut at the limit gets -1; one that ends just before it, a
    little less; short ones nothing. Use it with ``weight`` in
    ``rewards.extra`` (``fn: overlong``).
    """

    def __init__(self, max_tokens: int, buffer: int) -> None:
        if not 0 < buffer <= max_tokens:
            raise ValueError(f"need 0 < buffer <= max_tokens, got buffer={buffer}, max_tokens={max_tokens}")
        self.max_tokens = max_tokens
        self.buffer = buffer

    def __call__(self, turns: Sequence[FinishedTurn]) -> list[float]:
        return [self.penalty(turn.response_tokens) for turn in turns]

    def penalty(self, length: int) -> float:
        soft_start = self.max_tokens - self.buffer
        if length <= soft_start:
            return 0.0
        if length <= self.max_tokens:
            return (soft_start - length) / self.buffer
        return -1.0

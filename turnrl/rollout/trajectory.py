"""Typed records of rollouts: one :class:`TurnRecord` per model response, one
:class:`Trajectory` per episode.

A trajectory keeps both views of the episode: the chat messages (for logs,
HTTP policies and SFT) and, when the policy samples tokens, the token-exact
context (:class:`turnrl.rollout.context.EpisodeTokens`) that training reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from turnrl.agent.formats import ParsedResponse
    from turnrl.rollout.context import EpisodeTokens

# Episode statuses.
DONE = "done"  # the env terminated (success or failure)
TRUNCATED = "truncated"  # out of turns, action budget, env steps or context budget
ERROR = "error"  # the env or the policy failed; the episode is kept out of training


@dataclass
class TurnRecord:
    """One model response and what it did."""

    index: int
    """0-based turn number."""
    observation: str
    """Text of the user message the response answers."""
    response: str
    """The response text (decoded sampled tokens, special tokens removed)."""
    response_ids: list[int]
    """Sampled token ids (empty for text-only policies)."""
    response_logprobs: list[float]
    """Sampling log-probability of each id in ``response_ids``."""
    finish_reason: str
    """``stop``, ``length`` or ``error``."""
    parsed: ParsedResponse
    """Actions and reasoning fields parsed from the response."""
    actions: list[str] = field(default_factory=list)
    """Actions sent to the env, in order (stepping stops at the first invalid one or at episode end)."""
    actions_valid: list[bool] = field(default_factory=list)
    """Whether the env accepted each action in ``actions``."""
    env_reward: float = 0.0
    """Sum of the env rewards of this turn's steps."""
    format_reward: float = 0.0
    """Format reward plus the no-valid-action penalty."""
    images: list[np.ndarray] = field(default_factory=list)
    """Images of the observation (image modes), ``HxWx3`` uint8."""
    reward_errors: list[str] = field(default_factory=list)
    """Reward functions that failed on this turn (the turn still counts)."""

    @property
    def reward(self) -> float:
        return self.env_reward + self.format_reward

    @property
    def has_valid_action(self) -> bool:
        return any(self.actions_valid)


@dataclass
class Trajectory:
    """One episode."""

    env_id: str
    seed: int
    """Env seed (shared by the group)."""
    group: int
    """Group index within the rollout batch."""
    sample: int
    """Index of this episode within its group."""
    system_prompt: str = ""
    turns: list[TurnRecord] = field(default_factory=list)
    final_observation: str = ""
    """The env's observation after the last turn."""
    status: str = TRUNCATED
    """``done``, ``truncated`` or ``error``."""
    truncation_reason: str | None = None
    """``max_turns``, ``action_budget``, ``env_steps`` or ``context_budget`` when truncated."""
    success: bool = False
    error: str | None = None
    tokens: EpisodeTokens | None = None
    """The token-exact context (None for text-only policies)."""
    images: list[np.ndarray] = field(default_factory=list)
    """Every image shown, in order (the first observation's first)."""

    @property
    def total_reward(self) -> float:
        return sum(turn.reward for turn in self.turns)

    @property
    def env_reward(self) -> float:
        return sum(turn.env_reward for turn in self.turns)

    @property
    def num_actions(self) -> int:
        return sum(len(turn.actions) for turn in self.turns)

    @property
    def trainable(self) -> bool:
        """Has sampled tokens and ended cleanly."""
        return self.status != ERROR and self.tokens is not None and bool(self.turns)

    def to_json(self, image_paths: list[str] | None = None) -> dict[str, Any]:
        """A JSON-ready record of the episode (images by path, tokens left out)."""
        return {
            "env_id": self.env_id,
            "seed": self.seed,
            "group": self.group,
            "sample": self.sample,
            "status": self.status,
            "truncation_reason": self.truncation_reason,
            "success": self.success,
            "error": self.error,
            "total_reward": self.total_reward,
            "system_prompt": self.system_prompt,
            "final_observation": self.final_observation,
            "images": image_paths or [],
            "turns": [
                {
                    "index": turn.index,
                    "prompt": turn.observation,
                    "response": turn.response,
                    "finish_reason": turn.finish_reason,
                    "format_ok": turn.parsed.format_ok,
                    "fields": turn.parsed.fields,
                    "parse_errors": list(turn.parsed.errors),
                    "actions": turn.actions,
                    "actions_valid": turn.actions_valid,
                    "env_reward": turn.env_reward,
                    "format_reward": turn.format_reward,
                    "reward": turn.reward,
                    "reward_errors": turn.reward_errors,
                    "num_response_tokens": len(turn.response_ids),
                }
                for turn in self.turns
            ],
        }

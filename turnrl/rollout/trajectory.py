"""Typed records of rollouts: one :class:`TurnRecord` per model response, one
:class:`Trajectory` per episode.

A trajectory keeps both views of the episode: the chat messages (for logs,
HTTP policies and SFT) and, when the policy samples tokens, the token-exact
context (:class:`turnrl.rollout.context.EpisodeTokens`) that training reads.
:func:`write_trajectories` writes them as JSON lines, images as PNG files.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from turnrl.files import atomic_write_text

if TYPE_CHECKING:
    from turnrl.agent.formats import ParsedResponse
    from turnrl.rollout.context import EpisodeTokens

# Episode statuses.
DONE = "done"  # the env terminated (success or failure)
TRUNCATED = "truncated"  # out of turns, action budget, env steps or context budget
ERROR = "error"  # the env or the policy failed; the episode is kept out of training


def sum_by_name(parts: Iterable[Mapping[str, float]]) -> dict[str, float]:
    """Each name's values summed over ``parts`` (a name missing from a part counts 0 there): a trajectory's
    named rewards over its turns, rollout workers' counters."""
    totals: dict[str, float] = {}
    for part in parts:
        for name, value in part.items():
            totals[name] = totals.get(name, 0.0) + value
    return totals


@dataclass
class TurnRecord:
    """One model response and what it did."""

    index: int
    """0-based turn number."""
    observation: str
    """Text of the user message the response answers."""
    image_at: int = field(default=0, kw_only=True)
    """Where the observation's ``images`` stood in that message: before ``observation[image_at:]`` (0: before the
    text, as turnrl's and RAGEN's layouts put them; VAGEN's puts its image where its placeholder stood)."""
    response: str
    """The assistant message: the format's response prefix (which the prompt ended with), then the decoded
    sampled tokens, special tokens removed."""
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
    actions_effective: list[bool] = field(default_factory=list)
    """Whether each action in ``actions`` changed the env's state (``info["action_is_effective"]``; an accepted
    action counts as effective where the env does not say, a rejected one never)."""
    invalid_reasons: list[str | None] = field(default_factory=list)
    """Why the env rejected each action in ``actions`` (``info["invalid_reason"]``), None for an accepted one or
    where the env gave no reason; the next observation quotes them, and the record keeps the last turn's too."""
    rewards: dict[str, float] = field(default_factory=dict)
    """Unweighted named rewards: ``env`` (the env's rewards for this turn's steps), ``format`` (the format
    reward or the no-valid-action penalty) and every added reward (see :mod:`turnrl.rewards`)."""
    reward: float = 0.0
    """The turn reward, the weighted sum of ``rewards``: what training and the next observation use."""
    images: list[np.ndarray] = field(default_factory=list)
    """Images of the observation (image modes), ``HxWx3`` uint8."""
    reward_errors: list[str] = field(default_factory=list)
    """Reward functions that failed on this turn (scored as configured; the turn still counts)."""
    state_key: str | None = None
    """The env state the turn started from, equal for equal states (GiGPO's anchor states)."""
    response_prefix: str = ""
    """The start of ``response`` that the prompt held (the format's response prefix, after the text a thinking
    model's chat template opens the message with): the model wrote the rest."""
    expert_actions: list[str] = field(default_factory=list)
    """The env solver's actions for the turn's state when the expert played it (its completion's
    :attr:`~turnrl.policy.interface.Completion.expert_actions`), whatever it then played; empty otherwise."""
    weights_version: int | None = None
    """The trainer's update count of the weights that sampled this response (the policy's
    :attr:`~turnrl.policy.interface.Policy.weights_version`): a step's turns sampled before its update carry the
    step's index; an asynchronous run's carry the older weights they played with, and an episode whose weights
    changed between turns says so turn by turn. None where the policy's weights are no trainer's."""

    @property
    def env_reward(self) -> float:
        return self.rewards.get("env", 0.0)

    @property
    def format_reward(self) -> float:
        return self.rewards.get("format", 0.0)

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
    """Every observation's images, in order (the first observation's first); the last observation's were never
    shown where the episode then outgrew the context budget (it ends ``context_budget``, its prompt unsent)."""
    final_images: list[np.ndarray] = field(default_factory=list)
    """Images of the observation after the last turn (image modes), which no turn showed the model: where the
    episode ended (the hole the agent fell into), for the record and the viewer."""
    env_metrics: dict[str, float] = field(default_factory=dict)
    """The env's own figures of the episode as its last step left them (``info["metrics"]``, see
    :func:`turnrl.envs.contract.env_metrics`): e.g. Sokoban's share of boxes on targets; empty where none."""

    @property
    def total_reward(self) -> float:
        return sum(turn.reward for turn in self.turns)

    @property
    def env_reward(self) -> float:
        return sum(turn.env_reward for turn in self.turns)

    def named_rewards(self) -> dict[str, float]:
        """Each named reward summed over the episode's turns."""
        return sum_by_name(turn.rewards for turn in self.turns)

    @property
    def num_actions(self) -> int:
        return sum(len(turn.actions) for turn in self.turns)

    @property
    def trainable(self) -> bool:
        """Has sampled tokens and ended cleanly."""
        return self.status != ERROR and self.tokens is not None and bool(self.turns)

    def to_json(self, image_paths: list[str] | None = None, final_image_paths: list[str] | None = None
                ) -> dict[str, Any]:
        """A JSON-ready record of the episode (images by path: ``images`` those shown, ``final_images`` those of
        the final observation; tokens left out)."""
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
            "final_images": final_image_paths or [],
            "env_metrics": self.env_metrics,
            "turns": [
                {
                    "index": turn.index,
                    "prompt": turn.observation,
                    **({"image_at": turn.image_at} if turn.image_at else {}),
                    "response": turn.response,
                    "response_prefix": turn.response_prefix,
                    "finish_reason": turn.finish_reason,
                    "format_ok": turn.parsed.format_ok,
                    "fields": turn.parsed.fields,
                    "parse_errors": list(turn.parsed.errors),
                    "actions": turn.actions,
                    "actions_valid": turn.actions_valid,
                    "actions_effective": turn.actions_effective,
                    **({"invalid_reasons": turn.invalid_reasons} if any(turn.invalid_reasons) else {}),
                    "rewards": turn.rewards,
                    "reward": turn.reward,
                    "reward_errors": turn.reward_errors,
                    "state_key": turn.state_key,
                    "num_response_tokens": len(turn.response_ids),
                    "weights_version": turn.weights_version,
                    **({"expert_actions": turn.expert_actions} if turn.expert_actions else {}),
                }
                for turn in self.turns
            ],
        }


def write_trajectories(trajectories: list[Trajectory], out_dir: Path, name: str = "trajectories.jsonl") -> Path:
    """One JSON line per episode; images saved as PNG under ``out_dir/images`` (``<stem>_<episode>_<k>.png``
    those shown, ``<stem>_<episode>_final<k>.png`` those of the final observation), before the file that names
    them. The file is written whole or not at all (:func:`~turnrl.files.atomic_write_text`): the viewer reading
    a run as it trains, or a run killed mid-write, never meets a step's file cut short."""
    from PIL import Image

    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / name

    def save(image: np.ndarray, file_name: str) -> str:
        relative = Path("images") / file_name
        (out_dir / relative).parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(image).save(out_dir / relative)
        return str(relative)

    lines = []
    for index, trajectory in enumerate(trajectories):
        shown = [save(image, f"{path.stem}_{index:05d}_{k:03d}.png") for k, image in enumerate(trajectory.images)]
        final = [save(image, f"{path.stem}_{index:05d}_final{k}.png")
                 for k, image in enumerate(trajectory.final_images)]
        lines.append(json.dumps(trajectory.to_json(shown, final)) + "\n")
    atomic_write_text(path, "".join(lines))
    return path

"""An episode's messages in the words of ``agent.prompt_layout``: the system message and each turn's user message.

The texts themselves live in :mod:`turnrl.agent.prompts` (turnrl's and RAGEN's) and :mod:`turnrl.agent.vagen_texts`
(VAGEN's); :class:`Conversation` picks the layout's and fills them from the episode: the turn number, the actions
left, the previous turn's reward, actions and problems, and the observation's text and image.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import takewhile
from typing import Any

import numpy as np

from turnrl.agent.formats import ResponseFormat
from turnrl.agent.prompts import (
    TurnFeedback,
    observation_text,
    ragen_observation_text,
    ragen_reward_text,
    ragen_system_prompt,
    system_prompt,
)
from turnrl.agent.vagen_texts import VAGEN_DEFAULT_SEPARATOR, vagen_observation_text, vagen_system_prompt
from turnrl.config import AgentConfig
from turnrl.envs.contract import AgentEnv
from turnrl.rollout.trajectory import TurnRecord


@dataclass(frozen=True)
class UserTurn:
    """A user message and what the trajectory records of it."""

    text: str
    """The message's text (its text parts joined), what a turn's record holds as its observation."""
    image_at: int
    """Where in ``text`` the image goes (0: before it)."""
    message: dict[str, Any]
    """The chat message."""


def user_message(text: str, images: Sequence[np.ndarray], image_at: int = 0) -> dict[str, Any]:
    """A user message: ``text`` alone, or with ``images`` in parts of their own (as transformers processors take
    them) before ``text[image_at:]``: before the text at 0 (turnrl's and RAGEN's layouts), where VAGEN's
    placeholder stood in its layout.

    Raises:
        ValueError: ``image_at`` outside the text.
    """
    if not 0 <= image_at <= len(text):
        raise ValueError(f"image_at={image_at} is outside a text of {len(text)} characters")
    if not images:
        return {"role": "user", "content": text}
    pictures = [{"type": "image", "image": image} for image in images]
    if not image_at:
        return {"role": "user", "content": [*pictures, {"type": "text", "text": text}]}
    tail = [{"type": "text", "text": text[image_at:]}] if image_at < len(text) else []
    return {"role": "user", "content": [{"type": "text", "text": text[:image_at]}, *pictures, *tail]}


def _user_turn(text: str, image: np.ndarray | None, image_at: int = 0) -> UserTurn:
    return UserTurn(text, image_at, user_message(text, [image] if image is not None else [], image_at))


def stepped_actions(turn: TurnRecord) -> list[str]:
    """The turn's actions the env took, up to the first it rejected (VAGEN's ``valid_actions``)."""
    return [action for action, valid in takewhile(lambda pair: pair[1], zip(turn.actions, turn.actions_valid))]


@dataclass(frozen=True)
class Conversation:
    """Writes one env's episodes' messages in ``agent.prompt_layout``'s words.

    Raises (on construction):
        ConfigError: ``agent.prompt_layout=vagen`` with an env or format VAGEN's texts are not kept for.
    """

    agent: AgentConfig
    fmt: ResponseFormat
    """The format the responses are read in (its name, tags and separator are said in the prompts)."""
    env_id: str

    def __post_init__(self) -> None:
        self.agent.validate_for_env(self.env_id)

    @property
    def separator(self) -> str:
        return self.fmt.separator or VAGEN_DEFAULT_SEPARATOR

    def system(self, env: AgentEnv, names: list[str] | None) -> str:
        """The system message; ``names`` are the env's actions. The turnrl and RAGEN layouts hold the task's
        description where ``agent.env_instructions`` asks for it: ``agent.task_instructions``, or the env's
        ``instructions()``; VAGEN's has its own words for the env."""
        layout = self.agent.prompt_layout
        if layout == "vagen":
            return vagen_system_prompt(self.env_id, self.agent.format,
                                       max_actions_per_turn=self.agent.max_actions_per_turn, separator=self.separator)
        instructions = "" if not self.agent.env_instructions else (
            env.instructions() if self.agent.task_instructions is None else self.agent.task_instructions)
        if layout == "ragen":
            separator = self.fmt.separator
            return ragen_system_prompt(instructions, names if separator is not None else None,
                                       self.agent.max_actions_per_episode, separator or "")
        response_format = (self.fmt.instructions(names, self.agent.max_actions_per_turn)
                           if self.agent.format_instructions else "")
        return system_prompt(self.agent.system_prompt, instructions, response_format)

    def user(self, state_text: str, image: np.ndarray | None, *, turn: int, actions_left: int,
             feedback: TurnFeedback | None = None, names: list[str] | None = None,
             last: TurnRecord | None = None) -> UserTurn:
        """Turn ``turn``'s (1-based) user message; ``feedback`` and ``last`` tell of the turn before (None
        before the first), ``names`` are the env's actions."""
        layout = self.agent.prompt_layout
        if layout == "vagen":
            # VAGEN says nothing of a turn's problems: the list of the actions stepped (maybe []) is all.
            before, after = vagen_observation_text(
                self.env_id, self.agent.format, first=last is None,
                valid_actions=[] if last is None else stepped_actions(last),
                max_actions_per_turn=self.agent.max_actions_per_turn, separator=self.separator,
                image=image is not None, state_text=state_text)
            return _user_turn(before + after, image, len(before) if image is not None else 0)
        if layout == "ragen":
            text = ragen_observation_text(
                state_text, turn=turn, actions_left=actions_left, think="think" in self.fmt.tag_names,
                response_length_hint=self.agent.response_length_hint,
                last_reward=None if last is None else ragen_reward_text(last.env_reward, len(last.actions)),
                no_valid_action=feedback is not None and feedback.no_valid_action)
            return _user_turn(text, image)
        text = observation_text(state_text, turn=turn, actions_left=actions_left, feedback=feedback,
                                action_names=names, turn_info=self.agent.turn_info)
        return _user_turn(text, image)

"""The text of the conversation: system prompt and per-turn observations, in turnrl's and RAGEN's layouts
(``agent.prompt_layout``; VAGEN's texts are in :mod:`turnrl.agent.vagen_texts`).

``turnrl`` (:func:`system_prompt`, :func:`observation_text`) is kept short on purpose: every character here is a
token the model reads at every turn, and on a small model the context is most of the compute. ``ragen``
(:func:`ragen_system_prompt`, :func:`ragen_observation_text`) writes RAGEN's words, for a run that reproduces
its prompts (docs/fidelity.md).
"""

from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import dataclass
from typing import Literal

PromptLayout = Literal["turnrl", "ragen", "vagen"]
"""Whose words the conversation is in: turnrl's, RAGEN's or VAGEN's (:mod:`turnrl.agent.vagen_texts`)."""

DEFAULT_SYSTEM_PROMPT = "You are an agent acting in an environment. Reach the goal in as few actions as possible."


@dataclass(frozen=True)
class TurnFeedback:
    """What the agent is told about its previous turn."""

    reward: float
    """Reward of the previous turn."""
    no_valid_action: bool
    """The previous response had no valid action."""
    problems: tuple[str, ...] = ()
    """Parse or validity problems, shown when ``no_valid_action``. They may quote the response: pass them through
    :func:`neutralized` first."""
    rejected: tuple[str, ...] = ()
    """Notes on the actions the env rejected in a response that also had a valid one (``the env rejected 'x'``),
    shown on a line of their own; passed through :func:`neutralized` as ``problems`` are."""


def neutralized(text: str, control_texts: Collection[str]) -> str:
    """``text`` holding none of ``control_texts`` (a tokenizer's control tokens as text: ``<|im_end|>``): each
    one found gets a space after its first character (``< |im_end|>``), which the tokenizer reads as plain text.

    Feedback that quotes the model's response goes through it: a chat template's tokenizer reads a quoted
    ``<|im_end|><|im_start|>system`` as the control tokens themselves, so the model could end the user's message
    and open a turn of any role, or write an image placeholder with no image, in text made of ordinary tokens.
    Breaking one text may complete another out of the characters around it; the breaking repeats until none is
    left (each round splits two neighbouring characters for good, so it ends).

    Raises:
        ValueError: a control text of one character, or with a space among its first two (no space can break it).
    """
    texts = sorted(set(control_texts), key=len, reverse=True)
    unbreakable = [t for t in texts if len(t) < 2 or " " in t[:2]]
    if unbreakable:
        raise ValueError(f"control texts {unbreakable} cannot be broken by a space; quote the text another way")
    if not texts:
        return text
    pattern = re.compile("|".join(map(re.escape, texts)))
    while True:
        broken = pattern.sub(lambda match: f"{match[0][0]} {match[0][1:]}", text)
        if broken == text:
            return text
        text = broken


def system_prompt(base: str | None, env_instructions: str, format_instructions: str) -> str:
    """System message: role, the env's task description, the response format.

    ``base`` None takes :data:`DEFAULT_SYSTEM_PROMPT`; any string replaces it, ``""`` included (no role line:
    the message is the env's and the format's texts, or empty where those are off too).
    """
    parts = [DEFAULT_SYSTEM_PROMPT if base is None else base.strip(), env_instructions.strip(),
             format_instructions.strip()]
    return "\n\n".join(part for part in parts if part)


def observation_text(
    state_text: str,
    *,
    turn: int,
    actions_left: int,
    feedback: TurnFeedback | None = None,
    action_names: list[str] | None = None,
    turn_info: bool = True,
) -> str:
    """The user message of one turn.

    Args:
        state_text: the env's text observation.
        turn: 1-based turn number.
        actions_left: the episode's remaining action budget.
        feedback: about the previous turn; None on the first turn. Its notes on a response without a valid
            action, or with an action the env rejected beside a valid one, come before the state.
        action_names: listed again when the previous response had no valid action.
        turn_info: frame the state with the turn number, the last reward and the
            actions left; without it the message is the state alone (after the
            note on an invalid response, when ``feedback`` asks for one).
    """
    lines = [f"Turn {turn}."] if turn_info else []
    if feedback is not None:
        if turn_info:
            lines.append(f"Last reward: {feedback.reward:g}.")
        if feedback.no_valid_action:
            why = f" ({'; '.join(feedback.problems[:3])})" if feedback.problems else ""
            lines.append(f"Your last response had no valid action{why}.")
            if action_names:
                lines.append(f"Valid actions: {', '.join(action_names)}.")
        elif feedback.rejected:
            lines.append(f"Your last response had a rejected action ({'; '.join(feedback.rejected[:3])}).")
    if not turn_info:
        return "\n".join([*lines, state_text])
    lines.append(f"State:\n{state_text}")
    lines.append(f"Actions left: {actions_left}.")
    return "\n".join(lines)


# --------------------------------------------------------------------------- RAGEN's layout
# mll-lab-nu/RAGEN at 20daedc, ragen/llm_agent/ctx_manager.py (ContextManager) and es_manager.py.

RAGEN_INVALID_WARNING = "No valid action provided previously. Environment state remains the same. Please try again.\n"


def ragen_system_prompt(env_instructions: str, action_names: list[str] | None = None, max_actions: int = 10,
                        separator: str = "||") -> str:
    """RAGEN's system message (``_build_system_content``)::

        "You're a helpful assistant. " + env_instruction

    with nothing after the space when the instruction is empty. RAGEN's instruction is its ``envs.yaml``
    ``env_instruction`` with the symbols' meanings and, for an env with named actions, RAGEN's two action lines
    appended (``_init_prefix_lookup``; ``max_actions`` is the episode's budget, as RAGEN's
    ``max_actions_per_traj``)::

        "\nYour available actions are:\n" + ", ".join(actions)
        f"\nYou can make up to {max_actions} actions, separated by the action separator \" " + sep + " \"\n"

    Here the instruction is the env's own ``instructions()``, as the env gives them, then those two lines.
    The format is said in each user message.
    """
    actions = "" if not action_names else (
        f"\nYour available actions are:\n{', '.join(action_names)}"
        f'\nYou can make up to {max_actions} actions, separated by the action separator " {separator} "\n')
    return f"You're a helpful assistant. {env_instructions}{actions}"


def ragen_reward_text(env_reward: float, actions_stepped: int) -> str:
    """A turn's reward as RAGEN's ``Reward:`` message writes it: Python's ``str`` of ``acc_reward``, the int 0
    plus each stepped action's float reward (``es_manager.py``, ``_execute_actions``). A turn that stepped
    nothing reads ``0``; one that stepped reads as a float: ``-0.1``, ``0.0``, ``-0.30000000000000004``."""
    return str(float(env_reward)) if actions_stepped else "0"


def ragen_observation_text(
    state_text: str,
    *,
    turn: int,
    actions_left: int,
    think: bool,
    response_length_hint: int,
    last_reward: str | None = None,
    no_valid_action: bool = False,
) -> str:
    """RAGEN's user message of one turn, as its prompts for generation hold it. ``_build_turn_state_content``
    writes a turn's part (called with ``include_warning=True``)::

        content = f"\\nTurn {turn_number}:\\n"
        content += (
            f"State:\\n{turn['state']}\\n{warning}"
            f"You have {turn['actions_left']} actions left. Always output: {FORMAT_PROMPT} "
            f"with no extra text. Strictly follow this format. {LENGTH_PROMPT}\\n"
        )

    and ``_build_infer_multi_turn_messages`` appends it to the user message that holds the previous turn's
    ``f"Reward:\\n{content['reward']}\\n"`` (the first turn's to an empty one, so it opens with a newline).
    ``warning`` is :data:`RAGEN_INVALID_WARNING` after a turn with no valid action, else empty; ``FORMAT_PROMPT`` is
    ``<think> [Your thoughts] </think> <answer> [your answer] </answer>`` with ``enable_think``, else ``<answer>
    [your answer] </answer>``; ``LENGTH_PROMPT`` is ``f"Max response length: {max_tokens} words (tokens)."``
    (``_build_format_prompt``).

    Args:
        state_text: the env's text observation.
        turn: 1-based turn number.
        actions_left: the episode's remaining action budget.
        think: the format asks for reasoning in ``<think>``.
        response_length_hint: the words the message asks for at most (RAGEN's env ``max_tokens``).
        last_reward: the previous turn's reward as :func:`ragen_reward_text` writes it; None on the first turn.
        no_valid_action: the previous response had no valid action (RAGEN's ``manager_invalid_action``).
    """
    shape = ("<think> [Your thoughts] </think> <answer> [your answer] </answer>" if think
             else "<answer> [your answer] </answer>")
    reward = "" if last_reward is None else f"Reward:\n{last_reward}\n"
    warning = RAGEN_INVALID_WARNING if no_valid_action else ""
    return (f"{reward}\nTurn {turn}:\nState:\n{state_text}\n{warning}You have {actions_left} actions left. "
            f"Always output: {shape} with no extra text. Strictly follow this format. "
            f"Max response length: {response_length_hint} words (tokens).\n")

"""The text of the conversation: system prompt and per-turn observations.

Kept short on purpose: every character here is a token the model reads at
every turn, and on a small model the context is most of the compute.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_SYSTEM_PROMPT = "You are an agent acting in an environment. Reach the goal in as few actions as possible."


@dataclass(frozen=True)
class TurnFeedback:
    """What the agent is told about its previous turn."""

    reward: float
    """Reward of the previous turn."""
    no_valid_action: bool
    """The previous response had no valid action."""
    problems: tuple[str, ...] = ()
    """Parse or validity problems, shown when ``no_valid_action``."""


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
        feedback: about the previous turn; None on the first turn.
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
    if not turn_info:
        return "\n".join([*lines, state_text])
    lines.append(f"State:\n{state_text}")
    lines.append(f"Actions left: {actions_left}.")
    return "\n".join(lines)

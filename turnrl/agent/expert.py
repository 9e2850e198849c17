"""What an expert writes in each reasoning field of a format, from the env's ground truth.

The expert policy (the env's solver) and the built-in tokenizer's corpus both
use it, so demos in any format, VAGEN's grounding and world-modeling ones
included, describe the true state before and after the planned actions.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

from turnrl.envs.contract import AgentEnv, TurnEnv, optional_methods


def _state_text(env: AgentEnv) -> str:
    """The env's text of its state where it offers one (built-in envs; else ""), for envs whose facts say
    nothing."""
    return optional_methods(env).text()


def _describe_after(env: AgentEnv, actions: list[str]) -> str:
    """State facts after ``actions``, simulated on a copy of the env (one that draws no images, for a built-in
    env)."""
    shadow = env.planning_copy() if isinstance(env, TurnEnv) else copy.deepcopy(env)
    for action in actions:
        _, _, terminated, truncated, _ = shadow.step(action)
        if terminated or truncated:
            break
    return shadow.state_facts().describe() or _state_text(shadow)


def _reason(actions: list[str], planned: Sequence[str] | None) -> str:
    """Why these actions: the solver's way to the goal for those that follow it, and no claim for the others.

    Only the leading actions that agree with ``planned`` are called the shortest way; an action that stands in
    for the solver's (a random one, or any where the solver has no plan) is said to be tried, since the demo
    must not pass it off as the plan. ``planned`` None: every action is the solver's.
    """
    followed = len(actions) if planned is None else _common_prefix(actions, planned)
    on_plan, tried = ", ".join(actions[:followed]), ", ".join(actions[followed:])
    if not tried:
        return f"The shortest way to the goal starts with {on_plan}."
    if on_plan:
        return f"The shortest way to the goal starts with {on_plan}; then I try {tried}."
    return f"I try {tried}."


def _common_prefix(actions: Sequence[str], planned: Sequence[str]) -> int:
    """How many leading actions agree with ``planned``."""
    count = 0
    for action, expected in zip(actions, planned):
        if action != expected:
            break
        count += 1
    return count


def expert_fields(
    env: AgentEnv, actions: list[str], needed: Sequence[str], planned: Sequence[str] | None = None
) -> dict[str, str]:
    """Reasoning text for each field the format needs, from the env's ground truth.

    Args:
        env: the env in the state the response answers.
        actions: the actions the response takes.
        needed: the format's field names.
        planned: the solver's actions from this state, where ``actions`` may differ from them (noisy demos, or
            a stand-in action where the solver has none: pass ``[]``); None when ``actions`` are the solver's.
    """
    fields: dict[str, str] = {}
    observation = env.state_facts().describe() or _state_text(env)
    if "observation" in needed:
        fields["observation"] = observation
    if "reasoning" in needed or "justification" in needed or "think" in needed:
        reason = _reason(actions, planned)
        fields["reasoning"] = fields["justification"] = reason
        # Without an <observation> field, <think> states the state first (an empty one adds no blank).
        fields["think"] = reason if "observation" in needed else " ".join(filter(None, (observation, reason)))
    if "prediction" in needed:
        fields["prediction"] = _describe_after(env, actions)
    return fields

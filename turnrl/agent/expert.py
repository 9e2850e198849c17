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


def expert_fields(env: AgentEnv, actions: list[str], needed: Sequence[str]) -> dict[str, str]:
    """Reasoning text for each field the format needs, from the env's ground truth."""
    fields: dict[str, str] = {}
    observation = env.state_facts().describe() or _state_text(env)
    plan = ", ".join(actions)
    if "observation" in needed:
        fields["observation"] = observation
    if "reasoning" in needed or "justification" in needed or "think" in needed:
        reason = f"The shortest way to the goal starts with {plan}."
        fields["reasoning"] = fields["justification"] = reason
        fields["think"] = f"{observation} {reason}" if "observation" not in needed else reason
    if "prediction" in needed:
        fields["prediction"] = _describe_after(env, actions)
    return fields

"""What the determinism and action-fuzz tests of the built-in envs assert, written once for every env.

A determinism test plays one seed twice, on a fresh env and on one that has played another episode first, and
compares every transition whole: texts, images, rewards, flags and infos (``check_env`` compares all but the
infos, and only for its own random actions). A fuzz test steps any text and asserts that it is data: no
exception, an observation inside the observation space, and a rejected action that changes nothing.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from turnrl.envs.contract import StateFacts, TurnEnv

Policy = Callable[[TurnEnv, int], str]
"""The action of step ``k`` from the env's current state (so that a plan of the env's own solver can be followed)."""


@dataclass(frozen=True)
class Transition:
    """One reset or step as the determinism check compares it."""

    action: str | None
    """None for the reset."""
    text: str
    image: bytes | None
    reward: float | None
    terminated: bool | None
    truncated: bool | None
    info: dict[str, Any]


def cycle(actions: list[str]) -> Policy:
    """The policy that plays ``actions`` in turn, whatever the state."""
    return lambda env, k: actions[k % len(actions)]


def expert_or(invalid: str, every: int = 3) -> Policy:
    """The first action of the env's own plan, with ``invalid`` at every ``every``-th step (and once the plan is
    empty or None)."""

    def choose(env: TurnEnv, k: int) -> str:
        plan = env.solve()
        return invalid if k % every == every - 1 or not plan else plan[0]

    return choose


def play(env: TurnEnv, seed: int, policy: Policy, steps: int) -> list[Transition]:
    """The reset of ``seed`` and up to ``steps`` steps of ``policy``, until the episode ends."""
    obs, info = env.reset(seed=seed)
    record = [Transition(None, obs["text"], _image_bytes(obs), None, None, None, info)]
    for k in range(steps):
        action = policy(env, k)
        obs, reward, terminated, truncated, info = env.step(action)
        record.append(Transition(action, obs["text"], _image_bytes(obs), reward, terminated, truncated, info))
        if terminated or truncated:
            break
    return record


def assert_same_episode(fresh: TurnEnv, used: TurnEnv, seed: int, policy: Policy, steps: int) -> list[Transition]:
    """Two plays of ``seed`` give equal transitions, infos included: one on ``fresh``, one on ``used`` after it
    played ``seed + 1`` (history must not matter). Returns the episode."""
    play(used, seed + 1, policy, steps)
    first, second = play(fresh, seed, policy, steps), play(used, seed, policy, steps)
    assert len(first) == len(second)
    for k, (a, b) in enumerate(zip(first, second)):
        assert (a.action, a.text, a.reward, a.terminated, a.truncated) == (
            b.action, b.text, b.reward, b.terminated, b.truncated), f"transition {k}"
        assert a.image == b.image, f"the image of transition {k}"
        assert same_value(a.info, b.info), f"the info of transition {k}: {a.info} then {b.info}"
    return first


def same_value(a: Any, b: Any) -> bool:
    """``a == b`` through dicts, lists and tuples, numpy arrays compared by shape and elements."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and np.array_equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_value(a[key], b[key]) for key in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    return bool(a == b)


def same_facts(a: StateFacts, b: StateFacts) -> bool:
    """Two ``state_facts()`` are equal, numpy arrays in ``extra`` compared by value."""
    return a.player == b.player and a.objects == b.objects and same_value(a.extra, b.extra)


def assert_text_is_data(env: TurnEnv, action: str) -> dict[str, Any]:
    """Step ``action`` in ``env`` (reset by the caller): no exception, a finite reward, an observation inside the
    observation space; a rejected action leaves the observation and the facts as they were and ends nothing.
    Returns the info."""
    before, facts = env.observation(), env.state_facts()
    obs, reward, terminated, _, info = env.step(action)
    assert math.isfinite(reward) and env.observation_space.contains(obs)
    if not info["action_is_valid"]:
        assert obs["text"] == before["text"] and _image_bytes(obs) == _image_bytes(before)
        assert same_facts(env.state_facts(), facts) and not terminated
    return info


def _image_bytes(obs: dict[str, Any]) -> bytes | None:
    image = obs.get("image")
    return None if image is None else np.ascontiguousarray(image).tobytes()

"""Small envs defined outside turnrl, for make("module:Class"), Gymnasium ids and check_env.

``Corridor`` is a plain class (no ``gymnasium.Env``) with only the required AgentEnv
methods; ``CorridorTurnEnv`` is the same task on ``TurnEnv``. The ``Broken*``
classes each break one rule of the contract, so check_env must name it.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np

from turnrl.envs import StateFacts, StepOutcome, TurnEnv, facts_from_positions

DELTAS = {"Left": -1, "Right": 1}


class Corridor:
    """Walk right to the end of a corridor; an AgentEnv without gymnasium."""

    def __init__(self, length: int = 5) -> None:
        self.length = length
        self.position = 0

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        self.position = int(np.random.default_rng(seed).integers(0, self.length - 1))
        return self.observation(), {"success": False}

    def canonical(self, action: str) -> str | None:
        return next((name for name in DELTAS if name.lower() == action.strip().lower()), None)

    def step(self, action: str):
        name = self.canonical(action)
        if name is None:
            return self.observation(), 0.0, False, False, {"action_is_valid": False, "success": False}
        self.position = min(max(self.position + DELTAS[name], 0), self.length - 1)
        done = self.position == self.length - 1
        return self.observation(), float(done), done, False, {"action_is_valid": True, "success": done}

    def observation(self) -> Any:
        return {"text": "".join("P" if i == self.position else "_" for i in range(self.length))}

    def instructions(self) -> str:
        return "Walk to the right end of the corridor. P is you. Actions: Left, Right."

    def action_names(self) -> list[str]:
        return list(DELTAS)

    def state_facts(self) -> StateFacts:
        return facts_from_positions((0, self.position), [("exit", (0, self.length - 1))])

    def solve(self) -> list[str] | None:
        return ["Right"] * (self.length - 1 - self.position)


class BrokenRaisesOnBadAction(Corridor):
    def canonical(self, action: str) -> str | None:
        return action  # DELTAS[action] raises KeyError for anything but a name


class BrokenIgnoresSeed(Corridor):
    resets = 0

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        self.resets += 1
        self.position = self.resets % (self.length - 1)  # a new start every time, whatever the seed
        return self.observation(), {"success": False}


class BrokenObservation(Corridor):
    def observation(self) -> Any:
        return super().observation()["text"]  # the bare text, not {"text": ...}


class BrokenSolveName(Corridor):
    def solve(self) -> list[str] | None:
        return ["Forward"] * (self.length - 1 - self.position)


class BrokenBareReset(Corridor):
    """Its reset returns the observation alone (Gymnasium's envs before 0.26 did)."""

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        return super().reset(seed=seed, options=options)[0]


class BrokenSolvePlan(Corridor):
    def solve(self) -> list[str] | None:
        return ["Left"]  # valid, but it never reaches the exit


class BrokenAcceptsGarbage(Corridor):
    def canonical(self, action: str) -> str | None:
        return super().canonical(action) or "Right"


class BrokenRejectChangesState(Corridor):
    def step(self, action: str):
        obs, reward, terminated, truncated, info = super().step(action)
        if not info["action_is_valid"]:
            self.position = 0
            obs = self.observation()
        return obs, reward, terminated, truncated, info


class BrokenMetrics(Corridor):
    def step(self, action: str):
        obs, reward, terminated, truncated, info = super().step(action)
        return obs, reward, terminated, truncated, {**info, "metrics": {"distance": "far"}}


class NoInstructions:
    """Has reset and step but none of the agent methods."""

    def reset(self, *, seed=None, options=None):
        return {"text": ""}, {}

    def step(self, action):
        return {"text": ""}, 0.0, False, False, {}


class CorridorTurnEnv(TurnEnv):
    """The corridor on TurnEnv (a gymnasium.Env), to register under a Gymnasium id."""

    description = "Corridor: walk right to the exit."

    def __init__(
        self, length: int = 5, mode: str = "text", max_steps: int = 20, render_mode: str | None = None
    ) -> None:
        super().__init__(mode=mode, max_steps=max_steps, render_mode=render_mode)
        self.length = length
        self.position = 0

    def _reset(self, rng: np.random.Generator, options: dict) -> None:
        self.position = int(rng.integers(0, self.length - 1))

    def _step(self, action: str) -> StepOutcome:
        before = self.position
        self.position = min(max(before + DELTAS[action], 0), self.length - 1)
        done = self.success()
        return StepOutcome(reward=float(done), terminated=done, success=done, effective=self.position != before)

    def text(self) -> str:
        return "".join("P" if i == self.position else "_" for i in range(self.length))

    def instructions(self) -> str:
        return "Walk to the right end of the corridor. P is you. Actions: Left, Right."

    def action_names(self) -> list[str]:
        return list(DELTAS)

    def success(self) -> bool:
        return self.position == self.length - 1

    def solve(self) -> list[str]:
        return ["Right"] * (self.length - 1 - self.position)


class CorridorWithExtras(Corridor):
    """The corridor with every optional method of the contract, still a plain class (no turnrl base)."""

    closed = 0

    def state_key(self) -> str:
        return f"at {self.position}"

    def text(self) -> str:
        return self.observation()["text"]

    def image(self) -> np.ndarray:
        return np.full((2, self.length, 3), 40 * self.position, dtype=np.uint8)

    def action_budget(self) -> int:
        return self.length - 1

    def canonical_action(self, action: str) -> str | None:
        return self.canonical(action)

    def close(self) -> None:
        self.closed += 1


class CorridorGymEnv(Corridor, gym.Env):
    """The plain corridor as a ``gymnasium.Env``, to register under an id: the required methods only."""

    action_space = gym.spaces.Text(16)
    observation_space = gym.spaces.Dict({"text": gym.spaces.Text(16, charset="P_")})

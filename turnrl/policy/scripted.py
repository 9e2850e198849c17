"""Scripted policies: the env's solver (expert) and uniform random actions.

Both write their actions in the chosen reasoning format, so their responses
parse like a model's. The expert fills the reasoning fields from ground truth
(``state_facts`` before and after its actions), which makes its episodes
usable as SFT demonstrations in any format, VAGEN's grounding and
world-modeling ones included. ``random_action_share`` replaces a share of the
expert's actions with random ones, for imperfect demos.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from turnrl.agent.expert import expert_fields
from turnrl.agent.formats import ResponseFormat
from turnrl.config import SamplingConfig
from turnrl.envs.contract import AgentEnv
from turnrl.policy.interface import Completion, GenerationRequest, Policy


class ScriptedPolicy(Policy):
    """Base of the expert and random policies: text-only, one response per request."""

    def __init__(self, fmt: ResponseFormat, max_actions_per_turn: int = 1, seed: int = 0) -> None:
        self.fmt = fmt
        self.max_actions_per_turn = max_actions_per_turn
        self.rng = np.random.default_rng(seed)

    def generate(self, requests: Sequence[GenerationRequest], sampling: SamplingConfig) -> list[Completion]:
        completions = []
        for request in requests:
            if request.env is None:
                completions.append(Completion(text="", finish_reason="error", error="scripted policies need the env"))
                continue
            try:
                completions.append(self.complete(request.env))
            except Exception as error:  # a failing solver ends its own episode only
                completions.append(Completion(text="", finish_reason="error", error=f"{type(error).__name__}: {error}"))
        return completions

    @property
    def continues_response_prefix(self) -> bool:
        return True

    def complete(self, env: AgentEnv) -> Completion:
        """The completion for the env's current state: :meth:`respond`'s message after the response prefix,
        which the prompt ends with."""
        return Completion(text=self.fmt.continuation(self.respond(env)))

    def respond(self, env: AgentEnv) -> str:
        """The whole assistant message for the env's current state (the response prefix included)."""
        raise NotImplementedError

    def random_actions(self, env: AgentEnv, count: int) -> list[str]:
        names = env.action_names()
        if not names:
            return ["0"]  # free-form envs: a well-formed but wrong answer
        return [str(names[i]) for i in self.rng.integers(0, len(names), size=count)]

    def _actions_per_turn(self, env: AgentEnv) -> int:
        """How many actions one response can carry: ``max_actions_per_turn`` where the format splits the env's
        answers, else one (a free-form answer is one action unless a separator was given explicitly)."""
        splits = self.fmt.separator is not None and (env.action_names() is not None or self.fmt.split_free_form)
        return self.max_actions_per_turn if splits else 1


RANDOM_REASON = "Random choice: this policy does not reason."
"""What the random policy writes in every reasoning field: it must not pass off chance as a plan."""


class RandomPolicy(ScriptedPolicy):
    """Uniformly random actions, well formatted: the floor any learner should beat.

    Every reasoning field (``think``, ``observation``, ``prediction``, ...) says that the choice is random;
    the policy makes up no reasoning, so its episodes never read like demonstrations.
    """

    def respond(self, env: AgentEnv) -> str:
        count = int(self.rng.integers(1, self.max_actions_per_turn + 1)) if self.fmt.separator else 1
        fields = {name: RANDOM_REASON for name in self.fmt.tag_names if name != self.fmt.answer_tag}
        return self.fmt.render(self.random_actions(env, count), fields)


class ExpertPolicy(ScriptedPolicy):
    """The env's solver, re-planned from the current state every turn.

    Args:
        random_action_share: probability that each action is replaced by a random one.
    """

    def __init__(self, fmt: ResponseFormat, max_actions_per_turn: int = 1, seed: int = 0,
                 random_action_share: float = 0.0) -> None:
        super().__init__(fmt, max_actions_per_turn, seed)
        if not 0.0 <= random_action_share <= 1.0:
            raise ValueError(f"random_action_share must be in [0, 1], got {random_action_share}")
        self.random_action_share = random_action_share

    def complete(self, env: AgentEnv) -> Completion:
        message, planned = self._answer(env)
        return Completion(text=self.fmt.continuation(message), expert_actions=planned)

    def respond(self, env: AgentEnv) -> str:
        return self._answer(env)[0]

    def _answer(self, env: AgentEnv) -> tuple[str, list[str]]:
        """The message, and the solver's actions it started from (empty where the solver has no plan and a
        random action stands in)."""
        plan = env.solve()
        planned = list(plan[: self._actions_per_turn(env)]) if plan else []
        actions = planned or self.random_actions(env, 1)
        if self.random_action_share > 0:
            noise = self.rng.random(len(actions)) < self.random_action_share
            actions = [self.random_actions(env, 1)[0] if flip else a for a, flip in zip(actions, noise)]
        # The reasoning calls only the actions that follow the plan the shortest way: a demo never passes a random
        # action off as the solver's.
        return self.fmt.render(actions, expert_fields(env, actions, self.fmt.tag_names, planned)), planned

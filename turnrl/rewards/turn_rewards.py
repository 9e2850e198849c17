"""The reward seam: every turn gets named rewards, and its reward is their weighted sum.

Two named rewards are always there: ``env`` (the env's rewards for the turn's
steps) and ``format`` (the format reward, or the penalty for a turn without a
valid action; see :func:`turnrl.agent.formats.turn_format_reward`). Any other
reward is a :class:`RewardFn`: a callable that takes a batch of finished
turns and returns one score per turn. The rollout calls each reward function
once per round of turns (all the episodes that acted in that round), so a
function that asks a model or a server can batch its calls.

A reward function that raises, returns the wrong number of scores or a
non-finite score does not stop the run: every turn of that call gets
``on_error`` for that reward, the failure is written on the turn
(``reward_errors``, visible in the trajectories) and counted in the
``reward_errors`` metric. A non-finite ``env`` reward (an env step that
returned NaN) is treated the same way.
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from turnrl.agent.formats import ParsedResponse
from turnrl.config import ConfigError, RewardsConfig, RewardSpec, check_registered
from turnrl.envs.contract import StateFacts
from turnrl.envs.settings import check_settings, keyword_parameters
from turnrl.registry import Registry, check_callable

logger = logging.getLogger(__name__)

ENV = "env"
FORMAT = "format"


@dataclass(frozen=True)
class FinishedTurn:
    """What a reward function sees of one turn, after the env stepped its actions."""

    env_id: str
    seed: int
    """The episode's env seed."""
    turn: int
    """0-based turn number."""
    observation: str
    """Text of the user message the response answers."""
    response: str
    """The response text."""
    response_tokens: int
    """Number of sampled tokens (0 for text-only policies)."""
    finish_reason: str
    """``stop`` or ``length`` (cut at max tokens)."""
    parsed: ParsedResponse
    """Actions and reasoning fields of the response."""
    actions: tuple[str, ...]
    """Actions stepped, in order."""
    actions_valid: tuple[bool, ...]
    """Whether the env accepted each of them."""
    env_reward: float
    """The env's rewards for these steps, summed (the ``env`` reward)."""
    format_reward: float
    """The ``format`` reward."""
    terminated: bool
    """The env ended the episode during this turn."""
    success: bool
    """The env reports success after this turn."""
    facts_before: StateFacts | None = None
    """``env.state_facts()`` before the turn's first step; None unless a reward function asks for facts."""
    facts_after: StateFacts | None = None
    """``env.state_facts()`` after the turn's last step; None unless a reward function asks for facts."""


@runtime_checkable
class RewardFn(Protocol):
    """A named reward: one score per finished turn.

    Set an attribute ``needs_state_facts = True`` on the function (or class)
    to receive ``facts_before`` and ``facts_after``; they cost a call to the
    env's ``state_facts()`` per turn, so the rollout skips them otherwise.
    """

    def __call__(self, turns: Sequence[FinishedTurn]) -> Sequence[float]: ...


@dataclass
class TurnScores:
    """The named rewards of one turn and their weighted sum."""

    rewards: dict[str, float]
    """Unweighted score of every named reward (``env``, ``format``, and each added one)."""
    reward: float
    """The turn reward: ``sum(weight[name] * rewards[name])``."""
    errors: list[str] = field(default_factory=list)
    """Reward functions that failed on this turn, with why."""


class Rewards:
    """The rewards of a run: ``env`` and ``format`` with their weights, plus the added reward functions.

    Args:
        config: weights, added rewards (``module:callable`` or a built-in name) and the score on error.
        extra: reward functions given as objects, by name (tests, or code that builds its own), added to
            those of ``config`` with the weight 1.
    """

    def __init__(self, config: RewardsConfig | None = None, extra: dict[str, RewardFn] | None = None) -> None:
        config = config or RewardsConfig()
        self.on_error = config.on_error
        self.timeout_s = config.timeout_s
        self.weights: dict[str, float] = {ENV: config.env_weight, FORMAT: config.format_weight}
        self.functions: dict[str, RewardFn] = {}
        for spec in config.extra:
            self._add(spec.name, load_reward_fn(spec), spec.weight)
        for name, fn in (extra or {}).items():
            self._add(name, fn, 1.0)

    def _add(self, name: str, fn: RewardFn, weight: float) -> None:
        if name in self.weights:
            raise ConfigError(f"reward name {name!r} is used twice; names must be unique (env and format are taken)")
        self.weights[name] = weight
        self.functions[name] = fn

    @property
    def names(self) -> list[str]:
        """Every named reward, ``env`` and ``format`` first."""
        return list(self.weights)

    @property
    def needs_state_facts(self) -> bool:
        return any(getattr(fn, "needs_state_facts", False) for fn in self.functions.values())

    def score(self, turns: Sequence[FinishedTurn]) -> list[TurnScores]:
        """Every named reward of every turn (one call per reward function), and the weighted sums."""
        errors: list[list[str]] = [[] for _ in turns]
        named = [self._given(turn.env_reward, turn.format_reward, errs) for turn, errs in zip(turns, errors)]
        for name, fn in self.functions.items():
            # A turn whose env could not tell its facts is not shown to a function that reads them:
            # it scores on_error alone, and the rest of the round is scored as usual.
            needs_facts = getattr(fn, "needs_state_facts", False)
            usable = [i for i, turn in enumerate(turns)
                      if not needs_facts or (turn.facts_before is not None and turn.facts_after is not None)]
            for i in sorted(set(range(len(turns))) - set(usable)):
                named[i][name] = self.on_error
                errors[i].append(f"{name}: no state facts for this turn")
            if not usable:
                continue
            values, error = _call(fn, [turns[i] for i in usable], self.timeout_s)
            if error is not None:
                logger.warning("reward %r failed on %d turns (scored %s): %s", name, len(usable), self.on_error, error)
                values = [self.on_error] * len(usable)
                for i in usable:
                    errors[i].append(f"{name}: {error}")
            for i, value in zip(usable, values):
                named[i][name] = value
        return [self._weighted(rewards, turn_errors) for rewards, turn_errors in zip(named, errors)]

    def metrics(self) -> dict[str, float]:
        """What the reward functions report about themselves since the last call, as ``<name>/<key>``.

        A function (or its class) with a ``metrics()`` method returning a dict of numbers reports that way
        (the state rewards report their mean match and their judge's calls, errors and latency); a
        ``metrics()`` that fails is logged and skipped.
        """
        out: dict[str, float] = {}
        for name, fn in self.functions.items():
            report = getattr(fn, "metrics", None)
            if not callable(report):
                continue
            try:
                out.update({f"{name}/{key}": float(value) for key, value in report().items()})
            except Exception as error:  # diagnostics must not stop a run
                logger.warning("reward %r: metrics() failed: %s", name, error)
        return out

    def base_scores(self, env_reward: float, format_reward: float) -> TurnScores:
        """The scores of a turn that no reward function sees (its policy or env failed)."""
        errors: list[str] = []
        return self._weighted(self._given(env_reward, format_reward, errors), errors)

    def _given(self, env_reward: float, format_reward: float, errors: list[str]) -> dict[str, float]:
        """The two rewards every turn has. A non-finite one scores ``on_error`` and is written in ``errors``: one NaN
        in a turn reward would make the whole batch's advantages NaN."""
        rewards = {}
        for name, value in ((ENV, env_reward), (FORMAT, format_reward)):
            rewards[name] = value if math.isfinite(value) else self.on_error
            if not math.isfinite(value):
                errors.append(f"{name}: non-finite reward ({value})")
        return rewards

    def _weighted(self, rewards: dict[str, float], errors: list[str]) -> TurnScores:
        total = sum(self.weights[name] * value for name, value in rewards.items())
        return TurnScores(rewards, total, errors)


def _call(
    fn: RewardFn, turns: Sequence[FinishedTurn], timeout_s: float | None = None
) -> tuple[list[float], str | None]:
    """The scores of one reward function, or why it failed (raised, timed out, wrong count, non-finite)."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["values"] = [float(value) for value in fn(turns)]
        except Exception as error:  # a failing reward marks its turns; it never stops the run
            outcome["error"] = f"{type(error).__name__}: {error}"

    if timeout_s is None:
        run()
    else:
        # A daemon thread: a function that never returns is left behind, the rollout goes on.
        worker = threading.Thread(target=run, daemon=True)
        worker.start()
        worker.join(timeout_s)
        if worker.is_alive():
            return [], f"timed out after {timeout_s:g} s"
    if "error" in outcome:
        return [], outcome["error"]
    values = outcome["values"]
    if len(values) != len(turns):
        return [], f"returned {len(values)} scores for {len(turns)} turns"
    bad = [value for value in values if not math.isfinite(value)]
    if bad:
        return [], f"returned a non-finite score ({bad[0]})"
    return values, None


# --------------------------------------------------------------------------- loading
def as_reward(obj: Any) -> RewardFn | type[RewardFn]:
    """What ``rewards.extra[].fn=module:attr`` names: a class, whose instances (built with the spec's settings) are
    checked by :func:`load_reward_fn`, or a :class:`RewardFn` that takes the spec's settings as keywords.

    Raises:
        TypeError: an object that is not callable, or a function that cannot take the turns, saying what is
            expected.
    """
    if not isinstance(obj, type):
        check_callable(obj, RewardFn, "a reward (or a class whose instances are one)", settings_follow=True)
    return obj


REWARDS: Registry[RewardFn | type[RewardFn]] = Registry("reward", coerce=as_reward)
"""Every reward function by name: a :class:`RewardFn`, or a class whose instances are (built with the spec's
settings). ``rewards.extra[].fn`` takes a name or ``module:attr``. The built-in ones are registered by
``module:attr`` strings (their modules import this one)."""

REWARDS.register("overlong", "turnrl.rewards.shaping:OverlongPenalty")
REWARDS.register("grounding", "turnrl.rewards.state:GroundingReward")
REWARDS.register("worldmodel", "turnrl.rewards.state:WorldModelReward")

BUILTIN_REWARDS: tuple[str, ...] = REWARDS.names()
"""Short names of the reward functions that come with turnrl."""


def load_reward_fn(spec: RewardSpec) -> RewardFn:
    """The reward function ``spec.fn`` names: a registered name or ``module:attribute``.

    A class is instantiated with ``spec.settings``; a function gets them as
    keyword arguments on every call.

    Raises:
        ConfigError: an unknown name, a module or attribute that cannot be imported, settings the function or
            class does not take, or an object that cannot score turns (one line that says which).
    """
    obj = check_registered(f"rewards.extra[{spec.name}].fn", spec.fn, REWARDS)
    # An unknown setting named with the likely one of a typo; a function's first parameter is the turns.
    allowed = keyword_parameters(obj)
    try:
        check_settings(f"rewards.extra {spec.name!r} ({spec.fn})", allowed if allowed is None or inspect.isclass(obj)
                       else dict(list(allowed.items())[1:]), dict(spec.settings))
    except ValueError as error:
        raise ConfigError(str(error)) from error
    try:
        if inspect.isclass(obj):
            fn = obj(**spec.settings)
        else:
            inspect.signature(obj).bind(None, **spec.settings)  # unknown or missing settings fail now, not mid-run
            fn = functools.update_wrapper(functools.partial(obj, **spec.settings), obj) if spec.settings else obj
    except (TypeError, ValueError) as error:
        raise ConfigError(
            f"rewards.extra {spec.name!r}: bad settings {spec.settings} for {spec.fn!r}: {error}"
        ) from error
    if inspect.isclass(obj):  # a function's signature was bound above; what a class builds is checked here
        try:
            check_callable(fn, RewardFn, f"what the class {spec.fn!r} builds")
        except TypeError as error:
            raise ConfigError(f"rewards.extra {spec.name!r}: {error}") from error
    return fn

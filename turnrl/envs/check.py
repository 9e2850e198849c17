"""``check_env``: what turnrl asks of an env beyond Gymnasium's own checker.

Run it on a new env before training on it::

    from turnrl.envs import check_env
    check_env(MyEnv())

It runs Gymnasium's ``env_checker`` where the env is a ``gymnasium.Env``, then
the turnrl contract (:class:`~turnrl.envs.contract.AgentEnv`):

- ``reset`` takes the keywords ``seed`` and ``options``, as the rollout passes them;
- ``reset`` returns ``(observation, info)``; observations are dicts with a
  ``"text"`` str (at most the env's ``max_text_length()`` characters, an int
  >= 1, 8,192 where the env defines none; none a control character but
  ASCII whitespace nor a lone surrogate: any other Unicode is text) and,
  optionally, an ``"image"`` (``HxWx3`` uint8 array, a new one every call:
  the rollout keeps each) and nothing else; rewards are finite numbers,
  ``terminated`` and ``truncated`` bools, ``info`` a dict, whose ``"metrics"``, where given, maps
  names to finite numbers and whose ``"action_is_valid"``,
  ``"action_is_effective"`` and ``"success"``, where given, are bools, and
  whose ``"invalid_reason"``, where given, is a str (or None);
- the required methods exist (an error names the optional ones too, which an
  env may leave out: :class:`~turnrl.envs.contract.OptionalMethods` has their defaults)
  and, after a reset, none raises NotImplementedError (a ``TurnEnv`` stub not overridden);
- ``instructions()`` is a non-empty str; ``action_names()`` None or a
  non-empty list of distinct strs; ``state_facts()`` a ``StateFacts``;
  ``solve()`` None or a list of strs, and asking for it leaves the state alone;
- same seed, same episode: two resets with one seed and one action sequence
  give the same texts, images, rewards and flags;
- invalid actions never raise: an empty, garbage or very long action, and
  case and whitespace variants of a name, are either accepted as that name
  (same outcome) or rejected with ``info["action_is_valid"] is False``,
  leaving the observation and ``state_facts()`` as they were;
- ``solve()`` names only actions of ``action_names()`` and, followed from a
  reset, ends the episode with ``info["success"]`` True (skipped with
  ``deterministic=False``, ``turnrl check-env --stochastic``, for envs where
  chance can spoil a plan, e.g. slippery FrozenLake).

Every check runs; one :class:`EnvCheckError` lists each failure with what to
fix. It takes milliseconds for the built-in envs. An answer whose observation
cannot be read (a reset that returns no ``(observation, info)``, an observation
that is no dict) is one failure: the checks that compare observations skip
it, rather than report what follows from it.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.utils import env_checker

from turnrl.envs.contract import (
    MAX_TEXT_LENGTH,
    OPTIONAL_METHODS,
    QUERIES,
    REQUIRED_METHODS,
    AgentEnv,
    StateFacts,
    call_query,
    env_metrics,
    invalid_reason,
    is_flag,
    is_number,
    max_text_length_problems,
    missing_methods,
    missing_reset_keywords,
    optional_methods,
    reset_answer_problems,
    step_answer_problems,
    text_problems,
)

OBS_KEYS = ("text", "image")
GARBAGE_ACTIONS = ("", "   ", "not an action", "<answer>?</answer>", "\x00\u2603\u00fc", "x" * 10_000)
"""Actions that no env names: an env with action names must reject each one, and no env may raise."""
FIX_CHANCE = "draw all randomness from self.np_random, which reset(seed=...) seeds"
"""What to do about an env whose episodes differ for one seed and one action sequence."""
FIX_PLAN = ("return a plan that solves the task, or, where chance can spoil a plan (slippery ice), check with "
            "check_env(env, deterministic=False) (turnrl check-env --stochastic)")
"""What to do about a plan from ``solve()`` that, followed from a reset, does not reach success."""
ONE_STEP_TRUNCATION = "truncates after 1 step"
"""Gymnasium's checker forbids truncating after one step; a one-answer env (Bandit) does that by design."""


class EnvCheckError(AssertionError):
    """An env breaks the turnrl env contract; ``failures`` lists each broken rule."""

    def __init__(self, env_name: str, failures: list[str]) -> None:
        self.failures = list(failures)
        listing = "\n".join(f"- {failure}" for failure in self.failures)
        super().__init__(f"{env_name} fails {len(self.failures)} turnrl env check(s):\n{listing}")


class _Report:
    """Failures in the order found; a rule broken by many calls is one line naming the first few. It carries the
    env's bound on an observation's text too, which every check of an observation reads."""

    def __init__(self) -> None:
        self._messages: dict[str, str] = {}
        self._calls: dict[str, list[str]] = {}
        self.max_text_length = MAX_TEXT_LENGTH
        """The env's ``max_text_length()``, once read (:func:`_text_bound`); the default where it is unusable."""

    def add(self, message: str, call: str | None = None, rule: str | None = None) -> None:
        """Report ``message`` (at ``call``). A ``rule`` groups messages that differ by what they found (a text's
        length): the first one found stands for them all, naming each call."""
        rule = message if rule is None else rule
        self._messages.setdefault(rule, message)
        calls = self._calls.setdefault(rule, [])
        if call is not None and call not in calls:
            calls.append(call)

    def lines(self) -> list[str]:
        lines = []
        for rule, calls in self._calls.items():
            message = self._messages[rule]
            shown = ", ".join(calls[:3]) + (f" and {len(calls) - 3} more" if len(calls) > 3 else "")
            lines.append(f"{message} (at {shown})" if calls else message)
        return lines


@dataclass(frozen=True)
class _Step:
    """One transition as the same-seed check compares it."""

    action: str
    text: Any
    image: np.ndarray | None
    reward: Any
    terminated: Any
    truncated: Any


def check_env(env: AgentEnv, *, seed: int = 0, steps: int = 20, deterministic: bool = True) -> None:
    """Check ``env`` against the turnrl env contract; raise :class:`EnvCheckError` listing every failure.

    Args:
        env: the env to check; it is reset and stepped (and left mid-episode).
        seed: the seed of every reset.
        steps: most steps of the same-seed episode.
        deterministic: whether following ``solve()`` from a reset must reach
            success. Pass False when chance can spoil a plan (slippery ice);
            the plan's actions are still checked to be valid names.
    """
    name = type(env).__name__
    missing = missing_methods(env)
    if missing:
        methods = ", ".join(f"{method}()" for method in missing)
        required, optional = (", ".join(f"{m}()" for m in names) for names in (REQUIRED_METHODS, OPTIONAL_METHODS))
        raise EnvCheckError(name, [f"no {methods}: an agent env has {required} (and may have {optional}: "
                                   f"turnrl.envs.OptionalMethods); define {_and([_expected(m) for m in missing])}"])
    report = _Report()
    keywords = missing_reset_keywords(env)
    if keywords:
        report.add(f"reset() takes no {' or '.join(keywords)} keyword; the rollout calls reset(seed=..., "
                   "options=...): define reset(self, *, seed=None, options=None)")
        if "seed" in keywords:  # every other check resets with a seed
            raise EnvCheckError(name, report.lines())
    unimplemented = _unimplemented_queries(env, seed)
    if unimplemented:  # every check calls them: one line says so, not each check the same bare error
        methods = _and([f"{method}()" for method in unimplemented])
        report.add(f"{name} raises NotImplementedError from {methods}, which every check calls: define "
                   f"{_and([_expected(m) for m in unimplemented])}, as turnrl.envs.AgentEnv declares")
        raise EnvCheckError(name, report.lines())
    report.max_text_length = _text_bound(env, report)
    try:  # reset's answer first: turnrl's lines say in full what Gymnasium's checker says of it in general
        _reset(env, seed, report)
    except Exception:  # a reset that raises: the checks below report it
        pass
    if isinstance(env, gym.Env):
        _gymnasium_checks(env.unwrapped, report)
    repeatable = True

    def same_episode() -> None:
        nonlocal repeatable
        repeatable = _check_same_episode(env, seed, steps, report)

    for title, check in (
        ("reset and queries", lambda: _check_queries(env, seed, report)),
        ("same seed, same episode", same_episode),
        ("invalid actions", lambda: _check_invalid_actions(env, seed, repeatable, report)),
        ("solve()", lambda: _check_solve(env, seed, deterministic, report)),
    ):
        try:
            check()
        except Exception as error:  # a check that cannot finish is one failure, not the end of the report
            report.add(f"{title}: raised {type(error).__name__}: {_clip(str(error))}")
    if report.lines():
        raise EnvCheckError(name, report.lines())


def _unimplemented_queries(env: AgentEnv, seed: int) -> list[str]:
    """The required queries that raise NotImplementedError after ``reset(seed=seed)``: those a
    :class:`~turnrl.envs.contract.TurnEnv` subclass did not override, or a plain class left as stubs. Empty where
    the reset itself raises: the checks report that."""
    try:
        env.reset(seed=seed)
    except Exception:
        return []
    unimplemented = []
    for query in (q for q in QUERIES if q in REQUIRED_METHODS):
        try:
            call_query(env, query)
        except NotImplementedError:
            unimplemented.append(query)
        except Exception:  # a query that fails otherwise: the queries check reports it
            pass
    return unimplemented


def _text_bound(env: AgentEnv, report: _Report) -> int:
    """The env's ``max_text_length()``; where it raises or answers no int >= 1, that is reported and the default
    bound checks the texts."""
    try:
        bound = optional_methods(env).max_text_length()
    except Exception as error:
        report.add(f"max_text_length() raised {type(error).__name__}: {_clip(str(error))}; return the characters "
                   "an observation's text may hold, an int >= 1")
        return MAX_TEXT_LENGTH
    problems = max_text_length_problems(bound)
    for problem in problems:
        report.add(problem)
    return MAX_TEXT_LENGTH if problems else int(bound)


def _expected(method: str) -> str:
    """``instructions() -> str (task description for the system prompt: goal, symbols, actions)``: what a
    required method returns, read off its declaration in :class:`~turnrl.envs.contract.AgentEnv`."""
    declared = vars(AgentEnv)[method]
    returns = inspect.signature(declared).return_annotation  # the annotation's text: annotations are postponed
    summary = (inspect.getdoc(declared) or "").splitlines()[0].rstrip(".").replace("``", "")
    return f"{method}() -> {returns} ({summary[:1].lower()}{summary[1:]})"


def _and(items: list[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    return " and ".join(filter(None, [", ".join(items[:-1]), items[-1]]))


def _gymnasium_checks(env: gym.Env, report: _Report) -> None:
    """Gymnasium's ``check_env``, without render (the rollout never calls it)."""
    try:
        env_checker.check_env(env, skip_render_check=True)
    except AssertionError as error:
        if ONE_STEP_TRUNCATION not in str(error):
            report.add(f"gymnasium's env_checker: {_clip(str(error))}")
            return
        # check_step_determinism stopped at its last assertion; run the check that came after it.
        try:
            env_checker.check_returned_data_not_reused(env)
        except AssertionError as later:
            report.add(f"gymnasium's env_checker: {_clip(str(later))}")
    except Exception as error:
        report.add(f"gymnasium's env_checker raised {type(error).__name__}: {_clip(str(error))}")


def _clip(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} chars)"


def _short(action: str, limit: int = 24) -> str:
    return repr(action) if len(action) <= limit else f"{action[:limit]!r}... ({len(action)} chars)"


# --------------------------------------------------------------------------- calls with their return checked
UNREAD: dict[str, Any] = {}
"""What an observation that cannot be read (no dict, or a reset whose answer is not ``(observation, info)``) reads
as, once reported: empty, and told apart by identity (``obs is UNREAD``), so that a check comparing two
observations skips it instead of reporting what follows from it (a rejected action "changed" an observation the
reset never gave). Never written to."""


def _check_observation(obs: Any, call: str, report: _Report) -> None:
    if not isinstance(obs, dict):
        report.add(f"the observation must be a dict {{'text': str}} (+ 'image'), got a {type(obs).__name__}", call)
        return
    if not isinstance(obs.get("text"), str):
        report.add(f"obs['text'] must be a str, got {type(obs.get('text')).__name__}", call)
    else:
        for problem in text_problems(obs["text"], report.max_text_length):
            report.add(str(problem), call, rule=problem.rule)
    extra = sorted(set(obs) - set(OBS_KEYS))
    if extra:
        report.add(
            f"observation keys {extra} are never read; turnrl reads {list(OBS_KEYS)} (put diagnostics in info)", call
        )
    image = obs.get("image")
    if "image" in obs and not (
        isinstance(image, np.ndarray) and image.dtype == np.uint8 and image.ndim == 3 and image.shape[2] == 3
    ):
        shown = type(image).__name__
        if isinstance(image, np.ndarray):
            shown = f"a {image.dtype} array of shape {image.shape}"
        report.add(f"obs['image'] must be an HxWx3 uint8 array, got {shown}", call)


def _reset(env: AgentEnv, seed: int, report: _Report) -> tuple[dict[str, Any], dict[str, Any]]:
    """``env.reset(seed=seed)``, its return checked; a malformed observation reads as :data:`UNREAD`, a malformed
    info as ``{}``."""
    call = f"reset(seed={seed})"
    result = env.reset(seed=seed)
    problems = reset_answer_problems(result)
    for problem in problems:
        report.add(problem, call)
    if not (isinstance(result, tuple) and len(result) == 2):
        return UNREAD, {}
    obs, info = result
    _check_observation(obs, call, report)
    return (obs if isinstance(obs, dict) else UNREAD), (info if isinstance(info, dict) else {})


def _step(env: AgentEnv, action: str, report: _Report) -> tuple[dict[str, Any], Any, Any, Any, dict[str, Any]]:
    """``env.step(action)``, its return checked; a malformed observation or info reads as ``{}``."""
    call = f"step({_short(action)})"
    result = env.step(action)
    if not (isinstance(result, tuple) and len(result) == 5):
        report.add(
            f"step() must return (obs, reward, terminated, truncated, info), got a {type(result).__name__}", call
        )
        return UNREAD, 0.0, True, False, {}
    obs, reward, terminated, truncated, info = result
    _check_observation(obs, call, report)
    if not _finite_number(reward):
        report.add("the reward must be a finite number", f"{call} -> {_clip(repr(reward), 40)}")
    for problem in step_answer_problems(0.0, terminated, truncated, info):  # the reward's is asked above
        report.add(problem, call)
    obs, info = (obs if isinstance(obs, dict) else UNREAD), (info if isinstance(info, dict) else {})
    try:  # the rollout reads it for every rejected action: one it cannot read fails the episode
        invalid_reason(info)
    except ValueError:
        report.add(f"info['invalid_reason'] must be a str saying why the action was rejected (or None), got a "
                   f"{type(info['invalid_reason']).__name__}", call)
    try:
        env_metrics(info)
    except ValueError as error:
        report.add(str(error), call)
    return obs, reward, terminated, truncated, info


def _finite_number(value: Any) -> bool:
    """A real number (not a bool) that is finite; an int too large for a float is not."""
    if not is_number(value):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _same(a: Any, b: Any) -> bool:
    """``a == b``, where a NaN equals a NaN: a NaN reward is a defect of its own, not a sign of chance."""
    nans = all(isinstance(x, (float, np.floating)) and math.isnan(x) for x in (a, b))
    return nans or bool(a == b)


def _flag(info: dict[str, Any], key: str) -> bool | None:
    """``info[key]`` as a bool where it is one (numpy's too), else None (absent, or a wrong type reported)."""
    value = info.get(key)
    return bool(value) if is_flag(value) else None


def _same_facts(a: Any, b: Any) -> bool:
    """``a == b`` for two ``state_facts()``, where ``extra`` may hold numpy arrays (the env service carries them):
    compared by value, where ``==`` would raise on an array of several elements."""
    if not (isinstance(a, StateFacts) and isinstance(b, StateFacts)):
        return bool(a == b)
    return a.player == b.player and a.objects == b.objects and _same_value(a.extra, b.extra)


def _same_value(a: Any, b: Any) -> bool:
    """``a == b`` through dicts, lists and tuples, numpy arrays compared by shape and elements (NaN equal to NaN,
    as in :func:`_same`)."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        if not (isinstance(a, np.ndarray) and isinstance(b, np.ndarray)):
            return False
        numeric = a.dtype.kind in "fc" and b.dtype.kind in "fc"
        return bool(np.array_equal(a, b, equal_nan=numeric))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_value(a[key], b[key]) for key in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same_value(x, y) for x, y in zip(a, b))
    return _same(a, b)


def _same_image(a: np.ndarray | None, b: np.ndarray | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return bool(np.array_equal(a, b))


# --------------------------------------------------------------------------- the checks
def _check_queries(env: AgentEnv, seed: int, report: _Report) -> None:
    """instructions(), action_names(), state_facts(), solve(): types, and solve() leaves the state alone."""
    _reset(env, seed, report)
    text = env.instructions()
    if not isinstance(text, str) or not text.strip():
        report.add(f"instructions() must be a non-empty str (the task for the system prompt), got {text!r}")
    names = env.action_names()
    strs = isinstance(names, list) and all(isinstance(n, str) and n for n in names)
    distinct_strs = strs and names is not None and len(set(names)) == len(names)
    if names is not None and not (names and distinct_strs):
        report.add(f"action_names() must be None (free-form actions) or a non-empty list of distinct strs: {names!r}")
    facts = env.state_facts()
    if not isinstance(facts, StateFacts):
        report.add(f"state_facts() must return a turnrl.envs.StateFacts, got a {type(facts).__name__}")
    plan = env.solve()
    if plan is not None and not (isinstance(plan, list) and all(isinstance(a, str) for a in plan)):
        report.add(f"solve() must return None or a list of str actions, got {plan!r}")
    if not _same_facts(env.state_facts(), facts):
        report.add("calling solve() changed state_facts(); a solver must plan on a copy of the state")


def _play(env: AgentEnv, seed: int, actions: list[str] | None, steps: int, report: _Report) -> list[_Step]:
    """One episode from ``reset(seed)``: replay ``actions``, or choose up to ``steps`` of them.

    Both plays make the same calls in the same order, so a difference is the
    env's, not the check's. Chosen actions are seeded draws from
    ``action_names()`` with an invalid one now and then or, for free-form
    actions, the solver's plan and then a plain answer.
    """
    obs, _ = _reset(env, seed, report)
    record = [_Step("<reset>", obs.get("text"), obs.get("image"), None, None, None)]
    names, plan = env.action_names(), env.solve()
    rng = np.random.default_rng(seed)
    for k in range(steps if actions is None else len(actions)):
        if actions is not None:
            action = actions[k]
        elif names:
            action = "not an action" if k % 7 == 3 else names[int(rng.integers(len(names)))]
        else:
            action = plan[k] if plan and k < len(plan) else "1"
        obs, reward, terminated, truncated, _ = _step(env, action, report)
        record.append(_Step(action, obs.get("text"), obs.get("image"), reward, terminated, truncated))
        if terminated or truncated:
            break
        names = env.action_names()
    return record


def _check_same_episode(env: AgentEnv, seed: int, steps: int, report: _Report) -> bool:
    """Two plays from ``reset(seed)`` with the same actions; whether they gave the same episode."""
    first = _play(env, seed, None, steps, report)
    _check_images_not_reused(first, report)
    second = _play(env, seed, [step.action for step in first[1:]], steps, report)
    for k, (a, b) in enumerate(zip(first, second)):
        where = "after reset" if k == 0 else f"at step {k} ({_short(a.action)})"
        for field in ("text", "reward", "terminated", "truncated"):
            if not _same(getattr(a, field), getattr(b, field)):
                was, then = _clip(repr(getattr(a, field)), 80), _clip(repr(getattr(b, field)), 80)
                difference = f"{field} {where} was {was}, then {then}"
                report.add(f"same seed ({seed}) and actions gave different episodes: {difference}; {FIX_CHANCE}")
                return False
        if not _same_image(a.image, b.image):
            difference = f"the image {where} differs"
            report.add(f"same seed ({seed}) and actions gave different episodes: {difference}; {FIX_CHANCE}")
            return False
    if len(first) != len(second):
        lengths = f"{len(first) - 1} and {len(second) - 1} steps"
        report.add(f"same seed ({seed}) and actions gave episodes of {lengths}; {FIX_CHANCE}")
        return False
    return True


def _check_images_not_reused(record: list[_Step], report: _Report) -> None:
    """Each observation's image is an array of its own: the rollout keeps every turn's image, so an env that
    draws into one buffer would leave a trajectory whose images all show its last state."""
    images = [(k, step.image) for k, step in enumerate(record) if isinstance(step.image, np.ndarray)]
    for later, (k, image) in enumerate(images):
        shared = next((j for j, earlier in images[:later] if np.shares_memory(image, earlier)), None)
        if shared is not None:
            when = "at reset" if shared == 0 else f"at step {shared}"
            report.add(f"obs['image'] at step {k} shares memory with the image returned {when}; return a new "
                       "array every call (the rollout keeps each turn's image)")
            return


def _probes(names: list[str] | None) -> list[tuple[str, str | None]]:
    """``(action, the name it varies, or None)``: case and whitespace variants of a name, then garbage."""
    probes: list[tuple[str, str | None]] = []
    if names:
        name = names[0]
        for variant in (name.upper(), name.lower(), name.swapcase(), f"  {name}  ", f"{name}\n"):
            if variant not in names and variant not in (p for p, _ in probes):
                probes.append((variant, name))
    lowered = {n.strip().lower() for n in names or ()}
    return probes + [(garbage, None) for garbage in GARBAGE_ACTIONS if garbage.strip().lower() not in lowered]


def _check_invalid_actions(env: AgentEnv, seed: int, repeatable: bool, report: _Report) -> None:
    """Each probe from a fresh ``reset(seed)``: no raise; rejected without effect, or accepted as its name.

    An accepted variant is compared with what its name does, where that is repeatable: the same-episode check
    passed and the name, played twice from the reset, did the same. Elsewhere the two differ by chance, which
    is reported as such, not as the variant's fault.
    """
    _reset(env, seed, report)
    names = env.action_names()
    reference = _reference_outcome(env, seed, names[0], report) if names and repeatable else None
    for probe, name in _probes(names):
        before, _ = _reset(env, seed, report)
        facts = env.state_facts()
        call = f"step({_short(probe)})"
        try:
            after, reward, terminated, _, info = _step(env, probe, report)
        except Exception as error:
            report.add(
                f"step() raised {type(error).__name__}; an invalid action must return info['action_is_valid']=False "
                "and leave the state unchanged",
                call,
            )
            continue
        if _flag(info, "action_is_valid") is False:
            unread = before is UNREAD or after is UNREAD  # reported where it came; no change to judge
            if not unread and (after.get("text") != before.get("text")
                               or not _same_image(before.get("image"), after.get("image"))):
                report.add("a rejected action changed the observation; leave the state as it was", call)
            elif not _same_facts(env.state_facts(), facts):
                report.add("a rejected action changed state_facts(); leave the state as it was", call)
            if terminated:
                report.add("a rejected action terminated the episode; only truncation (a step limit) may end it", call)
        elif name is not None:
            if reference is not None and not _same_outcome((after, reward, terminated), reference):
                message = f"a variant of {name!r} was accepted but did not act as {name!r}"
                report.add(f"{message}; accept it as {name!r} or reject it", call)
        elif names is not None:
            message = "an action that is none of action_names() was not rejected; return info['action_is_valid']=False"
            report.add(message, call)


_Outcome = tuple[dict[str, Any], Any, Any]
"""What one step gives, as the variant check compares it: observation, reward, terminated."""


def _outcome(env: AgentEnv, seed: int, action: str, report: _Report) -> _Outcome:
    """``action`` from a fresh ``reset(seed)``."""
    _reset(env, seed, report)
    obs, reward, terminated, _, _ = _step(env, action, report)
    return obs, reward, terminated


def _reference_outcome(env: AgentEnv, seed: int, name: str, report: _Report) -> _Outcome | None:
    """What ``name`` does from ``reset(seed)``, where it does the same twice; else None (chance, reported)."""
    try:
        first, again = (_outcome(env, seed, name, report) for _ in range(2))
    except Exception:  # a valid action that raises: the same-episode check reports it; the probes still run
        return None
    if not _same_outcome(first, again):
        report.add(f"same seed ({seed}) and action {name!r} from reset gave different outcomes; {FIX_CHANCE}")
        return None
    return first


def _same_outcome(a: _Outcome, b: _Outcome) -> bool:
    (obs, reward, terminated), (other, other_reward, other_terminated) = a, b
    same = obs.get("text") == other.get("text") and _same(reward, other_reward) and terminated == other_terminated
    return same and _same_image(obs.get("image"), other.get("image"))


def _check_solve(env: AgentEnv, seed: int, deterministic: bool, report: _Report) -> None:
    """The plan from ``reset(seed)`` names valid actions and, if deterministic, reaches success."""
    _, info = _reset(env, seed, report)
    names, plan = env.action_names(), env.solve()
    if not isinstance(plan, list):
        return  # None: no solver here (a wrong type is reported by the queries check)
    unknown = [a for a in plan if names is not None and a not in names]
    if unknown:
        report.add(f"solve() returned actions that are not in action_names(): {unknown[:5]}")
        return
    for k, action in enumerate(plan, start=1):
        _, _, terminated, truncated, info = _step(env, action, report)
        if _flag(info, "action_is_valid") is False:
            report.add(f"step() rejected action {k} of solve()'s plan, {_short(action)}")
            return
        if (terminated or truncated) and k < len(plan):
            if deterministic:
                ended = f"the episode ended after {k} of {len(plan)} actions"
                report.add(f"following solve() from reset(seed={seed}), {ended}; {FIX_PLAN}")
            return
    if deterministic and _flag(info, "success") is not True:
        report.add(f"following solve() from reset(seed={seed}) did not end with info['success'] True; {FIX_PLAN}")

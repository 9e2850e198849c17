"""The env contract: :class:`AgentEnv` (what the rollout needs), :class:`OptionalMethods` and :class:`TurnEnv`.

A turnrl environment is a Gymnasium-style environment whose actions are
strings and whose observations are dicts: ``{"text": str}`` and, in image
modes, also ``"image"`` (an ``HxWx3`` uint8 array). On top of Gymnasium it
offers what an agent framework needs: task instructions for the system prompt,
the list of action names, ground-truth facts about the state (for grounding
rewards) and, where a solver exists, expert actions from the current state.
:class:`AgentEnv` states that contract as a Protocol, so any class with these
methods is an env (``turnrl.envs.check_env`` tests one); :class:`TurnEnv` is
the base class of the built-in envs, one way to satisfy it.

Beyond those, an env may define the methods of :class:`OptionalMethods`
(``state_key``, ``text``, ``image``, ``action_budget``, ``max_text_length``,
``canonical_action``, ``close``); that class declares each with what an env
without it answers.
Callers reach them through :func:`optional_methods`, the one place that looks
at what an env defines, and never look a name up themselves. The names of the
contract (:data:`REQUIRED_METHODS`, :data:`OPTIONAL_METHODS`) and the queries an
env that lives elsewhere answers (:data:`QUERIES`) are
read off these two declarations, so a capability is added in one place.

TurnEnv subclasses implement the small ``_reset`` / ``_step`` / ``text`` / ``image``
methods; this base class owns seeding, step counting, truncation and the
handling of bad actions, so that every env behaves the same way:

- Same seed, same episode, always.
- An unknown or malformed action never raises: ``info["action_is_valid"]`` is
  False, the state is unchanged, the step counts towards ``max_steps``, and the
  env's ``invalid_action_reward`` is paid.
- ``terminated`` (the task ended) is never merged with ``truncated``
  (``max_steps`` reached). An env with ``invalid_step_truncates = False``
  (Sudoku, Spatial, as RAGEN's) is not truncated by a step that was invalid
  or broke a rule (``StepOutcome.legal`` False); the agent's action budget
  still ends the episode.
"""

from __future__ import annotations

import copy
import hashlib
import inspect
import math
import re
import string
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, ClassVar, NamedTuple, Protocol, TypeVar, runtime_checkable

import gymnasium as gym
import numpy as np
from gymnasium import spaces

Position = tuple[int, int]
"""A grid cell as ``(row, col)``, row 0 at the top."""

# What the Text space of an observation samples from: printable ASCII plus the symbols the grid envs draw with.
# An observation may hold any other character too, but those of _UNREADABLE (ObservationText, text_problems).
OBS_CHARSET = frozenset(string.printable) | frozenset("√·█░▒▓←→↑↓")
ACTION_CHARSET = frozenset(string.printable)
NO_METRICS: Mapping[str, float] = MappingProxyType({})
"""What :meth:`TurnEnv.episode_metrics` reports by default: nothing (one shared, read-only mapping)."""
MAX_TEXT_LENGTH = 8192
"""Characters a text observation may hold unless its env says more (:meth:`OptionalMethods.max_text_length`): a
bound that catches a broken env, one that writes a page of text a turn into every trajectory."""
IMAGE_CAPTION = "The image shows the current state."
"""The text of an image-mode observation of an env whose image is the whole state."""
MAX_ACTION_LENGTH = 256


@dataclass(frozen=True)
class ObjectFact:
    """One object on the board and where it is relative to the player."""

    name: str
    """Object kind, e.g. ``"box"``, ``"target"``, ``"hole"``, ``"goal"``."""
    position: Position
    vertical: str
    """``"above"``, ``"below"`` or ``"same"`` (same row as the player)."""
    horizontal: str
    """``"left"``, ``"right"`` or ``"same"`` (same column as the player)."""

    def describe(self) -> str:
        """Natural-language relation, e.g. ``"box is above and to the left of the player"``."""
        vertical = self.vertical if self.vertical != "same" else ""
        horizontal = f"to the {self.horizontal} of" if self.horizontal != "same" else ""
        if vertical and horizontal:
            return f"{self.name} is {vertical} and {horizontal} the player"
        if vertical or horizontal:
            return f"{self.name} is directly {vertical or horizontal} the player"
        return f"{self.name} is at the player's position"


@dataclass(frozen=True)
class StateFacts:
    """Ground truth about a state: the player and every object relative to it.

    Grounding and world-model rewards compare what an agent says it sees (or
    predicts) with these facts.
    """

    player: Position | None
    objects: tuple[ObjectFact, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict)
    """Env-specific facts that have no position (e.g. Countdown's target)."""

    def describe(self) -> str:
        """One line per fact; the text an expert writes in ``<observation>``."""
        lines = []
        if self.player is not None:
            lines.append(f"The player is at row {self.player[0]}, column {self.player[1]}.")
        lines.extend(f"The {fact.describe()}." for fact in self.objects)
        lines.extend(f"{key}: {value}" for key, value in self.extra.items())
        return " ".join(lines)


@dataclass(frozen=True)
class StateRewardProfile:
    """How state rewards (:mod:`turnrl.rewards.state`) score a description of an env's state against its
    :class:`StateFacts`: the weight of each object kind and other names for the kinds."""

    weights: Mapping[str, float]
    """Weight of each object kind in the F1 (kinds not listed are not scored)."""
    aliases: Mapping[str, str] = field(default_factory=dict)
    """Other names of a kind, e.g. ``{"gift": "goal"}``."""


def check_text_fits(longest: int, what: str, advice: str = "", max_length: int = MAX_TEXT_LENGTH) -> None:
    """Raise ValueError if an env's longest text observation, ``longest`` characters (the env's own bound for its
    settings, ``what``), could exceed ``max_length`` (the env's :meth:`~OptionalMethods.max_text_length`): checked
    when the env is made, since an observation past it fails the observation space (and Gymnasium's checker) only
    on the episodes that reach it."""
    if longest > max_length:
        tail = f"; {advice}" if advice else ""
        raise ValueError(f"{what} can need {longest} characters, more than the {max_length} an observation "
                         f"may hold{tail}")


_UNREADABLE = re.compile("[\x00-\x08\x0e-\x1f\x7f-\x9f\ud800-\udfff]")
"""The characters an observation's text may not hold: Unicode's control characters (category Cc) but the ASCII
whitespace ones (tab, newline, vertical tab, form feed, carriage return, which :data:`OBS_CHARSET` holds), and the
surrogates (Cs), which UTF-8, and so the tokenizer, cannot encode alone. Every other character is text a tokenizer
takes (letters of any script, CJK, emoji, non-breaking and ideographic spaces, the joiners of emoji and of Persian
or Indic scripts): Python's ``str.isprintable`` refuses those spaces and joiners, so it is not the rule."""
TEXT_CHARACTERS_RULE = ("an observation's text may hold any character but a control character (other than ASCII "
                        "whitespace, such as a newline or tab) or a lone surrogate, which UTF-8 cannot encode")
RAISE_TEXT_LENGTH = "an env whose texts need more returns its bound from max_text_length()"
"""What a text past the default bound is told: the env, not turnrl, knows how long its texts may be."""
SHOWN_CHARACTERS = 3
"""The offending characters a message shows at most."""


class TextProblem(NamedTuple):
    """How an observation's text breaks a rule of :func:`text_problems`: the rule, what broke it here, and what
    to do where the rule alone does not say."""

    rule: str
    found: str
    advice: str = ""

    def __str__(self) -> str:
        return f"{self.rule}, got {self.found}" + (f"; {self.advice}" if self.advice else "")


def text_problems(text: str, max_length: int = MAX_TEXT_LENGTH) -> list[TextProblem]:
    """What is wrong with an observation's text (a ``str``): more than ``max_length`` characters (the env's
    :meth:`~OptionalMethods.max_text_length`; at the default, the problem says how an env raises it), or a
    character of :data:`_UNREADABLE` (the first few shown with ``repr``, where they are); empty when nothing is.
    ``check_env`` reports each, and the rollout ends the episode of an env that gives one, with these words."""
    problems = []
    if len(text) > max_length:
        advice = RAISE_TEXT_LENGTH if max_length == MAX_TEXT_LENGTH else ""
        problems.append(TextProblem(f"an observation's text may hold {max_length} characters", str(len(text)),
                                    advice))
    if not text.isprintable():  # the common case, answered in C; the pattern looks only at texts that need it
        found = [(match.start(), match.group()) for match in _UNREADABLE.finditer(text)]
        if found:
            shown = ", ".join(f"{char!r} at index {index}" for index, char in found[:SHOWN_CHARACTERS])
            more = f" and {len(found) - SHOWN_CHARACTERS} more" if len(found) > SHOWN_CHARACTERS else ""
            problems.append(TextProblem(TEXT_CHARACTERS_RULE, shown + more))
    return problems


class ObservationText(spaces.Text):
    """The Gymnasium space of an observation's text: from ``min_length`` to ``max_length`` characters, none of
    which :func:`text_problems` refuses.

    Written by hand because Gymnasium's ``Text`` holds a text only where each of its characters is in ``charset``,
    a set it must list in full to sample from: an env whose text holds an accented name, CJK or a glyph such as ⬛
    trains fine, yet would fail Gymnasium's checker (and ``turnrl check-env``) with no word of which character.
    ``contains`` asks turnrl's rule instead; ``sample`` still draws from ``charset``, each of whose characters
    (:data:`OBS_CHARSET`) the rule accepts.
    """

    def contains(self, x: Any) -> bool:
        return isinstance(x, str) and self.min_length <= len(x) <= self.max_length and _UNREADABLE.search(x) is None


def relation(player: Position, position: Position) -> tuple[str, str]:
    """Vertical and horizontal relation of ``position`` to ``player``.

    >>> relation((2, 2), (0, 3))
    ('above', 'right')
    """
    (player_row, player_col), (row, col) = player, position
    vertical = "above" if row < player_row else "below" if row > player_row else "same"
    horizontal = "left" if col < player_col else "right" if col > player_col else "same"
    return vertical, horizontal


def facts_from_positions(player: Position | None, objects: list[tuple[str, Position]]) -> StateFacts:
    """Build :class:`StateFacts` from the player's cell and ``(name, cell)`` pairs."""
    if player is None:
        facts = tuple(ObjectFact(name, pos, "same", "same") for name, pos in objects)
        return StateFacts(player=None, objects=facts)
    facts = tuple(ObjectFact(name, pos, *relation(player, pos)) for name, pos in objects)
    return StateFacts(player=player, objects=facts)


def env_metrics(info: Mapping[str, Any]) -> dict[str, float] | None:
    """The figures an env step reports in ``info["metrics"]`` (names to numbers: what the episode has reached so
    far, such as boxes on targets), or None where the step reports none.

    Raises:
        ValueError: ``info["metrics"]`` is not a dict of names to finite numbers (the message says what).
    """
    if "metrics" not in info:
        return None
    figures = info["metrics"]
    if not isinstance(figures, Mapping):
        raise ValueError(f"info['metrics'] must be a dict of names to numbers, got a {type(figures).__name__}")
    out: dict[str, float] = {}
    for name, value in figures.items():
        if not isinstance(name, str) or not isinstance(value, (int, float, np.number, np.bool_)):
            raise ValueError(f"info['metrics'] must map names to numbers, got {name!r}: {value!r}")
        try:
            number = float(value)
        except OverflowError:  # an int past float's range
            number = math.inf
        if not math.isfinite(number):
            raise ValueError(f"info['metrics'][{name!r}] must be finite, got {value!r}")
        out[name] = number
    return out


def invalid_reason(info: Mapping[str, Any]) -> str | None:
    """Why the env rejected a step's action, from ``info["invalid_reason"]`` (a ``str``, on one line here), or
    None where the step gives none (absent, None or blank).

    Raises:
        ValueError: ``info["invalid_reason"]`` is not a str (the message says what it is).
    """
    reason = info.get("invalid_reason")
    if reason is None:
        return None
    if not isinstance(reason, str):
        raise ValueError(f"info['invalid_reason'] must be a str saying why the action was rejected, got a "
                         f"{type(reason).__name__}: {reason!r:.100}")
    return " ".join(reason.split()) or None


INFO_FLAGS = ("action_is_valid", "action_is_effective", "success")
"""The ``info`` keys the rollout reads as truths: each must be a bool where given."""


def is_flag(value: Any) -> bool:
    """A bool as an env gives one: Python's or NumPy's (Gymnasium's envs give ``np.bool_``)."""
    return isinstance(value, (bool, np.bool_))


def is_number(value: Any) -> bool:
    """A real number as an env gives one (Python's or NumPy's int or float), not a bool."""
    return not is_flag(value) and isinstance(value, (int, float, np.integer, np.floating))


def step_answer_problems(reward: Any, terminated: Any, truncated: Any, info: Any) -> list[str]:
    """What is wrong with the types of a step's reward, end flags, ``info`` (a dict) and its flags
    (:data:`INFO_FLAGS`), one line each; empty when nothing is. The rollout reads each flag with ``bool()`` and the
    reward with ``float()``, where the str ``"False"`` is true and the str ``"1"`` a reward, so it refuses them
    here. Whether a number is finite is not asked: a NaN reward is the rewards' to score (``on_error``)."""
    problems = [] if is_number(reward) else [f"the reward must be a number, got {described(reward)}"]
    problems += [f"{name} must be a bool, got {described(value)}"
                 for name, value in (("terminated", terminated), ("truncated", truncated)) if not is_flag(value)]
    if not isinstance(info, Mapping):
        return [*problems, f"step()'s info must be a dict, got a {type(info).__name__}"]
    problems += [f"info[{key!r}] must be a bool, got {described(info[key])}"
                 for key in INFO_FLAGS if key in info and not is_flag(info[key])]
    return problems


def reset_answer_problems(result: Any) -> list[str]:
    """What is wrong with the shape of what ``reset`` returned, one line each; empty when nothing is: it must be the
    pair ``(observation, info)``, ``info`` a dict (what the observation holds is :func:`text_problems`' and the
    checker's). Unpacked without it, a reset that returns the bare observation fails with "not enough values to
    unpack", or, for a dict of two keys (text and image), reads as the keys' names."""
    if not (isinstance(result, tuple) and len(result) == 2):
        got = f"a tuple of {len(result)}" if isinstance(result, tuple) else described(result)
        return [f"reset() must return (observation, info), got {got}"]
    info = result[1]
    return [] if isinstance(info, Mapping) else [f"reset()'s info must be a dict, got a {type(info).__name__}"]


def reset_answer(result: Any) -> tuple[Any, dict[str, Any]]:
    """``(observation, info)``, what ``reset`` returned, where it is that pair (:func:`reset_answer_problems`; an
    info mapping of another kind comes as a dict).

    Raises:
        TypeError: with the problems' lines, where it is not.
    """
    problems = reset_answer_problems(result)
    if problems:
        raise TypeError("; ".join(problems))
    obs, info = result
    return obs, info if isinstance(info, dict) else dict(info)


def described(value: Any) -> str:
    """A value's type and its start, for a message: ``a str: 'False'``, ``an int: 0``."""
    name = type(value).__name__
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}: {value!r:.40}"


Method = TypeVar("Method", bound=Callable[..., Any])
_QUERY_NAMES: list[str] = []


def _query(method: Method) -> Method:
    """Mark a method of the contract as a query: it takes no argument and changes nothing, so an env that lives
    elsewhere (:mod:`turnrl.envservice`) answers it; :data:`QUERIES` lists every method so marked. (It marks
    this module's declarations only, as they are read.)"""
    _QUERY_NAMES.append(method.__name__)
    return method


@runtime_checkable
class AgentEnv(Protocol):
    """What the rollout needs of an environment: the required methods.

    Any object with these methods is an env; it need not subclass
    :class:`TurnEnv` nor even ``gymnasium.Env``. ``turnrl.envs.check_env``
    tests the behaviour the signatures cannot say: same seed, same episode;
    invalid actions never raise; observations are ``{"text": str}`` plus
    ``"image"`` (``HxWx3`` uint8) in image modes. The methods an env may add
    are those of :class:`OptionalMethods`.
    """

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """Start an episode: ``(observation, info)``."""
        ...

    def step(self, action: str) -> tuple[dict[str, Any], float, bool, bool, dict[str, Any]]:
        """Apply one action: ``(observation, reward, terminated, truncated, info)``.

        ``info["action_is_valid"]`` is False for an action the env rejects
        (the state is then unchanged); ``info["success"]`` says whether the
        task is solved. Optional: ``info["action_is_effective"]``, False for
        an accepted action that changed nothing (a push into a wall), and
        ``info["metrics"]``, a dict of names to numbers saying what the
        episode has reached so far (Sokoban: boxes on targets); the rollout
        keeps an episode's last and averages them as ``env_<name>``; and
        ``info["invalid_reason"]``, a ``str`` saying why a rejected action was
        rejected (``"a wall is in the way"``), read only when
        ``action_is_valid`` is False: the next observation tells the agent
        (:func:`invalid_reason`). It is shown to the model, so keep it short.
        """
        ...

    @_query
    def instructions(self) -> str:
        """Task description for the system prompt: goal, symbols, actions."""
        ...

    @_query
    def action_names(self) -> list[str] | None:
        """Canonical action names, or None when actions are free-form."""
        ...

    @_query
    def state_facts(self) -> StateFacts:
        """Ground-truth objects and their relations to the player."""
        ...

    @_query
    def solve(self) -> list[str] | None:
        """Expert actions from the current state, or None where no solver exists."""
        ...


class OptionalMethods:
    """The optional methods of the env contract, each with what an env that does not define it answers.

    An env offers one by defining it; subclassing this class is not needed (:class:`TurnEnv` does, so the type
    checker compares its signatures with these). Callers take an env's through :func:`optional_methods`.
    """

    @_query
    def state_key(self) -> str | None:
        """A key equal exactly for equal states (GiGPO groups turns by it). Default None: the env offers none,
        and :func:`state_key` hashes its latest observation instead."""
        return None

    @_query
    def text(self) -> str:
        """The text of the current state, for expert demos whose state facts say nothing. Default ``""``."""
        return ""

    @_query
    def image(self) -> np.ndarray:
        """The current state as an ``HxWx3`` uint8 image (image modes). Default: NotImplementedError."""
        raise NotImplementedError("the env offers no image() (an env in an image mode renders one)")

    @_query
    def action_budget(self) -> int | None:
        """Actions a competent agent needs at most to finish an episode (one action a turn): the turn and action
        budget ``turnrl eval`` gives by default. Default None: the agent's own budget is kept."""
        return None

    @_query
    def max_text_length(self) -> int:
        """Characters an observation's text may hold, an int >= 1: the rollout (once an episode, after its reset),
        ``check_env`` and the preflight refuse a longer text, and :class:`TurnEnv`'s observation space holds none
        (it asks in ``__init__``). Default :data:`MAX_TEXT_LENGTH`, which catches a broken env; an env whose
        texts are long by nature (retrieved documents, a web page, query results) returns its own bound."""
        return MAX_TEXT_LENGTH

    def canonical_action(self, action: str) -> str | None:
        """The action name ``action`` spells (another case or spelling of a name), or None. An adapter such as
        ``gym:`` accepts these spellings of the env's actions. Default None: the env reads no spelling beyond
        its action names."""
        return None

    def close(self) -> None:
        """Release what the env holds outside Python objects (a process, a window). Default: nothing."""
        return None


def _declared_methods(contract: type) -> tuple[str, ...]:
    """The public methods a class of the contract declares, in the order written."""
    return tuple(name for name, value in vars(contract).items() if inspect.isfunction(value)
                 and not name.startswith("_"))


REQUIRED_METHODS: tuple[str, ...] = _declared_methods(AgentEnv)
"""The methods of :class:`AgentEnv`, in the order an error message lists them."""
OPTIONAL_METHODS: tuple[str, ...] = _declared_methods(OptionalMethods)
"""The methods of :class:`OptionalMethods`."""
QUERIES: tuple[str, ...] = tuple(_QUERY_NAMES)
"""The methods marked as queries (required first): what an env that lives elsewhere answers."""


class _OwnOrDefault(OptionalMethods):
    """The optional methods of an env that does not subclass :class:`OptionalMethods`: its own where it defines
    them, the defaults elsewhere."""

    def __init__(self, env: object) -> None:
        for name in OPTIONAL_METHODS:
            own = getattr(env, name, None)
            if callable(own):  # an attribute that only shares the name (a caption str called text) is no method
                setattr(self, name, own)  # an instance attribute is found before the class's default


def optional_methods(env: object) -> OptionalMethods:
    """The optional methods of ``env``: its own where it defines them, the defaults of :class:`OptionalMethods`
    for the others. The one place that looks at which methods an env has, so that an env of any class (a
    user's ``module:Class``, a Gymnasium env behind ``AgentEnvWrapper``, a remote env) gets the same answers."""
    return env if isinstance(env, OptionalMethods) else _OwnOrDefault(env)


def is_text_bound(bound: Any) -> bool:
    """Whether ``bound`` can be a text's length bound: an int >= 1 (Python's or NumPy's), not a bool (``True``
    would read as a bound of 1)."""
    return not is_flag(bound) and isinstance(bound, (int, np.integer)) and bool(bound >= 1)


def max_text_length_problems(bound: Any) -> list[str]:
    """What is wrong with an env's answer to :meth:`OptionalMethods.max_text_length`, one line; empty when nothing
    is (:func:`is_text_bound`)."""
    if not is_text_bound(bound):
        return [f"max_text_length() must return an int >= 1 (the characters an observation's text may hold), "
                f"got {described(bound)}"]
    return []


def max_text_length_of(env: object) -> int:
    """The characters ``env``'s observation texts may hold: its :meth:`~OptionalMethods.max_text_length` (the
    default where it defines none), checked.

    Raises:
        ValueError: the answer is not an int >= 1 (:func:`max_text_length_problems` says what it was).
        What the env's method raises.
    """
    bound = optional_methods(env).max_text_length()
    problems = max_text_length_problems(bound)
    if problems:
        raise ValueError("; ".join(problems))
    return int(bound)


def call_query(env: AgentEnv, name: str) -> Any:
    """The answer of ``env`` to the query ``name`` (one of :data:`QUERIES`): its required method, or its optional
    one through :func:`optional_methods` (the default where it defines none). Raises what the env raises."""
    if name not in QUERIES:
        raise ValueError(f"unknown query {name!r}; choose from {list(QUERIES)}")
    methods = env if name in REQUIRED_METHODS else optional_methods(env)
    return getattr(methods, name)()


def observation_key(obs: dict[str, Any]) -> str:
    """A hash of an observation, text and image: the state key of an env without ``state_key()``."""
    digest = hashlib.sha1(str(obs.get("text", "")).encode())
    if "image" in obs:
        digest.update(np.ascontiguousarray(obs["image"]).tobytes())
    return digest.hexdigest()


def state_key(env: AgentEnv, obs: dict[str, Any]) -> str:
    """A key of the state ``env`` is in, equal exactly for equal states (GiGPO groups turns by it): the env's
    ``state_key()`` where it offers one, else :func:`observation_key` of ``obs``, the env's latest observation.
    Raises what the env's ``state_key()`` raises."""
    own = optional_methods(env).state_key()
    return observation_key(obs) if own is None else str(own)


def missing_methods(env: Any) -> list[str]:
    """The :class:`AgentEnv` methods that ``env`` (an instance or a class) lacks."""
    return [name for name in REQUIRED_METHODS if not callable(getattr(env, name, None))]


RESET_KEYWORDS = ("seed", "options")
"""The keywords every caller of ``reset`` passes (the rollout: ``reset(seed=..., options=...)``)."""


def missing_reset_keywords(env: AgentEnv) -> list[str]:
    """The keywords of :data:`RESET_KEYWORDS` that ``env.reset`` cannot take: an env written for the old
    ``reset()`` or ``reset(seed)`` raises TypeError on the first reset of a run, so it is told before."""
    try:
        parameters = inspect.signature(env.reset).parameters
    except (TypeError, ValueError):  # no signature to read (a builtin): the call itself will tell
        return []
    if any(parameter.kind is inspect.Parameter.VAR_KEYWORD for parameter in parameters.values()):
        return []
    return [
        keyword for keyword in RESET_KEYWORDS
        if keyword not in parameters or parameters[keyword].kind is inspect.Parameter.POSITIONAL_ONLY
    ]


class AgentEnvWrapper(gym.Wrapper):
    """Forwards the contract's methods through Gymnasium wrappers.

    Gymnasium 1.x wrappers do not forward unknown attributes, so ``gymnasium.make(id)`` returns a
    ``TimeLimit(...)`` without ``instructions()``. This wrapper keeps ``reset``, ``step`` and ``close`` going
    through every wrapper and finds each other method of the contract, required or optional, on the outermost
    layer that defines it (usually the env itself). An optional method that no layer defines is absent here
    too, so :func:`optional_methods` answers its default.
    """

    def __getattr__(self, name: str) -> Any:
        # Called only for what the wrapper itself lacks; the names come from the declaration, so a method added
        # to the contract is forwarded with no edit here.
        if name in REQUIRED_METHODS or name in OPTIONAL_METHODS:
            return self.env.get_wrapper_attr(name)
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")


@dataclass(frozen=True)
class StepOutcome:
    """What a subclass's ``_step`` reports for one valid action."""

    reward: float
    terminated: bool = False
    success: bool = False
    effective: bool = True
    """Whether the action changed the state (a push into a wall does not)."""
    info: dict[str, Any] = field(default_factory=dict)
    legal: bool = True
    """False when the action was read but breaks a rule (a Sudoku digit that clashes): RAGEN counts it as
    invalid (see ``TurnEnv.invalid_step_truncates``)."""


class TurnEnv(gym.Env[dict, str], OptionalMethods):
    """Base class of the built-in environments (see the module docstring); an :class:`AgentEnv`.

    Subclasses set ``modes``, ``description`` and implement ``_reset``,
    ``_step``, ``text``, ``instructions`` and ``action_names``; image modes
    also implement ``image``; ``state_facts`` and ``solve`` where they exist.
    """

    metadata: dict[str, Any] = {"render_modes": ["ansi", "rgb_array"], "render_fps": 4}  # declared as Gymnasium does
    modes: ClassVar[tuple[str, ...]] = ("text",)
    description: ClassVar[str] = ""
    setting_choices: ClassVar[dict[str, tuple[Any, ...]]] = {}
    """The allowed values of settings that take one of a few (``turnrl envs`` shows them; ``mode`` is
    ``modes``)."""
    state_reward_profile: ClassVar[StateRewardProfile | None] = None
    """How grounding and world-model rewards weigh the object kinds of :meth:`state_facts`, and other names
    for them; None weighs every kind in the facts the same."""
    corpus_variants: ClassVar[tuple[dict[str, Any], ...]] = ({},)
    """Settings that change what the env's texts look like (sizes, vocabularies): the built-in tokenizer's
    corpus plays each of them (:mod:`turnrl.models.builtin`, for the envs it names)."""
    invalid_action_reward: float = 0.0
    draws_images: bool = True
    """Whether an image mode's observations carry their image: False in a :meth:`planning_copy`."""
    reset_options: ClassVar[tuple[str, ...] | None] = None
    """The keys ``reset(options=...)`` takes; :meth:`reset` refuses any other (a misspelt option would play a
    random episode in silence). None leaves the options unchecked, for an env that reads them itself."""
    invalid_step_truncates: ClassVar[bool] = True
    """Whether reaching ``max_steps`` with an invalid or illegal step truncates the episode. RAGEN's Sudoku and
    Spatial envs return ``done=False`` for such a step whatever the count, so those envs set False."""

    def __init__(
        self,
        mode: str = "text",
        max_steps: int = 100,
        image_shape: tuple[int, int] | None = None,
        render_mode: str | None = None,
    ) -> None:
        if mode not in self.modes:
            raise ValueError(f"{type(self).__name__}: unknown mode {mode!r}; choose one of {list(self.modes)}")
        if render_mode is not None and render_mode not in self.metadata["render_modes"]:
            raise ValueError(f"render_mode must be one of {self.metadata['render_modes']}, got {render_mode!r}")
        if max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {max_steps}")
        self.mode = mode
        self.max_steps = int(max_steps)
        self.render_mode = render_mode
        obs_spaces: dict[str, spaces.Space] = {
            "text": ObservationText(max_text_length_of(self), min_length=0, charset=OBS_CHARSET)
        }
        if self.is_image_mode:
            if image_shape is None:
                raise ValueError(f"{type(self).__name__}: an image mode needs image_shape=(height, width), the "
                                 "size of what image() draws: pass it to TurnEnv.__init__ (docs/extending.md, An "
                                 "image mode)")
            height, width = image_shape
            obs_spaces["image"] = spaces.Box(0, 255, (height, width, 3), dtype=np.uint8)
        self.observation_space = spaces.Dict(obs_spaces)
        self.action_space = spaces.Text(MAX_ACTION_LENGTH, min_length=0, charset=ACTION_CHARSET)
        self._steps = 0
        self._terminated = False

    # ----------------------------------------------------------------- to implement
    def _reset(self, rng: np.random.Generator, options: dict[str, Any]) -> None:
        """Draw a new episode from ``rng`` (or ``options``, e.g. a given level)."""
        raise NotImplementedError

    def _step(self, action: str) -> StepOutcome:
        """Apply one canonical action (an element of ``action_names()``)."""
        raise NotImplementedError

    def text(self) -> str:
        """The text observation of the current state."""
        raise NotImplementedError

    def image(self) -> np.ndarray:
        """The current state as an ``HxWx3`` uint8 image (image modes)."""
        raise NotImplementedError(f"{type(self).__name__} has no image rendering")

    def instructions(self) -> str:
        """Task description for the system prompt: goal, symbols, actions."""
        raise NotImplementedError

    def action_names(self) -> list[str] | None:
        """Canonical action names, or None when actions are free-form."""
        raise NotImplementedError

    def state_facts(self) -> StateFacts:
        """Ground-truth objects and their relations to the player."""
        return StateFacts(player=None)

    def solve(self) -> list[str] | None:
        """Expert actions from the current state, or None where no solver exists."""
        return None

    def episode_metrics(self) -> Mapping[str, float]:
        """What the episode has reached so far, as numbers by name: every step's ``info["metrics"]`` (nothing
        by default; omitted when empty). Called on every step, so it must be cheap, and return a new dict each
        time (an info's data is the caller's to keep, as Gymnasium requires)."""
        return NO_METRICS

    def action_budget(self) -> int:
        """Actions a competent agent needs at most to finish an episode under these settings (one action a
        turn): the turn and action budget ``turnrl eval`` gives by default. The base class allows the
        env's own step limit; envs that know a tighter bound say so."""
        return self.max_steps

    # ----------------------------------------------------------------- shared logic
    @property
    def is_image_mode(self) -> bool:
        """Whether observations carry an ``"image"`` (modes named ``image...``)."""
        return self.mode.startswith("image")

    @property
    def steps(self) -> int:
        """Steps taken in this episode, invalid ones included."""
        return self._steps

    def canonical_action(self, action: Any) -> str | None:
        """Map a raw action to its canonical name, or None if it is not one.

        Default: case-insensitive match of the stripped string against
        ``action_names()``. Free-form envs override this.
        """
        if not isinstance(action, str):
            return None
        lookup = self.__dict__.get("_action_lookup")
        if lookup is None:
            names = self.action_names()
            lookup = None if names is None else {name.lower(): name for name in names}
            self._action_lookup = lookup
        if lookup is None:
            return action
        return lookup.get(action.strip().lower())

    def success(self) -> bool:
        """Whether the current state solves the task."""
        return False

    def observation(self) -> dict[str, Any]:
        """The observation of the current state, as ``reset`` and ``step`` return it."""
        obs: dict[str, Any] = {"text": self.text()}
        if self.is_image_mode and self.draws_images:
            obs["image"] = self.image()
        return obs

    def planning_copy(self) -> TurnEnv:
        """A deep copy to simulate moves on (the expert's predicted state after its actions): the same dynamics,
        texts and facts, but its observations carry no image. A plan never looks at the picture, which a visual
        env draws at every step: PrimitiveSkill's MuJoCo scene makes a renderer for each copy (0.15 s on two CPU
        cores) and takes about 40 ms a frame. The copy shares the env's spaces, which describe what an observation
        and an action may be and never change with the state: deep-copying them was most of a small env's copy
        (0.5 of 0.6 ms for Bandit), and the expert copies the env for every response it writes."""
        shared: dict[int, Any] = {id(self.observation_space): self.observation_space,
                                  id(self.action_space): self.action_space}
        shadow = copy.deepcopy(self, shared)
        shadow.draws_images = False
        return shadow

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        self._steps = 0
        self._terminated = False
        self._reset(self.np_random, self._checked_options(options or {}))
        self.__dict__.pop("_action_lookup", None)  # action names may differ per episode
        return self.observation(), {"success": self.success()}

    def _checked_options(self, options: dict[str, Any]) -> dict[str, Any]:
        """A copy of ``options``; ValueError naming the keys :attr:`reset_options` does not hold, and those it does."""
        unknown = sorted(set(options) - set(self.reset_options)) if self.reset_options is not None else []
        if unknown:
            takes = ", ".join(map(repr, self.reset_options or ())) or "no reset options (the seed draws the episode)"
            raise ValueError(f"{type(self).__name__.removesuffix('Env')} reset options: unknown {unknown}; it takes "
                             f"{takes}")
        return dict(options)

    def step(self, action: str):
        canonical = None if self._terminated else self.canonical_action(action)
        self._steps += 1
        if canonical is None:
            reward, terminated, success, info = self.invalid_action_reward, self._terminated, self.success(), {}
            valid, effective, legal = False, False, False
        else:
            outcome = self._step(canonical)
            reward, terminated, success, info = outcome.reward, outcome.terminated, outcome.success, dict(outcome.info)
            valid, effective, legal = True, outcome.effective, outcome.legal
        self._terminated = bool(terminated)
        truncated = (not self._terminated and self._steps >= self.max_steps
                     and (legal or self.invalid_step_truncates))
        info.update(action_is_valid=valid, action_is_effective=effective, success=bool(success))
        figures = self.episode_metrics()
        if figures:
            info["metrics"] = figures
        return self.observation(), float(reward), self._terminated, truncated, info

    def ansi(self) -> str:
        """The state as text for ``render_mode="ansi"``, whatever the mode (default: :meth:`text`)."""
        return self.text()

    def state_key(self) -> str:
        """A key that is equal exactly for equal states (GiGPO groups turns by it): the board as text."""
        return self.ansi()

    def render(self):
        if self.render_mode == "ansi":
            return self.ansi()
        if self.render_mode == "rgb_array":
            return self.image()
        return None

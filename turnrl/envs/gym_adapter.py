"""Any Gymnasium env that renders ``rgb_array`` frames, as a turnrl image env (the VisGym contract).

``make("gym:FrozenLake-v1", is_slippery=False)`` (or ``env.id=gym:FrozenLake-v1``
with ``env.settings``) builds ``gymnasium.make("FrozenLake-v1",
render_mode="rgb_array", is_slippery=False)`` and wraps it in
:class:`GymImageEnv`:

- **Observations** are ``{"text": caption, "image": frame}``: the frame is
  ``env.render()`` after every reset and step (``HxWx3`` uint8, resized with
  Pillow when ``image_size`` is set), the caption a short fixed text, since
  the image carries the state. Over HTTP the client sends the frame as a
  base64 PNG in an OpenAI-format user message, as VisGym does.
- **Actions** are strings: the names of an action map (``{"left": 0, ...}``),
  matched case-insensitively, or VisGym's tuple spellings, read by a small
  scanner and never evaluated: ``('left',)`` names an action and
  ``('move', k)`` is the env's own action ``k``, where the map has it.
- **An unknown action** never raises and never steps the env:
  ``info["action_is_valid"]`` is False and the observation is the frame as
  it was (the rollout then resends it with the list of valid actions).
  After the episode has ended every action is rejected so.
- ``terminated`` and ``truncated`` (e.g. the ``TimeLimit`` that
  ``gymnasium.make`` adds) pass through unmerged, rewards pass through as
  floats and the env's ``info`` is kept; ``info["success"]`` is decided from
  the state for the envs in :data:`KNOWN_ENVS` and taken from the env's own
  ``info["success"]`` or ``info["is_success"]`` for any other (False if it
  has neither).
- **The turn budget** ``turnrl eval`` gives by default (``action_budget()``)
  is the env's own step limit (``max_episode_steps`` of its spec, which
  ``gymnasium.make`` enforces with ``TimeLimit``); an env without one keeps
  the agent's budget.
- **A turnrl env underneath** (one with the :class:`~turnrl.envs.contract.AgentEnv`
  methods, e.g. ``gym:turnrl/Maze2D-v0`` with ``mode="image"``) keeps its own
  action names, instructions, state facts and solver, and the spellings its
  ``canonical_action`` accepts (Maze2D's VisGym tuples).

Settings of ``make("gym:<id>", **settings)``: the adapter's own keys
(:data:`ADAPTER_KEYS`, see :class:`GymImageEnv`) and the env's, which go to
``gymnasium.make`` and are checked against its constructor first.

Gymnasium's toy-text envs (FrozenLake, CliffWalking, Taxi) draw with pygame,
which opens its display module even for ``rgb_array``; the adapter sets
``SDL_VIDEODRIVER=dummy`` (unless it is set already) so that they render on
machines without a display.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import gymnasium as gym
import numpy as np
from gymnasium import spaces
from gymnasium.envs.registration import load_env_creator
from PIL import Image

from turnrl.envs import search
from turnrl.envs.actions import parse_tuple
from turnrl.envs.contract import (
    ACTION_CHARSET,
    MAX_ACTION_LENGTH,
    MAX_TEXT_LENGTH,
    OBS_CHARSET,
    AgentEnv,
    StateFacts,
    check_text_fits,
    described,
    facts_from_positions,
    is_text_bound,
    missing_methods,
    missing_reset_keywords,
    optional_methods,
)
from turnrl.envs.settings import close_names, did_you_mean, registered_settings

__all__ = [
    "ADAPTER_KEYS",
    "DEFAULT_TEXT",
    "GYM_PREFIX",
    "KNOWN_ENVS",
    "GymImageEnv",
    "KnownEnv",
    "make_image_env",
]

GYM_PREFIX = "gym:"
"""``env.id`` prefix that routes a Gymnasium id to this adapter."""
ADAPTER_KEYS = ("actions", "instructions", "image_size", "text", "max_text_length")
"""Settings the adapter takes itself; every other setting goes to ``gymnasium.make``."""
DEFAULT_TEXT = "The image shows the current state."
"""The text part of every observation unless ``text`` is given."""


# --------------------------------------------------------------------------- tuple actions
def _name_key(name: str) -> str:
    """Lookup key of an action name: case-insensitive, whitespace collapsed; tuples in one spelling."""
    items = parse_tuple(name)
    if items is not None:
        return repr(tuple(item.lower() if isinstance(item, str) else item for item in items))
    return " ".join(name.split()).lower()


# --------------------------------------------------------------------------- what the adapter knows of some envs
@dataclass(frozen=True)
class KnownEnv:
    """Defaults for one Gymnasium env class and the rules the adapter reads from its state.

    Each callable takes the unwrapped env (``env.unwrapped``).
    """

    actions: dict[str, int]
    """The default action map, in the env's own order."""
    describe: Callable[[Any], str]
    """The task and what the image shows, for the default instructions (the action list is added)."""
    success: Callable[[Any], bool]
    """Whether the current state solves the task."""
    facts: Callable[[Any], StateFacts]
    goal_state: Callable[[Any], int | None] | None = None
    """The state to reach, for the breadth-first solver over the env's transition table ``P``."""


def _frozenlake_goal(lake: Any) -> int:
    return int(np.flatnonzero(lake.desc.ravel() == b"G")[0])


def _frozenlake_facts(lake: Any) -> StateFacts:
    cells = lake.desc.ravel()
    objects = [("goal", divmod(_frozenlake_goal(lake), lake.ncol))]
    objects += [("hole", divmod(int(i), lake.ncol)) for i in np.flatnonzero(cells == b"H")]
    return facts_from_positions(divmod(int(lake.s), lake.ncol), objects)


def _frozenlake_describe(lake: Any) -> str:
    slippery = " The ice is slippery: a move may slide you to either side instead." if _stochastic(lake) else ""
    return (
        f"FrozenLake. Walk across a frozen lake of {lake.nrow}x{lake.ncol} tiles from the start (the tile "
        "marked S) to the goal (the tile marked G, with the red flag) without falling into a hole. In the "
        "image you are the small grey figure, ice tiles are light blue and holes are dark blue water. Each "
        "action moves you one tile; walking into the edge leaves you where you are. Reaching the goal gives "
        f"reward 1 and ends the game; falling into a hole ends it with 0.{slippery}"
    )


def _cliff_goal(cliff: Any) -> int:
    rows, cols = cliff.shape
    return int(np.ravel_multi_index((rows - 1, cols - 1), cliff.shape))


def _cliff_facts(cliff: Any) -> StateFacts:
    cols = cliff.shape[1]
    objects = [("goal", divmod(_cliff_goal(cliff), cols))]
    objects += [("cliff", (int(r), int(c))) for r, c in np.argwhere(cliff._cliff)]
    return facts_from_positions(divmod(int(cliff.s), cols), objects)


def _cliff_describe(cliff: Any) -> str:
    rows, cols = cliff.shape
    slippery = " The ground is slippery: a move may slide you to either side instead." if _stochastic(cliff) else ""
    return (
        f"CliffWalking. Walk along a {rows}x{cols} grid from the start (bottom left, marked S) to the goal "
        "(bottom right, marked G, with the red flag). In the image you are the small grey figure and the brown "
        "strip along the bottom row between start and goal is a cliff: stepping onto it costs -100 and sends "
        "you back to the start. Every step costs -1, so take the shortest path that avoids the cliff. Each "
        f"action moves you one tile; walking into the edge leaves you where you are. Reaching the goal ends "
        f"the game.{slippery}"
    )


def _taxi_success(taxi: Any) -> bool:
    _, _, passenger, destination = taxi.decode(taxi.s)
    return bool(passenger == destination)  # only a drop-off at the destination puts the passenger there


def _taxi_facts(taxi: Any) -> StateFacts:
    row, col, passenger, destination = taxi.decode(taxi.s)
    objects = [("destination", tuple(taxi.locs[destination]))]
    if passenger < len(taxi.locs):
        objects.append(("passenger", tuple(taxi.locs[passenger])))
    facts = facts_from_positions((int(row), int(col)), objects)
    return StateFacts(facts.player, facts.objects, {"passenger in the taxi": bool(passenger == len(taxi.locs))})


def _taxi_goal(taxi: Any) -> int | None:
    if taxi.fickle_passenger:  # the destination may change outside the transition table
        return None
    _, _, _, destination = taxi.decode(taxi.s)
    row, col = taxi.locs[destination]
    return int(taxi.encode(row, col, destination, destination))


def _taxi_describe(taxi: Any) -> str:
    rainy = " It is rainy: a move may go to either side instead." if _stochastic(taxi) else ""
    return (
        "Taxi. Drive the taxi to the passenger, pick them up, drive to their destination and drop them off. "
        "The image shows a 5x5 grid of streets with walls (dark lines) that the taxi cannot cross. The taxi is "
        "the yellow car; the four coloured squares R, G, Y and B are the places where passengers wait and "
        "leave; the passenger (a small figure) waits on one of them until picked up, and the hotel marks the "
        "destination. Every step costs -1, a pickup or drop-off at the wrong place costs -10, and dropping the "
        f"passenger at the destination gives +20 and ends the game.{rainy}"
    )


KNOWN_ENVS: dict[str, KnownEnv] = {
    "gymnasium.envs.toy_text.frozen_lake:FrozenLakeEnv": KnownEnv(
        actions={"left": 0, "down": 1, "right": 2, "up": 3},
        describe=_frozenlake_describe,
        # reward_schedule can make every tile pay, so success is read from the tile, not the reward.
        success=lambda lake: lake.desc.ravel()[lake.s] == b"G",
        facts=_frozenlake_facts,
        goal_state=_frozenlake_goal,
    ),
    "gymnasium.envs.toy_text.cliffwalking:CliffWalkingEnv": KnownEnv(
        actions={"up": 0, "right": 1, "down": 2, "left": 3},
        describe=_cliff_describe,
        success=lambda cliff: int(cliff.s) == _cliff_goal(cliff),  # the episode ends only at the goal
        facts=_cliff_facts,
        goal_state=_cliff_goal,
    ),
    "gymnasium.envs.toy_text.taxi:TaxiEnv": KnownEnv(
        actions={"down": 0, "up": 1, "right": 2, "left": 3, "pickup": 4, "dropoff": 5},
        describe=_taxi_describe,
        success=_taxi_success,
        facts=_taxi_facts,
        goal_state=_taxi_goal,
    ),
}
"""Envs the adapter knows, by the ``module:Class`` of ``env.unwrapped`` (any registered id of that class,
e.g. FrozenLake-v1 and FrozenLake8x8-v1, CliffWalking-v1 and CliffWalkingSlippery-v1, Taxi-v4)."""


def _class_path(env: gym.Env) -> str:
    cls = type(env.unwrapped)
    return f"{cls.__module__}:{cls.__qualname__}"


def _stochastic(env: Any) -> bool:
    """Whether a transition table ``P`` has an action with more than one outcome (slippery ice, rain)."""
    return any(len(outcomes) > 1 for moves in env.P.values() for outcomes in moves.values())


# --------------------------------------------------------------------------- the adapter
class GymImageEnv(gym.Wrapper):
    """A Gymnasium env that renders ``rgb_array`` frames, as a turnrl image env (see the module docstring).

    Args:
        env: the env, made with ``render_mode="rgb_array"``.
        actions: action names -> the env's actions, e.g. ``{"left": 0, "down": 1,
            "right": 2, "up": 3}``; a list names the actions ``0, 1, ...`` in order.
            Default: the map of :data:`KNOWN_ENVS`; for a turnrl env its own
            ``action_names()``; for a ``Discrete(n)`` space the names ``"0"`` ...
            ``"n-1"``; other spaces need a map.
        instructions: the task for the system prompt, used as given. Default:
            for a turnrl env its own ``instructions()``; for a known env what the
            image shows and the rules, else a generic line, either followed by
            the action names and their tuple spellings.
        image_size: resize every frame to ``(height, width)``, or to this long
            side (aspect kept; VisGym uses 336); None keeps the rendered size.
        text: the text part of every observation (default :data:`DEFAULT_TEXT`).
        max_text_length: the characters an observation's text may hold (``max_text_length()``, and the text
            space's bound); raise it from :data:`~turnrl.envs.contract.MAX_TEXT_LENGTH` for a longer ``text``.
    """

    def __init__(
        self,
        env: gym.Env,
        *,
        actions: Mapping[str, Any] | Sequence[str] | None = None,
        instructions: str | None = None,
        image_size: int | Sequence[int] | None = None,
        text: str = DEFAULT_TEXT,
        max_text_length: int = MAX_TEXT_LENGTH,
    ) -> None:
        super().__init__(env)
        label = env.spec.id if env.spec is not None else type(env.unwrapped).__name__
        if env.render_mode != "rgb_array":
            raise ValueError(f"{label}: the gym: adapter needs render_mode='rgb_array', got {env.render_mode!r}")
        if instructions is not None and (not isinstance(instructions, str) or not instructions.strip()):
            raise ValueError(f"instructions must be a non-empty str, got {instructions!r}")
        if not isinstance(text, str):
            raise ValueError(f"text must be a str, got {type(text).__name__}")
        if not is_text_bound(max_text_length):
            raise ValueError(f"max_text_length must be an int >= 1, got {described(max_text_length)}")
        check_text_fits(len(text), "the text setting", "raise the max_text_length setting",
                        max_length=int(max_text_length))
        keywords = missing_reset_keywords(cast(AgentEnv, env.unwrapped))
        if keywords:
            raise ValueError(
                f"{label}: its reset() takes no {' or '.join(keywords)} keyword; the gym: adapter resets with "
                "reset(seed=..., options=...), as Gymnasium 1.x envs take them (the seed makes episodes "
                "repeatable): define reset(self, *, seed=None, options=None) and seed with super().reset(seed=seed)"
            )
        self.label = label
        self.known = KNOWN_ENVS.get(_class_path(env))
        unwrapped: Any = env.unwrapped
        self.agent_env: AgentEnv | None = None if missing_methods(unwrapped) else unwrapped
        if actions is None and self.agent_env is not None and self.agent_env.action_names():
            actions = {name: name for name in self.agent_env.action_names() or ()}
        self._actions = _action_map(label, env.action_space, actions, self.known)
        self._lookup = {_name_key(name): name for name in self._actions}
        self._by_number: dict[int, str] = {}  # ('move', k) -> the name of the env's action k
        for name, value in self._actions.items():
            if isinstance(value, (int, np.integer)):
                self._by_number.setdefault(int(value), name)
        self._instructions = instructions
        self.image_size = _image_size(image_size)
        self.caption = text
        self._max_text_length = int(max_text_length)
        # Render once now: an env that cannot draw fails here, and the observation space needs the frame's shape.
        env.reset()
        height, width, _ = self._frame().shape
        self.observation_space = spaces.Dict(
            {
                "text": spaces.Text(self._max_text_length, min_length=0, charset=OBS_CHARSET | set(text)),
                "image": spaces.Box(0, 255, (height, width, 3), dtype=np.uint8),
            }
        )
        self.action_space = spaces.Text(MAX_ACTION_LENGTH, min_length=0, charset=ACTION_CHARSET)
        self._obs: dict[str, Any] = {}
        self._terminated = self._truncated = False
        self._success = False

    # ----------------------------------------------------------------- Gymnasium
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        _, info = self.env.reset(seed=seed, options=options)
        self._terminated = self._truncated = False
        info = dict(info)
        self._success = info["success"] = self._decide_success(info)
        self._obs = {"text": self.caption, "image": self._frame()}
        return self._obs, info

    def step(self, action: str):
        if not self._obs:
            raise gym.error.ResetNeeded("call reset() before step()")
        env_action = None if self._terminated or self._truncated else self.env_action(action)
        if env_action is None:  # no env step: the state, and the frame, stay as they were
            obs = {"text": self.caption, "image": self._obs["image"].copy()}
            info = {"action_is_valid": False, "success": self._success}
            return obs, 0.0, self._terminated, self._truncated, info
        _, reward, terminated, truncated, info = self.env.step(env_action)
        self._terminated, self._truncated = bool(terminated), bool(truncated)
        info = dict(info)
        self._success = self._decide_success(info)
        info.update(action_is_valid=True, success=self._success)
        self._obs = {"text": self.caption, "image": self._frame()}
        return self._obs, float(reward), self._terminated, self._truncated, info

    # ----------------------------------------------------------------- the turnrl contract
    def instructions(self) -> str:
        if self._instructions is not None:
            return self._instructions
        if self.agent_env is not None:
            return self.agent_env.instructions()
        if self.known is not None:
            task = self.known.describe(self.env.unwrapped)
        else:
            task = f"{self.label}. The image shows the current state of the environment."
        return f"{task} {self._actions_line()}"

    def action_names(self) -> list[str]:
        return list(self._actions)

    def action_budget(self) -> int | None:
        """Actions a competent agent needs at most (the budget ``turnrl eval`` gives by default): the step limit
        of the env's ``TimeLimit`` (``max_episode_steps`` of its spec: 100 for FrozenLake-v1, or the setting),
        or a turnrl env's own ``action_budget()`` where that is tighter; None for an env with neither
        (CliffWalking-v1), which keeps the agent's budget."""
        limit = self.env.spec.max_episode_steps if self.env.spec is not None else None
        own = None if self.agent_env is None else optional_methods(self.agent_env).action_budget()
        budgets = [int(b) for b in (limit, own) if b is not None]
        return min(budgets) if budgets else None

    def max_text_length(self) -> int:
        """Characters an observation's text may hold: the ``max_text_length`` setting (every observation's text
        is the ``text`` setting, so a turnrl env underneath has no say)."""
        return self._max_text_length

    def state_facts(self) -> StateFacts:
        """The player and objects of a known or a turnrl env; an empty ``StateFacts`` for any other env."""
        if self.agent_env is not None:
            return self.agent_env.state_facts()
        if self.known is None:
            return StateFacts(player=None)
        return self.known.facts(self.env.unwrapped)

    def solve(self) -> list[str] | None:
        """Shortest action names to the goal, for known envs whose transitions are deterministic; else None.

        Breadth-first search over the env's transition table ``P`` from the
        current state, through the mapped actions only; a transition that ends
        the episode anywhere but at the goal (a hole) is never taken. A turnrl
        env's own plan, where the map names each of its actions.
        """
        if self.agent_env is not None:
            plan = self.agent_env.solve()
            names = [self._name_of(action) for action in plan or ()]
            if plan is None or None in names:
                return None
            return [name for name in names if name is not None]
        known, env = self.known, cast(Any, self.env.unwrapped)  # a toy-text env: transition table P, state s
        if known is None or known.goal_state is None or _stochastic(env):
            return None
        goal = known.goal_state(env)
        if goal is None:
            return None
        moves = [(name, value) for name, value in self._actions.items() if isinstance(value, (int, np.integer))]

        def successors(state: int):
            for name, value in moves:
                ((_, nxt, _, done),) = env.P[state][int(value)]
                if not done or nxt == goal:
                    yield name, int(nxt)

        return search.shortest_path(int(env.s), goal, successors)

    # ----------------------------------------------------------------- helpers
    def env_action(self, action: Any) -> Any | None:
        """The env's action for an action string, or None if it names none.

        A name (any case, whitespace collapsed); a tuple whose spelling is a
        name of the map; ``(name,)``; ``('move', k)`` for the env's action ``k``;
        or, for a turnrl env, a spelling its ``canonical_action`` reads as a mapped action.
        """
        if not isinstance(action, str) or len(action) > 2 * MAX_ACTION_LENGTH:
            return None
        name = self._lookup.get(_name_key(action))
        items = parse_tuple(action) if name is None else None
        if items is not None:
            if len(items) == 1 and isinstance(items[0], str):
                name = self._lookup.get(_name_key(items[0]))
            elif len(items) == 2 and str(items[0]).lower() == "move" and isinstance(items[1], int):
                name = self._by_number.get(items[1])
        if name is None and self.agent_env is not None:
            name = self._name_of(optional_methods(self.agent_env).canonical_action(action))
        return None if name is None else self._actions[name]

    def _name_of(self, action: Any) -> str | None:
        """The map's name of an env action (str or int actions only), or None."""
        if isinstance(action, (str, int, np.integer)) and not isinstance(action, bool):
            return next((name for name, value in self._actions.items() if _same_action(value, action)), None)
        return None

    def _decide_success(self, info: dict[str, Any]) -> bool:
        if self.known is not None:
            return bool(self.known.success(self.env.unwrapped))
        return bool(info.get("success", info.get("is_success", False)))

    def _frame(self) -> np.ndarray:
        frame = self.env.render()
        if not (
            isinstance(frame, np.ndarray) and frame.dtype == np.uint8 and frame.ndim == 3 and frame.shape[2] in (3, 4)
        ):
            shown = f"a {frame.dtype} array of shape {frame.shape}" if isinstance(frame, np.ndarray) else repr(frame)
            shown = shown if len(shown) <= 80 else shown[:77] + "..."
            raise ValueError(f"{self.label}: render() must return an HxWx3 uint8 array in rgb_array mode, got {shown}")
        frame = frame[..., :3]
        if self.image_size is None:
            return np.array(frame)  # a copy: the env may draw into the array it returned
        height, width = frame.shape[:2]
        size = self.image_size
        if isinstance(size, int):
            scale = size / max(height, width)
            size = (max(1, round(height * scale)), max(1, round(width * scale)))
        if size == (height, width):
            return np.array(frame)
        # Box filter when shrinking keeps thin lines of grid drawings; nearest when enlarging keeps cell edges sharp.
        shrink = size[0] * size[1] < height * width
        resample = Image.Resampling.BOX if shrink else Image.Resampling.NEAREST
        return np.asarray(Image.fromarray(frame).resize((size[1], size[0]), resample)).copy()

    def _actions_line(self) -> str:
        names = list(self._actions)
        line = f"Actions: {', '.join(names)}."
        if parse_tuple(names[0]) is None:
            line += f" Tuple spellings work too: ('{names[0]}',) is {names[0]}"
            if any(name != str(number) for number, name in self._by_number.items()):
                numbered = ", ".join(f"{number} = {name}" for number, name in sorted(self._by_number.items()))
                line += f", and ('move', k) is action number k: {numbered}"
            elif self._by_number:  # the names are the numbers (a Discrete env without a map)
                line += ", and ('move', k) is action k"
            line += "."
        return line


def _same_action(value: Any, action: str | int | np.integer) -> bool:
    if isinstance(action, str):
        return isinstance(value, str) and value == action
    return isinstance(value, (int, np.integer)) and int(value) == int(action)


def _action_map(
    label: str, space: spaces.Space, actions: Mapping[str, Any] | Sequence[str] | None, known: KnownEnv | None
) -> dict[str, Any]:
    """The checked action map: names -> actions of ``space``."""
    if actions is None:
        if known is not None:
            return dict(known.actions)
        if isinstance(space, spaces.Discrete):
            start = int(space.start)
            return {str(start + k): start + k for k in range(int(space.n))}
        raise ValueError(
            f"{label} has a {type(space).__name__} action space, so the gym: adapter cannot name its actions; "
            "pass actions={name: action, ...} (a few named actions of the space)"
        )
    if isinstance(actions, Sequence) and not isinstance(actions, str):
        actions = {name: k for k, name in enumerate(actions)}
    if not isinstance(actions, Mapping) or not actions:
        raise ValueError(f"actions must be a non-empty mapping of names to {label}'s actions, got {actions!r}")
    checked: dict[str, Any] = {}
    keys: dict[str, str] = {}
    for name, value in actions.items():
        if not isinstance(name, str) or not name.strip() or len(name) > MAX_ACTION_LENGTH:
            raise ValueError(f"action names must be non-empty strs, got {name!r}")
        if _name_key(name) in keys:
            raise ValueError(f"action names {keys[_name_key(name)]!r} and {name!r} differ only in case or spacing")
        keys[_name_key(name)] = name
        action = _space_action(space, value)
        if action is None:
            raise ValueError(f"action {name!r}: {value!r} is not an action of {label}'s action space {space}")
        checked[name.strip()] = action
    return checked


def _space_action(space: spaces.Space, value: Any) -> Any | None:
    """``value`` as an element of ``space``, or None if it is not one.

    Lists (a map read from YAML) become arrays of an array space's dtype, and tuples and dicts are read item by
    item, so a ``Tuple`` space gets a tuple and a ``Dict`` space a dict of arrays, as its ``sample()`` gives.
    """
    if isinstance(value, (bool, np.bool_)):
        return None
    if isinstance(space, spaces.Discrete):
        return int(value) if isinstance(value, (int, np.integer)) and space.contains(np.int64(value)) else None
    if isinstance(space, (spaces.Box, spaces.MultiDiscrete, spaces.MultiBinary)):
        return _array_action(space, value)
    if isinstance(space, spaces.Tuple):
        if not isinstance(value, (list, tuple)) or len(value) != len(space.spaces):
            return None
        items = [_space_action(part, item) for part, item in zip(space.spaces, value)]
        return None if any(item is None for item in items) else tuple(items)
    if isinstance(space, spaces.Dict):
        if not isinstance(value, Mapping) or set(value) != set(space.spaces):
            return None
        entries = {key: _space_action(part, value[key]) for key, part in space.spaces.items()}
        return None if any(entry is None for entry in entries.values()) else entries
    try:
        return value if space.contains(value) else None
    except (TypeError, ValueError):
        return None


def _array_action(space: spaces.Box | spaces.MultiDiscrete | spaces.MultiBinary, value: Any) -> np.ndarray | None:
    """``value`` as an array of the space's dtype: numbers of any precision (an ``np.array([2.0])`` is float64
    where Pendulum's space is float32), but never a fraction cut to an integer (1.5 is no MultiDiscrete action)."""
    try:
        given = np.asarray(value)
    except (TypeError, ValueError):
        return None
    if given.dtype.kind not in "biuf":
        return None
    action = given.astype(space.dtype)
    if np.issubdtype(space.dtype, np.integer) and not np.array_equal(action, given):
        return None
    return action if space.contains(action) else None


def _image_size(size: int | Sequence[int] | None) -> int | tuple[int, int] | None:
    def positive(n: Any) -> bool:
        return isinstance(n, (int, np.integer)) and not isinstance(n, bool) and 1 <= int(n) <= 8192

    if size is None:
        return None
    if positive(size):
        return int(size)  # type: ignore[arg-type]
    if isinstance(size, Sequence) and not isinstance(size, str) and len(size) == 2 and all(map(positive, size)):
        return int(size[0]), int(size[1])
    raise ValueError(f"image_size must be a long side or (height, width), positive ints, or None; got {size!r}")


# --------------------------------------------------------------------------- gym:<id>
def make_image_env(env_id: str, **settings: Any) -> GymImageEnv:
    """``gymnasium.make(env_id, render_mode="rgb_array", ...)`` wrapped in :class:`GymImageEnv`.

    ``settings`` holds the adapter's keys (:data:`ADAPTER_KEYS`) and the
    env's; the env's are checked against its constructor (and the settings of
    ``gymnasium.make`` itself, e.g. ``max_episode_steps``) before anything is
    built, and an env whose class declares no ``rgb_array`` rendering is refused.
    """
    label = f"{GYM_PREFIX}{env_id}"
    if env_id not in gym.registry:
        near = [f"{GYM_PREFIX}{name}" for name in close_names(env_id, gym.registry)]
        hint = f"did you mean {' or '.join(near)}?" if near else "e.g. gym:FrozenLake-v1"
        raise ValueError(f"{label}: {env_id!r} is not a registered Gymnasium id ({hint})")
    own = {key: settings.pop(key) for key in ADAPTER_KEYS if key in settings}
    if "render_mode" in settings:
        raise ValueError(f"{label}: render_mode is not a setting here; the gym: adapter always renders rgb_array")
    allowed = registered_settings(env_id)
    if allowed is not None:
        allowed.pop("render_mode", None)
        unknown = sorted(set(settings) - set(allowed))
        if unknown:
            env_listing = ", ".join(f"{k}={v!r}" for k, v in allowed.items())
            raise ValueError(
                f"{label} has no setting {', '.join(unknown)}; {did_you_mean(unknown, [*ADAPTER_KEYS, *allowed])}"
                f"the adapter's settings: {', '.join(ADAPTER_KEYS)}; {env_id}'s: {env_listing}"
            )
    modes = _render_modes(env_id)
    if modes is not None and "rgb_array" not in modes:
        raise ValueError(
            f"{label}: {env_id} cannot render images (its render_modes are {modes}); the gym: adapter needs an env "
            "that renders rgb_array frames"
        )
    os.environ.setdefault("SDL_VIDEODRIVER", "dummy")  # pygame-drawn envs render without a display
    env = gym.make(env_id, render_mode="rgb_array", **settings)
    try:
        return GymImageEnv(env, **own)
    except Exception:
        env.close()
        raise


def _render_modes(env_id: str) -> list[str] | None:
    """The render modes the env's class declares, or None if it declares none (the first render then tells)."""
    entry_point = gym.spec(env_id).entry_point
    creator = load_env_creator(entry_point) if isinstance(entry_point, str) else entry_point
    metadata = getattr(creator, "metadata", None)
    modes = metadata.get("render_modes") if isinstance(metadata, dict) else None
    return list(modes) if modes is not None else None

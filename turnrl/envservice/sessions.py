"""The env server's sessions: one env each, what it last did, and the env calls made on it.

:class:`Session` is one env and its record (the lock that lets one call at a time reach it, the resets and
steps applied and the last answer, for exactly-once retries); :class:`SessionTable` holds the open ones by id
and per client and remembers why recently closed ones closed; :class:`ServerMetrics` counts what ``/health``
and ``/metrics`` (:func:`prometheus_text`) report.

The env calls (:func:`run_reset`, :func:`run_step`, :func:`run_queries`, :func:`close_env`) run on the
server's worker threads and turn what an env raises into answers: a reset or step that raises is an error item
(the server then closes its session), a query that raises an error answer of its own (the session goes on),
an env that fails to close a logged error.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import traceback
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from turnrl.envs import AgentEnv, optional_methods
from turnrl.envservice.protocol import answer_query, encode_answer, error_item, query_failure, reset_item, step_item
from turnrl.envservice.request_bodies import ResetItem, StepItem

logger = logging.getLogger("turnrl.env_server")

RECENTLY_CLOSED = 100_000
"""Closed session ids remembered, so that using one says why it is gone."""
RECENTLY_FAILED = 10_000
"""Failed resets and steps remembered with their error items (a traceback's last frames each, about a kilobyte),
to answer a retry of one whose answer was lost: retries come within seconds, and an env that always raises would
otherwise hold a hundred megabytes of them."""


# --------------------------------------------------------------------------- sessions
@dataclass(frozen=True)
class Applied:
    """A reset or step that a session applied: what answers a retry of it (``seq`` alone would answer a call that
    reuses the number with another action with this call's answer, and never apply it)."""

    kind: str
    """``reset`` or ``step``."""
    seq: int
    """Its number in the session (1, 2, ...)."""
    request: str
    """The request item without its queries, as JSON: a retry repeats it."""
    answer: dict[str, Any]
    """The answer item."""


def request_key(item: ResetItem | StepItem) -> str:
    """What a retry of ``item`` repeats: every field but the queries to bring back (they change no env). Written
    by ``json``, which escapes what UTF-8 cannot encode (an action may hold a lone surrogate)."""
    return json.dumps(item.model_dump(exclude={"queries"}), sort_keys=True)


@dataclass(eq=False)
class Session:
    """One env on the server and what it last did."""

    id: str
    env_id: str
    settings: dict[str, Any]
    owner: str
    env: AgentEnv
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    last_used: float = field(default_factory=time.monotonic)
    seq: int = 0
    """Resets and steps applied."""
    last: Applied | None = None
    """The last reset or step (to answer a retry of it again)."""
    state: str = "new"
    """``new`` (never reset), ``running`` or ``over`` (terminated or truncated)."""
    last_obs: dict[str, Any] = field(default_factory=dict)
    """The env's latest observation (for the observation hash of an env without ``state_key``)."""
    closed: bool = False
    settings_key: str = ""
    """The settings as the request sent them (JSON, keys sorted): what a retried open is compared by (NaN is not
    equal to itself, and an array's ``==`` is elementwise)."""
    forked_from: str | None = None
    """The session this one is a copy of (``/v1/sessions/fork``): what a retried fork is recognized by."""


class SessionTable:
    """Open sessions by id and per owner; remembers why recently closed ones closed."""

    def __init__(self) -> None:
        self.sessions: dict[str, Session] = {}
        self.per_owner: dict[str, int] = {}
        self.closed: OrderedDict[str, str] = OrderedDict()
        self.failed: OrderedDict[str, Applied] = OrderedDict()
        """Sessions closed because their env raised: the reset or step that raised, with its error item, to answer
        a retry of that call (whose first answer was lost) with the same item, not a 404."""

    def __len__(self) -> int:
        return len(self.sessions)

    def add(self, session: Session) -> None:
        self.sessions[session.id] = session
        self.per_owner[session.owner] = self.per_owner.get(session.owner, 0) + 1

    def remove(self, session: Session, reason: str) -> None:
        if self.sessions.pop(session.id, None) is None:
            return
        session.closed = True
        left = self.per_owner.get(session.owner, 1) - 1
        if left:
            self.per_owner[session.owner] = left
        else:
            self.per_owner.pop(session.owner, None)
        self.closed[session.id] = reason
        while len(self.closed) > RECENTLY_CLOSED:
            self.closed.popitem(last=False)
        while len(self.failed) > RECENTLY_FAILED:
            self.failed.popitem(last=False)


@dataclass
class ServerMetrics:
    """Counters behind ``/health`` and ``/metrics``."""

    started: float = field(default_factory=time.time)
    steps: int = 0
    resets: int = 0
    sessions_opened: int = 0
    sessions_closed: dict[str, int] = field(default_factory=dict)
    """By reason: ``client``, ``idle``, ``env_error``, ``shutdown``."""
    errors: dict[str, int] = field(default_factory=dict)
    """By code: ``env_error`` (an env raised) and each 4xx/5xx code answered."""
    _window: deque = field(default_factory=deque)
    """``(whole second, steps in it)`` for the last ``WINDOW_S`` seconds."""

    WINDOW_S = 10

    def count_steps(self, n: int) -> None:
        self.steps += n
        second = int(time.monotonic())
        if self._window and self._window[-1][0] == second:
            self._window[-1][1] += n
        else:
            self._window.append([second, n])
        while self._window and self._window[0][0] <= second - self.WINDOW_S:
            self._window.popleft()

    def steps_per_s(self) -> float:
        """Steps per second over the last ``WINDOW_S`` whole seconds."""
        now = int(time.monotonic())
        return sum(n for second, n in self._window if now - self.WINDOW_S <= second < now) / self.WINDOW_S

    def count(self, table: dict[str, int], key: str, n: int = 1) -> None:
        table[key] = table.get(key, 0) + n


def prometheus_text(metrics: ServerMetrics, sessions: int) -> str:
    """The counters in Prometheus' text exposition format."""
    lines = [
        "# HELP turnrl_env_sessions Open sessions.", "# TYPE turnrl_env_sessions gauge",
        f"turnrl_env_sessions {sessions}",
        "# HELP turnrl_env_steps_total Env steps applied.", "# TYPE turnrl_env_steps_total counter",
        f"turnrl_env_steps_total {metrics.steps}",
        "# HELP turnrl_env_resets_total Env resets applied.", "# TYPE turnrl_env_resets_total counter",
        f"turnrl_env_resets_total {metrics.resets}",
        "# HELP turnrl_env_steps_per_second Steps per second over the last 10 s.",
        "# TYPE turnrl_env_steps_per_second gauge", f"turnrl_env_steps_per_second {metrics.steps_per_s():.3f}",
        "# HELP turnrl_env_sessions_opened_total Sessions opened.", "# TYPE turnrl_env_sessions_opened_total counter",
        f"turnrl_env_sessions_opened_total {metrics.sessions_opened}",
        "# HELP turnrl_env_sessions_closed_total Sessions closed, by reason.",
        "# TYPE turnrl_env_sessions_closed_total counter",
    ]
    closed = sorted(metrics.sessions_closed.items())
    lines += [f'turnrl_env_sessions_closed_total{{reason="{k}"}} {v}' for k, v in closed]
    lines += ["# HELP turnrl_env_errors_total Errors, by code.", "# TYPE turnrl_env_errors_total counter"]
    lines += [f'turnrl_env_errors_total{{code="{k}"}} {v}' for k, v in sorted(metrics.errors.items())]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- env calls (worker threads)
def _failure(session: Session, what: str, error: BaseException) -> str:
    trace = "".join(traceback.format_exception(type(error), error, error.__traceback__, limit=-3))
    return f"{session.env_id}: {what} raised {type(error).__name__}: {error}\n{trace}"


def run_queries(session: Session, names: Sequence[str]) -> dict[str, Any]:
    """Each query's encoded answer, or ``{"error": message}`` where it raised (the session goes on)."""
    out: dict[str, Any] = {}
    for name in dict.fromkeys(names):
        try:
            out[name] = encode_answer(name, answer_query(session.env, name, session.last_obs))
        except Exception as error:
            out[name] = {"error": query_failure(error)}
    return out


def run_reset(session: Session, item: ResetItem, options: Any) -> dict[str, Any]:
    try:
        obs, info = session.env.reset(seed=item.seed, options=options)
        session.last_obs = obs
        return reset_item(session.id, obs, info, run_queries(session, item.queries))
    except Exception as error:
        return error_item(session.id, _failure(session, "reset()", error))


def run_step(session: Session, item: StepItem) -> dict[str, Any]:
    try:
        obs, reward, terminated, truncated, info = session.env.step(item.action)
        session.last_obs = obs
        return step_item(session.id, obs, reward, terminated, truncated, info, run_queries(session, item.queries))
    except Exception as error:
        return error_item(session.id, _failure(session, "step()", error))


def close_env(env: AgentEnv) -> None:
    try:
        optional_methods(env).close()
    except Exception:  # an env that fails to close must not take the server with it
        logger.exception("closing an env failed")

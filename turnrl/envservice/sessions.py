"""The env server's sessions: one env each, what it last did, and the env calls made on it.

:class:`Session` is one env and its record (the lock that lets one call at a time reach it, the resets and
steps applied and the last answer, for exactly-once retries); :class:`SessionTable` holds the open ones by id
and per client and remembers why recently closed ones closed; :class:`ServerMetrics` counts what ``/health``
and ``/metrics`` (:func:`prometheus_text`) report.

The env calls (:func:`run_reset`, :func:`run_step`, :func:`run_queries`, :func:`close_env`) run on the
server's worker threads (:class:`EnvThreads`) and turn what an env raises into answers: a reset or step that
raises is an error item (the server then closes its session), a query that raises an error answer of its own
(the session goes on), an env that fails to close a logged error. :class:`CallBatch` makes the calls of one
request on several threads at once and tells which of them ran past their deadline; :func:`run_with_deadline`
awaits such a batch in the event loop. :func:`attempt_build` builds or copies an env for an open or fork.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import math
import queue
import threading
import time
import traceback
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from turnrl.envs import AgentEnv, make, optional_methods
from turnrl.envs.contract import reset_answer
from turnrl.envservice.protocol import (
    APIError,
    answer_query,
    encode_answer,
    error_item,
    query_failure,
    reset_item,
    step_item,
)
from turnrl.envservice.request_bodies import ResetItem, StepItem, short_repr

logger = logging.getLogger("turnrl.env_server")

T = TypeVar("T")

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
    env_closed: threading.Event = field(default_factory=threading.Event, init=False, repr=False)
    """Set once the env is closed."""
    _use: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)
    """Guards the fields below, which worker threads and the event loop both change."""
    _calls: int = field(default=0, init=False)
    """Env calls running on worker threads (one at a time, or a call abandoned past its deadline)."""
    _close_asked: bool = field(default=False, init=False)
    _close_claimed: bool = field(default=False, init=False)

    # An env must never be closed under a call that runs on it (a native simulator crashes) nor twice. Whoever
    # closes a session (its client, the reaper, a deadline, the shutdown) asks with release_env; the env is closed
    # by that caller when no call runs, else by the last call running as it returns (end_call).
    def begin_call(self) -> bool:
        """Count an env call in (on its worker thread, before it touches the env); False once the env's close was
        asked: the caller must not touch the env."""
        with self._use:
            if self._close_asked:
                return False
            self._calls += 1
            return True

    def end_call(self) -> None:
        """Count an env call out; the last one out of an env whose close was asked closes it (on this thread)."""
        with self._use:
            self._calls -= 1
            close = self._claim_close()
        if close:
            self.close_now()

    def release_env(self) -> bool:
        """Ask for the env to be closed: True when the caller must close it now (:meth:`close_now`), as no call
        runs on it and no one closed it yet; False when a call that runs will close it as it returns, or it is
        closed already."""
        with self._use:
            self._close_asked = True
            return self._claim_close()

    def _claim_close(self) -> bool:
        """Whether the caller (holding ``_use``) is the one to close the env: asked, idle, and not yet claimed."""
        claim = self._close_asked and not self._calls and not self._close_claimed
        self._close_claimed |= claim
        return claim

    def close_now(self) -> None:
        """Close the env (by the one :meth:`release_env` or :meth:`end_call` picked)."""
        close_env(self.env)
        self.env_closed.set()


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
    """By reason: ``client``, ``idle``, ``env_error``, ``env_timeout``, ``shutdown``."""
    errors: dict[str, int] = field(default_factory=dict)
    """By code: ``env_error`` (an env raised), ``env_timeout`` (a call ran past its deadline) and each 4xx/5xx code
    answered."""
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


def prometheus_text(metrics: ServerMetrics, sessions: int, stuck: int = 0) -> str:
    """The counters in Prometheus' text exposition format (``stuck``: env calls abandoned past their deadline that
    have not returned)."""
    lines = [
        "# HELP turnrl_env_sessions Open sessions.", "# TYPE turnrl_env_sessions gauge",
        f"turnrl_env_sessions {sessions}",
        "# HELP turnrl_env_stuck_calls Env calls abandoned past --step-timeout that still hold a thread.",
        "# TYPE turnrl_env_stuck_calls gauge", f"turnrl_env_stuck_calls {stuck}",
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


# These catch BaseException: on a worker thread, SystemExit or KeyboardInterrupt can only come from the env
# itself (``sys.exit()`` in a simulator's error path), and re-raised in the event loop it stops the server.
def run_queries(session: Session, names: Sequence[str]) -> dict[str, Any]:
    """Each query's encoded answer, or ``{"error": message}`` where it raised (the session goes on)."""
    out: dict[str, Any] = {}
    for name in dict.fromkeys(names):
        try:
            out[name] = encode_answer(name, answer_query(session.env, name, session.last_obs))
        except BaseException as error:
            out[name] = {"error": query_failure(error)}
    return out


def run_reset(session: Session, item: ResetItem, options: Any) -> dict[str, Any]:
    try:
        obs, info = reset_answer(session.env.reset(seed=item.seed, options=options))
        session.last_obs = obs
        return reset_item(session.id, obs, info, run_queries(session, item.queries))
    except BaseException as error:
        return error_item(session.id, _failure(session, "reset()", error))


def run_step(session: Session, item: StepItem) -> dict[str, Any]:
    try:
        obs, reward, terminated, truncated, info = session.env.step(item.action)
        session.last_obs = obs
        return step_item(session.id, obs, reward, terminated, truncated, info, run_queries(session, item.queries))
    except BaseException as error:
        return error_item(session.id, _failure(session, "step()", error))


def call_on_env(session: Session, call: Callable[[], T], refused: Callable[[], T]) -> T:
    """``call()`` counted as a call on the session's env (:meth:`Session.begin_call`); ``refused()`` without
    calling it once the env's close was asked (the server shut down after the request took the session)."""
    if not session.begin_call():
        return refused()
    try:
        return call()
    finally:
        session.end_call()


def closed_item(kind: str, session: Session) -> dict[str, Any]:
    """The item of a call that never ran: its session was closed as the server shut down (on a worker thread)."""
    return error_item(session.id, f"session {session.id} is closed (the server shut down) before its {kind} ran; "
                                  "open a new one", code="unknown_session")


def refuse_copy() -> AgentEnv:
    """A fork's copy of a session closed as the server shut down (it never ran)."""
    raise shutting_down()


def copy_env(session: Session) -> AgentEnv:
    """A deep copy of a session's env (a fork); an env that cannot be copied is a 500 that says so."""
    try:
        return copy.deepcopy(session.env)
    except Exception as error:
        raise APIError(500, "env_error", f"the env cannot be copied: {type(error).__name__}: {error}") from None


def close_env(env: AgentEnv) -> None:
    try:
        optional_methods(env).close()
    except BaseException:  # an env that fails to close must not take the server with it
        logger.exception("closing an env failed")


def build_env(env_id: str, settings: dict[str, Any]) -> AgentEnv:
    """``make(env_id, **settings)`` on a worker thread, its refusal of a setting a 400 ``bad_settings``."""
    try:
        return make(env_id, **settings)
    except (ValueError, TypeError, OverflowError) as error:  # OverflowError: int() of an infinite setting
        raise APIError(400, "bad_settings", f"{env_id} with settings {short_repr(settings)}: "
                                            f"{short_repr(str(error))[1:-1]}") from None
    except BaseException as error:  # SystemExit too: this runs on a worker thread, and the env raised it
        raise APIError(500, "env_error", f"building {env_id} raised {type(error).__name__}: {error}") from None


def reset_env(env_id: str, settings: dict[str, Any]) -> AgentEnv:
    """:func:`build_env`, then a reset (seed 0), its refusal a 400 ``bad_settings`` as the build's: some settings
    are judged only at a reset (a 2048 target the first tiles can never make), and a client checks them with
    ``/v1/validate`` before it opens sessions."""
    env = build_env(env_id, settings)
    try:
        env.reset(seed=0)
    except (ValueError, TypeError, OverflowError) as error:
        close_env(env)
        raise APIError(400, "bad_settings", f"{env_id} with settings {short_repr(settings)}: its first reset "
                                            f"refused them: {short_repr(str(error))[1:-1]}") from None
    except BaseException as error:
        close_env(env)
        raise APIError(500, "env_error", f"resetting {env_id} raised {type(error).__name__}: {error}") from None
    return env


@dataclass(frozen=True)
class Built:
    """What building (or copying) one env for a session gave: the env, or the error its request is answered with."""

    env: AgentEnv | None = None
    error: APIError | None = None


def attempt_build(make_env: Callable[[], AgentEnv]) -> Built:
    """``make_env()`` on a worker thread, what it raises kept as an error (a :class:`CallBatch` call must not
    raise): an :class:`APIError` as it is, anything else (``sys.exit()`` in a simulator's start-up) as a 500."""
    try:
        return Built(env=make_env())
    except APIError as error:
        return Built(error=error)
    except BaseException as error:
        return Built(error=APIError(500, "env_error", f"building the env raised {type(error).__name__}: {error}"))


def close_built(built: Built) -> None:
    """Close the env of a build whose request no longer wants it (it failed, or the build ran past its deadline)."""
    if built.env is not None:
        close_env(built.env)


# --------------------------------------------------------------------------- worker threads
Task = tuple[Future, Callable[..., Any], tuple[Any, ...]]


class EnvThreads(Executor):
    """The threads that run env calls: ``size`` of them take tasks from one queue, in order.

    A thread stuck in an env call past its deadline is written off (:meth:`write_off`): a new thread takes its
    place at once, so that hung envs never leave the server without workers, and the stuck one ends when its call
    returns, if ever. The threads are daemons: one stuck for good must not keep the process from exiting (those of
    a ``ThreadPoolExecutor`` are joined at exit, and a thread cannot be stopped from outside).

    A task that raises what is not an ``Exception`` (an env building or copying itself calls ``sys.exit()``)
    fails its future with a RuntimeError that names it: SystemExit re-raised in the event loop stops the server.
    """

    def __init__(self, size: int, name: str = "turnrl-env") -> None:
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        self.size, self.name = size, name
        self._tasks: queue.SimpleQueue[Task | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._working: set[threading.Thread] = set()
        self._stuck: set[threading.Thread] = set()
        """Threads written off and still in their call."""
        self._made = 0
        self._shut = False

    @property
    def shut(self) -> bool:
        """Whether :meth:`shutdown` was called: no task is taken any more."""
        return self._shut

    @property
    def stuck(self) -> int:
        """Threads written off that are still in their call."""
        return len(self._stuck)

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        if kwargs:
            raise TypeError("EnvThreads.submit takes positional arguments only")
        future: Future = Future()
        with self._lock:
            if self._shut:
                raise RuntimeError("the env threads are shut down")
            while self._made < self.size:  # started at the first task: a server built and never used starts none
                self._start()
            self._tasks.put((future, fn, args))
        return future

    def write_off(self, thread: threading.Thread) -> None:
        """Count ``thread`` out of the workers (stuck in a call) and start another in its place."""
        with self._lock:
            if thread not in self._working or self._shut:
                return
            self._working.discard(thread)
            self._stuck.add(thread)
            self._start()

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Stop the threads once the tasks queued are done (or cancelled); ``wait`` joins those not stuck."""
        with self._lock:
            self._shut = True
            threads = list(self._working)
        if cancel_futures:
            while True:
                try:
                    task = self._tasks.get_nowait()
                except queue.Empty:
                    break
                if task is not None:
                    task[0].cancel()
        for _ in threads:
            self._tasks.put(None)
        if wait:
            for thread in threads:
                thread.join()

    def _start(self) -> None:
        """Start one more worker (called holding the lock)."""
        self._made += 1
        thread = threading.Thread(target=self._work, name=f"{self.name}_{self._made}", daemon=True)
        self._working.add(thread)
        thread.start()

    def _work(self) -> None:
        me = threading.current_thread()
        while (task := self._tasks.get()) is not None:
            future, fn, args = task
            del task
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except Exception as error:
                    future.set_exception(error)
                except BaseException as error:
                    future.set_exception(RuntimeError(f"an env call raised {type(error).__name__}: {error}"))
            del future
            with self._lock:
                if me in self._stuck:  # written off: another thread works in its place
                    self._stuck.discard(me)
                    return
        with self._lock:
            self._working.discard(me)


class CallBatch(Generic[T]):
    """The env calls of one request, made on several threads at once: each thread that runs :meth:`run` takes the
    next call not yet taken until none is left, so calls are spread over the threads as they free up, and a call
    that hangs holds up its own thread only (the others take the rest).

    ``calls[k]`` must not raise (the env calls above turn what an env raises into an answer). A call that runs
    past its deadline is abandoned (:meth:`abandon_overdue`): its answer, if it ever comes, is not stored;
    ``late(k, answer)`` runs on its thread instead (to close the env, which no other thread may touch while the call
    runs, or the env the call built), and that thread then takes no more calls. ``settled()`` runs (on a worker
    thread) once every call is answered, ``started()`` as the first call starts.
    """

    def __init__(self, calls: Sequence[Callable[[], T]], late: Callable[[int, T], None],
                 settled: Callable[[], None], started: Callable[[], None] = lambda: None) -> None:
        self.calls = calls
        self.answers: list[T | None] = [None] * len(calls)
        self.abandoned: set[int] = set()
        self._late, self._settled, self._started = late, settled, started
        self._running: dict[int, tuple[float, threading.Thread]] = {}
        """Calls under way: their start (``time.monotonic()``) and thread."""
        self._next = 0
        self._lock = threading.Lock()

    def run(self) -> None:
        """Make calls until none is left to take (the body of one worker thread's task)."""
        me = threading.current_thread()
        while True:
            with self._lock:
                k = self._next
                if k >= len(self.calls):
                    return
                self._next += 1
                self._running[k] = (time.monotonic(), me)
            if k == 0:
                self._started()
            answer = self.calls[k]()
            with self._lock:
                late = k in self.abandoned
                if not late:
                    del self._running[k]
                    self.answers[k] = answer
                done = self.is_done()
            if late:
                self._late(k, answer)
                return
            if done:
                self._settled()

    def is_done(self) -> bool:
        """Every call answered or abandoned."""
        return self._next == len(self.calls) and not self._running

    def untaken(self) -> int:
        """Calls no thread has taken yet."""
        with self._lock:
            return len(self.calls) - self._next

    def first_start(self) -> float | None:
        """When the longest-running call under way started (None: none is)."""
        with self._lock:
            return min((start for start, _ in self._running.values()), default=None)

    def abandon_overdue(self, started_before: float, write_off: Callable[[threading.Thread], None]) -> list[int]:
        """Abandon the calls under way that started before ``started_before``, writing off their threads (in the
        same lock as their answers are stored: a call that returns meanwhile is either answered or abandoned,
        never both); the calls abandoned."""
        with self._lock:
            overdue = [k for k, (start, _) in self._running.items() if start < started_before]
            for k in overdue:
                _, thread = self._running.pop(k)
                self.abandoned.add(k)
                write_off(thread)
            return overdue

    def give_up(self, write_off: Callable[[threading.Thread], None]) -> list[int]:
        """Stop the batch: the calls no thread has taken are never made, those under way are abandoned (as
        :meth:`abandon_overdue` does); the calls answered so far."""
        with self._lock:
            self._next = len(self.calls)
        self.abandon_overdue(math.inf, write_off)
        return [k for k, answer in enumerate(self.answers) if answer is not None]


SHUTDOWN_CHECK_S = 1.0
"""How often a request waiting on its env calls looks whether the server shut down (its threads then take no call,
and a call under way may never return)."""


SPREAD_AFTER_S = 0.002
"""A batch's calls start on one thread and spread to more once a call has run this long. An env that waits (a
simulator, a subprocess) gains a thread per call; one whose steps are pure Python (tens of microseconds) holds the
interpreter lock, and more threads only hand it over: 64 Sokoban steps took 3.4 ms on 16 threads against 1.4 ms on
one (2 cores; benchmarks/env_service_batch.py times whole requests)."""


def shutting_down() -> APIError:
    """The error of a request that the server's shutdown stopped."""
    return APIError(503, "shutting_down", "the env server is shutting down; open new sessions on another server")


async def run_with_deadline(executor: EnvThreads, threads: int, deadline_s: float, calls: Sequence[Callable[[], T]],
                            late: Callable[[int, T], None],
                            unused: Callable[[T], None] = lambda answer: None) -> list[T | None]:
    """Each of ``calls`` on up to ``threads`` of ``executor`` at once (in the running event loop); the answers in
    order, None for a call abandoned because it still ran ``deadline_s`` after it started (its thread is written
    off, and ``late(k, answer)`` runs on it if the call ever returns: see :class:`CallBatch`). The calls start on
    one thread, and the others join once a call has run :data:`SPREAD_AFTER_S`.

    Raises:
        APIError: a 503 ``shutting_down`` once ``executor`` is shut down (within :data:`SHUTDOWN_CHECK_S`): the
            calls not taken are never made, those under way are abandoned as past the deadline, and the answers
            already made go to ``unused`` (to close the envs that a build made).
    """
    if not calls:
        return []
    if executor.shut:
        raise shutting_down()
    loop = asyncio.get_running_loop()
    woken = asyncio.Event()

    def wake() -> None:
        try:
            loop.call_soon_threadsafe(woken.set)
        except RuntimeError:  # the loop closed: the server is gone, no one waits
            pass

    helpers = min(threads, len(calls)) - 1  # threads still to add once a call is slow
    batch = CallBatch(calls, late=late, settled=wake, started=wake if helpers else lambda: None)
    executor.submit(batch.run)
    while not batch.is_done():
        woken.clear()  # before reading the batch: a wake after this read is not lost
        first = batch.first_start()
        now = time.monotonic()
        # Until a call starts (they may wait for threads that other requests hold), look again now and then.
        wait = deadline_s if first is None else first + deadline_s - now
        if helpers and first is not None:
            wait = min(wait, first + SPREAD_AFTER_S - now)
        try:
            await asyncio.wait_for(woken.wait(), max(min(wait, SHUTDOWN_CHECK_S), 0.0))
        except asyncio.TimeoutError:
            pass
        if executor.shut and not batch.is_done():
            for k in batch.give_up(executor.write_off):
                unused(batch.answers[k])
            raise shutting_down()
        first = batch.first_start()
        if helpers and first is not None and time.monotonic() - first >= SPREAD_AFTER_S:
            for _ in range(min(helpers, batch.untaken())):
                executor.submit(batch.run)
            helpers = 0
        for _ in batch.abandon_overdue(time.monotonic() - deadline_s, executor.write_off):
            if batch.untaken():
                executor.submit(batch.run)  # in place of the thread that is stuck
    return batch.answers

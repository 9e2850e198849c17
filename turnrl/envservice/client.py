"""The env-service client: envs that live on ``turnrl serve-env`` servers, each an
:class:`~turnrl.envs.contract.AgentEnv`.

:class:`RemoteEnv` holds one session on one server and answers the env
contract (``reset``, ``step``, ``instructions``, ``action_names``,
``state_facts``, ``solve``, ``state_key``) by calling it. Several envs share an
:class:`EnvServerPool`: the server URLs, one ``httpx`` client (connection
pooling, thread-safe), timeouts, retries with backoff and failover.
:func:`remote_env_factory` is what the trainer calls when ``env.remote`` lists
servers; :class:`RemoteEnvBatch` steps many sessions in one request.

What a caller can rely on:

- **Same trajectories.** Observations, rewards, flags, ``info`` and the query
  results cross the wire losslessly (:func:`~turnrl.envservice.protocol.encode_value`),
  so a seeded episode on a server equals the same episode in process.
- **Exactly-once steps.** Every reset and step carries the session's next
  sequence number; a retry of a request whose answer was lost is answered from
  the server's record of it, never applied twice.
- **Failover where it is exact.** A reset starts a fresh episode, so a reset
  whose server is gone (or that restarted and forgot the session) opens a new
  session on the next server and resets there. A step cannot move: its
  episode's state died with the server. It raises :class:`SessionLostError`,
  which the rollout records as an env error of that episode; the next reset of
  the same env fails over.
- **Few round trips.** Each reset and step brings back, computed right after
  it, the queries the rollout asks every turn (``action_names``,
  ``state_key``; ``instructions`` after a reset); results are cached until the
  state changes, so a turn costs one request per action.

The queries, the encoding and the errors are :mod:`turnrl.envservice.protocol`'s; the server is
:mod:`turnrl.envservice.server`.
"""

from __future__ import annotations

import copy
import itertools
import json
import operator
import os
import queue
import random
import socket
import threading
import time
import uuid
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from turnrl.envservice.protocol import (
    CLIENT_HEADER,
    RESET_QUERIES,
    STEP_QUERIES,
    TOKEN_ENV_VAR,
    EnvRaisedError,
    EnvSpecError,
    ItemResult,
    LimitError,
    NoServerError,
    QueriedEnv,
    RemoteEnvError,
    RequestError,
    ServerUnavailableError,
    SessionLostError,
    check_prefetch,
    decode_item,
    decode_queries,
    encode_value,
    queries_to_bring,
)

# --------------------------------------------------------------------------- options and the pool
CLOSE_BATCH = 256
"""Sessions closed per request: within any server's ``--max-batch`` a deployment would set."""


@dataclass(frozen=True)
class ClientOptions:
    """How a client talks to env servers."""

    timeout_s: float = 60.0
    """Longest wait for one answer (an env step on a heavy simulator can take a while)."""
    connect_timeout_s: float = 5.0
    """Longest wait to connect."""
    retries: int = 3
    """Retries of a request that got no answer (refused, timed out, broken, 502/503/504), per server."""
    backoff_s: float = 0.1
    """First wait before a retry; doubled each retry, with up to 50% random jitter."""
    max_backoff_s: float = 2.0
    """Longest wait between retries."""
    cooldown_s: float = 10.0
    """How long a server that did not answer is tried only after the others when opening sessions."""
    token: str | None = None
    """Bearer token; None reads ``TURNRL_ENV_TOKEN`` (and sends none when that is unset)."""
    client_id: str | None = None
    """Name sent in ``x-turnrl-client`` (the server's per-client limit counts by it); None: a fresh uuid."""
    prefetch: tuple[str, ...] = ()
    """Queries to bring back with every reset and step besides ``action_names`` and ``state_key``, e.g.
    ``("state_facts",)`` when state rewards read them every turn."""

    def __post_init__(self) -> None:
        if self.timeout_s <= 0 or self.connect_timeout_s <= 0:
            raise ValueError(f"timeouts must be > 0, got {self.timeout_s} and {self.connect_timeout_s}")
        if self.retries < 0 or self.backoff_s < 0 or self.max_backoff_s < 0 or self.cooldown_s < 0:
            raise ValueError("retries, backoff_s, max_backoff_s and cooldown_s must be >= 0")
        check_prefetch(self.prefetch)


def check_url(url: str) -> str:
    """``url`` without a trailing slash; ValueError unless it is an ``http(s)://host[:port]`` URL."""
    try:
        parsed = httpx.URL(url)
    except Exception as error:
        raise ValueError(f"env server URL {url!r} is not a URL ({error}); write http://host:port") from None
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ValueError(f"env server URL {url!r} must be http://host:port or https://host:port")
    return url.rstrip("/")


def _error_of(response: httpx.Response) -> tuple[str, str]:
    """``(code, message)`` of an error answer, whatever its body holds."""
    try:
        body = response.json()
        error = body.get("error") if isinstance(body, dict) else None
        if isinstance(error, dict):
            return str(error.get("code") or "error"), str(error.get("message") or response.reason_phrase)
    except Exception:  # not JSON: a proxy's page, a truncated body
        pass
    return "error", (response.text[:300] or response.reason_phrase)


def parse_answer(response: httpx.Response) -> dict[str, Any]:
    """The JSON object of a successful answer; RemoteEnvError for any other body."""
    try:
        body = response.json()
    except Exception as error:
        raise RemoteEnvError(f"the env server answered something that is not JSON: {error}") from None
    if not isinstance(body, dict):
        raise RemoteEnvError(f"the env server answered a JSON {type(body).__name__}, not an object")
    return body


class EnvServerPool:
    """Server URLs and one HTTP client shared by many remote envs (thread-safe).

    Args:
        urls: servers, in the order they are preferred.
        options: timeouts, retries, token.
        transport: an ``httpx`` transport to use instead of the network (e.g. ``httpx.MockTransport``).
    """

    def __init__(self, urls: Sequence[str], options: ClientOptions | None = None,
                 transport: httpx.BaseTransport | None = None) -> None:
        if isinstance(urls, str) or not urls:
            raise ValueError("env servers: pass a non-empty list of URLs, e.g. ['http://127.0.0.1:8100']")
        self.urls = [check_url(url) for url in urls]
        self.options = options or ClientOptions()
        token = self.options.token if self.options.token is not None else os.environ.get(TOKEN_ENV_VAR)
        headers = {CLIENT_HEADER: self.options.client_id or uuid.uuid4().hex}
        if token:
            headers["authorization"] = f"Bearer {token}"
        timeout = httpx.Timeout(self.options.timeout_s, connect=self.options.connect_timeout_s)
        if transport is None:
            # No Nagle delay: a request is written in two pieces (head, body), and waiting to send the second
            # until the first is acknowledged costs each small request about a millisecond.
            transport = httpx.HTTPTransport(socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)],
                                            limits=httpx.Limits(max_connections=256, max_keepalive_connections=256))
        self.http = httpx.Client(headers=headers, timeout=timeout, transport=transport)
        self._lock = threading.Lock()
        self._down_until: dict[str, float] = {}
        self._rng = random.Random()
        self._abandoned: queue.SimpleQueue[tuple[str, str]] = queue.SimpleQueue()
        """(URL, session id) of envs garbage-collected with a session open, closed at the next :meth:`open`."""
        self._held: dict[str, set[str]] = {}
        """Session ids this pool opened or forked and has not closed, by server: what :meth:`close` closes."""

    # ------------------------------------------------------------------ requests
    def post(self, url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST ``body`` to ``url + path``, retrying what got no answer; the answer's JSON object.

        Raises:
            ServerUnavailableError: no answer after every retry.
            RequestError: a 4xx (its subclasses for bad env specs, limits); SessionLostError for an unknown
                session; RemoteEnvError for any other failure.
        """
        content = json.dumps(body, allow_nan=False).encode()
        headers = {"content-type": "application/json"}
        last = ""
        for attempt in range(self.options.retries + 1):
            if attempt:
                time.sleep(self._backoff(attempt))
            try:
                response = self.http.post(url + path, content=content, headers=headers)
            except httpx.TransportError as error:  # refused, timed out, reset: the request may not have run
                last = f"{type(error).__name__}: {error}"
                continue
            if response.status_code in (502, 503, 504):
                last = f"HTTP {response.status_code}: {_error_of(response)[1]}"
                continue
            self._mark_up(url)
            return self._answer(url, response)
        self._mark_down(url)
        tries = self.options.retries + 1
        raise ServerUnavailableError(f"env server {url} did not answer {path} ({tries} tries; last: {last})")

    def get(self, url: str, path: str) -> dict[str, Any]:
        """GET ``url + path`` once (health and listings; no retries)."""
        try:
            response = self.http.get(url + path)
        except httpx.TransportError as error:
            raise ServerUnavailableError(f"env server {url} did not answer {path}: {error}") from None
        return self._answer(url, response)

    def _answer(self, url: str, response: httpx.Response) -> dict[str, Any]:
        if response.status_code < 400:
            return parse_answer(response)
        code, message = _error_of(response)
        status = response.status_code
        if status == 404 and code == "unknown_session":
            raise SessionLostError(f"env server {url}: {message}")
        if code in ("unknown_env", "bad_settings"):
            raise EnvSpecError(status, code, f"env server {url}: {message}")
        if status == 429:
            raise LimitError(status, code, f"env server {url}: {message}")
        if status < 500:
            raise RequestError(status, code, f"env server {url}: {message}")
        raise RemoteEnvError(f"env server {url} failed: {message} (HTTP {status})")

    def _backoff(self, attempt: int) -> float:
        wait = min(self.options.max_backoff_s, self.options.backoff_s * 2 ** (attempt - 1))
        with self._lock:
            return wait * (1 + 0.5 * self._rng.random())

    def _mark_down(self, url: str) -> None:
        with self._lock:
            self._down_until[url] = time.monotonic() + self.options.cooldown_s

    def _mark_up(self, url: str) -> None:
        if url in self._down_until:
            with self._lock:
                self._down_until.pop(url, None)

    def order(self, start: int) -> list[str]:
        """Servers to try for a new session: round robin from ``start``, those that lately did not answer last."""
        n = len(self.urls)
        rotated = [self.urls[(start + k) % n] for k in range(n)]
        now = time.monotonic()
        with self._lock:
            down = {url for url, until in self._down_until.items() if until > now}
        return [url for url in rotated if url not in down] + [url for url in rotated if url in down]

    # ------------------------------------------------------------------ sessions
    def validate(self, env_id: str, settings: dict[str, Any]) -> dict[str, Any]:
        """Ask the first server that answers whether it builds ``env_id`` with ``settings``.

        Raises:
            EnvSpecError: the server refused the env or a setting (also a ValueError).
            NoServerError: no server answered.
        """
        reasons: dict[str, str] = {}
        for url in self.order(0):
            try:
                return self.post(url, "/v1/validate", {"env_id": env_id, "settings": encode_value(settings)})
            except EnvSpecError:
                raise
            except RemoteEnvError as error:
                reasons[url] = str(error)
        raise NoServerError(_no_server_message("check", env_id, reasons), reasons)

    def open(self, env_id: str, settings: dict[str, Any], count: int = 1, start: int = 0) -> tuple[str, list[str]]:
        """Open ``count`` sessions of ``env_id`` on the first server (round robin from ``start``) with room;
        ``(server URL, session ids)``. Ids are chosen here so that a retried request opens nothing twice.

        Raises:
            EnvSpecError: the env or a setting was refused.
            NoServerError: every server failed or was full.
        """
        self.close_abandoned()
        ids = [uuid.uuid4().hex for _ in range(count)]
        body = {"env_id": env_id, "settings": encode_value(settings), "ids": ids}
        reasons: dict[str, str] = {}
        for url in self.order(start):
            try:
                answer = self.post(url, "/v1/sessions", body)
            except EnvSpecError:
                raise
            except RemoteEnvError as error:  # down, full, or refusing: the next server may do
                reasons[url] = str(error)
                continue
            sessions = answer.get("sessions")
            if sessions != ids:
                raise RemoteEnvError(f"env server {url} opened {sessions!r}, not the sessions asked for")
            self.hold(url, ids)
            return url, ids
        raise NoServerError(_no_server_message("open a session of", env_id, reasons), reasons)

    def hold(self, url: str, sessions: list[str]) -> None:
        """Record sessions opened (or forked) on ``url``, for :meth:`close` to close."""
        with self._lock:
            self._held.setdefault(url, set()).update(sessions)

    def fork(self, url: str, session: str) -> str:
        """Copy ``session`` on its server, env state included; the copy's id."""
        new_id = uuid.uuid4().hex
        self.post(url, "/v1/sessions/fork", {"sessions": [session], "ids": [new_id]})
        self.hold(url, [new_id])
        return new_id

    def close_sessions(self, url: str, sessions: list[str]) -> None:
        """Close sessions; never raises (a dead server closed them already, an idle timeout will otherwise)."""
        with self._lock:
            self._held.get(url, set()).difference_update(sessions)
        for start in range(0, len(sessions), CLOSE_BATCH):
            try:
                self.http.post(url + "/v1/sessions/close", json={"sessions": sessions[start:start + CLOSE_BATCH]},
                               timeout=min(self.options.timeout_s, self.options.connect_timeout_s, 2.0))
            except Exception:  # closing is a courtesy: the server reaps idle sessions anyway
                pass

    def abandon(self, url: str, session: str) -> None:
        """Queue a session to close at the next :meth:`open` (or :meth:`close`): what a garbage-collected env's
        finalizer calls. The garbage collector runs a finalizer in whatever thread allocates, possibly inside this
        pool's own HTTP client holding its locks; when the finalizer sent the close itself, a test saw two threads'
        requests of the pool wait together for the close's 2 s timeout. A put on a ``SimpleQueue`` does no I/O and
        is safe there."""
        self._abandoned.put((url, session))

    def close_abandoned(self) -> None:
        """Close the sessions :meth:`abandon` queued, one request per server."""
        by_url: dict[str, list[str]] = {}
        while True:
            try:
                url, session = self._abandoned.get_nowait()
            except queue.Empty:
                break
            by_url.setdefault(url, []).append(session)
        for url, sessions in by_url.items():
            self.close_sessions(url, sessions)

    def health(self) -> dict[str, dict[str, Any] | str]:
        """Each server's ``/health`` answer, or the error it gave."""
        out: dict[str, dict[str, Any] | str] = {}
        for url in self.urls:
            try:
                out[url] = self.get(url, "/health")
            except RemoteEnvError as error:
                out[url] = str(error)
        return out

    def close(self) -> None:
        """Close every session this pool holds open (its envs' and batches'), then the HTTP client: a command
        that ends leaves nothing on the servers for their idle timeout to reap."""
        self.close_abandoned()
        with self._lock:
            held = {url: sorted(sessions) for url, sessions in self._held.items() if sessions}
        for url, sessions in held.items():
            self.close_sessions(url, sessions)
        self.http.close()


def _no_server_message(what: str, env_id: str, reasons: dict[str, str]) -> str:
    listing = "\n".join(f"  - {url}: {reason}" for url, reason in reasons.items())
    return (f"no env server could {what} {env_id!r}:\n{listing}\n"
            "start one with `turnrl serve-env`, or check env.remote, the token and the servers' limits")


# --------------------------------------------------------------------------- one env
@dataclass
class _Session:
    url: str
    id: str
    seq: int = 0
    """Resets and steps applied so far; the next one is ``seq + 1``."""


class RemoteEnv(QueriedEnv):
    """An :class:`~turnrl.envs.contract.AgentEnv` whose env lives on an env server.

    The session opens on first use (so building envs never fails for a server that is down); one thread
    at a time may use an env (the rollout's executor does). ``copy.deepcopy`` forks the session on the
    server, state and all (the expert's world-model predictions step a copy).

    Args:
        pool: the servers and the HTTP client (shared by many envs).
        env_id: the env on the server, e.g. ``"Sokoban"``.
        settings: its constructor settings.
        start: which server to try first (round robin: the k-th env of a factory starts at server k).
    """

    def __init__(self, pool: EnvServerPool, env_id: str, settings: dict[str, Any] | None = None,
                 start: int = 0) -> None:
        self.pool = pool
        self.env_id = env_id
        self.settings = dict(settings or {})
        self.start = start
        self._session: _Session | None = None
        self._episode = False
        self._cache: dict[str, Any] = {}
        self._finalizer: weakref.finalize | None = None

    # ------------------------------------------------------------------ where it lives
    @property
    def server(self) -> str | None:
        """URL of the server holding the session (None before the first reset or after a loss)."""
        return self._session.url if self._session is not None else None

    @property
    def session_id(self) -> str | None:
        return self._session.id if self._session is not None else None

    def _open(self) -> _Session:
        url, (session_id,) = self.pool.open(self.env_id, self.settings, 1, self.start)
        return self._adopt(_Session(url, session_id))

    def _adopt(self, session: _Session) -> _Session:
        self._drop()
        self._session = session
        # Close the session after this env is garbage collected (the pool's next open); at interpreter exit idle
        # reaping does it.
        self._finalizer = weakref.finalize(self, self.pool.abandon, session.url, session.id)
        self._finalizer.atexit = False
        return session

    def _drop(self) -> None:
        """Forget the session (lost or closed by the server); the next reset opens another."""
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        self._session = None
        self._episode = False

    def _give_up(self, session: _Session) -> None:
        """Forget a session whose last reset or step may have been applied without this env learning its outcome
        (no answer, a 5xx, an answer it cannot read), and close it on its server at the pool's next open. Kept,
        it would number its next call as the one the server may have applied, and every later reset would be
        refused as out of order; forgotten without a close, it would hold its server's room until the idle
        timeout."""
        self._drop()
        self.pool.abandon(session.url, session.id)

    def _call(self, session: _Session, path: str, item: dict[str, Any], step: bool) -> ItemResult:
        answer = self.pool.post(session.url, path, {"items": [item]})
        items = answer.get("items")
        if not isinstance(items, list) or len(items) != 1:
            raise RemoteEnvError(f"env server {session.url} answered {path} without its one item")
        return decode_item(session.url, items[0], step)

    # ------------------------------------------------------------------ the contract
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None
              ) -> tuple[dict[str, Any], dict[str, Any]]:
        """Start an episode; on a server that is gone or forgot the session, on the next server instead."""
        seed = None if seed is None else operator.index(seed)  # a numpy integer is a JSON number too
        attempts = 0
        while True:
            session = self._session or self._open()  # a server that did not answer is tried last
            item = {"session": session.id, "seq": session.seq + 1, "seed": seed,
                    "options": encode_value(options) if options is not None else None,
                    "queries": queries_to_bring(RESET_QUERIES, self.pool.options.prefetch)}
            try:
                result = self._call(session, "/v1/reset", item, step=False)
            except (SessionLostError, ServerUnavailableError) as error:
                # A reset loses nothing: start the episode in a new session.
                if isinstance(error, ServerUnavailableError):
                    self._give_up(session)
                else:
                    self._drop()
                attempts += 1
                if attempts > len(self.pool.urls):
                    raise SessionLostError(f"reset failed {attempts} times, the last: {error}") from error
                continue
            except EnvRaisedError:
                self._drop()
                raise
            except RemoteEnvError:
                self._give_up(session)
                raise
            session.seq += 1
            self._episode = True
            self._cache = result.queries
            return result.observation, result.info

    def step(self, action: str) -> tuple[dict[str, Any], float, bool, bool, dict[str, Any]]:
        """Apply one action on the server: ``(observation, reward, terminated, truncated, info)``.

        Raises:
            SessionLostError: the server died or forgot the session; this episode cannot go on.
            EnvRaisedError: the env raised on the server (its session is closed).
            RemoteEnvError: no episode is running (reset first, or the last one ended), or the server failed
                or answered what cannot be read (the session is given up: the next reset opens another).
        """
        session = self._session
        if session is None or not self._episode:
            raise RemoteEnvError(f"{self.env_id}: step() with no episode running; call reset() first")
        item = {"session": session.id, "seq": session.seq + 1, "action": action,
                "queries": queries_to_bring(STEP_QUERIES, self.pool.options.prefetch)}
        try:
            result = self._call(session, "/v1/step", item, step=True)
        except ServerUnavailableError as error:
            self._give_up(session)
            raise SessionLostError(f"the episode is lost with its server: {error}") from error
        except (SessionLostError, EnvRaisedError):
            self._drop()  # the server closed the session
            raise
        except RemoteEnvError:
            self._give_up(session)
            raise
        session.seq += 1
        self._cache = result.queries
        if result.terminated or result.truncated:
            self._episode = False
        return result.observation, result.reward, result.terminated, result.truncated, result.info

    def _query(self, name: str) -> Any:
        """A query's result for the current state: from the cache, else one request (cached until the state
        changes)."""
        if name not in self._cache:
            session = self._session or self._open()
            body = {"items": [{"session": session.id, "queries": [name]}]}
            try:
                answer = self.pool.post(session.url, "/v1/query", body)
            except SessionLostError as error:
                self._drop()
                raise SessionLostError(f"{name}(): the session is lost: {error}") from error
            except ServerUnavailableError as error:
                self._give_up(session)
                raise SessionLostError(f"{name}(): the session is lost: {error}") from error
            items = answer.get("items")
            if not isinstance(items, list) or len(items) != 1 or not isinstance(items[0], dict):
                raise RemoteEnvError(f"env server {session.url} answered a query without its one item")
            if items[0].get("ok") is not True:
                decode_item(session.url, items[0], step=False)  # raises the item's error
            try:
                self._cache.update(decode_queries(session.url, items[0].get("queries", {})))
            except ValueError as error:
                raise RemoteEnvError(f"env server {session.url} answered a malformed query: {error}") from None
            if name not in self._cache:
                raise RemoteEnvError(f"env server {session.url} did not answer {name}()")
        value = self._cache[name]
        if isinstance(value, RemoteEnvError):
            raise value
        return copy.deepcopy(value)  # callers may change what they get; the cache must not change

    def close(self) -> None:
        """Close the session on the server (the env can be reset again: it opens a new one)."""
        session = self._session
        self._drop()
        if session is not None:
            self.pool.close_sessions(session.url, [session.id])

    def __deepcopy__(self, memo: dict[int, Any]) -> RemoteEnv:
        """A copy with a session of its own: the server forks this session, env state included."""
        twin = RemoteEnv(self.pool, self.env_id, self.settings, self.start)
        session = self._session
        if session is None:
            return twin
        new_id = self.pool.fork(session.url, session.id)
        twin._adopt(_Session(session.url, new_id, session.seq))
        twin._episode = self._episode
        twin._cache = copy.deepcopy(self._cache)
        return twin

    def __repr__(self) -> str:
        where = f"{self.server} session {self.session_id}" if self._session else "no session"
        return f"RemoteEnv({self.env_id!r}, {self.settings!r}, {where})"


# --------------------------------------------------------------------------- many sessions at once
@dataclass
class BatchStep:
    """One session's step in a :class:`RemoteEnvBatch`; ``error`` set when it failed."""

    observation: dict[str, Any] = field(default_factory=dict)
    reward: float = 0.0
    terminated: bool = False
    truncated: bool = False
    info: dict[str, Any] = field(default_factory=dict)
    error: RemoteEnvError | None = None


class RemoteEnvBatch:
    """``n`` sessions of one env on one server, reset and stepped with one request each time.

    For loops of one's own (a vectorized env): ``reset(seeds)``, ``step(actions)``, ``close()``. Only
    sessions with an episode running are sent a step; the others (episode over, env raised) get an error
    in their place without a request. A reset replaces the sessions that cannot go on: those whose env raised,
    those the server lost (idle past its timeout while the others' episodes ran on) and those whose last call
    failed without an answer this batch could read (the server may have applied it). After :meth:`close`, a
    reset raises.
    """

    def __init__(self, pool: EnvServerPool, env_id: str, settings: dict[str, Any] | None, n: int,
                 start: int = 0) -> None:
        if n < 1:
            raise ValueError(f"a batch needs n >= 1 sessions, got {n}")
        self.pool = pool
        self.env_id, self.settings = env_id, dict(settings or {})
        self.url, self.ids = pool.open(env_id, self.settings, n, start)
        self.seqs = [0] * n
        self.running = [False] * n
        """Whether session k has an episode running."""
        self.broken = [False] * n
        """Whether session k must be replaced at the next reset (see the class docstring)."""
        self.closed = False
        """Whether :meth:`close` closed the sessions."""

    def _send(self, path: str, items: list[dict[str, Any]], sessions: list[int]) -> list[Any]:
        """The answer items of a request about ``sessions`` (by index); where the request fails, those sessions
        are marked for replacement first: the server may have applied some of it, and a session numbered from
        what this batch last heard would be refused as out of order from then on."""
        try:
            answer = self.pool.post(self.url, path, {"items": items})
            out = answer.get("items")
            if not isinstance(out, list) or len(out) != len(items):
                raise RemoteEnvError(f"env server {self.url} answered {path} with the wrong number of items")
        except RemoteEnvError:
            if not self.closed:
                for k in sessions:
                    self.broken[k], self.running[k] = True, False
            raise
        return out

    def _reopen(self) -> None:
        """New sessions in place of those marked for replacement; the old ones still open are closed."""
        broken = [k for k, gone in enumerate(self.broken) if gone]
        if not broken:
            return
        self.pool.close_sessions(self.url, [self.ids[k] for k in broken])
        ids = [uuid.uuid4().hex for _ in broken]
        self.pool.hold(self.url, ids)  # before the request: an open whose answer is lost is closed with the pool
        self.pool.post(self.url, "/v1/sessions", {"env_id": self.env_id, "settings": encode_value(self.settings),
                                                  "ids": ids})
        for k, session_id in zip(broken, ids):
            self.ids[k], self.seqs[k], self.broken[k] = session_id, 0, False

    def _reset_all(self, seeds: Sequence[int | None]) -> list[Any]:
        self._reopen()
        items: list[dict[str, Any]] = [{"session": sid, "seq": seq + 1, "queries": [],
                                        "seed": None if seed is None else operator.index(seed)}
                                       for sid, seq, seed in zip(self.ids, self.seqs, seeds)]
        return self._send("/v1/reset", items, list(range(len(self.ids))))

    def reset(self, seeds: Sequence[int | None]) -> list[tuple[dict[str, Any], dict[str, Any]] | RemoteEnvError]:
        """Reset every session (``seeds[k]`` for session k)."""
        if len(seeds) != len(self.ids):
            raise ValueError(f"{len(seeds)} seeds for {len(self.ids)} sessions")
        try:
            answers = self._reset_all(seeds)
        except SessionLostError:
            if self.closed:
                raise
            # The server closed one of them (idle, or it restarted), which fails the request as a whole; a reset
            # loses nothing: start over in new sessions.
            answers = self._reset_all(seeds)
        out: list[tuple[dict[str, Any], dict[str, Any]] | RemoteEnvError] = []
        for k, item in enumerate(answers):
            try:
                result = decode_item(self.url, item, step=False)
            except RemoteEnvError as error:
                self.broken[k], self.running[k] = True, False
                out.append(error)
                continue
            self.seqs[k] += 1
            self.running[k] = True
            out.append((result.observation, result.info))
        return out

    def step(self, actions: Sequence[str]) -> list[BatchStep]:
        """Step every session that has an episode running with its action (one request)."""
        if len(actions) != len(self.ids):
            raise ValueError(f"{len(actions)} actions for {len(self.ids)} sessions")
        live = [k for k in range(len(self.ids)) if self.running[k]]
        out = [BatchStep(error=RemoteEnvError(f"session {k} has no episode running; reset first"))
               for k in range(len(self.ids))]
        if not live:
            return out
        items: list[dict[str, Any]] = [
            {"session": self.ids[k], "seq": self.seqs[k] + 1, "action": actions[k], "queries": []} for k in live]
        for k, item in zip(live, self._send("/v1/step", items, live)):
            try:
                result = decode_item(self.url, item, step=True)
            except RemoteEnvError as error:
                self.broken[k], self.running[k] = True, False
                out[k] = BatchStep(error=error)
                continue
            self.seqs[k] += 1
            self.running[k] = not (result.terminated or result.truncated)
            out[k] = BatchStep(result.observation, result.reward, result.terminated, result.truncated, result.info)
        return out

    def close(self) -> None:
        self.closed = True
        self.pool.close_sessions(self.url, self.ids)
        self.running = [False] * len(self.ids)


# --------------------------------------------------------------------------- what the trainer calls
class RemoteEnvFactory:
    """A ``make_env`` whose envs live on env servers: the k-th env prefers server ``k mod len(urls)``.

    Built by :func:`remote_env_factory`; its envs share ``pool``, and :meth:`close` closes every session they
    hold (call it when the command ends, however it ends).
    """

    def __init__(self, pool: EnvServerPool, env_id: str, settings: dict[str, Any]) -> None:
        self.pool = pool
        self.env_id, self.settings = env_id, dict(settings)
        self._counter = itertools.count()
        self._lock = threading.Lock()

    def __call__(self) -> RemoteEnv:
        with self._lock:
            start = next(self._counter)
        return RemoteEnv(self.pool, self.env_id, self.settings, start=start)

    def close(self) -> None:
        self.pool.close()


def remote_env_factory(env_id: str, settings: dict[str, Any], urls: list[str], **options: Any) -> RemoteEnvFactory:
    """A ``make_env`` for :class:`~turnrl.rollout.groups.EnvGroups` whose envs live on ``urls``.

    Checks now, with the first server that answers, that it builds ``env_id`` with ``settings``; each env
    then opens its session on first use, the k-th env preferring server ``k mod len(urls)``.

    Args:
        env_id: the env id as the servers know it (``env.id``).
        settings: its settings (``env.settings``).
        urls: ``env.remote``.
        options: fields of :class:`ClientOptions` (``timeout_s``, ``retries``, ``token``, ...).

    Raises:
        EnvSpecError: a server refused the env or a setting (a ValueError, as ``turnrl.envs.make`` raises).
        NoServerError: no server answered.
        ValueError: a bad URL or option.
    """
    known = set(ClientOptions.__dataclass_fields__)
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"unknown remote env options {unknown}; allowed: {sorted(known)}")
    pool = EnvServerPool(urls, ClientOptions(**options))
    try:
        pool.validate(env_id, settings)
    except Exception:
        pool.close()
        raise
    return RemoteEnvFactory(pool, env_id, settings)

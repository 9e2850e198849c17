"""``turnrl serve-env``: turnrl envs as a service over HTTP, so that heavy simulators can live on other machines.

A client opens *sessions* (one env each), resets and steps them, asks them
read-only *queries* and closes them. Every call but ``/health`` and ``/metrics``
takes a list, so one request can reset, step or query many sessions; a
session's part of the answer is its own (an env that raises fails its item
only). :class:`turnrl.envservice.client.RemoteEnv` is the client; ``env.remote``
in a training run or ``turnrl eval`` uses it.

The server is :class:`EnvServer`, a plain class: each endpoint is a method that takes the parsed body (and the
client's name) and returns the answer, or raises :class:`~turnrl.envservice.protocol.APIError`, so that it runs
and is tested without HTTP. :func:`build_app` puts it behind a thin FastAPI router.

The request bodies are :mod:`turnrl.envservice.request_bodies`'s; the sessions, their counters and the env calls
that run on worker threads are :mod:`turnrl.envservice.sessions`'s.

Endpoints (JSON bodies; values in the tagged encoding of
:func:`turnrl.envservice.protocol.encode_value`, images as PNG):

- ``POST /v1/validate`` ``{env_id, settings}``: builds the env and resets it once, to check the id and settings.
- ``POST /v1/sessions`` ``{env_id, settings, count | ids}``: opens sessions (ids chosen by the client make
  a retried request idempotent).
- ``POST /v1/reset`` ``{items: [{session, seq, seed, options, queries}]}``
- ``POST /v1/step`` ``{items: [{session, seq, action, queries}]}``
- ``POST /v1/query`` ``{items: [{session, queries}]}``: the queries of
  :data:`turnrl.envservice.protocol.QUERIES`.
- ``POST /v1/sessions/fork`` ``{sessions, ids}``: copies sessions, env state included.
- ``POST /v1/sessions/close`` ``{sessions}``
- ``GET /v1/envs``, ``GET /health`` (no token needed), ``GET /metrics`` (Prometheus text).

Guarantees:

- **Exactly-once steps.** ``seq`` is the number the reset or step will have in
  its session (1, 2, ...). The next number is applied; the last one again, with
  the same request, is answered from the server's record of it (a client
  retrying a request whose answer was lost); any other is a 409. Without ``seq``
  a call is simply applied.
- **Bad input is a 4xx and the server stays up**: malformed JSON or fields
  (400), a missing or wrong token (401), an unknown session (404), a step with
  no episode running (409), an oversized body (413), a full server (429), an
  env or setting not served (400). An env that raises ends its session with an
  error item; the server and the other sessions go on.
- **Limits**: request size, items per request, sessions per client (named by
  the ``x-turnrl-client`` header, else the peer address) and in total, and idle
  time (an idle session is closed; using it later is a 404 that says so).
- **Isolation**: env calls run on a thread pool, one call at a time per
  session; a slow env holds one thread, not the server. A batch's sessions are
  reset, stepped or queried on up to ``--workers`` threads at once (their envs are
  independent objects), and answered in the request's order.
- **Deadlines**: a session's reset, step or queries still running after
  ``--step-timeout`` seconds is abandoned: its item is an ``env_timeout`` error
  that names the session and the option, its session is closed (its env is
  closed when the call returns, if ever) and its thread is replaced, so a hung
  env costs one thread, never the server. Building an env (an open or a
  validate) or copying one (a fork) has the same deadline: past it the request
  fails with a 500 ``env_timeout`` that names the session and the option, no
  session is opened, and a fork's source session is closed.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import functools
import json
import logging
import os
import secrets
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Container
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import asdict
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from turnrl.envs import AgentEnv
from turnrl.envs.catalog import builtin_name, env_names
from turnrl.envservice.http_guards import BodyLimit, bind_port, check_token, is_loopback
from turnrl.envservice.options import ServerLimits, add_arguments
from turnrl.envservice.protocol import CLIENT_HEADER, QUERIES, TOKEN_ENV_VAR, APIError, error_item
from turnrl.envservice.request_bodies import (
    EnvSpec,
    ForkBody,
    OpenBody,
    QueryBody,
    ResetBody,
    ResetItem,
    SessionsBody,
    StepBody,
    StepItem,
    decode_request_value,
    short_repr,
    validation_message,
)
from turnrl.envservice.sessions import (
    Applied,
    EnvThreads,
    ServerMetrics,
    Session,
    SessionTable,
    attempt_build,
    build_env,
    call_on_env,
    close_built,
    close_env,
    closed_item,
    copy_env,
    prometheus_text,
    refuse_copy,
    request_key,
    reset_env,
    run_queries,
    run_reset,
    run_step,
    run_with_deadline,
    shutting_down,
)

logger = logging.getLogger("turnrl.env_server")

SHUTDOWN_GRACE_S = 5.0
"""How long a shutdown waits for the env calls under way to return, each closing its env as it does, so that
their envs are closed before the process exits (a call still running then closes its env when it returns, if the
process lives on)."""


# --------------------------------------------------------------------------- the server
def canonical_env_id(env_id: str) -> str:
    """A built-in's name (``sokoban`` -> ``Sokoban``); any other id as given."""
    return builtin_name(env_id) or env_id


class EnvServer:
    """The env server without HTTP: sessions, limits and counters, one method per endpoint.

    Methods that touch envs are coroutines of the server's event loop; env calls run on its thread pool.
    Call :meth:`start` in the running loop before serving (it starts the reaper of idle sessions) and
    :meth:`shutdown` at the end.

    Args:
        envs: env ids clients may open (built-in names in any case, ``module:Class``, Gymnasium ids,
            ``gym:<id>``); None: every built-in env. Only these are ever built: a client cannot make the
            server import anything else.
        token: the bearer token every request but ``/health`` must carry; None: no auth.
        limits: request size, batch, session and idle limits, worker threads.
    """

    def __init__(self, envs: list[str] | None = None, *, token: str | None = None,
                 limits: ServerLimits | None = None) -> None:
        self.limits = limits or ServerLimits()
        self.allowed = sorted({canonical_env_id(env_id) for env_id in (envs if envs is not None else env_names())})
        if not self.allowed:
            raise ValueError("serve at least one env")
        check_token(token)
        self.token = token
        self.table = SessionTable()
        self._making: dict[str, asyncio.Event] = {}
        """Ids whose sessions a request is making (opening or forking), each with the event set when it is done."""
        self.metrics = ServerMetrics()
        self.instance = uuid.uuid4().hex[:12]
        self.executor = EnvThreads(self.limits.workers)
        self.idle_check_s = max(0.05, min(self.limits.idle_timeout_s / 4, 10.0))
        self._reaper: asyncio.Task | None = None

    # ------------------------------------------------------------------ lifetime
    def start(self) -> None:
        """Start reaping idle sessions (in the running event loop)."""
        self._reaper = asyncio.get_running_loop().create_task(self._reap_idle(), name="turnrl-env-reaper")

    def shutdown(self, grace_s: float = SHUTDOWN_GRACE_S) -> None:
        """Close every session and stop the threads: the threads take no more calls, each idle env is closed now,
        and the envs under a call are closed by their calls as they return, waited for up to ``grace_s`` seconds.
        Each env is closed once, never under a call that runs on it."""
        if self._reaper is not None:
            self._reaper.cancel()
        self.executor.shutdown(wait=False, cancel_futures=True)
        sessions = list(self.table.sessions.values())
        for session in sessions:
            self.table.remove(session, "the server shut down")
            self.metrics.count(self.metrics.sessions_closed, "shutdown")
            if session.release_env():
                session.close_now()
        deadline = time.monotonic() + grace_s
        running = [s.id for s in sessions if not s.env_closed.wait(max(deadline - time.monotonic(), 0.0))]
        if running:
            logger.warning("shutting down with env calls still running after %g s on sessions %s; each env is "
                           "closed when its call returns", grace_s, ", ".join(running[:5]))

    async def _reap_idle(self) -> None:
        while True:
            await asyncio.sleep(self.idle_check_s)
            cutoff = time.monotonic() - self.limits.idle_timeout_s
            for session in list(self.table.sessions.values()):
                if session.last_used < cutoff and not session.lock.locked():
                    self._drop(session, f"idle for more than {self.limits.idle_timeout_s:g} s")

    # ------------------------------------------------------------------ who asks
    def authorize(self, authorization: str, client_name: str | None, peer: str | None) -> str:
        """Check the bearer token of the ``authorization`` header; the client's name (for the per-client limit):
        its ``x-turnrl-client`` header, else its address."""
        if self.token is not None:
            scheme, _, given = authorization.partition(" ")
            if scheme.lower() != "bearer" or not given:
                raise APIError(401, "unauthorized", "this server needs a bearer token: send 'Authorization: Bearer "
                                                    f"<token>' (the client reads {TOKEN_ENV_VAR})")
            # surrogatepass: a lone surrogate (no header has one, a caller in process may) is a wrong token.
            if not secrets.compare_digest(given.strip().encode(errors="surrogatepass"), self.token.encode()):
                raise APIError(401, "unauthorized", "wrong token")
        return client_name[:128] if client_name else (peer or "unknown")

    def count_error(self, code: str) -> None:
        """Count an error answered (``/metrics``)."""
        self.metrics.count(self.metrics.errors, code)

    # ------------------------------------------------------------------ endpoints
    def health(self) -> dict[str, Any]:
        """``GET /health``."""
        return {"status": "ok", "instance": self.instance, "sessions": len(self.table), "resets": self.metrics.resets,
                "steps_per_s": self.metrics.steps_per_s(), "steps": self.metrics.steps,
                "errors": sum(self.metrics.errors.values()), "stuck_calls": self.executor.stuck,
                "uptime_s": time.time() - self.metrics.started}

    def prometheus(self) -> str:
        """``GET /metrics``."""
        return prometheus_text(self.metrics, len(self.table), self.executor.stuck)

    def envs(self) -> dict[str, Any]:
        """``GET /v1/envs``."""
        return {"envs": self.allowed, "queries": list(QUERIES), "limits": asdict(self.limits)}

    async def validate(self, body: EnvSpec) -> dict[str, Any]:
        """``POST /v1/validate``: the env built and reset once (seed 0), under the builds' deadline."""
        env_id, settings = self._env_spec(body)
        envs = await asyncio.shield(self._build_envs(env_id, [None], lambda k: reset_env(env_id, settings)))
        self.executor.submit(close_env, envs[0])
        return {"ok": True, "env_id": env_id}

    async def open_sessions(self, body: OpenBody, client: str) -> dict[str, Any]:
        """``POST /v1/sessions``."""
        env_id, settings = self._env_spec(body)
        if body.ids is not None and body.count is not None and body.count != len(body.ids):
            raise APIError(400, "invalid_request", f"count={body.count} but {len(body.ids)} ids")
        # Checked before any id is made: a count of 10**12 must not make 10**12 ids first.
        wanted = len(body.ids) if body.ids is not None else body.count or 1
        if wanted > self.limits.max_batch:
            raise APIError(400, "batch_too_large",
                           f"{wanted} sessions in one request; at most {self.limits.max_batch} (--max-batch)")
        ids = body.ids if body.ids is not None else [uuid.uuid4().hex for _ in range(wanted)]
        if len(set(ids)) != len(ids):
            raise APIError(400, "invalid_request", "the ids repeat")
        settings_key = json.dumps(body.settings, sort_keys=True)
        # Shielded, as _apply is: a client that hangs up must not leave envs built that no session holds.
        return await asyncio.shield(self._open(ids, env_id, settings, settings_key, client))

    async def _open(self, ids: list[str], env_id: str, settings: dict[str, Any], settings_key: str,
                    client: str) -> dict[str, Any]:
        async with self._making_ids(ids):
            existing = [self.table.sessions.get(i) for i in ids]
            if any(existing):
                # A retried open: the same client asking for the same sessions gets them again.
                same = all(s is not None and s.owner == client and s.env_id == env_id and
                           s.settings_key == settings_key for s in existing)
                if not same:
                    raise APIError(409, "session_exists", "a session with one of these ids exists; choose other ids")
                return {"sessions": ids, "instance": self.instance}
            self._check_room(client, len(ids))
            built = await self._build_envs(env_id, list(ids), lambda k: build_env(env_id, settings))
            try:
                self._check_room(client, len(ids))  # others may have opened sessions meanwhile
            except APIError:
                for env in built:
                    self.executor.submit(close_env, env)
                raise
            for session_id, env in zip(ids, built):
                self.table.add(Session(session_id, env_id, settings, client, env, settings_key=settings_key))
        self.metrics.sessions_opened += len(ids)
        return {"sessions": ids, "instance": self.instance}

    async def reset(self, body: ResetBody) -> dict[str, Any]:
        """``POST /v1/reset``."""
        answered = self._failed_answers("reset", body.items)
        items = [item for k, item in enumerate(body.items) if k not in answered]
        sessions = self._check_batch([item.session for item in body.items], answered)
        try:
            options = [None if item.options is None else decode_request_value(item.options) for item in items]
        except ValueError as error:
            raise APIError(400, "invalid_request", f"options cannot be read: {error}") from None
        if any(opt is not None and not isinstance(opt, dict) for opt in options):
            raise APIError(400, "invalid_request", "options must be an object")
        work = self._apply("reset", sessions, items, lambda k: run_reset(sessions[k], items[k], options[k]))
        return {"items": with_answered(await asyncio.shield(work), answered)}

    async def step(self, body: StepBody) -> dict[str, Any]:
        """``POST /v1/step``."""
        answered = self._failed_answers("step", body.items)
        items = [item for k, item in enumerate(body.items) if k not in answered]
        sessions = self._check_batch([item.session for item in body.items], answered)
        work = self._apply("step", sessions, items, lambda k: run_step(sessions[k], items[k]))
        return {"items": with_answered(await asyncio.shield(work), answered)}

    def _failed_answers(self, kind: str, items: list[Any]) -> dict[int, dict[str, Any]]:
        """The items (by index) that repeat the reset or step whose env raised and closed its session: a retry
        whose first answer was lost gets that error item again, and the batch's other items go on, where a 404
        for the whole request left a client's batch unable to learn what its other envs did."""
        answered = {}
        for k, item in enumerate(items):
            record = None if item.session in self.table.sessions else self.table.failed.get(item.session)
            if record is not None and (record.kind, record.seq, record.request) == (kind, item.seq, request_key(item)):
                answered[k] = record.answer
        return answered

    async def query(self, body: QueryBody) -> dict[str, Any]:
        """``POST /v1/query``."""
        sessions = self._check_batch([item.session for item in body.items])

        def answer(k: int) -> dict[str, Any]:
            return {"session": sessions[k].id, "ok": True, "queries": run_queries(sessions[k], body.items[k].queries)}

        async def work() -> list[dict[str, Any]]:
            # Shielded whole, as _apply is: a client that hangs up must not free the locks while the calls run.
            async with self._holding(sessions):
                items = await self._run_calls("query", sessions, answer)
                for session, item in zip(sessions, items):
                    if not item["ok"] and item["error"]["code"] == "env_timeout":
                        self._drop(session, "env_timeout: its queries ran past --step-timeout")
            return items

        return {"items": await asyncio.shield(work())}

    async def fork(self, body: ForkBody, client: str) -> dict[str, Any]:
        """``POST /v1/sessions/fork``."""
        sessions = self._check_batch(body.sessions)
        ids = body.ids if body.ids is not None else [uuid.uuid4().hex for _ in sessions]
        if len(ids) != len(sessions) or len(set(ids)) != len(ids):
            raise APIError(400, "invalid_request", "fork takes one new, unused id per session")
        async with self._making_ids(ids):
            existing = [self.table.sessions.get(i) for i in ids]
            if any(existing):
                # A retried fork (its answer was lost): the same client's copies of the same sessions, again.
                if all(twin is not None and twin.owner == client and twin.forked_from == source.id
                       for twin, source in zip(existing, sessions)):
                    return {"sessions": ids, "instance": self.instance}
                raise APIError(400, "invalid_request", "fork takes one new, unused id per session")
            self._check_room(client, len(ids))

            def copy_of(k: int) -> AgentEnv:
                return call_on_env(sessions[k], functools.partial(copy_env, sessions[k]), refuse_copy)

            async with self._holding(sessions):
                envs = await asyncio.shield(self._build_envs(sessions[0].env_id, [s.id for s in sessions],
                                                             copy_of, sessions))
                try:
                    self._check_room(client, len(ids))  # others may have opened sessions meanwhile
                except APIError:
                    for env in envs:
                        self.executor.submit(close_env, env)
                    raise
                for new_id, source, env in zip(ids, sessions, envs):
                    twin = Session(new_id, source.env_id, source.settings, client, env, seq=source.seq,
                                   state=source.state, last_obs=copy.deepcopy(source.last_obs),
                                   settings_key=source.settings_key, forked_from=source.id)
                    self.table.add(twin)
        self.metrics.sessions_opened += len(ids)
        return {"sessions": ids, "instance": self.instance}

    async def close(self, body: SessionsBody) -> dict[str, Any]:
        """``POST /v1/sessions/close``."""
        if len(body.sessions) > self.limits.max_batch:
            raise APIError(400, "batch_too_large", f"{len(body.sessions)} sessions in one request; at most "
                                                   f"{self.limits.max_batch} (--max-batch)")
        closed, unknown = [], []
        for session_id in body.sessions:
            session = self.table.sessions.get(session_id)
            if session is None:
                unknown.append(session_id)
                continue
            async with session.lock:
                self._drop(session, "client: closed by its client")
            closed.append(session_id)
        return {"closed": closed, "unknown": unknown}

    # ------------------------------------------------------------------ helpers
    def _drop(self, session: Session, reason: str) -> None:
        """Close a session now; its env is closed on a worker thread, or by the call that still runs on it (one
        abandoned past its deadline) when it returns."""
        if session.closed:
            return
        self.table.remove(session, reason)
        self.metrics.count(self.metrics.sessions_closed, reason.split(" ")[0].rstrip(":"))
        if session.release_env():
            self.executor.submit(session.close_now)

    async def _run_calls(self, kind: str, sessions: list[Session], call: Callable[[int], dict[str, Any]]
                         ) -> list[dict[str, Any]]:
        """``call(k)`` for each of ``sessions`` (distinct sessions, whose locks the caller holds), on up to
        ``--workers`` threads at once; the answers in order. A call running past ``--step-timeout`` is answered
        with an ``env_timeout`` error item (its session is the caller's to close; its env is closed when the call
        returns)."""
        def on_env(k: int) -> dict[str, Any]:
            refused = functools.partial(closed_item, kind, sessions[k])
            return call_on_env(sessions[k], functools.partial(call, k), refused)

        # An abandoned call closes its env itself as it returns (call_on_env), once its session is dropped.
        answers = await run_with_deadline(self.executor, self.limits.workers, self.limits.step_timeout_s,
                                          [functools.partial(on_env, k) for k in range(len(sessions))],
                                          late=lambda k, answer: None)
        return [answer if answer is not None else self._timed_out(kind, sessions[k])
                for k, answer in enumerate(answers)]

    async def _build_envs(self, env_id: str, ids: list[str | None], make_env: Callable[[int], AgentEnv],
                          sources: list[Session] | None = None) -> list[AgentEnv]:
        """``make_env(k)`` for the session ``ids[k]`` (None: a validate's env, no session) on up to ``--workers``
        threads at once: the envs of an open, or (``sources``) the copies a fork makes of those sessions' envs.

        A build has the deadline of a step, ``--step-timeout``, rather than one of its own: an open or fork is a
        request the client waits on as it waits on a step, and that deadline sits below the client's timeout so
        that the client reads the error; a longer one would end after the client gave up and retried the open, and
        each retry would hang one more thread. An env that takes that long to build needs a larger
        ``--step-timeout`` (and client timeout) either way.

        Raises:
            APIError: a build raised, or ran past the deadline (a 500 ``env_timeout`` naming the session and the
                option: its thread is written off, the env it builds is closed when it returns, and a fork's
                source session is closed, its env by the copy as it returns, since the copy still reads it), or
                the server shut down meanwhile (a 503: no session must be added to a server that closed its
                sessions). Every env built is then closed.
        """
        results = await run_with_deadline(self.executor, self.limits.workers, self.limits.step_timeout_s,
                                          [functools.partial(attempt_build, functools.partial(make_env, k))
                                           for k in range(len(ids))], late=lambda k, built: close_built(built),
                                          unused=close_built)
        envs = [result.env for result in results if result is not None and result.env is not None]
        if self.executor.shut:  # the builds ended before the shutdown was seen; the threads take no task now
            for env in envs:
                close_env(env)
            raise shutting_down()
        error = next((result.error for result in results if result is not None and result.error), None)
        overdue = [k for k, result in enumerate(results) if result is None]
        if overdue:
            for source in [sources[k] for k in overdue] if sources is not None else []:
                self._drop(source, "env_timeout: copying its env (fork) ran past --step-timeout")
            error = self._build_timed_out(env_id, [ids[k] for k in overdue], forked=sources is not None)
        if error is not None:
            for env in envs:
                self.executor.submit(close_env, env)
            raise error
        return envs

    def _build_timed_out(self, env_id: str, overdue: list[str | None], forked: bool) -> APIError:
        """The error of an open, fork or validate whose builds (for the sessions ``overdue``) ran past the deadline."""
        limit = self.limits.step_timeout_s
        named = ", ".join(map(str, overdue[:3])) + (f" and {len(overdue) - 3} more" if len(overdue) > 3 else "")
        sessions = f"session{'s' if len(overdue) > 1 else ''} {named}: "
        if forked:
            what, outcome = f"{sessions}copying the env (fork)", "the copy was abandoned and the session closed"
        else:
            what = f"{sessions if overdue[0] is not None else ''}building {env_id}"
            outcome = "the build was abandoned and no session opened"
        logger.warning("%s ran past %g s (--step-timeout); abandoned", what, limit)
        return APIError(500, "env_timeout", f"{what} still ran after {limit:g} s, the server's deadline "
                                            f"(--step-timeout); {outcome}. If this env takes that long to build, "
                                            "start the server with a larger --step-timeout")

    def _timed_out(self, kind: str, session: Session) -> dict[str, Any]:
        """The error item of a call abandoned past ``--step-timeout``."""
        self.count_error("env_timeout")
        limit = self.limits.step_timeout_s
        logger.warning("session %s (%s): %s ran past %g s (--step-timeout); abandoned", session.id, session.env_id,
                       kind, limit)
        return error_item(session.id, f"session {session.id}: {session.env_id} {kind} still ran after {limit:g} s, "
                                      f"the server's deadline (--step-timeout); the call was abandoned and the "
                                      f"session closed. If this env's calls take that long, start the server with a "
                                      f"larger --step-timeout", code="env_timeout")

    def _env_spec(self, spec: EnvSpec) -> tuple[str, dict[str, Any]]:
        env_id = canonical_env_id(spec.env_id)
        if env_id not in self.allowed:
            raise APIError(400, "unknown_env", f"env {spec.env_id!r} is not served here; this server serves "
                                               f"{', '.join(self.allowed)} (turnrl serve-env --envs ...)")
        try:
            settings = decode_request_value(spec.settings)
        except ValueError as error:
            raise APIError(400, "bad_settings", f"settings cannot be read: {error}") from None
        if not isinstance(settings, dict) or not all(isinstance(key, str) for key in settings):
            raise APIError(400, "bad_settings", "settings must be an object of named settings, got "
                                                f"{short_repr(spec.settings)}")
        return env_id, settings

    def _check_room(self, owner: str, count: int) -> None:
        if len(self.table) + count > self.limits.max_sessions:
            raise APIError(429, "too_many_sessions", f"this server holds {len(self.table)} sessions of at most "
                                                     f"{self.limits.max_sessions} (--max-sessions); close some or "
                                                     "use another server")
        held = self.table.per_owner.get(owner, 0)
        if held + count > self.limits.max_sessions_per_client:
            raise APIError(429, "too_many_sessions", f"this client holds {held} sessions of at most "
                                                     f"{self.limits.max_sessions_per_client} "
                                                     "(--max-sessions-per-client); close some first")

    def _check_batch(self, ids: list[str], answered: Container[int] = ()) -> list[Session]:
        """The open sessions of a request's ``ids``, but those (by index) ``answered`` already."""
        if len(ids) > self.limits.max_batch:
            raise APIError(400, "batch_too_large", f"{len(ids)} items in one request; at most "
                                                   f"{self.limits.max_batch} (--max-batch)")
        if len(set(ids)) != len(ids):
            repeated = sorted({i for i in ids if ids.count(i) > 1})
            raise APIError(400, "invalid_request", f"sessions {repeated[:5]} appear twice in one request")
        return [self._session_of(i) for k, i in enumerate(ids) if k not in answered]

    def _session_of(self, session_id: str) -> Session:
        session = self.table.sessions.get(session_id)
        if session is None:
            raise self._gone(session_id)
        return session

    def _gone(self, session_id: str) -> APIError:
        reason = self.table.closed.get(session_id)
        if reason is not None:
            return APIError(404, "unknown_session", f"session {session_id} is closed ({reason}); open a new one")
        return APIError(404, "unknown_session", f"unknown session {session_id}: this server (instance "
                                                f"{self.instance}) never opened it; it may have restarted since")

    @asynccontextmanager
    async def _making_ids(self, ids: list[str]) -> AsyncIterator[None]:
        """Hold ``ids`` while their sessions are made: a request for any of them meanwhile (a retry whose first
        answer was lost) waits, then finds them made (and is answered as a retry) or free. Without this, two
        requests both checked the ids before either had built its envs, and both added sessions: one env was never
        closed, and the client was charged for two."""
        while busy := {id(event): event for i in ids if (event := self._making.get(i)) is not None}:
            await asyncio.gather(*(event.wait() for event in busy.values()))
        done = asyncio.Event()
        self._making.update(dict.fromkeys(ids, done))
        try:
            yield
        finally:
            for i in ids:
                self._making.pop(i, None)
            done.set()

    @asynccontextmanager
    async def _holding(self, sessions: list[Session], closed_ok: bool = False) -> AsyncIterator[None]:
        """Hold the sessions' locks (in a fixed order, so two batches never wait on each other); a session closed
        while this request waited is a 404, unless ``closed_ok`` (the caller looks at each)."""
        async with AsyncExitStack() as stack:
            for session in sorted(sessions, key=lambda s: s.id):
                await stack.enter_async_context(session.lock)
            for session in sessions:
                if session.closed and not closed_ok:  # closed while this request waited
                    raise self._gone(session.id)
                session.last_used = time.monotonic()
            try:
                yield
            finally:
                now = time.monotonic()
                for session in sessions:
                    session.last_used = now

    def _replay_or_check(self, session: Session, kind: str, item: ResetItem | StepItem) -> dict[str, Any] | None:
        """The recorded answer when ``item`` repeats the last call (its ``seq`` and request); None when its
        ``seq`` is next (or absent).

        A session closed while this request waited for it (its env raised or ran past its deadline in the call
        this request retries) answers from the record of that call, as :meth:`_failed_answers` does for a retry
        that comes later: a 404 would fail the batch's other items, which were applied."""
        if session.closed:
            record = self.table.failed.get(session.id)
            if record is not None and (record.kind, record.seq, record.request) == (kind, item.seq, request_key(item)):
                return record.answer
            raise self._gone(session.id)
        seq = item.seq
        if seq is None or seq == session.seq + 1:
            return None
        last = session.last
        if seq == session.seq and last is not None and last.kind == kind:
            if last.request == request_key(item):
                return last.answer
            raise APIError(409, "out_of_order", f"session {session.id}: {kind} {seq} was applied already, with "
                                                f"another request; a retry repeats its request, and a new {kind} "
                                                f"is numbered {seq + 1}")
        raise APIError(409, "out_of_order", f"session {session.id} has applied {session.seq} resets and steps; "
                                            f"this {kind} is numbered {seq} (expected {session.seq + 1})")

    def _settle(self, session: Session, kind: str, item: ResetItem | StepItem, answer: dict[str, Any],
                replayed: bool) -> None:
        """Record one applied reset or step (or close the session of an env that raised)."""
        if replayed:
            return
        applied = Applied(kind, session.seq + 1, request_key(item), answer)
        if not answer["ok"]:
            self.table.failed[session.id] = applied  # kept as long as the reason (remove)
            code = answer["error"]["code"]
            if code == "env_timeout":
                self._drop(session, f"env_timeout: its {kind} ran past --step-timeout")
            elif code == "env_error":
                self.count_error("env_error")
                self._drop(session, "env_error: its env raised")
            return
        session.seq += 1
        session.last = applied
        if kind == "reset":
            session.state = "running"
        elif answer["terminated"] or answer["truncated"]:
            session.state = "over"

    async def _apply(self, kind: str, sessions: list[Session], items: list[Any],
                     call: Callable[[int], dict[str, Any]]) -> list[dict[str, Any]]:
        """Apply a batch of resets or steps under the sessions' locks: each item's recorded answer where its
        ``seq`` repeats the last call, else ``call(k)`` on a worker thread; then record what was applied.

        Shielded from cancellation by the caller: a client that hangs up mid-request must not leave an env
        stepped without the record of it (its retry would step it again)."""
        async with self._holding(sessions, closed_ok=True):
            replays = [self._replay_or_check(s, kind, item) for s, item in zip(sessions, items)]
            if kind == "step":
                for session, replay in zip(sessions, replays):
                    if replay is None and session.state != "running":
                        why = "was never reset" if session.state == "new" else "ended (terminated or truncated)"
                        raise APIError(409, "no_episode", f"session {session.id}: its episode {why}; reset it first")
            todo = [k for k, replay in enumerate(replays) if replay is None]
            done = dict(zip(todo, await self._run_calls(kind, [sessions[k] for k in todo],
                                                        lambda j: call(todo[j]))))
            answers = []
            for k, session in enumerate(sessions):
                replay = replays[k]
                answer = replay if replay is not None else done[k]
                self._settle(session, kind, items[k], answer, replay is not None)
                answers.append(answer)
        if kind == "step":
            self.metrics.count_steps(len(todo))
        else:
            self.metrics.resets += len(todo)
        return answers


def with_answered(answers: list[dict[str, Any]], answered: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
    """A request's items in order: those ``answered`` (by index) from a record, the others from ``answers``."""
    rest = iter(answers)
    return [answered[k] if k in answered else next(rest) for k in range(len(answers) + len(answered))]


# --------------------------------------------------------------------------- the router
class AnswerResponse(JSONResponse):
    """A JSON answer written as ASCII (other characters as ``\\uXXXX`` escapes, which JSON readers turn back
    into the same text). An env's text may hold lone surrogates (a program's output read with
    ``errors="surrogateescape"``, an action it echoes), which UTF-8 cannot encode: written as UTF-8, the answer
    of a reset or step already applied would fail as a 500, and so would every retry of it."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


def error_response(error: APIError) -> JSONResponse:
    """An :class:`APIError` as its HTTP answer."""
    headers = {"www-authenticate": "Bearer"} if error.status == 401 else None
    body = error.body()
    # A message may quote the client's text, lone surrogates included (JSON's "\\udfff"), which UTF-8 cannot
    # encode: escaped, so that the answer is the 4xx and not a failure to write it.
    body["error"]["message"] = body["error"]["message"].encode("utf-8", "backslashreplace").decode("utf-8")
    return JSONResponse(body, status_code=error.status, headers=headers)


def build_app(envs: list[str] | None = None, *, token: str | None = None,
              limits: ServerLimits | None = None) -> FastAPI:
    """The env server's app: an :class:`EnvServer` (built with these arguments) behind HTTP routes; the server
    is ``app.state.server``."""
    server = EnvServer(envs, token=token, limits=limits)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        server.start()
        yield
        server.shutdown()

    app = FastAPI(title="turnrl env server", lifespan=lifespan)
    app.state.server = server
    limit = server.limits.max_body_bytes
    app.add_middleware(BodyLimit, limit=limit, on_reject=lambda: server.count_error("body_too_large"),
                       too_large=lambda: error_response(APIError(
                           413, "body_too_large", f"the request body is over {limit} bytes (--max-body-bytes)")))

    @app.exception_handler(APIError)
    async def _api_error(request: Request, error: APIError) -> JSONResponse:
        server.count_error(error.code)
        return error_response(error)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        return await _api_error(request, APIError(400, "invalid_request", validation_message(error)))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, error: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(error.status_code, "http_error")
        message = f"{request.method} {request.url.path}: {error.detail}; see GET /v1/envs and the endpoints in the docs"
        return await _api_error(request, APIError(error.status_code, code, message))

    @app.exception_handler(Exception)
    async def _crash(request: Request, error: Exception) -> JSONResponse:
        logger.exception("request failed")
        return await _api_error(request, APIError(500, "server_error", f"{type(error).__name__}: {error}"))

    async def authorize(request: Request) -> str:
        return server.authorize(request.headers.get("authorization", ""), request.headers.get(CLIENT_HEADER),
                                request.client.host if request.client else None)

    @app.api_route("/health", methods=["GET", "HEAD"])  # health checkers ask with HEAD too
    async def health() -> AnswerResponse:
        return AnswerResponse(server.health())

    @app.get("/metrics")
    async def prometheus(client: str = Depends(authorize)) -> PlainTextResponse:
        return PlainTextResponse(server.prometheus(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/envs")
    async def list_envs(client: str = Depends(authorize)) -> AnswerResponse:
        return AnswerResponse(server.envs())

    @app.post("/v1/validate")
    async def validate(body: EnvSpec, client: str = Depends(authorize)) -> AnswerResponse:
        return AnswerResponse(await server.validate(body))

    @app.post("/v1/sessions")
    async def open_sessions(body: OpenBody, client: str = Depends(authorize)) -> AnswerResponse:
        return AnswerResponse(await server.open_sessions(body, client))

    @app.post("/v1/reset")
    async def reset(body: ResetBody, client: str = Depends(authorize)) -> AnswerResponse:
        return AnswerResponse(await server.reset(body))

    @app.post("/v1/step")
    async def step(body: StepBody, client: str = Depends(authorize)) -> AnswerResponse:
        return AnswerResponse(await server.step(body))

    @app.post("/v1/query")
    async def query(body: QueryBody, client: str = Depends(authorize)) -> AnswerResponse:
        return AnswerResponse(await server.query(body))

    @app.post("/v1/sessions/fork")
    async def fork(body: ForkBody, client: str = Depends(authorize)) -> AnswerResponse:
        return AnswerResponse(await server.fork(body, client))

    @app.post("/v1/sessions/close")
    async def close(body: SessionsBody, client: str = Depends(authorize)) -> AnswerResponse:
        return AnswerResponse(await server.close(body))

    return app


# --------------------------------------------------------------------------- command line
def exposure_warning(host: str, token: str | None) -> str | None:
    """The warning for a server that anyone on the network can use (bound beyond loopback, no token)."""
    if token or is_loopback(host):
        return None
    return (f"serving on {host} without a token: anyone who can reach this port can open envs and use this "
            f"machine's CPU; pass --token or set {TOKEN_ENV_VAR}")


def main(args: argparse.Namespace) -> int:
    """Serve until interrupted; 0 on a clean stop, 2 for bad options."""
    import uvicorn

    token = args.token if args.token is not None else os.environ.get(TOKEN_ENV_VAR) or None
    try:
        limits = ServerLimits(max_body_bytes=args.max_body_bytes, max_batch=args.max_batch,
                              max_sessions=args.max_sessions, max_sessions_per_client=args.max_sessions_per_client,
                              idle_timeout_s=args.idle_timeout, workers=args.workers,
                              step_timeout_s=args.step_timeout)
        app = build_app(args.envs, token=token, limits=limits)
        sock = bind_port(args.host, args.port, "serve-env")
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    warning = exposure_warning(args.host, token)
    if warning is not None:
        logger.warning(warning)
        print(f"warning: {warning}", file=sys.stderr)
    print(f"serving envs {', '.join(app.state.server.allowed)} at http://{args.host}:{sock.getsockname()[1]} "
          f"(token {'required' if token else 'off'}, {limits.workers} env threads, "
          f"{limits.step_timeout_s:g} s per env call)", flush=True)
    try:
        uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                      access_log=args.access_log, timeout_graceful_shutdown=5)).run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn raises Ctrl-C again once it has shut down: a clean stop (as uvicorn.run)
        pass
    finally:
        sock.close()
    return 0


if __name__ == "__main__":  # python -m turnrl.envservice.server: the server without the rest of the command line
    _parser = argparse.ArgumentParser(prog="turnrl serve-env", description=__doc__.split("\n\n")[0])
    add_arguments(_parser)
    sys.exit(main(_parser.parse_args()))

"""The env server's shutdown while requests wait on env calls: every request ends, none waits for good."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, cast

import pytest

from tests.envservice.env_helpers import GATE, GATED, IN_GATE, GatedEnv, close_gate, opened, step_items
from turnrl.envservice.options import ServerLimits
from turnrl.envservice.protocol import APIError, SessionLostError, decode_item
from turnrl.envservice.request_bodies import OpenBody
from turnrl.envservice.server import EnvServer


@contextlib.asynccontextmanager
async def serving(env_id: str, workers: int, ids: list[str]) -> AsyncIterator[EnvServer]:
    """A started server of ``workers`` threads and no step deadline, with sessions ``ids`` of ``env_id`` open, its
    gate closed; on leaving, the gate opens and the server shuts down (again, where the test shut it down)."""
    close_gate()
    server = EnvServer([env_id], limits=ServerLimits(workers=workers, step_timeout_s=float("inf")))
    server.start()
    try:
        if ids:
            await opened(server, env_id, ids)
        yield server
    finally:
        GATE.set()
        server.shutdown()


def test_requests_waiting_on_env_calls_end_with_a_503_when_the_server_shuts_down():
    """One thread, stuck in a's step; b's step waits for it, its call taken by no thread. The shutdown cancels the
    calls not taken, and the request waited for them for good (it looked again every second); the step under way
    had no deadline, and its request waited as long as the env. Both now end with a 503 within a second, and a
    request after the shutdown is a 503 too (it was a 500 of the thread pool's own error)."""

    async def scenario() -> None:
        async with serving(GATED, 1, ["a", "b"]) as server:
            hung = asyncio.ensure_future(server.step(step_items(["a"], ["wait-inc"])))
            assert await asyncio.to_thread(IN_GATE.acquire, timeout=10)  # a's step holds the one thread
            queued = asyncio.ensure_future(server.step(step_items(["b"], ["inc"])))
            await asyncio.sleep(0.1)
            assert not queued.done()
            server.shutdown(grace_s=0.1)  # a's step hangs past it
            for request in (queued, hung):
                with pytest.raises(APIError, match="shutting down") as raised:
                    await asyncio.wait_for(request, 5)
                assert raised.value.status == 503 and raised.value.code == "shutting_down"
            with pytest.raises(APIError, match="shutting down"):
                await server.open_sessions(OpenBody(env_id=GATED, settings={}, ids=["c"]), "me")

    asyncio.run(scenario())


LOGGED = "tests.envservice.test_server_shutdown:LoggedEnv"


class LoggedEnv(GatedEnv):
    """A :class:`GatedEnv` that logs its steps' starts and ends and its closes, in order: a close between a
    step's start and its end was made under the step, two closes are one too many, a step after a close ran on a
    closed env."""

    def __init__(self, **settings: Any) -> None:
        super().__init__(**settings)
        self.log: list[str] = []

    def step(self, action: str):
        self.log.append("step")
        try:
            return super().step(action)
        finally:
            self.log.append("stepped")

    def close(self) -> None:
        super().close()
        self.log.append("close")


def envs_of(server: EnvServer) -> dict[str, LoggedEnv]:
    return {session.id: cast(LoggedEnv, session.env) for session in server.table.sessions.values()}


def wait_until(done: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not done() and time.monotonic() < deadline:
        time.sleep(0.01)
    return done()


def test_a_shutdown_waits_for_a_running_step_and_then_its_env_is_closed_once_after_it():
    """a's step hangs when the server shuts down; the gate opens 0.3 s later, within the grace. The shutdown closed
    a's env under its step (a native simulator crashes there), then the abandoned step closed it again as it
    returned; now the shutdown returns once the step has returned and closed its env, once, and b's idle env is
    closed once as well."""

    async def scenario() -> None:
        async with serving(LOGGED, 2, ["a", "b"]) as server:
            envs = envs_of(server)
            hung = asyncio.ensure_future(server.step(step_items(["a"], ["wait-inc"])))
            assert await asyncio.to_thread(IN_GATE.acquire, timeout=10)
            opener = threading.Timer(0.3, GATE.set)
            opener.start()
            server.shutdown(grace_s=30)
            assert envs["a"].log[-3:] == ["step", "stepped", "close"]  # waited for the step, then closed
            await asyncio.wait_for(hung, 10)  # answered: the step ended before the request saw the shutdown
            assert wait_until(lambda: server.executor.stuck == 0)
            assert envs["a"].log.count("close") == 1 and envs["b"].log[-1:] == ["close"]
            assert envs["b"].log.count("close") == 1

    asyncio.run(scenario())


def test_a_step_still_running_past_the_grace_closes_its_env_once_when_it_returns():
    """a's step still hangs when the shutdown's grace ends: the shutdown returns without closing a's env (b's, idle,
    is closed), the request ends with a 503, and when the step finally returns its env is closed, once."""

    async def scenario() -> None:
        async with serving(LOGGED, 2, ["a", "b"]) as server:
            envs = envs_of(server)
            hung = asyncio.ensure_future(server.step(step_items(["a"], ["wait-inc"])))
            assert await asyncio.to_thread(IN_GATE.acquire, timeout=10)
            server.shutdown(grace_s=0.1)
            assert envs["a"].log[-1] == "step" and envs["b"].log[-1:] == ["close"]
            with pytest.raises(APIError, match="shutting down"):
                await asyncio.wait_for(hung, 10)
            GATE.set()
            assert await asyncio.to_thread(wait_until, lambda: server.executor.stuck == 0)
            await asyncio.sleep(0.1)  # a second close, if one came, after the call's thread was counted out
            assert envs["a"].log[-3:] == ["step", "stepped", "close"] and envs["a"].log.count("close") == 1
            assert envs["b"].log.count("close") == 1

    asyncio.run(scenario())


def test_a_batch_call_not_started_at_the_shutdown_never_touches_its_closed_env():
    """One thread steps a then b in one request; a's step hangs as the server shuts down. b's env is closed at once
    (idle), and when a's step returns the thread went on to step b's closed env; now b's item says its session is
    closed, and b's env saw no step after its close."""

    async def scenario() -> None:
        async with serving(LOGGED, 1, ["a", "b"]) as server:
            envs = envs_of(server)
            batch = asyncio.ensure_future(server.step(step_items(["a", "b"], ["wait-inc", "inc"])))
            assert await asyncio.to_thread(IN_GATE.acquire, timeout=10)
            opener = threading.Timer(0.3, GATE.set)
            opener.start()
            server.shutdown(grace_s=30)
            a, b = (await asyncio.wait_for(batch, 10))["items"]
            assert a["ok"] and not b["ok"] and b["error"]["code"] == "unknown_session"
            assert "closed (the server shut down) before its step ran" in b["error"]["message"]
            with pytest.raises(SessionLostError, match="the server shut down"):
                decode_item("here", b, step=True)
            assert envs["b"].log[-1] == "close" and envs["b"].log.count("close") == 1
            assert "env_error" not in server.metrics.errors  # the env raised nothing

    asyncio.run(scenario())


def test_an_env_built_as_the_server_shuts_down_opens_no_session_and_is_closed():
    """An open's build ends after the shutdown but before its request saw it: the session was added to the
    server that had closed its sessions, and its env never closed. Now the open is a 503 and the env is closed."""
    GatedEnv.made.clear()

    async def scenario() -> None:
        async with serving(LOGGED, 1, []) as server:
            body = OpenBody(env_id=LOGGED, settings={"gate_build": True}, ids=["late"], count=None)
            opening = asyncio.ensure_future(server.open_sessions(body, "me"))
            assert await asyncio.to_thread(IN_GATE.acquire, timeout=10)
            server.shutdown(grace_s=0)
            GATE.set()
            assert wait_until(lambda: len(GatedEnv.made) == 1)  # built, with the event loop still held here
            with pytest.raises(APIError, match="shutting down"):
                await asyncio.wait_for(opening, 10)
            assert len(server.table) == 0 and GatedEnv.made[0].closes
            assert len(GatedEnv.made[0].closes) == 1

    asyncio.run(scenario())

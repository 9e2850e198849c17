"""Deadlines of the env server's builds: an env whose constructor, copy (a fork) or reset hangs fails its session
after ``--step-timeout`` with an error naming the session and the option, and the server stays healthy."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.envservice.env_helpers import GATE, GATED, GatedEnv, ServerProcess, close_gate
from turnrl.envservice.client import ClientOptions, EnvServerPool, RemoteEnv
from turnrl.envservice.options import ServerLimits
from turnrl.envservice.protocol import APIError, NoServerError
from turnrl.envservice.request_bodies import ForkBody, OpenBody, ResetBody, ResetItem
from turnrl.envservice.server import EnvServer

TIMEOUT = 10.0
"""Seconds a test waits for an answer: the old server never answered an open whose env hung."""


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=TIMEOUT)


def error_of(response: httpx.Response) -> tuple[int, str, str]:
    error = response.json()["error"]
    return response.status_code, error["code"], error["message"]


def test_an_env_whose_constructor_or_reset_hangs_fails_its_session_and_the_server_serves_on():
    """A real server in a subprocess, where the gated envs hang for good: the open, the validate and the client's
    open fail with a 500 ``env_timeout`` naming the sessions and ``--step-timeout`` (a hung constructor held the
    request forever), a hung reset fails its item, and with more stuck threads than workers the server still
    opens, resets and steps other envs."""
    with ServerProcess(extra=["--step-timeout", "0.5", "--workers", "2"]) as served:
        url = served.url
        hung = post(url, "/v1/sessions", {"env_id": GATED, "settings": {"gate_build": True}, "ids": ["a", "b", "c"]})
        status, code, message = error_of(hung)
        assert (status, code) == (500, "env_timeout")  # the build hangs for good: only the deadline answers
        assert message.startswith(f"sessions a, b, c: building {GATED} still ran after 0.5 s, the server's deadline "
                                  "(--step-timeout); the build was abandoned and no session opened"), message
        checked = post(url, "/v1/validate", {"env_id": GATED, "settings": {"gate_build": True}})
        assert error_of(checked)[:2] == (500, "env_timeout") and f"building {GATED} still ran" in checked.text
        pool = EnvServerPool([url], ClientOptions(retries=1, backoff_s=0.01, timeout_s=TIMEOUT))
        with pytest.raises(NoServerError, match=r"session \w+: building .* still ran after 0.5 s.*--step-timeout"):
            RemoteEnv(pool, GATED, {"gate_build": True}).reset(seed=0)
        pool.close()

        checked = post(url, "/v1/validate", {"env_id": GATED, "settings": {"gate_reset": True}})  # its reset hangs
        assert error_of(checked)[:2] == (500, "env_timeout"), checked.text
        opened = post(url, "/v1/sessions", {"env_id": GATED, "settings": {"gate_reset": True}, "ids": ["r"]})
        assert opened.status_code == 200, opened.text
        (reset,) = post(url, "/v1/reset", {"items": [{"session": "r", "seed": 0}]}).json()["items"]
        assert reset["error"]["code"] == "env_timeout" and "session r: " in reset["error"]["message"]
        assert "--step-timeout" in reset["error"]["message"]

        health = httpx.get(url + "/health", timeout=TIMEOUT).json()
        assert (health["status"], health["sessions"], health["stuck_calls"]) == ("ok", 0, 7)
        post(url, "/v1/sessions", {"env_id": "Sokoban", "ids": ["s"]}).raise_for_status()
        assert post(url, "/v1/reset", {"items": [{"session": "s", "seed": 0}]}).json()["items"][0]["ok"]
        assert post(url, "/v1/step", {"items": [{"session": "s", "action": "Up"}]}).json()["items"][0]["ok"]
        metrics = httpx.get(url + "/metrics", timeout=TIMEOUT).text
        assert 'turnrl_env_errors_total{code="env_timeout"} 5' in metrics  # four requests and one reset item


def test_hung_builds_and_copies_are_closed_when_they_return_and_a_hung_fork_closes_its_source():
    """In process, where the test lets the gated envs go: no session opens for a hung build, a fork whose copy
    hangs fails and closes its source (the copy still reads its env) while the other sessions go on, and every env
    built or copied meanwhile is closed once, when its call returns."""
    close_gate()
    GatedEnv.made.clear()

    async def scenario() -> None:
        server = EnvServer([GATED], limits=ServerLimits(workers=2, step_timeout_s=0.3))
        server.start()
        try:
            with pytest.raises(APIError, match=r"^session a: building .* still ran after 0.3 s") as caught:
                await asyncio.wait_for(server.open_sessions(
                    OpenBody(env_id=GATED, settings={"gate_build": True}, ids=["a"], count=None), "me"), TIMEOUT)
            assert (caught.value.status, caught.value.code, len(server.table)) == (500, "env_timeout", 0)
            source = OpenBody(env_id=GATED, settings={"gate_copy": True}, ids=["src"], count=None)
            await server.open_sessions(source, "me")
            # "a" is free again: no session was opened for it.
            await server.open_sessions(OpenBody(env_id=GATED, ids=["other", "a"], count=None), "me")
            with pytest.raises(APIError, match=r"^session src: copying the env \(fork\) still ran after 0.3 s.*"
                                               r"the copy was abandoned and the session closed"):
                await asyncio.wait_for(server.fork(ForkBody(sessions=["src", "other"], ids=["t1", "t2"]), "me"),
                                       TIMEOUT)
            assert sorted(server.table.sessions) == ["a", "other"] and server.health()["stuck_calls"] == 2
            assert server.table.closed["src"].startswith("env_timeout: copying its env (fork)")
            other = await server.reset(ResetBody(items=[ResetItem(session="other", seq=1, seed=0)]))
            assert other["items"][0]["ok"]
            GATE.set()
            deadline = time.monotonic() + TIMEOUT
            while server.health()["stuck_calls"] and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.1)  # the closes queued on the worker threads
            open_envs = {id(session.env) for session in server.table.sessions.values()}
            # a's late build, src, and the copies of src and other: each closed once; the open sessions' envs never.
            assert len(GatedEnv.made) == 6
            assert all(len(env.closes) == (id(env) not in open_envs) for env in GatedEnv.made)
        finally:
            GATE.set()
            server.shutdown()

    asyncio.run(scenario())

"""The env server's shutdown while requests wait on env calls: every request ends, none waits for good."""

from __future__ import annotations

import asyncio

import pytest

from tests.envservice.env_helpers import GATE, GATED, IN_GATE, close_gate
from tests.envservice.test_server import opened, step_items
from turnrl.envservice.options import ServerLimits
from turnrl.envservice.protocol import APIError
from turnrl.envservice.request_bodies import OpenBody
from turnrl.envservice.server import EnvServer


def test_requests_waiting_on_env_calls_end_with_a_503_when_the_server_shuts_down():
    """One thread, stuck in a's step; b's step waits for it, its call taken by no thread. The shutdown cancels the
    calls not taken, and the request waited for them for good (it looked again every second); the step under way
    had no deadline, and its request waited as long as the env. Both now end with a 503 within a second, and a
    request after the shutdown is a 503 too (it was a 500 of the thread pool's own error)."""
    close_gate()

    async def scenario() -> None:
        server = EnvServer([GATED], limits=ServerLimits(workers=1, step_timeout_s=float("inf")))
        server.start()
        try:
            await opened(server, GATED, ["a", "b"])
            hung = asyncio.ensure_future(server.step(step_items(["a"], ["wait-inc"])))
            assert await asyncio.to_thread(IN_GATE.acquire, timeout=10)  # a's step holds the one thread
            queued = asyncio.ensure_future(server.step(step_items(["b"], ["inc"])))
            await asyncio.sleep(0.1)
            assert not queued.done()
            server.shutdown()
            for request in (queued, hung):
                with pytest.raises(APIError, match="shutting down") as raised:
                    await asyncio.wait_for(request, 5)
                assert raised.value.status == 503 and raised.value.code == "shutting_down"
            with pytest.raises(APIError, match="shutting down"):
                await server.open_sessions(OpenBody(env_id=GATED, settings={}, ids=["c"]), "me")
        finally:
            GATE.set()
            server.shutdown()

    asyncio.run(scenario())

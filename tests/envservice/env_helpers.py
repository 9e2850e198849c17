"""Helpers of the env-service tests: a probe env, servers in a thread and in a subprocess, a lossy transport.

``ProbeEnv`` is served by name (``tests.envservice.env_helpers:ProbeEnv``), so a server in a subprocess must run
from the repository root with it on ``PYTHONPATH`` (:class:`ServerProcess` does that).
"""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar

import httpx
import numpy as np

from tests.serve.running import free_port, running
from turnrl.envs.contract import StateFacts, StepOutcome, TurnEnv
from turnrl.envservice.options import ServerLimits
from turnrl.envservice.request_bodies import OpenBody, ResetBody, ResetItem, StepBody, StepItem
from turnrl.envservice.server import EnvServer, build_app

ROOT = Path(__file__).resolve().parents[2]
PROBE = "tests.envservice.env_helpers:ProbeEnv"
GATED = "tests.envservice.env_helpers:GatedEnv"
SERVED = ["Sokoban", "FrozenLake", "Countdown", "Bandit", "Maze2D", PROBE, GATED]


class ProbeEnv(TurnEnv):
    """A counter for the service tests. ``inc`` adds one (reward 1); ``win`` ends the episode; ``slow``
    sleeps ``delay_s`` then adds one; ``explode`` raises; building it takes ``build_s``. The text shows the
    count, so a lost or doubled step shows; ``info`` carries values JSON cannot hold as they are (a tuple,
    numpy numbers, an array)."""

    modes = ("text", "image")
    description = "a counter for the env-service tests"
    slow_threads: ClassVar[set[str]] = set()
    """The threads that ran a ``slow`` step (a test of an in-process server clears it first)."""

    def __init__(self, mode: str = "text", max_steps: int = 10_000, delay_s: float = 0.5, build_s: float = 0.0) -> None:
        super().__init__(mode=mode, max_steps=max_steps, image_shape=(5, 7) if mode == "image" else None)
        time.sleep(build_s)  # an env slow to build (a simulator starting): requests for its ids meet meanwhile
        self.delay_s = delay_s
        self.count = 0

    def _reset(self, rng: np.random.Generator, options: dict[str, Any]) -> None:
        self.count = int(options.get("start", rng.integers(0, 100)))

    def _step(self, action: str) -> StepOutcome:
        if action == "explode":
            raise RuntimeError("the probe exploded")
        if action == "slow":
            ProbeEnv.slow_threads.add(threading.current_thread().name)
            time.sleep(self.delay_s)
        if action == "win":
            return StepOutcome(10.0, terminated=True, success=True)
        self.count += 1
        info = {"pair": (self.count, "x"), "half": np.float32(0.5), "row": np.arange(3, dtype=np.int64)}
        return StepOutcome(1.0, info=info)

    def text(self) -> str:
        return f"count={self.count}"

    def image(self) -> np.ndarray:
        return np.full((5, 7, 3), self.count % 256, dtype=np.uint8)

    def instructions(self) -> str:
        return "Count with inc; win ends it."

    def action_names(self) -> list[str]:
        return ["inc", "win", "slow", "explode"]

    def state_facts(self) -> StateFacts:
        return StateFacts(player=(0, self.count % 7), extra={"count": self.count, "pair": (1, 2)})

    def solve(self) -> list[str]:
        return ["win"]


ECHO = "tests.envservice.env_helpers:EchoEnv"


class EchoEnv(ProbeEnv):
    """A :class:`ProbeEnv` whose every action counts one and whose text ends with the last action as it came:
    text a client sent that UTF-8 cannot encode (a lone surrogate) comes back in the env's answer."""

    said = ""

    def step(self, action: str):
        self.said = action
        return super().step("inc")

    def text(self) -> str:
        return f"count={self.count} said={self.said}"


GATE = threading.Event()
"""What a :class:`GatedEnv`'s ``wait-`` actions wait for (a test clears it, and sets it when done)."""
IN_GATE = threading.Semaphore(0)
"""Released once by each ``wait-`` action as it starts waiting."""


def close_gate() -> None:
    """Make :class:`GatedEnv`'s ``wait-`` actions wait again, and forget the waits counted so far."""
    GATE.clear()
    while IN_GATE.acquire(blocking=False):
        pass


class GatedEnv(ProbeEnv):
    """A :class:`ProbeEnv` whose ``wait-<action>`` waits for :data:`GATE`, then does ``<action>`` (a step that hangs
    until the test lets it go, then counts or explodes), and whose ``solve()``, ``reset()``, constructor or deep
    copy wait too with ``gate_solve``, ``gate_reset``, ``gate_build`` or ``gate_copy`` (in a server in a subprocess,
    where no test sets the gate, they hang for good); ``closes`` holds the thread of each ``close()`` call, and
    :attr:`made` every instance built or copied in this process."""

    made: ClassVar[list[GatedEnv]] = []

    def __init__(self, gate_solve: bool = False, gate_reset: bool = False, gate_build: bool = False,
                 gate_copy: bool = False, **settings: Any) -> None:
        super().__init__(**settings)
        self.gate_solve, self.gate_reset, self.gate_copy = gate_solve, gate_reset, gate_copy
        self.gate_build = gate_build
        self.closes: list[str] = []
        if gate_build:  # a simulator that never finishes starting
            IN_GATE.release()
            GATE.wait()
        GatedEnv.made.append(self)

    def __deepcopy__(self, memo: dict[int, Any]) -> GatedEnv:
        if self.gate_copy:
            IN_GATE.release()
            GATE.wait()
        twin = object.__new__(type(self))
        memo[id(self)] = twin
        twin.__dict__.update({key: copy.deepcopy(value, memo) for key, value in self.__dict__.items()})
        GatedEnv.made.append(twin)
        return twin

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        if self.gate_reset:
            IN_GATE.release()
            GATE.wait()
        return super().reset(seed=seed, options=options)

    def solve(self) -> list[str]:
        if self.gate_solve:  # a solver that never finishes
            IN_GATE.release()
            GATE.wait()
        return super().solve()

    def step(self, action: str):
        if action.startswith("wait-"):
            IN_GATE.release()
            GATE.wait()
            action = action.removeprefix("wait-")
        return super().step(action)

    def close(self) -> None:
        self.closes.append(threading.current_thread().name)


EXITING = "tests.envservice.env_helpers:ExitingEnv"


class ExitingEnv(ProbeEnv):
    """A :class:`ProbeEnv` that calls ``sys.exit()``: in ``step("exit")``, or when built with ``exit_on_build``
    (a simulator's error path that ends "its" process)."""

    def __init__(self, exit_on_build: bool = False, **settings: Any) -> None:
        if exit_on_build:
            sys.exit("the simulator failed to start")
        super().__init__(**settings)

    def step(self, action: str):
        if action == "exit":
            sys.exit(3)
        return super().step(action)


@contextmanager
def env_server(token: str | None = None, limits: ServerLimits | None = None,
               envs: list[str] | None = None) -> Iterator[str]:
    """An env server on a free loopback port in this process; yields its base URL."""
    app = build_app(envs if envs is not None else SERVED, token=token, limits=limits)
    with running(app) as url:
        yield url.removesuffix("/v1")


class ServerProcess:
    """``python -m turnrl.envservice.server`` in a subprocess on a fixed port, to be killed and started again."""

    def __init__(self, port: int | None = None, extra: list[str] | None = None, log: Path | None = None) -> None:
        """``extra``: more options of the server; ``log``: a file for its output (else the options hold
        ``--log-level warning`` and stderr is kept only to quote a failed start)."""
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.extra = list(extra or []) if log is not None else ["--log-level", "warning", *(extra or [])]
        self.log = log
        self.process: subprocess.Popen | None = None

    def start(self, timeout_s: float = 60.0) -> ServerProcess:
        command = [sys.executable, "-m", "turnrl.envservice.server", "--port", str(self.port), "--envs", *SERVED,
                   *self.extra]
        environment = {**os.environ, "PYTHONPATH": str(ROOT)}
        if self.log is None:
            self.process = subprocess.Popen(command, cwd=ROOT, env=environment, stdout=subprocess.DEVNULL,
                                            stderr=subprocess.PIPE)
        else:
            with self.log.open("wb") as log:  # the server writes to its own copy of the file
                self.process = subprocess.Popen(command, cwd=ROOT, env=environment, stdout=log, stderr=log)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                error = self.process.stderr.read().decode() if self.process.stderr else self.log_text()
                raise RuntimeError(f"the env server exited with {self.process.returncode}: {error[-2000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"the env server did not start on port {self.port} in {timeout_s} s")

    def log_text(self) -> str:
        """What the server wrote to ``log`` so far."""
        return self.log.read_text() if self.log is not None else ""

    def kill(self) -> None:
        """SIGKILL: no shutdown, no goodbye to the clients."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=10)
        self.process = None

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.kill()


class LoseAnswers(httpx.BaseTransport):
    """Sends every request to the real server, then loses the answer of the ones ``lose(request)`` picks
    (raises ``ReadError`` as a dropped connection would): the server did the work, the client never heard."""

    def __init__(self, lose: Any) -> None:
        self.inner = httpx.HTTPTransport()
        self.lose = lose
        self.lost = 0
        self._lock = threading.Lock()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = self.inner.handle_request(request)
        response.read()
        if self.lose(request):
            with self._lock:
                self.lost += 1
            raise httpx.ReadError("the connection dropped before the answer arrived", request=request)
        return response

    def close(self) -> None:
        self.inner.close()


class SpoilAnswers(LoseAnswers):
    """Sends every request to the real server, then answers the ones ``spoil(request)`` picks with a bare 500 (a
    proxy's error page, a server bug): the server did the work, the client heard only that it failed."""

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = self.inner.handle_request(request)
        response.read()
        if not self.lose(request):
            return response
        with self._lock:
            self.lost += 1
        return httpx.Response(500, text="<html>500 Internal Server Error</html>", request=request)


# --------------------------------------------------------------------------- requests the tests send
FAST = {"retries": 1, "backoff_s": 0.01, "cooldown_s": 0.5, "timeout_s": 20.0}
"""Client options for tests: a dead server is given up on within milliseconds."""


def post(url: str, path: str, body, headers: dict | None = None) -> httpx.Response:
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(url + path, content=content, headers={"content-type": "application/json", **(headers or {})})


def open_one(url: str, env_id: str = PROBE, settings: dict | None = None, headers: dict | None = None) -> str:
    answer = post(url, "/v1/sessions", {"env_id": env_id, "settings": settings or {}}, headers)
    assert answer.status_code == 200, answer.text
    return answer.json()["sessions"][0]


def step_items(ids: list[str], actions: list[str], seq: int | None = 2) -> StepBody:
    return StepBody(items=[StepItem(session=i, seq=seq, action=a, queries=["text", "state_facts"])
                           for i, a in zip(ids, actions)])


async def opened(server: EnvServer, env_id: str, ids: list[str], settings: dict | None = None) -> None:
    """Open sessions ``ids`` of ``env_id`` and reset each (seed = its index)."""
    await server.open_sessions(OpenBody(env_id=env_id, settings=settings or {}, ids=ids), "me")
    answer = await server.reset(ResetBody(items=[ResetItem(session=i, seq=1, seed=k) for k, i in enumerate(ids)]))
    assert all(item["ok"] for item in answer["items"])

"""The time of one batched step request to the env server with one env thread (``--workers 1``) and with the
default pool: a batch's sessions start on one thread and spread to up to ``--workers`` threads at once when a call
runs longer than ``turnrl.envservice.sessions.SPREAD_AFTER_S``.

Rows (each a batch of ``--sessions`` sessions, one :class:`turnrl.envservice.client.RemoteEnvBatch` request
stepping all of them; the median request time over ``--requests`` requests after a warm-up):

- sleep 20 ms: :class:`SleepingEnv`, whose step sleeps 20 ms (a simulator that waits on a renderer or a
  subprocess and releases the interpreter lock meanwhile): what the pool is for;
- Sokoban text and image: pure Python steps that hold the interpreter lock, so extra threads cannot step them
  faster; the row shows what the pool costs or saves on a CPU-bound env.

Both servers run in subprocesses on this machine (``python -m turnrl.envservice.server``), started once and
measured in alternating passes, so that a busy minute falls on both columns. An episode that ends is reset and the
reset is not timed.

    python benchmarks/env_service_batch.py            # about a minute
    python benchmarks/env_service_batch.py --quick    # a few seconds, 16 sessions
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from turnrl.envs import make  # noqa: E402
from turnrl.envs.contract import StepOutcome, TurnEnv  # noqa: E402
from turnrl.envservice.client import ClientOptions, EnvServerPool, RemoteEnvBatch  # noqa: E402
from turnrl.envservice.options import ServerLimits  # noqa: E402

SLEEPING = "benchmarks.env_service_batch:SleepingEnv"


class SleepingEnv(TurnEnv):
    """An env whose step sleeps ``sleep_s`` seconds (the interpreter lock released, as a simulator waiting on a
    renderer does) and never ends the episode."""

    description = "sleeps on every step (the env-server batch benchmark)"

    def __init__(self, mode: str = "text", max_steps: int = 1_000_000, sleep_s: float = 0.02) -> None:
        super().__init__(mode=mode, max_steps=max_steps)
        self.sleep_s = sleep_s
        self.count = 0

    def _reset(self, rng: np.random.Generator, options: dict[str, Any]) -> None:
        self.count = 0

    def _step(self, action: str) -> StepOutcome:
        time.sleep(self.sleep_s)
        self.count += 1
        return StepOutcome(0.0)

    def text(self) -> str:
        return f"step {self.count}"

    def instructions(self) -> str:
        return "Wait."

    def action_names(self) -> list[str]:
        return ["wait"]


@dataclass(frozen=True)
class Workload:
    """One row: an env id, its settings, and its actions (drawn at random each step)."""

    name: str
    env_id: str
    settings: dict[str, Any]


WORKLOADS = (
    Workload("sleep 20 ms a step", SLEEPING, {"sleep_s": 0.02}),
    Workload("Sokoban 6x6 text", "Sokoban", {"size": 6, "num_boxes": 1, "max_steps": 10_000}),
    Workload("Sokoban 6x6 image", "Sokoban", {"size": 6, "num_boxes": 1, "max_steps": 10_000, "mode": "image"}),
)


@dataclass(frozen=True)
class Row:
    """Median milliseconds of one step request of ``sessions`` sessions, per ``--workers`` setting."""

    name: str
    sessions: int
    ms: dict[int, float]


def request_times(pool: EnvServerPool, workload: Workload, sessions: int, requests: int) -> list[float]:
    """Seconds of each of ``requests`` step requests of a batch of ``sessions`` (after two untimed ones)."""
    batch = RemoteEnvBatch(pool, workload.env_id, workload.settings, sessions)
    names = make(workload.env_id, **workload.settings).action_names() or []
    rnd = random.Random(0)
    seeds = list(range(sessions))
    batch.reset(seeds)
    times: list[float] = []
    try:
        while len(times) < requests + 2:
            start = time.perf_counter()
            batch.step([rnd.choice(names) for _ in range(sessions)])
            times.append(time.perf_counter() - start)
            if not all(batch.running):  # a solved level: new episodes for all, untimed
                seeds = [seed + sessions for seed in seeds]
                batch.reset(seeds)
    finally:
        batch.close()
    return times[2:]


def start_server(workers: int) -> tuple[subprocess.Popen, str]:
    """A server with ``workers`` env threads in a subprocess; its process and URL."""
    from benchmarks.env_service import free_port

    port = free_port()
    command = [sys.executable, "-m", "turnrl.envservice.server", "--port", str(port), "--workers", str(workers),
               "--envs", SLEEPING, "Sokoban", "--log-level", "warning"]
    process = subprocess.Popen(command, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                               stdout=subprocess.DEVNULL)
    return process, f"http://127.0.0.1:{port}"


def wait_until_up(process: subprocess.Popen, url: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.05)
    process.kill()
    raise SystemExit(f"the env server at {url} did not start (exit code {process.poll()})")


def measure(workers: list[int], sessions: int, requests: int, passes: int) -> list[Row]:
    """Every workload's median request time on a server per ``workers`` setting, in ``passes`` alternating passes."""
    servers = [start_server(n) for n in workers]  # started together: they load at the same time
    pools: list[EnvServerPool] = []
    try:
        for process, url in servers:
            wait_until_up(process, url)
            pools.append(EnvServerPool([url], ClientOptions(timeout_s=120.0)))
        times: dict[tuple[str, int], list[float]] = {}
        for _ in range(passes):
            for workload in WORKLOADS:
                for n, pool in zip(workers, pools):
                    times.setdefault((workload.name, n), []).extend(request_times(pool, workload, sessions, requests))
    finally:
        for pool in pools:
            pool.close()
        for process, _ in servers:
            process.terminate()
            process.wait(timeout=10)
    return [Row(w.name, sessions, {n: 1e3 * statistics.median(times[w.name, n]) for n in workers}) for w in WORKLOADS]


def table(rows: list[Row], baseline: int, pool: int) -> str:
    """The rows as text: each setting's ms per request and the baseline's time over the pool's."""
    header = (f"{'env':<20} {'sessions':>8} {f'--workers {baseline} ms':>16} {f'--workers {pool} ms':>17} "
              f"{'speed-up':>9}")
    lines = [header, "-" * len(header)]
    for row in rows:
        lines.append(f"{row.name:<20} {row.sessions:>8} {row.ms[baseline]:>16,.1f} {row.ms[pool]:>17,.1f} "
                     f"{row.ms[baseline] / row.ms[pool]:>8.1f}x")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[Row]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="16 sessions, 5 requests a row, one pass")
    parser.add_argument("--sessions", type=int, default=None, help="sessions in a batch (default 64, --quick 16)")
    parser.add_argument("--requests", type=int, default=None, help="timed requests a row and pass (default 20)")
    parser.add_argument("--passes", type=int, default=None, help="alternating passes (default 3, --quick 1)")
    args = parser.parse_args(argv)
    sessions = args.sessions or (16 if args.quick else 64)
    requests = args.requests or (5 if args.quick else 20)
    passes = args.passes or (1 if args.quick else 3)
    if min(sessions, requests, passes) < 1:
        parser.error("--sessions, --requests and --passes must be >= 1")
    pool = ServerLimits().workers
    print(f"{platform.python_implementation()} {platform.python_version()} on {platform.machine()}, "
          f"{os.cpu_count()} cores visible; servers in subprocesses on this machine; median of {requests * passes} "
          f"requests a cell; {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    rows = measure([1, pool], sessions, requests, passes)
    print(table(rows, 1, pool))
    return rows


if __name__ == "__main__":
    main()

"""Env steps/s through the env server (one at a time and batched) against the same env in process.

Rows, for Sokoban 6x6 with one box in text and image mode:

- in process: ``env.step`` on one env, random valid actions (what the rollout does without a server);
- one at a time: :class:`turnrl.envservice.client.RemoteEnv`, one HTTP request per step (what the rollout does
  with ``env.remote``: every env is stepped on its own);
- batched xN: :class:`turnrl.envservice.client.RemoteEnvBatch`, one request steps N sessions; steps/s counts
  every session's step.

An episode that ends is reset and the reset time is left out of the rate (as in
``benchmarks/env_throughput.py``). The server runs in a subprocess on this machine
(``python -m turnrl.envservice.server``), so client and server do not share an interpreter
lock; pass ``--url`` to measure a server started elsewhere instead. Each row runs
about ``--seconds`` (default 3) after a warm-up.

    python benchmarks/env_service.py            # about a minute
    python benchmarks/env_service.py --quick    # a few seconds
    python benchmarks/env_service.py --repeat 3 --seconds 2   # medians of three passes (a busy machine)
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from turnrl.envs import make  # noqa: E402
from turnrl.envservice.client import ClientOptions, EnvServerPool, RemoteEnv, RemoteEnvBatch  # noqa: E402

ENV_ID = "Sokoban"
SETTINGS: dict[str, dict[str, Any]] = {
    "text": {"size": 6, "num_boxes": 1, "max_steps": 10_000},
    "image": {"size": 6, "num_boxes": 1, "max_steps": 10_000, "mode": "image"},
}
BATCHES = (8, 64, 256)


@dataclass
class Row:
    name: str
    steps_per_s: float
    ms_per_request: float


def timed(step: Callable[[], tuple[int, float]], seconds: float) -> tuple[float, float]:
    """``(steps/s, ms per call)`` of ``step()`` over about ``seconds``; ``step()`` returns the env steps it
    made and the seconds it spent on resets, which are left out."""
    warm_until = time.perf_counter() + min(0.5, seconds / 5)
    while time.perf_counter() < warm_until:
        step()
    steps = calls = 0
    resets = 0.0
    start = time.perf_counter()
    while (now := time.perf_counter()) - start < seconds:
        made, reset_s = step()
        steps, resets, calls = steps + made, resets + reset_s, calls + 1
    elapsed = now - start - resets
    return steps / elapsed, 1e3 * elapsed / calls


def stepper(env: Any, names: list[str]) -> Callable[[], tuple[int, float]]:
    """One random valid action on ``env`` (in process or remote); an episode that ends is reset with a new seed."""
    rnd = random.Random(0)
    state = {"seed": 0}

    def one() -> tuple[int, float]:
        _, _, terminated, truncated, _ = env.step(rnd.choice(names))
        if not (terminated or truncated):
            return 1, 0.0
        start = time.perf_counter()
        state["seed"] += 1
        env.reset(seed=state["seed"])
        return 1, time.perf_counter() - start

    return one


def in_process(mode: str, seconds: float) -> Row:
    env = make(ENV_ID, **SETTINGS[mode])
    env.reset(seed=0)
    rate, ms = timed(stepper(env, env.action_names() or []), seconds)
    return Row(f"{mode}: in process", rate, ms)


def one_at_a_time(pool: EnvServerPool, mode: str, seconds: float) -> Row:
    env = RemoteEnv(pool, ENV_ID, SETTINGS[mode])
    env.reset(seed=0)
    rate, ms = timed(stepper(env, env.action_names() or []), seconds)
    env.close()
    return Row(f"{mode}: server, one at a time", rate, ms)


def batched(pool: EnvServerPool, mode: str, n: int, seconds: float) -> Row:
    batch = RemoteEnvBatch(pool, ENV_ID, SETTINGS[mode], n)
    seeds = list(range(n))
    batch.reset(seeds)
    names = make(ENV_ID, **SETTINGS[mode]).action_names() or []
    rnd = random.Random(0)

    def one() -> tuple[int, float]:
        live = sum(batch.running)
        batch.step([rnd.choice(names) for _ in range(n)])
        if all(batch.running):
            return live, 0.0
        start = time.perf_counter()  # a solved level: new episodes for all
        seeds[:] = [seed + n for seed in seeds]
        batch.reset(seeds)
        return live, time.perf_counter() - start

    rate, ms = timed(one, seconds)
    batch.close()
    return Row(f"{mode}: server, batched x{n}", rate, ms)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server() -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [sys.executable, "-m", "turnrl.envservice.server", "--port", str(port), "--envs", ENV_ID,
               "--log-level", "warning"]
    process = subprocess.Popen(command, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                               stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return process, url
        except httpx.TransportError:
            time.sleep(0.05)
    process.kill()
    raise SystemExit("the env server did not start")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="about 0.5 s a row")
    parser.add_argument("--seconds", type=float, default=None, help="seconds a row (default 3, --quick 0.5)")
    parser.add_argument("--url", default=None, help="an env server to measure instead of starting one here")
    parser.add_argument("--repeat", type=int, default=1, help="measure every row this many times; print medians")
    args = parser.parse_args(argv)
    seconds = args.seconds if args.seconds is not None else (0.5 if args.quick else 3.0)

    process, url = (None, args.url) if args.url else start_server()
    where = url if args.url else f"a subprocess on this machine ({url})"
    print(f"{platform.python_implementation()} {platform.python_version()} on {platform.machine()}, "
          f"{os.cpu_count()} cores visible; server: {where}; {seconds:g} s a row; "
          f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    pool = EnvServerPool([url], ClientOptions())
    runs: list[list[Row]] = []
    try:
        for _ in range(max(1, args.repeat)):  # whole passes, so that a busy minute spreads over every row
            rows: list[Row] = []
            for mode in SETTINGS:
                rows.append(in_process(mode, seconds))
                rows.append(one_at_a_time(pool, mode, seconds))
                rows.extend(batched(pool, mode, n, seconds) for n in BATCHES)
            runs.append(rows)
    finally:
        pool.close()
        if process is not None:
            process.terminate()
            process.wait(timeout=10)

    rows = [Row(group[0].name, statistics.median(r.steps_per_s for r in group),
                statistics.median(r.ms_per_request for r in group)) for group in zip(*runs)]
    if len(runs) > 1:
        print(f"medians of {len(runs)} passes")
    header = f"{'Sokoban 6x6, 1 box':<34} {'steps/s':>11} {'ms/request':>11} {'vs in process':>14}"
    print(header)
    print("-" * len(header))
    base: dict[str, float] = {}
    for row in rows:
        mode = row.name.split(":")[0]
        base.setdefault(mode, row.steps_per_s)
        ratio = row.steps_per_s / base[mode]
        shown = "1" if ratio == 1 else (f"1/{1 / ratio:,.0f}" if ratio < 1 else f"{ratio:,.1f}x")
        print(f"{row.name:<34} {row.steps_per_s:>11,.0f} {row.ms_per_request:>11.3f} {shown:>14}")


if __name__ == "__main__":
    main()

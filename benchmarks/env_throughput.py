"""Environment throughput on one core: resets/s and text steps/s.

Rows: turnrl's Sokoban (6x6 with 1 box, 8x8 with 2 boxes) and FrozenLake (4x4,
8x8), and, when it can be run, gym-sokoban's level generator and env, the ones
RAGEN and VAGEN train on, measured in the same run so the ratios compare like
with like.

- resets/s: ``env.reset()`` (each a new level from the env's random stream);
  "seeded" is ``env.reset(seed=i)`` with a new seed each time, which adds
  Gymnasium's seeding. gym-sokoban's rows time ``generate_room`` as its env
  calls it (``num_steps = 1.7 * (rows + cols)``), counting the levels it fails
  to make (it raises and the caller retries).
- steps/s: uniformly random valid actions; an episode that ends is reset, and
  the reset time is left out (``with resets`` includes it). gym-sokoban's step
  renders an RGB frame every time; that is its env's default and what RAGEN
  pays.

gym-sokoban needs the old ``gym`` package, which does not belong in turnrl's
environment. Install it in a throwaway venv and point this script at it:

    python3 -m venv .venv-gym-sokoban && .venv-gym-sokoban/bin/pip install gym-sokoban
    python benchmarks/env_throughput.py --gym-sokoban-python .venv-gym-sokoban/bin/python
    python benchmarks/env_throughput.py --quick        # a few seconds, turnrl only

Each row runs about ``--seconds`` (default 2.5) after a short warm-up; times
come from ``time.perf_counter``. Everything runs in one process and thread,
except gym-sokoban's rows, which run in a subprocess of that interpreter.
This file must stay importable without turnrl (the subprocess imports it).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# From a 2-core machine (PEERS.md): gym-sokoban's generator and env.
REFERENCE = {"gs_reset_6x6": 453.0, "gs_reset_8x8": 184.0, "gs_step_6x6": 484.0}
GOAL_RESETS, GOAL_STEPS = 20.0, 100.0


@dataclass
class Row:
    """One measured configuration."""

    name: str
    resets_per_s: float | None = None
    seeded_resets_per_s: float | None = None
    steps_per_s: float | None = None
    """Step time only."""
    steps_with_resets_per_s: float | None = None
    failures: int = 0
    """gym-sokoban: generation attempts that raised."""
    note: str = ""


# ---------------------------------------------------------------------- timing helpers
def rate(call: Callable[[int], None], seconds: float, batch: int = 20) -> float:
    """Calls per second of ``call(i)`` over about ``seconds``, after a warm-up."""
    warm_until = time.perf_counter() + min(0.3, seconds / 5)
    i = 0
    while time.perf_counter() < warm_until:
        call(i)
        i += 1
    count, start = 0, time.perf_counter()
    end = start + seconds
    while True:
        for _ in range(batch):
            call(i)
            i += 1
        count += batch
        now = time.perf_counter()
        if now >= end:
            return count / (now - start)


def step_rate(env: Any, actions: list[Any], seconds: float, done_of: Callable[[tuple], bool]) -> tuple[float, float]:
    """(steps/s without reset time, steps/s with it) for random actions; resets when an episode ends."""
    step, reset = env.step, env.reset
    reset()
    n = len(actions)
    for i in range(min(2000, n)):  # warm-up
        if done_of(step(actions[i])):
            reset()
    steps, reset_time, i = 0, 0.0, 0
    start = time.perf_counter()
    end = start + seconds
    while True:
        for _ in range(200):
            if done_of(step(actions[i % n])):
                t = time.perf_counter()
                reset()
                reset_time += time.perf_counter() - t
            i += 1
        steps += 200
        now = time.perf_counter()
        if now >= end:
            total = now - start
            return steps / (total - reset_time), steps / total


# ---------------------------------------------------------------------- turnrl
def measure_turnrl(seconds: float) -> list[Row]:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from turnrl.envs.games.sokoban.sokoban_env import SokobanEnv

    factories: list[tuple[str, Callable[[], Any] | None, str]] = [
        ("turnrl Sokoban 6x6, 1 box", lambda: SokobanEnv(size=6, num_boxes=1), ""),
        ("turnrl Sokoban 8x8, 2 boxes", lambda: SokobanEnv(size=8, num_boxes=2), ""),
    ]
    try:
        from turnrl.envs.games.frozenlake import FrozenLakeEnv
    except ImportError as error:
        note = f"skipped: turnrl.envs.games.frozenlake not importable ({error})"
        factories += [("turnrl FrozenLake 4x4", None, note), ("turnrl FrozenLake 8x8", None, note)]
    else:
        factories += [
            ("turnrl FrozenLake 4x4", lambda: FrozenLakeEnv(size=4), ""),
            ("turnrl FrozenLake 8x8", lambda: FrozenLakeEnv(size=8), ""),
        ]
    rows = []
    for name, factory, note in factories:
        if factory is None:
            rows.append(Row(name, note=note))
            continue
        env = factory()
        env.reset(seed=0)
        resets = rate(lambda i: env.reset(), seconds)
        seeded = rate(lambda i: env.reset(seed=i), seconds)
        rnd = random.Random(0)
        names = env.action_names()
        actions = [rnd.choice(names) for _ in range(100_000)]
        steps, with_resets = step_rate(env, actions, seconds, lambda out: out[2] or out[3])
        rows.append(Row(name, resets, seeded, steps, with_resets))
    return rows


# ---------------------------------------------------------------------- gym-sokoban
def measure_gym_sokoban(seconds: float) -> list[Row]:
    """gym-sokoban's generator and env (run where ``gym_sokoban`` imports)."""
    import warnings

    warnings.filterwarnings("ignore")
    import numpy as np
    from gym_sokoban.envs.room_utils import generate_room
    from gym_sokoban.envs.sokoban_env import SokobanEnv as GymSokobanEnv

    np.random.seed(0)
    rows = []
    for dims, boxes in (((6, 6), 1), ((8, 8), 2)):
        failures = [0]

        def one_level(i: int, dims=dims, boxes=boxes) -> None:
            while True:
                try:
                    generate_room(dim=dims, num_steps=int(1.7 * sum(dims)), num_boxes=boxes, second_player=False)
                    return
                except Exception:  # gym-sokoban raises when a room fails; its env retries too
                    failures[0] += 1

        resets = rate(one_level, seconds, batch=5)
        name = f"gym-sokoban generator {dims[0]}x{dims[1]}, {boxes} box{'es' if boxes > 1 else ''}"
        rows.append(Row(name, resets, failures=failures[0]))
    env = GymSokobanEnv(dim_room=(6, 6), num_boxes=1, max_steps=100)
    actions = [int(a) for a in np.random.default_rng(0).integers(1, 5, size=100_000)]  # 1-4: push/move up..right
    steps, with_resets = step_rate(env, actions, seconds, lambda out: bool(out[2]) or (len(out) == 5 and bool(out[3])))
    rows.append(Row("gym-sokoban env 6x6, 1 box", steps_per_s=steps, steps_with_resets_per_s=with_resets))
    return rows


def gym_sokoban_rows(seconds: float, python: str | None) -> tuple[list[Row], str]:
    """Measure gym-sokoban here if it imports, else with ``python``; (rows, note)."""
    try:
        import gym_sokoban  # noqa: F401
    except Exception as error:  # noqa: BLE001 - any import failure means "not here"
        local_error = f"{type(error).__name__}: {error}"
    else:
        return measure_gym_sokoban(seconds), "gym-sokoban measured in this process"
    if python is None:
        return [], f"gym-sokoban not measured: not importable here ({local_error}); see --gym-sokoban-python"
    result = subprocess.run(
        [python, str(Path(__file__).resolve()), "--only-gym-sokoban", "--seconds", str(seconds)],
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        return [], f"gym-sokoban not measured: {python} failed:\n{result.stderr[-2000:]}"
    payload = json.loads(result.stdout.strip().splitlines()[-1])
    return [Row(**row) for row in payload["rows"]], f"gym-sokoban measured with {python} ({payload['versions']})"


# ---------------------------------------------------------------------- report
def fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def print_table(rows: list[Row]) -> None:
    header = f"{'env':<34} {'resets/s':>10} {'seeded/s':>10} {'steps/s':>11} {'w/ resets':>11}  note"
    print(header)
    print("-" * len(header))
    for row in rows:
        note = row.note or (f"{row.failures} failed attempts" if row.failures else "")
        print(
            f"{row.name:<34} {fmt(row.resets_per_s):>10} {fmt(row.seeded_resets_per_s):>10} "
            f"{fmt(row.steps_per_s):>11} {fmt(row.steps_with_resets_per_s):>11}  {note}"
        )


def print_ratios(ours: list[Row], theirs: list[Row]) -> None:
    by_name = {row.name: row for row in ours + theirs}
    # (label, our row, their row, field compared, goal ratio, reference key)
    pairs = [
        ("resets 6x6/1", "turnrl Sokoban 6x6, 1 box", "gym-sokoban generator 6x6, 1 box", "resets_per_s", GOAL_RESETS,
         "gs_reset_6x6"),
        ("resets 8x8/2", "turnrl Sokoban 8x8, 2 boxes", "gym-sokoban generator 8x8, 2 boxes", "resets_per_s",
         GOAL_RESETS, "gs_reset_8x8"),
        ("steps 6x6/1", "turnrl Sokoban 6x6, 1 box", "gym-sokoban env 6x6, 1 box", "steps_per_s", GOAL_STEPS,
         "gs_step_6x6"),
    ]
    print("\nours / theirs (goal: >= 20x resets, >= 100x steps)")
    for label, mine, other, field, goal, ref_key in pairs:
        value = getattr(by_name[mine], field) if mine in by_name else None
        if value is None:
            continue
        parts = [f"  {label:<13} ours {value:,.0f}/s"]
        theirs = getattr(by_name[other], field) if other in by_name else None
        if theirs:
            verdict = "meets" if value / theirs >= goal else "below"
            parts.append(f"vs measured {theirs:,.0f}/s = {value / theirs:,.1f}x ({verdict} {goal:.0f}x)")
        parts.append(f"vs reference {REFERENCE[ref_key]:,.0f}/s = {value / REFERENCE[ref_key]:,.1f}x")
        print("; ".join(parts))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="about 0.3 s a row")
    parser.add_argument("--seconds", type=float, default=None, help="seconds a row (default 2.5, --quick 0.3)")
    parser.add_argument("--gym-sokoban-python", default=None, help="an interpreter where gym_sokoban imports")
    parser.add_argument("--only-gym-sokoban", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    seconds = args.seconds if args.seconds is not None else (0.3 if args.quick else 2.5)
    # Checked before the turnrl rows are measured, so that a venv not built yet costs no run.
    if args.gym_sokoban_python is not None and shutil.which(args.gym_sokoban_python) is None:
        parser.error(f"--gym-sokoban-python {args.gym_sokoban_python}: no such interpreter; build it with "
                     "`python3 -m venv .venv-gym-sokoban && .venv-gym-sokoban/bin/pip install gym-sokoban`, "
                     "or leave the flag out to measure turnrl's envs alone")

    if args.only_gym_sokoban:  # subprocess mode: JSON on the last line
        from importlib.metadata import version

        packages = ", ".join(f"{name} {version(name)}" for name in ("gym-sokoban", "gym", "numpy"))
        versions = f"{packages}, Python {platform.python_version()}"
        print(json.dumps({"rows": [asdict(row) for row in measure_gym_sokoban(seconds)], "versions": versions}))
        return

    print(f"{platform.python_implementation()} {platform.python_version()} on {platform.machine()}, "
          f"{os.cpu_count()} cores visible, one process; {seconds:g} s a row; {time.strftime('%Y-%m-%d %H:%M:%S')}")
    ours = measure_turnrl(seconds)
    theirs, note = gym_sokoban_rows(seconds, args.gym_sokoban_python)
    print(note + "\n")
    print_table(ours + theirs)
    print_ratios(ours, theirs)


if __name__ == "__main__":
    main()

"""PrimitiveSkill throughput on one core: resets/s, skill steps/s and renders/s.

Rows, for each task (``align``, ``place``, ``stack``, ``drawer``):

- ``reset``: ``env.reset(seed=i)``, a new seed each time (layout draw, MuJoCo
  reset, 0.2 s of settling physics).
- ``expert step``: the expert's next action from a fresh reset, replanned
  every step as the expert policy does (pick, place, push: 1 to 3 s of
  simulated time each, at 500 physics steps a simulated second).
- ``random step``: ``pick``/``place``/``push`` at uniformly random points of
  the workspace (most grasp nothing); an episode that ends is reset, and the
  reset time is left out.
- ``render NxN``: the front camera's image alone (offscreen OpenGL,
  ``MUJOCO_GL``; EGL by default), from the state after a reset.
- ``predict, deep copy`` and ``predict, planning copy``: what the expert does
  for a demo's predicted state (VAGEN's world-modeling field), in the image
  mode at 256x256: copy the env after a reset, step the plan's first action
  on the copy, read its facts; on a ``copy.deepcopy`` (which draws the frame
  of its step, with a renderer of its own) and on ``env.planning_copy()``
  (which draws none). The last line is their ratio for each task.

    python benchmarks/primitive_skill.py            # about 40 s
    python benchmarks/primitive_skill.py --quick    # about 10 s

Times come from ``time.perf_counter`` in one process and thread.
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.timing import rate  # noqa: E402
from turnrl.envs.games.primitive_skill.primitive_skill_env import SPECS, TASKS, PrimitiveSkillEnv  # noqa: E402


def random_action(rng: np.random.Generator, task: str) -> str:
    ws = SPECS[task].workspace
    point = lambda: [round(rng.uniform(*b) * 1000) for b in (ws.x, ws.y, ws.z)]  # noqa: E731
    kind = rng.integers(3)
    coords = point() if kind < 2 else point() + point()
    return f"{('pick', 'place', 'push')[kind]}({','.join(map(str, coords))})"


def measure(task: str, seconds: float) -> dict[str, float]:
    env = PrimitiveSkillEnv(task=task)
    row = {"reset": rate(lambda i: env.reset(seed=i), seconds)}

    def expert_step(i: int) -> None:
        env.reset(seed=i)
        env.step((env.solve() or ["pick(0,0,20)"])[0])

    reset_time = 1.0 / row["reset"]
    row["expert step"] = 1.0 / (1.0 / rate(expert_step, seconds) - reset_time)
    rng = np.random.default_rng(0)
    env.reset(seed=0)
    elapsed, steps = 0.0, 0
    while elapsed < seconds or steps < 3:
        action = random_action(rng, task)
        start = time.perf_counter()
        _, _, terminated, truncated, _ = env.step(action)
        elapsed += time.perf_counter() - start
        steps += 1
        if terminated or truncated:
            env.reset(seed=steps)
    row["random step"] = steps / elapsed
    for size in (128, 256):
        viewer = PrimitiveSkillEnv(task=task, mode="image", image_size=size)
        viewer.reset(seed=0)
        row[f"render {size}x{size}"] = rate(lambda i: viewer.image(), seconds)  # noqa: B023 - called right here
        viewer.close()
    env.close()
    viewer = PrimitiveSkillEnv(task=task, mode="image", image_size=256)
    viewer.reset(seed=0)
    action = (viewer.solve() or ["pick(0,0,20)"])[0]

    def predict(copy_env: Callable[[], PrimitiveSkillEnv]) -> Callable[[int], None]:
        def call(i: int) -> None:
            shadow = copy_env()
            shadow.step(action)
            shadow.state_facts().describe()
            shadow.close()
        return call

    row["predict, deep copy"] = rate(predict(lambda: copy.deepcopy(viewer)), seconds)
    row["predict, planning copy"] = rate(predict(viewer.planning_copy), seconds)
    viewer.close()
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="about 0.3 s a cell")
    parser.add_argument("--seconds", type=float, default=None, help="seconds a cell (default 1.5, --quick 0.3)")
    args = parser.parse_args(argv)
    seconds = args.seconds if args.seconds is not None else (0.3 if args.quick else 1.5)
    print(f"{platform.python_implementation()} {platform.python_version()}, {os.cpu_count()} cores visible, "
          f"one process; MUJOCO_GL={os.environ.get('MUJOCO_GL')}; {seconds:g} s a cell; "
          f"{time.strftime('%Y-%m-%d %H:%M:%S')}")
    rows = {task: measure(task, seconds) for task in TASKS}
    columns = list(next(iter(rows.values())))
    widths = [max(18, len(c) + 5) for c in columns]
    print(f"{'task':<8}" + "".join(f"{c + '/s':>{w}}" for c, w in zip(columns, widths)))
    for task, row in rows.items():
        print(f"{task:<8}" + "".join(f"{row[c]:>{w},.1f}" for c, w in zip(columns, widths)))
    print("a prediction on a planning copy against a deep copy: " + ", ".join(
        f"{task} {row['predict, planning copy'] / row['predict, deep copy']:.1f}x" for task, row in rows.items()))


if __name__ == "__main__":
    main()

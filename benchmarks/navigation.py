"""Navigation env throughput on one core: resets/s, steps/s and renders/s.

Rows (each on the env's default layouts and 4 objects):

- ``reset``: ``env.reset(seed=i)``, a new seed each time: drawing the layout,
  building it in MiniWorld, mapping the agent's lattice with MiniWorld's
  collision test and the expert plan that checks it is solvable.
- ``step text`` / ``step image``: uniformly random actions; every step renders
  the camera frame once (text mode needs it too: the description lists what
  the occlusion query says the camera sees). Resets are left out of the time.
- ``render WxH``: the camera frame alone (``world.look()``: the frame plus
  the visibility query) at several sizes, from a fixed pose; MiniWorld's
  default observation (80x60) and its default human frame (800x600) included.
- ``solve``: the expert's plan from a fresh reset (Dijkstra on the lattice).

    python benchmarks/navigation.py            # about 30 s
    python benchmarks/navigation.py --quick    # a few seconds

Times come from ``time.perf_counter`` in one process and thread; the OpenGL
route (``TURNRL_GL``: EGL without a display by default) is printed with them.
"""

from __future__ import annotations

import argparse
import platform
import time
from collections.abc import Callable

import numpy as np

from turnrl.envs.games.navigation.navigation_env import ACTIONS, NavigationEnv
from turnrl.envs.games.navigation.gl import ensure_gl


def rate(fn: Callable[[], int], seconds: float) -> float:
    """Calls of ``fn`` per second (each returns how many units it did) over about ``seconds``."""
    fn()  # warm-up: first textures and meshes load once per process
    done, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        done += fn()
    return done / (time.perf_counter() - start)


def bench_resets(seconds: float) -> float:
    env = NavigationEnv(mode="text")
    seeds = iter(range(10**9))
    return rate(lambda: (env.reset(seed=next(seeds)), 1)[1], seconds)


def bench_steps(mode: str, seconds: float) -> float:
    env = NavigationEnv(mode=mode)
    env.reset(seed=0)
    rng = np.random.default_rng(0)
    spent, steps = [0.0], [0]
    seeds = iter(range(1, 10**9))

    def burst() -> int:
        for _ in range(50):
            action = ACTIONS[int(rng.integers(len(ACTIONS)))]
            start = time.perf_counter()
            _, _, terminated, truncated, _ = env.step(action)
            spent[0] += time.perf_counter() - start
            steps[0] += 1
            if terminated or truncated:
                env.reset(seed=next(seeds))
        return 50

    burst()
    spent[0], steps[0] = 0.0, 0
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        burst()
    return steps[0] / spent[0]


def bench_render(width: int, height: int, seconds: float) -> float:
    env = NavigationEnv(mode="image", image_size=(height, width))
    env.reset(seed=0)
    world = env._ensure_world()

    def render() -> int:
        world.look()
        return 1

    return rate(render, seconds)


def bench_solve(seconds: float) -> float:
    env = NavigationEnv(mode="text")
    seeds = iter(range(10**9))
    spent, count = [0.0], [0]

    def one() -> int:
        env.reset(seed=next(seeds))
        start = time.perf_counter()
        env.solve()
        spent[0] += time.perf_counter() - start
        count[0] += 1
        return 1

    one()
    spent[0], count[0] = 0.0, 0
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        one()
    return count[0] / spent[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="time per row")
    parser.add_argument("--quick", action="store_true", help="0.5 s per row")
    args = parser.parse_args()
    seconds = 0.5 if args.quick else args.seconds
    backend = ensure_gl()
    from pyglet.gl import gl_info

    NavigationEnv(mode="text").reset(seed=0)  # creates the OpenGL context that gl_info reads
    print(f"{platform.processor() or platform.machine()}, Python {platform.python_version()}, OpenGL via {backend}: "
          f"{gl_info.get_renderer()}")
    rows = [
        ("reset (seeded)", "resets/s", bench_resets(seconds)),
        ("step, text mode", "steps/s", bench_steps("text", seconds)),
        ("step, image mode 224x224", "steps/s", bench_steps("image", seconds)),
        ("solve (expert plan)", "plans/s", bench_solve(seconds)),
    ]
    for width, height in ((80, 60), (224, 224), (448, 448), (800, 600)):
        rows.append((f"render {width}x{height}", "renders/s", bench_render(width, height, seconds)))
    print(f"{'row':28s} {'rate':>10s}")
    for name, unit, value in rows:
        print(f"{name:28s} {value:10.1f} {unit}")


if __name__ == "__main__":
    main()

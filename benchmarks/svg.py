"""SVG env throughput on one core: resets/s, answers scored/s, and what the render sandbox costs.

Rows:

- ``reset``: ``env.reset(seed=i)``: generate an icon and render the target.
- ``step, expert answer``: check + render + similarity of the target's own SVG.
- ``step, refused answer``: an answer the checker refuses (a ``<script>``), never rendered.
- ``render, sandboxed worker``: one icon through :class:`SvgRenderer` (pipe round trip, PNG decode).
- ``render, resvg in process``: the same icon through ``resvg_py`` directly plus the same PNG decode: the
  difference with the row above is the price of the sandbox per render.
- ``similarity``: pixel + SSIM + edge scores of an answer's 256x256 render against the target (whose edges
  are computed once an episode, as the env does).
- ``worker start``: starting a fresh worker (after a crash or a timeout), to its first render.

    python benchmarks/svg.py            # about 15 s
    python benchmarks/svg.py --quick    # a few seconds

Times come from ``time.perf_counter``; everything but the worker runs in this process and thread.
"""

from __future__ import annotations

import argparse
import io
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import resvg_py  # noqa: E402
from PIL import Image  # noqa: E402

from benchmarks.timing import rate  # noqa: E402
from turnrl.envs.games.svg.svg_env import SVGEnv  # noqa: E402
from turnrl.envs.games.svg.render import Reference, SvgRenderer, similarity  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="about 0.3 s a row")
    parser.add_argument("--seconds", type=float, default=None, help="seconds a row (default 2, --quick 0.3)")
    args = parser.parse_args(argv)
    seconds = args.seconds if args.seconds is not None else (0.3 if args.quick else 2.0)
    print(f"{platform.python_implementation()} {platform.python_version()}, {os.cpu_count()} cores visible; "
          f"{seconds:g} s a row; {time.strftime('%Y-%m-%d %H:%M:%S')}")

    env = SVGEnv()
    rows: dict[str, float] = {"reset": rate(lambda i: env.reset(seed=i), seconds)}

    def expert(i: int) -> None:
        env.reset(seed=i % 50)
        env.step(env.icon.svg)

    rows["step, expert answer"] = 1.0 / (1.0 / rate(expert, seconds) - 1.0 / rows["reset"])
    env.reset(seed=0)
    hostile = '<svg xmlns="http://www.w3.org/2000/svg"><script>alert(1)</script></svg>'
    rows["step, refused answer"] = rate(lambda i: env.step(hostile), seconds)
    icon = env.icon.svg
    renderer = SvgRenderer(size=256)
    rows["render, sandboxed worker"] = rate(lambda i: renderer.render(icon), seconds)

    def in_process(i: int) -> None:
        png = resvg_py.svg_to_bytes(svg_string=icon, width=256, height=256, background="white", skip_system_fonts=True)
        np.asarray(Image.open(io.BytesIO(bytes(png))).convert("RGB"))

    rows["render, resvg in process"] = rate(in_process, seconds)
    reference = Reference.of(env.target)
    blank = np.full_like(env.target, 255)
    rows["similarity"] = rate(lambda i: similarity(reference, blank), seconds)

    def restart(i: int) -> None:
        renderer.close()
        renderer.render(icon)

    rows["worker start (+1 render)"] = rate(restart, seconds)
    renderer.close()
    for name, value in rows.items():
        print(f"{name:<28} {value:>10,.1f}/s   {1000.0 / value:>8.2f} ms")
    extra = 1000.0 / rows["render, sandboxed worker"] - 1000.0 / rows["render, resvg in process"]
    print(f"sandbox cost per render: {extra:+.2f} ms")


if __name__ == "__main__":
    main()

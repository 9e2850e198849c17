"""SVG reconstruction: the env (:mod:`.env`), checking, sandboxed rendering and similarity (:mod:`.render`) and
the render worker started as a script (``worker.py``)."""

from turnrl.envs.games.svg.svg_env import SVGEnv

__all__ = ["SVGEnv"]

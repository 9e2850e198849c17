"""MiniWorld behind the Navigation env: an OpenGL context on any machine, and worlds built from layouts.

MiniWorld renders with pyglet (OpenGL 2 fixed pipeline) and asks for an
OpenGL context as soon as it is imported, so nothing here imports it at module
load: :func:`miniworld_modules` chooses how to get a context on first use.

- ``display``: a display is there (``$DISPLAY`` is set): pyglet uses it.
- ``egl``: no display: pyglet's headless mode, an EGL context without a
  window server (Mesa's llvmpipe on a CPU machine; pyglet's
  ``headless_device`` 0 where a GPU driver offers EGL devices). Measured on
  a 2-core CPU VM it renders as fast as Xvfb does (about 650 MiniWorld
  steps/s at 80x60), needs no extra process, and is the default when there
  is no display and a subprocess probe gets a context.
- ``xvfb``: no display and no working EGL: a private Xvfb server is started on
  the first free display number (``Xvfb -displayfd``) and stopped when Python
  exits.

``TURNRL_GL=display|egl|xvfb`` forces one; with none available the error says
what to install. The choice is made once per process, because pyglet makes it
once: before its window module is first imported.

MiniWorld compiles the static part of a world (rooms, lights) into OpenGL
display list number 1, which every world in a process shares. A process that
holds many envs (a rollout does) would draw one env's rooms in another's
frame, so :class:`World` recompiles the list whenever a different world drew
last (a fraction of a millisecond for a few rooms).

MiniWorld's texture loader has pyglet convert RGB to RGBA in pure Python
(1.3 s a texture); :func:`miniworld_modules` replaces ``Texture.load`` with
:func:`_load_texture`, which decodes with Pillow and makes the same OpenGL
calls (the same RGB texels; only the unused alpha channel differs).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes.util
import io
import math
import os
import select
import shutil
import subprocess
import sys
import weakref
from dataclasses import dataclass
from functools import lru_cache
from types import SimpleNamespace
from typing import Any

import numpy as np

from turnrl.envs.games.navigation.layouts import Layout, ObjectSpec

GL_ENV_VAR = "TURNRL_GL"
GL_BACKENDS = ("display", "egl", "xvfb")
_XVFB_START_TIMEOUT_S = 20.0


@dataclass
class _GLState:
    backend: str | None = None
    xvfb: subprocess.Popen | None = None


_GL = _GLState()


def choose_backend(requested: str, has_display: bool, has_egl: bool, has_xvfb: bool) -> str:
    """The OpenGL route to take: ``requested`` (``auto`` or one of :data:`GL_BACKENDS`) given what the machine has.

    >>> choose_backend("auto", has_display=False, has_egl=True, has_xvfb=True)
    'egl'
    """
    if requested not in ("auto", *GL_BACKENDS):
        raise RuntimeError(f"{GL_ENV_VAR}={requested!r} is not one of auto, {', '.join(GL_BACKENDS)}")
    if requested != "auto":
        return requested
    if has_display:
        return "display"
    if has_egl:
        return "egl"
    if has_xvfb:
        return "xvfb"
    raise RuntimeError(
        "the Navigation env renders with OpenGL and found no way to get a context: no $DISPLAY, no EGL library "
        "(libEGL) and no Xvfb. Install one of them (Debian: apt-get install libegl1 or apt-get install xvfb) "
        f"or run under a display; {GL_ENV_VAR}=egl|xvfb|display forces a choice"
    )


def _start_xvfb(xvfb: str) -> str:
    """Start a private Xvfb on the first free display number and return its name (``":N"``)."""
    read_fd, write_fd = os.pipe()
    process = subprocess.Popen(
        [xvfb, "-displayfd", str(write_fd), "-screen", "0", "1024x768x24", "-nolisten", "tcp"],
        pass_fds=(write_fd,),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        # Out of the run's process group, which Ctrl-C and a job-wide SIGTERM reach: the run finishes its step
        # after them, frames included. Stopped at exit (_stop_xvfb).
        start_new_session=True,
    )
    os.close(write_fd)
    # Xvfb writes the display number to the pipe once it accepts connections.
    with os.fdopen(read_fd) as pipe:
        ready, _, _ = select.select([pipe], [], [], _XVFB_START_TIMEOUT_S)
        number = pipe.readline().strip() if ready else ""
    if not number.isdigit():
        process.kill()
        process.wait()
        raise RuntimeError(
            f"Xvfb ({xvfb}) did not start within {_XVFB_START_TIMEOUT_S:g} s (exit code {process.poll()}); "
            f"try {GL_ENV_VAR}=egl"
        )
    _GL.xvfb = process
    atexit.register(_stop_xvfb)
    return f":{number}"


def _stop_xvfb() -> None:
    if _GL.xvfb is not None and _GL.xvfb.poll() is None:
        _GL.xvfb.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            _GL.xvfb.wait(timeout=5)
    _GL.xvfb = None


def _egl_works() -> bool:
    """Whether pyglet gets a headless EGL context here, tried in a subprocess (about 0.5 s, once)."""
    if ctypes.util.find_library("EGL") is None:
        return False
    probe = "import pyglet; pyglet.options['headless'] = True; import pyglet.gl"
    try:
        done = subprocess.run([sys.executable, "-c", probe], capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def ensure_gl() -> str:
    """Set up the process's OpenGL route once (see the module docstring) and return its name."""
    if _GL.backend is not None:
        return _GL.backend
    import pyglet

    if "pyglet.window" in sys.modules:  # someone imported pyglet's window module first: it has chosen
        _GL.backend = "egl" if pyglet.options["headless"] else "display"
        return _GL.backend
    requested = os.environ.get(GL_ENV_VAR, "auto").strip().lower() or "auto"
    xvfb = shutil.which("Xvfb")
    has_display = bool(os.environ.get("DISPLAY"))
    backend = choose_backend(
        requested,
        has_display=has_display,
        # Probe only when EGL would be chosen: a libEGL without a usable device fails on first use, and pyglet's
        # choice cannot be undone in this process once made.
        has_egl=requested == "auto" and not has_display and _egl_works(),
        has_xvfb=xvfb is not None,
    )
    if backend == "egl":
        pyglet.options["headless"] = True
    elif backend == "xvfb":
        if xvfb is None:
            raise RuntimeError(f"{GL_ENV_VAR}=xvfb but Xvfb is not installed (Debian: apt-get install xvfb)")
        os.environ["DISPLAY"] = _start_xvfb(xvfb)
    elif not os.environ.get("DISPLAY"):
        raise RuntimeError(f"{GL_ENV_VAR}=display but $DISPLAY is not set")
    _GL.backend = backend
    return backend


@lru_cache(maxsize=1)
def miniworld_modules() -> SimpleNamespace:
    """MiniWorld's modules, imported after :func:`ensure_gl`; raises RuntimeError saying what to fix."""
    backend = ensure_gl()
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            from miniworld import entity, miniworld, opengl, params
            from pyglet import gl
    except Exception as error:  # pyglet raises its own classes for a missing display or EGL device
        raise RuntimeError(
            f"MiniWorld could not get an OpenGL context through {backend} ({type(error).__name__}: {error}); "
            f"set {GL_ENV_VAR} to one of {', '.join(GL_BACKENDS)} to try another route"
        ) from error
    opengl.Texture.load = classmethod(_load_texture)
    return SimpleNamespace(entity=entity, miniworld=miniworld, opengl=opengl, params=params, gl=gl)


def _load_texture(cls: type, path: str) -> Any:
    """MiniWorld's ``Texture.load`` with the pixels decoded by Pillow.

    MiniWorld's own loader asks pyglet for RGBA bytes of RGB files, which
    pyglet converts in pure Python: about 1.3 s per 1024x1024 texture, 15 s
    before the first frame of a new process. Pillow's conversion gives the
    same bytes (rows bottom-up, as pyglet stores them) in milliseconds; the
    OpenGL calls are MiniWorld's.
    """
    import pyglet
    from PIL import Image
    from pyglet import gl

    with Image.open(path) as source:
        image = source.convert("RGBA").transpose(Image.Transpose.FLIP_TOP_BOTTOM)
    data = image.tobytes()
    tex = pyglet.image.ImageData(image.width, image.height, "RGBA", data, pitch=image.width * 4).get_texture()
    gl.glEnable(tex.target)
    gl.glBindTexture(tex.target, tex.id)
    gl.glTexImage2D(gl.GL_TEXTURE_2D, 0, gl.GL_RGB, image.width, image.height, 0, gl.GL_RGBA, gl.GL_UNSIGNED_BYTE, data)
    gl.glHint(gl.GL_GENERATE_MIPMAP_HINT, gl.GL_NICEST)
    gl.glGenerateMipmap(gl.GL_TEXTURE_2D)
    gl.glTexParameteri(gl.GL_TEXTURE_2D, gl.GL_TEXTURE_MAG_FILTER, gl.GL_LINEAR)
    gl.glTexParameteri(gl.GL_TEXTURE_2D, gl.GL_TEXTURE_MIN_FILTER, gl.GL_LINEAR_MIPMAP_LINEAR)
    gl.glBindTexture(gl.GL_TEXTURE_2D, 0)
    return tex


# --------------------------------------------------------------------------- the world
def _make_entity(spec: ObjectSpec, mw: SimpleNamespace) -> Any:
    if spec.kind == "box":
        return mw.entity.Box(color=spec.color, size=spec.size)
    if spec.kind == "ball":
        return mw.entity.Ball(color=spec.color, size=spec.size)
    return mw.entity.MeshEnt(mesh_name=spec.kind, height=spec.size, static=True)


_last_drawn: list[weakref.ref | None] = [None]
"""The world whose static scene display list 1 holds now (see the module docstring)."""


@lru_cache(maxsize=1)
def _world_class() -> type:
    """The MiniWorld subclass, defined once MiniWorld can be imported."""
    mw = miniworld_modules()
    gl = mw.gl

    class World(mw.miniworld.MiniWorldEnv):  # type: ignore[name-defined]
        """A MiniWorld world built from a :class:`Layout`; the env moves its agent and reads its frames."""

        def __init__(self, layout: Layout, width: int, height: int, fov_y: float) -> None:
            self.layout = layout
            params = mw.params.DEFAULT_PARAMS.no_random()
            params.set("cam_fov_y", float(fov_y))
            with contextlib.redirect_stdout(io.StringIO()):  # MiniWorld prints its multisampling fallback
                # MiniWorld's frame buffer for people (window_*) is only drawn by top_view(), which makes its own
                # on first use: a token one here halves the memory of an env (llvmpipe keeps both in RAM).
                super().__init__(
                    max_episode_steps=math.inf,
                    obs_width=width,
                    obs_height=height,
                    window_width=16,
                    window_height=16,
                    params=params,
                    domain_rand=False,
                )
            self._top_fb: Any = None

        def _gen_world(self) -> None:
            rooms = [
                self.add_rect_room(
                    min_x=r.min_x, max_x=r.max_x, min_z=r.min_z, max_z=r.max_z,
                    wall_tex=r.wall_tex, floor_tex=r.floor_tex, no_ceiling=True,
                )
                for r in self.layout.rooms
            ]
            for door in self.layout.doors:
                axis = door.axis
                span = {f"min_{axis}": door.lo, f"max_{axis}": door.hi}
                self.connect_rooms(rooms[door.a], rooms[door.b], **span)
            for spec in self.layout.objects:
                self.place_entity(_make_entity(spec, mw), pos=np.array([spec.x, 0.0, spec.z]), dir=spec.heading)
            start = np.array([self.layout.start_x, 0.0, self.layout.start_z])
            self.place_agent(pos=start, dir=self.layout.start_heading * math.pi / 2)

        def _render_static(self) -> None:
            super()._render_static()
            _last_drawn[0] = weakref.ref(self)

        def pose(self, x: float, z: float, heading: int, pitch: float) -> None:
            """Put the agent at ``(x, z)`` facing ``heading`` quarter turns, the camera tilted ``pitch`` degrees."""
            self.agent.pos = np.array([x, 0.0, z])
            self.agent.dir = heading * math.pi / 2
            self.agent.cam_pitch = float(pitch)

        def blocked(self, x: float, z: float) -> bool:
            """Whether the agent's body at ``(x, z)`` would overlap a wall or an object (MiniWorld's collision test)."""
            return bool(self.intersect(self.agent, np.array([x, 0.0, z]), self.agent.radius))

        def look(self) -> tuple[np.ndarray, list[bool]]:
            """The agent's camera frame (``HxWx3`` uint8, a copy) and, per object, whether the camera sees it.

            Visibility is an OpenGL occlusion query, like MiniWorld's
            ``get_visible_ents`` but with a box that fills most of the object
            (half its footprint, most of its height) rather than a 20 cm cube
            on the floor: an object counts as seen when any sample of its box
            is inside the view (field of view, camera tilt) and not behind a
            wall. Objects do not hide each other.
            """
            owner = _last_drawn[0]
            if owner is None or owner() is not self:
                self._render_static()
            frame = self.render_obs().copy()
            # The camera's matrices are still set; redraw the depth of the rooms alone, so that an object's own
            # surfaces (or another object's) never hide its query box: walls and the view's edges decide.
            self.obs_fb.bind()
            gl.glClear(gl.GL_DEPTH_BUFFER_BIT)
            gl.glColorMask(gl.GL_FALSE, gl.GL_FALSE, gl.GL_FALSE, gl.GL_FALSE)
            for room in self.rooms:
                room._render()
            gl.glDepthMask(gl.GL_FALSE)
            gl.glDisable(gl.GL_CULL_FACE)
            others = [ent for ent in self.entities if ent is not self.agent]
            queries = (gl.GLuint * len(others))()
            gl.glGenQueries(len(others), queries)
            for query, ent in zip(queries, others):
                x, _, z = ent.pos
                half = 0.5 * ent.radius
                gl.glBeginQuery(gl.GL_ANY_SAMPLES_PASSED, query)
                mw.opengl.drawBox(x - half, x + half, 0.05 * ent.height, 0.9 * ent.height, z - half, z + half)
                gl.glEndQuery(gl.GL_ANY_SAMPLES_PASSED)
            gl.glEnable(gl.GL_CULL_FACE)
            gl.glDepthMask(gl.GL_TRUE)
            gl.glColorMask(gl.GL_TRUE, gl.GL_TRUE, gl.GL_TRUE, gl.GL_TRUE)
            seen = []
            for query in queries:
                result = gl.GLuint(0)
                gl.glGetQueryObjectuiv(query, gl.GL_QUERY_RESULT, ctypes.byref(result))
                seen.append(result.value != 0)
            gl.glDeleteQueries(len(others), queries)
            return frame, seen

        def top_view(self) -> np.ndarray:
            """The whole floor plan from above with the agent as a red triangle (``HxWx3`` uint8, a copy)."""
            owner = _last_drawn[0]
            if owner is None or owner() is not self:
                self._render_static()
            if self._top_fb is None:
                with contextlib.redirect_stdout(io.StringIO()):
                    self._top_fb = mw.opengl.FrameBuffer(self.obs_fb.width, self.obs_fb.height, 4)
            return self.render_top_view(self._top_fb).copy()

    return World


def build_world(layout: Layout, width: int, height: int, fov_y: float) -> Any:
    """A MiniWorld world of ``layout`` rendering ``height x width`` frames with a vertical field of view ``fov_y``."""
    return _world_class()(layout, width, height, fov_y)

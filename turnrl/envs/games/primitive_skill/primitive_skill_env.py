"""PrimitiveSkill: VAGEN's table-top manipulation tasks, on MuJoCo physics.

The agent commands a gripper with VAGEN's primitive actions, coordinates in
millimetres (integers; decimals are rounded)::

    pick(x, y, z)                    grasp the object at (x, y, z)
    place(x, y, z)                   put the held object down at (x, y, z)
    push(x1, y1, z1, x2, y2, z2)     push an object from (x1, y1, z1) to (x2, y2, z2)

Each action is one env step: a controller moves the gripper through the
skill's waypoints (:mod:`turnrl.envs.games.primitive_skill.sim`) and MuJoCo decides
what happens; success is read from the simulated state. Coordinates are
clipped to the task's workspace, as in VAGEN. A malformed action (an unknown
name, the wrong number of coordinates, text that is not a number) is invalid
and changes nothing.

Tasks (``task=``), VAGEN's family on a scene built in MJCF here:

==========  ====================  ==========================================================
``align``   AlignTwoCube          both cubes at x = 0 (+-10 mm), on the table
``place``   PlaceTwoCube          the red cube on the red target, the green one on the green
``stack``   StackThreeCube        red on green, then purple on red
``drawer``  PutAppleInDrawer      the apple in the (open) drawer, then the drawer pushed shut
==========  ====================  ==========================================================

Reward (VAGEN's, paid as it accrues): a state is worth 2 points per task stage
reached (e.g. "red cube grasped", "red cube on its target") and 10 when the
task is done; each step pays the change in that worth, minus 0.1. An
episode's return is therefore VAGEN's ``final worth - initial worth - 0.1 *
steps``. The episode terminates on success, or on failure when an object falls
off the table.

Observations: text gives the instruction, the workspace, each object's name and
position (mm) and what the gripper holds (VAGEN's layout); ``image`` mode adds
the view of the front camera, rendered offscreen (EGL by default).

The skills: ``pick`` opens the fingers, flies over the point at a safe height,
descends to it and closes (whatever the friction of the pads holds comes up
with them); ``place`` descends with the held object until its centre would
be at the point (a cube below stops the descent) and opens; ``push`` turns the
closed fingers' flat side to face the push, comes down behind the start
point (clear of a 4 cm cube turned any way), and slides to where a 4 cm cube
ahead of it would end centred on the end point. The gripper then returns to
its waiting place above the right edge of the table.

Differences from VAGEN's ManiSkill scenes: a gantry gripper instead of a
Franka arm (no inverse kinematics or reach limits to fail); PlaceTwoCube's
targets are drawn from the seed rather than fixed; StackThreeCube's success
also asks that the red cube still stands on the green one; the drawer is a
box on a slide joint with a handle, not a PartNet cabinet, and the apple a
sphere.
"""

from __future__ import annotations

import copy
import math
import os
import re
from dataclasses import dataclass
from typing import Any, Literal, get_args

import numpy as np

from turnrl.envs.contract import IMAGE_CAPTION, StateFacts, StepOutcome, TurnEnv
from turnrl.envs.games.primitive_skill.sim import (
    APPLE_RADIUS,
    CUBE_HALF,
    DRAWER_INNER,
    DRAWER_RANGE,
    MIN_TCP_HEIGHT,
    PUSH_END,
    PUSH_START,
    SAFE_HEIGHT,
    Gripper,
    SceneObject,
    mujoco,
    scene_xml,
)

Vec3 = tuple[float, float, float]
"""A point in metres."""

Task = Literal["align", "place", "stack", "drawer"]
"""The tasks (``turnrl envs`` lists them, as it does any setting typed as a ``Literal``)."""
TASKS: tuple[Task, ...] = get_args(Task)
HOME = (-0.02, 0.2, SAFE_HEIGHT)
"""Where the gripper waits between skills: high and to the right, out of the camera's way."""
SUCCESS_WORTH, STAGE_WORTH, STEP_COST = 10.0, 2.0, 0.1
FALLEN_Z = -0.05
"""An object below this height has fallen off the table."""
MAX_MM = 9_999_999
"""The largest coordinate an action may spell, in whole millimetres (seven digits, as the grammar reads)."""
_NUMBER = r"\s*([-+]?(?:\d{1,7}(?:\.\d{0,6})?|\.\d{1,6}))\s*"
_ACTION = re.compile(r"\s*(pick|place|push)\s*\((" + _NUMBER + r"(?:," + _NUMBER + r")*)\)\s*", re.IGNORECASE)
_ARITY = {"pick": 3, "place": 3, "push": 6}


@dataclass(frozen=True)
class Workspace:
    """Bounds (metres) that action coordinates are clipped to."""

    x: tuple[float, float]
    y: tuple[float, float]
    z: tuple[float, float]

    def clip(self, point: np.ndarray) -> np.ndarray:
        low = np.array([self.x[0], self.y[0], self.z[0]])
        high = np.array([self.x[1], self.y[1], self.z[1]])
        return np.clip(point, low, high)

    def describe(self) -> str:
        def mm(bounds: tuple[float, float]) -> str:
            return f"{round(bounds[0] * 1000)} to {round(bounds[1] * 1000)}"

        return f"x from {mm(self.x)}, y from {mm(self.y)}, z from {mm(self.z)}"


@dataclass(frozen=True)
class Skill:
    """A parsed action: its name and its coordinates in metres (3 for pick/place, 6 for push)."""

    name: str
    coords: tuple[float, ...]


def parse_skill(action: Any) -> Skill | None:
    """``"pick(62, -55, 20)"`` (mm) -> ``Skill("pick", (0.062, -0.055, 0.02))``; None if malformed.

    Case and spaces are free; coordinates are numbers of up to 7 digits
    before the point (no exponents, no ``nan``); the count must fit the name.

    >>> parse_skill("Push(0, 10, 20, 30, 40, 50)").name
    'push'
    >>> parse_skill("pick(1, 2)") is None
    True
    """
    if not isinstance(action, str) or len(action) > 200:
        return None
    match = _ACTION.fullmatch(action)
    if match is None:
        return None
    name = match.group(1).lower()
    values = tuple(float(part) / 1000.0 for part in match.group(2).split(","))
    if len(values) != _ARITY[name]:
        return None
    return Skill(name, values)


def skill_text(name: str, coords: tuple[float, ...]) -> str:
    """The canonical spelling of an action, VAGEN's: ``pick(62,-55,20)`` (whole millimetres).

    A coordinate is held to ``MAX_MM`` either way, so that the spelling reads back: ``9999999.9`` would round to
    eight digits. Every coordinate is clipped to the workspace, far inside, when the skill is played.
    """
    return f"{name}({','.join(str(max(-MAX_MM, min(MAX_MM, round(c * 1000)))) for c in coords)})"


def mm(point: np.ndarray | tuple[float, ...]) -> tuple[int, ...]:
    """A point in whole millimetres."""
    return tuple(int(round(float(c) * 1000)) for c in point)


@dataclass(frozen=True)
class TaskSpec:
    """What a task's scene holds and what it asks."""

    name: str
    instruction: str
    objects: tuple[SceneObject, ...]
    targets: tuple[tuple[str, str], ...] = ()
    drawer: bool = False
    workspace: Workspace = Workspace((-0.10, 0.15), (-0.20, 0.20), (0.01, 0.20))


RED, GREEN, PURPLE = "0.85 0.12 0.1 1", "0.15 0.7 0.2 1", "0.6 0.2 0.8 1"
SPECS: dict[Task, TaskSpec] = {
    "align": TaskSpec(
        "align",
        "Align the cubes along the y-axis: push or move both cubes so that their x-coordinates are 0 (+-10 mm), "
        "resting on the table.",
        (SceneObject("red_cube", "cube", RED), SceneObject("green_cube", "cube", GREEN)),
    ),
    "place": TaskSpec(
        "place",
        "Place the red cube on the red target and the green cube on the green target.",
        (SceneObject("red_cube", "cube", RED), SceneObject("green_cube", "cube", GREEN)),
        targets=(("red_target", "0.95 0.55 0.55 1"), ("green_target", "0.55 0.9 0.6 1")),
    ),
    "stack": TaskSpec(
        "stack",
        "Stack the red cube on top of the green cube, and then the purple cube on top of the red cube.",
        (
            SceneObject("red_cube", "cube", RED),
            SceneObject("green_cube", "cube", GREEN),
            SceneObject("purple_cube", "cube", PURPLE),
        ),
        workspace=Workspace((-0.10, 0.15), (-0.15, 0.15), (0.01, 0.20)),
    ),
    "drawer": TaskSpec(
        "drawer",
        "Put the apple in the drawer and close the drawer.",
        (SceneObject("apple", "apple", "0.8 0.05 0.1 1"),),
        drawer=True,
        workspace=Workspace((-0.25, 0.15), (-0.20, 0.20), (0.01, 0.20)),
    ),
}


class PrimitiveSkillEnv(TurnEnv):
    """VAGEN's PrimitiveSkill tasks on MuJoCo (see the module docstring).

    Args:
        task: ``"align"``, ``"place"``, ``"stack"`` or ``"drawer"``.
        mode: ``"text"`` or ``"image"`` (the front camera's view besides the text).
        image_size: side of the square image in pixels.
        max_steps: actions before truncation (VAGEN: 10).
        render_mode: ``None``, ``"ansi"`` or ``"rgb_array"``.
    """

    modes = ("text", "image")
    description = "PrimitiveSkill: pick/place/push with mm coordinates on a MuJoCo table (align, place, stack, drawer)."

    def __init__(
        self,
        task: Task = "place",
        mode: str = "text",
        image_size: int = 256,
        max_steps: int = 10,
        render_mode: str | None = None,
    ) -> None:
        if task not in SPECS:
            raise ValueError(f"unknown PrimitiveSkill task {task!r}; choose one of {list(TASKS)}")
        if not 32 <= image_size <= 640:
            raise ValueError(f"image_size must be between 32 and 640 pixels, got {image_size}")
        super().__init__(mode=mode, max_steps=max_steps, image_shape=(image_size, image_size), render_mode=render_mode)
        self.task = SPECS[task]
        self.image_size = int(image_size)
        self.model = mujoco.MjModel.from_xml_string(scene_xml(self.task.objects, self.task.targets, self.task.drawer))
        self.data = mujoco.MjData(self.model)
        self.gripper = Gripper(self.model)
        self._renderer: Any = None
        self._last_action: str | None = None
        self._names = [obj.name for obj in self.task.objects]

    # ----------------------------------------------------------------- copying and closing
    def __deepcopy__(self, memo: dict[int, Any]) -> PrimitiveSkillEnv:
        """A copy that shares the (never modified) model and opens its own renderer when it needs one."""
        clone = type(self).__new__(type(self))
        memo[id(self)] = clone
        memo[id(self.model)] = self.model
        for key, value in self.__dict__.items():
            clone.__dict__[key] = None if key == "_renderer" else copy.deepcopy(value, memo)
        return clone

    def close(self) -> None:
        if self._renderer is not None:
            self._renderer.close()
            self._renderer = None

    # ----------------------------------------------------------------- episode
    def _reset(self, rng: np.random.Generator, options: dict[str, Any]) -> None:
        mujoco.mj_resetData(self.model, self.data)
        self._last_action = None
        layout = self._sample_layout(rng)
        for name, (x, y) in layout.items():
            if name in self._names:
                self._set_free_body(name, (x, y), float(rng.uniform(-math.pi / 4, math.pi / 4)))
            else:  # targets are mocap bodies: their place is part of MjData
                self.data.mocap_pos[self.model.body(name).mocapid[0], :2] = (x, y)
        if self.task.drawer:
            self.data.qpos[self.model.joint("drawer").qposadr[0]] = DRAWER_RANGE
        self.gripper.reset(self.data, HOME)
        mujoco.mj_forward(self.model, self.data)
        mujoco.mj_step(self.model, self.data, 100)  # let objects settle on the table

    def _sample_layout(self, rng: np.random.Generator) -> dict[str, tuple[float, float]]:
        """xy of every object and target, drawn far enough apart (rejection sampling)."""
        ws = self.task.workspace
        if self.task.name == "align":  # as VAGEN: one cube on each side of x = 0
            regions = {"red_cube": ((-0.10, -0.04), ws.y), "green_cube": ((0.05, 0.15), ws.y)}
        elif self.task.name == "drawer":
            regions = {"apple": ((0.0, 0.12), (-0.15, 0.15))}
        else:
            names = [*self._names, *(name for name, _ in self.task.targets)]
            regions = {name: (ws.x, (ws.y[0] + 0.02, ws.y[1] - 0.02)) for name in names}
        for _ in range(1000):
            layout = {name: (float(rng.uniform(*xr)), float(rng.uniform(*yr))) for name, (xr, yr) in regions.items()}
            if all(self._apart(a, b, layout) for i, a in enumerate(layout) for b in list(layout)[i + 1 :]):
                return layout
        raise RuntimeError(f"PrimitiveSkill {self.task.name}: could not place the objects apart in 1000 draws")

    def _apart(self, a: str, b: str, layout: dict[str, tuple[float, float]]) -> bool:
        """Whether two objects start far enough apart for the task to be solvable without clearing the way."""
        if self.task.name == "align":  # both cubes end on the line x = 0: their y must differ by a cube and more
            return abs(layout[a][1] - layout[b][1]) >= 0.075
        gap = 0.11 if a.endswith("target") or b.endswith("target") else 0.075
        return math.dist(layout[a], layout[b]) >= gap

    def _set_free_body(self, name: str, xy: tuple[float, float], yaw: float) -> None:
        adr = self.model.joint(name).qposadr[0]
        z = APPLE_RADIUS if name == "apple" else CUBE_HALF
        self.data.qpos[adr : adr + 3] = (*xy, z)
        self.data.qpos[adr + 3 : adr + 7] = (math.cos(yaw / 2), 0.0, 0.0, math.sin(yaw / 2))

    def canonical_action(self, action: Any) -> str | None:
        skill = parse_skill(action)
        return None if skill is None else skill_text(skill.name, skill.coords)

    def _step(self, action: str) -> StepOutcome:
        skill = parse_skill(action)
        assert skill is not None  # canonical_action let it through
        before_worth, before = self._worth(), self._snapshot()
        points = [self.task.workspace.clip(np.array(skill.coords[k : k + 3])) for k in range(0, len(skill.coords), 3)]
        if skill.name == "pick":
            self._pick(points[0])
        elif skill.name == "place":
            self._place(points[0])
        else:
            self._push(points[0], points[1])
        self._last_action = action
        fell = [name for name in self._names if self.position(name)[2] < FALLEN_Z]
        success = self.success()
        reward = self._worth() - before_worth - STEP_COST
        info: dict[str, Any] = {"stage": self.stage(), "fell": fell}
        return StepOutcome(reward, terminated=success or bool(fell), success=success,
                           effective=self._snapshot() != before, info=info)

    # ----------------------------------------------------------------- skills
    def _travel(self, xy: np.ndarray, yaw: float = 0.0) -> None:
        """Rise to the safe height, then fly there and turn to ``yaw``."""
        pose = self.gripper.pose(self.data)
        self.gripper.move(self.data, np.array([pose[0], pose[1], SAFE_HEIGHT, pose[3]]), settle=0.0)
        self.gripper.move(self.data, np.array([xy[0], xy[1], SAFE_HEIGHT, yaw]), settle=0.05)

    def _go_home(self) -> None:
        self._travel(np.array(HOME[:2]))
        mujoco.mj_step(self.model, self.data, 100)  # let what was released come to rest

    def _pick(self, point: np.ndarray) -> None:
        self.gripper.set_fingers(self.data, closed=False, duration=0.2)
        self._travel(point[:2])
        self.gripper.move(self.data, np.array([point[0], point[1], max(point[2], MIN_TCP_HEIGHT), 0.0]))
        self.gripper.set_fingers(self.data, closed=True)
        self._go_home()

    def _place(self, point: np.ndarray) -> None:
        self._travel(point[:2])
        # Descend until the held object (or the fingers) would reach ``point``; a cube below stops the servo.
        self.gripper.move(self.data, np.array([point[0], point[1], max(point[2], MIN_TCP_HEIGHT), 0.0]))
        self.gripper.set_fingers(self.data, closed=False, duration=0.25)
        self._go_home()
        self.gripper.set_fingers(self.data, closed=False, duration=0.05)

    def _push(self, start: np.ndarray, end: np.ndarray) -> None:
        direction = end[:2] - start[:2]
        length = float(np.linalg.norm(direction))
        if length < 1e-4:  # nowhere to push to: the skill does nothing
            return
        unit = direction / length
        # The closed fingers' flat side leads: the finger (closing) axis, local y, points along the push.
        yaw = math.atan2(unit[1], unit[0]) - math.pi / 2
        yaw = (yaw + math.pi) % (2 * math.pi) - math.pi
        z_start, z_end = max(start[2], MIN_TCP_HEIGHT), max(end[2], MIN_TCP_HEIGHT)
        begin = start[:2] - unit * PUSH_START
        finish = end[:2] - unit * PUSH_END
        self.gripper.set_fingers(self.data, closed=True, duration=0.2)
        self._travel(begin, yaw)
        self.gripper.move(self.data, np.array([begin[0], begin[1], z_start, yaw]), settle=0.05)
        self.gripper.move(self.data, np.array([finish[0], finish[1], z_end, yaw]), settle=0.1)
        back = finish - unit * 0.02
        self.gripper.move(self.data, np.array([back[0], back[1], z_end, yaw]), settle=0.0)
        self._travel(np.array(HOME[:2]))
        self.gripper.set_fingers(self.data, closed=False, duration=0.2)

    # ----------------------------------------------------------------- state
    def position(self, name: str) -> np.ndarray:
        """World position (m) of an object or target body."""
        return self.data.body(name).xpos.copy()

    def grasped(self) -> str | None:
        """The object both fingers touch while it is off the table, or None."""
        for name in self._names:
            geom = self.model.geom(name).id
            if len(self.gripper.touching(self.data, geom)) == 2 and self.position(name)[2] > CUBE_HALF + 0.01:
                return name
        return None

    def drawer_opening(self) -> float:
        """How far the drawer is pulled out (m); 0 when shut."""
        return float(self.data.qpos[self.model.joint("drawer").qposadr[0]])

    def _drawer_points(self) -> tuple[np.ndarray, np.ndarray]:
        """(centre of the tray's floor top, centre of the handle) in world coordinates."""
        tray = self.data.body("drawer").xpos.copy()
        handle = self.data.geom("handle").xpos.copy()
        return tray + np.array([0.0, 0.0, 0.003]), handle

    def _on_top(self, upper: str, lower: str) -> bool:
        """VAGEN's test: centres within half an edge in xy, and ``upper`` higher by more than half an edge."""
        a, b = self.position(upper), self.position(lower)
        return bool(np.linalg.norm(a[:2] - b[:2]) < CUBE_HALF and a[2] > b[2] + CUBE_HALF)

    def _in_target(self, cube: str) -> bool:
        target = cube.replace("_cube", "_target")
        p = self.position(cube)
        return bool(np.linalg.norm(p[:2] - self.position(target)[:2]) <= 0.05 and p[2] < 2 * CUBE_HALF)

    def _aligned(self, cube: str) -> bool:
        p = self.position(cube)
        return bool(abs(p[0]) <= 0.01 and p[2] <= 0.05)

    def _apple_in_drawer(self) -> bool:
        tray, _ = self._drawer_points()
        apple = self.position("apple")
        inside = np.all(np.abs(apple[:2] - tray[:2]) <= DRAWER_INNER)
        return bool(inside and tray[2] <= apple[2] <= tray[2] + 0.06)

    def stages(self) -> list[bool]:
        """VAGEN's task stages in the current state (the last one is success)."""
        held = self.grasped()
        name = self.task.name
        if name == "align":
            return [self._aligned("red_cube"), self._aligned("red_cube") and self._aligned("green_cube")]
        if name == "place":
            red = self._in_target("red_cube") and held != "red_cube"
            return [held == "red_cube" or red, red and held == "green_cube",
                    red and self._in_target("green_cube") and held is None]
        if name == "stack":
            red_on_green = self._on_top("red_cube", "green_cube") and held != "red_cube"
            return [held == "red_cube" or red_on_green, red_on_green, red_on_green and held == "purple_cube",
                    red_on_green and self._on_top("purple_cube", "red_cube") and held is None]
        inside = self._apple_in_drawer() and held is None
        return [held == "apple" or inside, inside, inside and self.drawer_opening() <= 0.01]

    def stage(self) -> int:
        """The number of the highest stage reached, counting from 1 (0: none), as VAGEN counts."""
        return max((k + 1 for k, done in enumerate(self.stages()) if done), default=0)

    def success(self) -> bool:
        return self.stages()[-1]

    def _worth(self) -> float:
        """VAGEN's stage reward of the current state: 10 when solved, else 2 per stage reached."""
        return SUCCESS_WORTH if self.success() else STAGE_WORTH * self.stage()

    def _snapshot(self) -> tuple[Any, ...]:
        """Object positions (mm), the grasp and the drawer (mm): equal when an action changed nothing."""
        drawer = round(self.drawer_opening() * 1000) if self.task.drawer else None
        return (*(mm(self.position(name)) for name in self._names), self.grasped(), drawer)

    def positions(self) -> dict[str, tuple[int, ...]]:
        """Every named point of the scene in whole millimetres, VAGEN's ``*_pos`` entries."""
        points = {name: mm(self.position(name)) for name in self._names}
        points.update({name: mm(self.position(name)) for name, _ in self.task.targets})
        if self.task.drawer:
            tray, handle = self._drawer_points()
            points["drawer"], points["drawer_handle"] = mm(tray), mm(handle)
        return points

    # ----------------------------------------------------------------- views
    def text(self) -> str:
        listed = ", ".join(f"{name} ({', '.join(map(str, p))})" for name, p in self.positions().items())
        held = self.grasped()
        lines = [
            f"Human instruction: {self.task.instruction}",
            f"Workspace (mm): {self.task.workspace.describe()}.",
            f"Object positions (mm, x y z): {listed}.",
            f"Gripper: {'holding ' + held if held else 'empty'}.",
        ]
        if self.task.drawer:
            lines.append(f"Drawer opening: {round(self.drawer_opening() * 1000)} mm.")
        if self._last_action is not None:
            lines.append(f"Last action: {self._last_action}.")
        if self.is_image_mode:
            lines.insert(0, IMAGE_CAPTION)
        return "\n".join(lines)

    def image(self) -> np.ndarray:
        if self._renderer is None:
            self._renderer = _make_renderer(self.model, self.image_size)
        self._renderer.update_scene(self.data, camera="front")
        return np.array(self._renderer.render(), dtype=np.uint8)

    def instructions(self) -> str:
        ws = self.task.workspace.describe()
        seen = "an image of the table from the front and " if self.is_image_mode else ""
        return (
            "PrimitiveSkill. You control a robot gripper above a table. Each turn you see "
            f"{seen}the positions of the objects in millimetres. Task: {self.task.instruction} "
            "Actions (coordinates in whole millimetres):\n"
            "- pick(x, y, z): grasp the object at (x, y, z).\n"
            "- place(x, y, z): put the held object down with its centre at (x, y, z); it is fine to give a "
            "higher z, the object then drops onto what is below.\n"
            "- push(x1, y1, z1, x2, y2, z2): push the object at (x1, y1, z1) so that it ends at (x2, y2, z2).\n"
            f"The x axis points towards you, y to your right, z up. Workspace: {ws}; coordinates outside it are "
            f"clipped. Cubes are {round(2000 * CUBE_HALF)} mm wide. Example: pick(62,-55,20) then "
            "place(75,33,60) puts the cube at (62,-55,20) on the cube at (75,33,20). Reward: 2 per stage of the "
            f"task reached, {SUCCESS_WORTH:g} when it is done, -0.1 per action."
        )

    def action_names(self) -> list[str] | None:
        return None

    def state_facts(self) -> StateFacts:
        extra: dict[str, Any] = {name: p for name, p in self.positions().items()}
        extra["holding"] = self.grasped() or "nothing"
        if self.task.drawer:
            extra["drawer_opening_mm"] = round(self.drawer_opening() * 1000)
        return StateFacts(player=None, extra=extra)

    def state_key(self) -> str:
        return repr(self._snapshot())

    # ----------------------------------------------------------------- expert
    def solve(self) -> list[str] | None:
        """The scripted expert's actions from the current state (re-planned every turn by the expert policy).

        ``[]`` when the task is done or cannot be finished (an object fell, or
        the drawer was shut without the apple: there is no pull skill).
        """
        if self.success() or any(self.position(name)[2] < FALLEN_Z for name in self._names):
            return []
        held = self.grasped()
        plan: list[tuple[str, tuple[float, ...]]] = []
        if self.task.name == "align":
            for cube in ("red_cube", "green_cube"):
                p = self.position(cube)
                if held == cube:
                    plan.append(("place", (0.0, p[1], 2 * CUBE_HALF)))
                elif not self._aligned(cube):
                    plan.append(("push", (*p, 0.0, p[1], p[2])))
        elif self.task.name == "place":
            for cube in ("red_cube", "green_cube"):
                if self._in_target(cube) and held != cube:
                    continue
                target = self.position(cube.replace("_cube", "_target"))
                if held != cube:
                    plan.append(("pick", tuple(self.position(cube))))
                plan.append(("place", (target[0], target[1], 2 * CUBE_HALF)))
                held = None
        elif self.task.name == "stack":
            base = self.position("green_cube")
            for cube, level in (("red_cube", 1), ("purple_cube", 2)):
                below = "green_cube" if cube == "red_cube" else "red_cube"
                if self._on_top(cube, below) and held != cube:
                    continue
                if held != cube:
                    plan.append(("pick", tuple(self.position(cube))))
                plan.append(("place", (base[0], base[1], base[2] + 2 * CUBE_HALF * level + 0.01)))
                held = None
        else:
            tray, handle = self._drawer_points()
            if not self._apple_in_drawer():
                if self.drawer_opening() < 0.06:
                    return []
                if held != "apple":
                    plan.append(("pick", tuple(self.position("apple"))))
                plan.append(("place", (tray[0], tray[1], tray[2] + APPLE_RADIUS + 0.03)))
            shut = handle[0] - self.drawer_opening() - 0.02
            plan.append(("push", (handle[0], handle[1], handle[2], shut, handle[1], handle[2])))
        return [skill_text(name, coords) for name, coords in plan]


def _make_renderer(model: mujoco.MjModel, size: int) -> Any:
    """An offscreen MuJoCo renderer, or a RuntimeError that says how to get one."""
    try:
        return mujoco.Renderer(model, size, size)
    except Exception as error:  # mujoco raises FatalError (or others) when no GL context can be made
        backend = os.environ.get("MUJOCO_GL", "")
        raise RuntimeError(
            f"MuJoCo could not open an offscreen OpenGL context (MUJOCO_GL={backend!r}): {error}. "
            "Install EGL (Debian: apt-get install libegl1) and set MUJOCO_GL=egl, or install OSMesa "
            "(libosmesa6) and set MUJOCO_GL=osmesa, before turnrl is imported; or use mode='text'."
        ) from error


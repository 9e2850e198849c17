"""The PrimitiveSkill scene in MuJoCo: a table, objects, a drawer and a gripper driven by a controller.

The scene is written in MJCF here (no downloaded assets). The gripper is a
gantry-mounted parallel-jaw hand: three slide joints (x, y, z) and a yaw hinge
carry the palm, two slide joints carry the fingers, and every joint is driven
by a MuJoCo position actuator (a PD servo with a force limit). A skill
(``pick``, ``place``, ``push``) is a sequence of waypoints for those servos;
MuJoCo's contact physics decides what happens to the objects: whether the
fingers' friction holds a cube, whether a placed cube stays on the one below,
how far a push slides it.

Units are metres, radians and seconds. The table top is the plane ``z = 0``;
the camera looks along ``-x`` (``-y`` is on its left), as in VAGEN's scenes.

MuJoCo needs an OpenGL backend for images: this module sets ``MUJOCO_GL=egl``
before importing mujoco unless the variable is already set (``osmesa`` also
works where Mesa's OSMesa is installed).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

os.environ.setdefault("MUJOCO_GL", "egl")  # must precede the mujoco import: the backend is chosen on import

import mujoco  # noqa: E402
import numpy as np  # noqa: E402

CUBE_HALF = 0.02
"""Half the edge of a cube (4 cm cubes, as VAGEN's ManiSkill scenes)."""
APPLE_RADIUS = 0.025
FINGER_HALF = np.array([0.018, 0.006, 0.022])
"""Half sizes of a finger pad: 3.6 cm wide (x), 1.2 cm thick (y, the closing axis), 4.4 cm tall."""
FINGER_OPEN = 0.045
"""Finger joint position when open: the pads' inner faces are 7.8 cm apart, room for a cube turned 45 degrees."""
SAFE_HEIGHT = 0.16
"""Height of the tool centre point while the gripper travels between skills."""
MIN_TCP_HEIGHT = FINGER_HALF[2] + 0.002
"""Lowest tool centre point: the finger tips stay 2 mm above the table."""
PUSH_START = CUBE_HALF * np.sqrt(2) + 2 * FINGER_HALF[1] + 0.005
"""How far behind a push's start point the closed fingers' centre comes down: half a cube's diagonal (a cube
may be turned), the closed pads' half thickness, 5 mm of air."""
PUSH_END = CUBE_HALF + 2 * FINGER_HALF[1]
"""How far behind a push's end point the fingers' centre stops: a pushed cube turns its face to the flat
pads, so its centre then lies at the end point."""

DRAWER_RANGE = 0.12
"""Travel of the drawer (m): 0 is closed, 0.12 fully open."""
DRAWER_INNER = np.array([0.05, 0.065])
"""Half sizes (x, y) of the drawer tray's floor."""
CABINET_X = -0.20
"""x of the cabinet's front face; the drawer slides out towards +x."""

TIMESTEP = 0.002
SERVO_SPEED = 0.6
"""Top speed (m/s) of a waypoint move of the gripper."""


def _cube_body(name: str, rgba: str) -> str:
    return (
        f'<body name="{name}" pos="0 0 {CUBE_HALF}"><freejoint name="{name}"/>'
        f'<geom name="{name}" type="box" size="{CUBE_HALF} {CUBE_HALF} {CUBE_HALF}" rgba="{rgba}" mass="0.05"/>'
        "</body>"
    )


def _target_body(name: str, rgba: str) -> str:
    # A flat disc that only shows where a goal is: no collisions (contype/conaffinity 0); a mocap body, so
    # each episode moves it in MjData and the compiled model is never changed.
    return (
        f'<body name="{name}" pos="0 0 0.0005" mocap="true">'
        f'<geom name="{name}" type="cylinder" size="0.05 0.0005" rgba="{rgba}" contype="0" conaffinity="0"/></body>'
    )


def _drawer_bodies() -> str:
    """A cabinet (top, sides, back) with a drawer tray on a slide joint along x, its handle facing +x."""
    inner_x, inner_y = DRAWER_INNER
    wall, height = 0.005, 0.04
    depth = 2 * inner_x + 2 * wall
    back = CABINET_X - depth - 0.01
    cab_half_y = inner_y + 2 * wall + 0.005
    top_z = height + 0.055  # the palm (5 to 7 cm above a push) passes under the top when pushing it shut
    cabinet = (
        f'<body name="cabinet" pos="0 0 0">'
        f'<geom type="box" pos="{(CABINET_X + back) / 2} 0 {top_z}" size="{(CABINET_X - back) / 2} {cab_half_y} 0.006"'
        ' rgba="0.55 0.35 0.2 1"/>'
        f'<geom type="box" pos="{(CABINET_X + back) / 2} {cab_half_y} {top_z / 2}"'
        f' size="{(CABINET_X - back) / 2} 0.005 {top_z / 2}" rgba="0.55 0.35 0.2 1"/>'
        f'<geom type="box" pos="{(CABINET_X + back) / 2} {-cab_half_y} {top_z / 2}"'
        f' size="{(CABINET_X - back) / 2} 0.005 {top_z / 2}" rgba="0.55 0.35 0.2 1"/>'
        f'<geom type="box" pos="{back} 0 {top_z / 2}" size="0.005 {cab_half_y} {top_z / 2}" rgba="0.55 0.35 0.2 1"/>'
        "</body>"
    )
    # The tray's frame sits at the cabinet's front face when closed; its joint slides it out along +x.
    centre_x = CABINET_X - inner_x - wall
    tray = (
        f'<body name="drawer" pos="{centre_x} 0 0.004">'
        f'<joint name="drawer" type="slide" axis="1 0 0" range="0 {DRAWER_RANGE}" damping="4" frictionloss="0.3"/>'
        f'<geom name="drawer_floor" type="box" size="{inner_x + wall} {inner_y + wall} 0.003" rgba="0.8 0.6 0.35 1"'
        ' mass="0.3"/>'
        f'<geom name="drawer_front" type="box" pos="{inner_x + wall / 2} 0 {height / 2}"'
        f' size="{wall / 2} {inner_y + wall} {height / 2}" rgba="0.8 0.6 0.35 1" mass="0.05"/>'
        f'<geom type="box" pos="{-inner_x - wall / 2} 0 {height / 2}" size="{wall / 2} {inner_y + wall} {height / 2}"'
        ' rgba="0.8 0.6 0.35 1" mass="0.05"/>'
        f'<geom type="box" pos="0 {inner_y + wall / 2} {height / 2}" size="{inner_x} {wall / 2} {height / 2}"'
        ' rgba="0.8 0.6 0.35 1" mass="0.05"/>'
        f'<geom type="box" pos="0 {-inner_y - wall / 2} {height / 2}" size="{inner_x} {wall / 2} {height / 2}"'
        ' rgba="0.8 0.6 0.35 1" mass="0.05"/>'
        f'<geom name="handle" type="box" pos="{inner_x + wall + 0.012} 0 {height / 2}" size="0.012 0.03 0.006"'
        ' rgba="0.25 0.25 0.25 1" mass="0.02"/>'
        "</body>"
    )
    return cabinet + tray


@dataclass(frozen=True)
class SceneObject:
    """A movable object of a scene: its body name and what it looks like."""

    name: str
    kind: str
    """``"cube"`` or ``"apple"``."""
    rgba: str


def scene_xml(objects: tuple[SceneObject, ...], targets: tuple[tuple[str, str], ...], drawer: bool) -> str:
    """The MJCF of a scene with ``objects``, flat goal ``targets`` (name, rgba) and optionally the drawer."""
    bodies = []
    for obj in objects:
        if obj.kind == "cube":
            bodies.append(_cube_body(obj.name, obj.rgba))
        else:
            bodies.append(
                f'<body name="{obj.name}" pos="0 0 {APPLE_RADIUS}"><freejoint name="{obj.name}"/>'
                f'<geom name="{obj.name}" type="sphere" size="{APPLE_RADIUS}" rgba="{obj.rgba}" mass="0.06"/></body>'
            )
    bodies += [_target_body(name, rgba) for name, rgba in targets]
    if drawer:
        bodies.append(_drawer_bodies())
    fx, fy, fz = FINGER_HALF
    return f"""
<mujoco model="primitive_skill">
  <compiler angle="radian" autolimits="true"/>
  <option timestep="{TIMESTEP}" cone="elliptic" impratio="10" integrator="implicitfast"/>
  <visual><global offwidth="640" offheight="640"/><quality shadowsize="1024"/></visual>
  <default>
    <geom friction="1.0 0.01 0.001" condim="4" solref="0.004 1"/>
    <default class="finger"><geom friction="2.0 0.02 0.002" condim="6" rgba="0.2 0.2 0.25 1"/></default>
  </default>
  <asset>
    <texture name="sky" type="skybox" builtin="gradient" rgb1="0.75 0.82 0.9" rgb2="0.35 0.4 0.5" width="32"
      height="192"/>
    <texture name="floor" type="2d" builtin="checker" rgb1="0.85 0.85 0.85" rgb2="0.75 0.75 0.75" width="64"
      height="64"/>
    <material name="floor" texture="floor" texrepeat="8 8"/>
  </asset>
  <worldbody>
    <light pos="0.4 0.2 0.9" dir="-0.4 -0.2 -1" diffuse="0.8 0.8 0.8" castshadow="true"/>
    <light pos="-0.3 -0.3 0.8" dir="0.3 0.3 -1" diffuse="0.3 0.3 0.3" castshadow="false"/>
    <geom name="floor" type="plane" pos="0 0 -0.76" size="2 2 0.1" material="floor"/>
    <geom name="table" type="box" pos="0 0 -0.02" size="0.45 0.4 0.02" rgba="0.93 0.9 0.82 1"/>
    <camera name="front" pos="0.40 0 0.40" xyaxes="0 1 0 -0.666 0 0.746" fovy="52"/>
    <body name="gantry" pos="0 0 0" gravcomp="1">
      <joint name="x" type="slide" axis="1 0 0" range="-0.45 0.45" damping="40"/>
      <joint name="y" type="slide" axis="0 1 0" range="-0.45 0.45" damping="40"/>
      <joint name="z" type="slide" axis="0 0 1" range="0 0.4" damping="40"/>
      <joint name="yaw" type="hinge" axis="0 0 1" range="-3.2 3.2" damping="2"/>
      <geom name="palm" type="box" pos="0 0 {fz + 0.012}" size="0.02 0.06 0.01" rgba="0.3 0.3 0.35 1" mass="0.4"/>
      <geom name="wrist" type="cylinder" pos="0 0 {fz + 0.06}" size="0.012 0.04" rgba="0.5 0.5 0.55 1" mass="0.1"
        contype="0" conaffinity="0"/>
      <site name="tcp" pos="0 0 0" size="0.004" rgba="1 0 0 0"/>
      <body name="finger_left" pos="0 {-FINGER_OPEN} 0" gravcomp="1">
        <joint name="finger_left" type="slide" axis="0 1 0" range="0 {FINGER_OPEN}" damping="5"/>
        <geom name="finger_left" class="finger" type="box" size="{fx} {fy} {fz}" mass="0.05"/>
      </body>
      <body name="finger_right" pos="0 {FINGER_OPEN} 0" gravcomp="1">
        <joint name="finger_right" type="slide" axis="0 -1 0" range="0 {FINGER_OPEN}" damping="5"/>
        <geom name="finger_right" class="finger" type="box" size="{fx} {fy} {fz}" mass="0.05"/>
      </body>
    </body>
    {"".join(bodies)}
  </worldbody>
  <actuator>
    <position name="x" joint="x" kp="4000" kv="120" forcerange="-80 80"/>
    <position name="y" joint="y" kp="4000" kv="120" forcerange="-80 80"/>
    <position name="z" joint="z" kp="4000" kv="120" forcerange="-80 80"/>
    <position name="yaw" joint="yaw" kp="60" kv="4" forcerange="-10 10"/>
    <position name="finger_left" joint="finger_left" kp="400" kv="10" forcerange="-12 12"/>
    <position name="finger_right" joint="finger_right" kp="400" kv="10" forcerange="-12 12"/>
  </actuator>
</mujoco>
"""


class Gripper:
    """Drives the gantry gripper of a compiled scene through its position servos.

    Joint positions of the gantry are the tool centre point (the point between
    the finger pads' centres) in world coordinates, so a waypoint is simply
    ``(x, y, z, yaw)``; the fingers are open (0) or closed (``FINGER_OPEN``).
    """

    def __init__(self, model: mujoco.MjModel) -> None:
        self.model = model
        self.joint_qpos = [model.joint(name).qposadr[0] for name in ("x", "y", "z", "yaw")]
        self.finger_qpos = [model.joint(name).qposadr[0] for name in ("finger_left", "finger_right")]
        self.finger_geoms = {model.geom("finger_left").id, model.geom("finger_right").id}

    def pose(self, data: mujoco.MjData) -> np.ndarray:
        """``(x, y, z, yaw)`` of the tool centre point now."""
        return np.array([data.qpos[i] for i in self.joint_qpos])

    def reset(self, data: mujoco.MjData, xyz: tuple[float, float, float]) -> None:
        """Put the gripper, open, at ``xyz`` (before ``mj_forward``) with its servos holding it there."""
        for adr, value in zip(self.joint_qpos, (*xyz, 0.0)):
            data.qpos[adr] = value
        data.ctrl[:4] = (*xyz, 0.0)
        data.ctrl[4:6] = 0.0

    def move(self, data: mujoco.MjData, target: np.ndarray, settle: float = 0.15, timeout: float = 1.5) -> None:
        """Move the servo set points in a straight line to ``target`` ``(x, y, z, yaw)`` at ``SERVO_SPEED``.

        Then let physics run until the gripper is within 2 mm of the target (it
        may never get there: a cube below stops a descent) or ``timeout``
        seconds pass, and ``settle`` seconds more.
        """
        start = np.array(data.ctrl[:4])
        distance = float(np.linalg.norm(target[:3] - start[:3]))
        ticks = max(1, int(np.ceil(distance / SERVO_SPEED / (10 * TIMESTEP))))
        for k in range(1, ticks + 1):
            data.ctrl[:4] = start + (target - start) * (k / ticks)
            mujoco.mj_step(self.model, data, 10)
        waited = 0.0
        while waited < timeout and np.linalg.norm(self.pose(data)[:3] - target[:3]) > 0.002:
            mujoco.mj_step(self.model, data, 10)
            waited += 10 * TIMESTEP
        mujoco.mj_step(self.model, data, max(1, int(settle / TIMESTEP)))

    def set_fingers(self, data: mujoco.MjData, closed: bool, duration: float = 0.35) -> None:
        """Open or close the fingers (force-limited: they stop on whatever they grip) and wait ``duration`` s."""
        data.ctrl[4:6] = FINGER_OPEN if closed else 0.0
        mujoco.mj_step(self.model, data, int(duration / TIMESTEP))

    def touching(self, data: mujoco.MjData, geom: int) -> set[int]:
        """The finger geoms in contact with ``geom``."""
        found = set()
        for contact in data.contact[: data.ncon]:
            pair = {int(contact.geom1), int(contact.geom2)}
            if geom in pair:
                found |= pair & self.finger_geoms
        return found

"""Navigation (MiniWorld): conformance, seeded layouts, dynamics, the solver, views, headless OpenGL."""

import copy
import json
import math
import os
import subprocess
import sys
import warnings
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.envs.registration import EnvSpec
from gymnasium.utils.env_checker import check_env as gym_check_env
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.envs.games.episodes import assert_same_episode, expert_or
from turnrl.envs import check_env
from turnrl.envs.games.navigation.gl import GL_ENV_VAR, choose_backend, miniworld_modules
from turnrl.envs.games.navigation.layouts import (
    CATALOG,
    FOOTPRINT,
    LAYOUT_KINDS,
    Layout,
    ObjectSpec,
    RoomSpec,
    draw_layout,
)
from turnrl.envs.games.navigation.navigation_env import (
    ACTIONS,
    SECTORS,
    NavigationEnv,
    NavigationFacts,
    bearing,
    direction_words,
    move_delta,
    sector,
)
from turnrl.envs.seeds import SeedSplits
from turnrl.rewards.matching import MatchItem, RuleMatcher, parse_relation

SPEC = EnvSpec("turnrl/Navigation-v0", entry_point="turnrl.envs.games.navigation:NavigationEnv")


def open_room(objects, start=(2.0, 4.0), heading=0, size=8.0):
    """One empty square room with the given objects (target first); the agent at ``start`` facing ``heading``."""
    room = RoomSpec(0.0, size, 0.0, size, "brick_wall", "floor_tiles_bw")
    return Layout("one_room", (room,), (), tuple(objects), start[0], start[1], heading)


RED_BOX = ObjectSpec("red box", "box", "red", 0.7, 6.0, 4.0, 0.0)
BLUE_BALL = ObjectSpec("blue ball", "ball", "blue", 0.6, 2.0, 7.0, 0.0)


@pytest.fixture(scope="module")
def text_env():
    return NavigationEnv(mode="text")


@pytest.fixture(scope="module")
def image_env():
    return NavigationEnv(mode="image")


# --------------------------------------------------------------------------- conformance
@pytest.mark.parametrize("mode", ["image", "text"])
def test_turnrl_check_env(mode):
    check_env(NavigationEnv(mode=mode))


@pytest.mark.parametrize(("mode", "render_mode"), [("image", "rgb_array"), ("text", "ansi"), ("text", None)])
def test_gymnasium_check_env(mode, render_mode):
    env = gym.make(SPEC, mode=mode, render_mode=render_mode, layouts=["one_room"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gym_check_env(env.unwrapped)


def test_bad_settings_say_what_to_do():
    with pytest.raises(ValueError, match="layouts must be"):
        NavigationEnv(layouts=["mansion"])
    with pytest.raises(ValueError, match="num_objects"):
        NavigationEnv(num_objects=0)
    with pytest.raises(ValueError, match="step_length"):
        NavigationEnv(step_length=2.0)
    with pytest.raises(ValueError, match="image_size"):
        NavigationEnv(image_size=(8, 8))
    with pytest.raises(ValueError, match="success_reward"):  # every success would pay NaN
        NavigationEnv(success_reward=float("nan"))
    with pytest.raises(ValueError, match="unknown mode"):
        NavigationEnv(mode="video")
    env = NavigationEnv()
    with pytest.raises(ValueError, match="navigation.layouts.Layout"):
        env.reset(seed=0, options={"layout": "one room please"})


# --------------------------------------------------------------------------- layouts
@pytest.mark.parametrize("kind", LAYOUT_KINDS)
def test_layouts_are_well_formed(kind):
    for seed in range(25):
        layout = draw_layout(np.random.default_rng(seed), (kind,), 6)
        assert layout is not None and layout.kind == kind
        names = [obj.name for obj in layout.objects]
        assert len(set(names)) == len(names) == 6  # the instruction's name is unique
        for obj in layout.objects:
            room = layout.room_of(obj.x, obj.z)
            assert room is not None and layout.rooms[room].contains(obj.x, obj.z, FOOTPRINT)
        spots = [(o.x, o.z, FOOTPRINT) for o in layout.objects] + [(layout.start_x, layout.start_z, 0.4)]
        for k, (x, z, r) in enumerate(spots):
            assert all(math.hypot(x - x2, z - z2) >= r + r2 + 0.9 - 1e-9 for x2, z2, r2 in spots[k + 1 :])
        for door in layout.doors:
            a, b = layout.rooms[door.a], layout.rooms[door.b]
            lo, hi = (max(a.min_x, b.min_x), min(a.max_x, b.max_x)) if door.axis == "x" else (
                max(a.min_z, b.min_z), min(a.max_z, b.max_z))
            assert lo < door.lo < door.hi < hi and door.hi - door.lo >= 1.6 - 1e-9


def test_catalog_footprints_fit_miniworld():
    entity = miniworld_modules().entity
    for entry in CATALOG:
        if entry.kind == "box":
            ent = entity.Box(color=entry.color, size=entry.size)
        elif entry.kind == "ball":
            ent = entity.Ball(color=entry.color, size=entry.size)
        else:
            ent = entity.MeshEnt(mesh_name=entry.kind, height=entry.size)
        assert ent.radius <= FOOTPRINT, entry


def test_same_seed_same_episode_different_seeds_differ(text_env):
    other = NavigationEnv(mode="text")
    layouts = []
    for seed in (0, 1, 2, 10_000, 10_001):
        obs, _ = text_env.reset(seed=seed)
        again, _ = other.reset(seed=seed)
        assert obs == again and text_env._layout == other._layout
        layouts.append(text_env._layout)
    assert len({repr(layout) for layout in layouts}) == len(layouts)


def test_same_seed_same_whole_episode_infos_included(text_env):
    """The expert's moves with an unknown action between: the same views, distances and flags on both plays, the
    second after another episode (a fresh env's reset is checked above; the image mode's frames by the turnrl
    checker's replay)."""
    episode = assert_same_episode(text_env, text_env, 5, expert_or("fly", every=3), 6)
    assert {step.info.get("action_is_valid") for step in episode[1:]} == {True, False}


def test_validation_and_training_seeds_draw_different_episodes(text_env):
    splits = SeedSplits()
    seen = set()
    for seed in splits.val_seeds(15) + splits.train_seeds(0, 15):
        text_env.reset(seed=seed)
        seen.add(repr(text_env._layout))
    assert len(seen) == 30


# --------------------------------------------------------------------------- dynamics
def test_moves_follow_the_heading(text_env):
    text_env.reset(seed=0, options={"layout": open_room([RED_BOX], start=(2.0, 2.0), heading=0)})
    assert move_delta("moveahead", 0) == (1, 0) and move_delta("moveright", 0) == (0, 1)
    _, reward, terminated, _, info = text_env.step("moveahead")
    assert text_env._cell == (1, 0) and info["action_is_effective"] and reward == 0 and not terminated
    text_env.step("rotateleft")  # now facing -z: ahead is (0, -1), right is (+1, 0)
    assert text_env._heading == 1
    text_env.step("moveright")
    assert text_env._cell == (2, 0)
    text_env.step("moveback")
    assert text_env._cell == (2, 1)
    text_env.step("rotateright")
    text_env.step("moveleft")
    assert text_env._cell == (2, 0) and text_env._heading == 0


def test_walls_and_objects_block_moves(text_env):
    # The agent 0.8 m from the west wall (x=0) facing -x: one step would put its 0.4 m body into the wall.
    obs, _ = text_env.reset(seed=0, options={"layout": open_room([RED_BOX], start=(0.8, 4.0), heading=2)})
    after, reward, terminated, truncated, info = text_env.step("moveahead")
    assert not info["action_is_effective"] and info["action_is_valid"] and text_env._cell == (0, 0)
    assert after == obs and "right in front of you" in after["text"]
    # A blue ball straight ahead stops the agent short of it.
    ball = ObjectSpec("blue ball", "ball", "blue", 0.6, 4.0, 4.0, 0.0)
    text_env.reset(seed=0, options={"layout": open_room([RED_BOX, ball], start=(2.0, 4.0), heading=0)})
    assert text_env.clear_ahead() == 2  # 1.0 m: body (0.4) + ball (0.42) fit, 1.5 m does not
    for _ in range(3):
        text_env.step("moveahead")
    assert text_env._cell == (2, 0)


def test_map_matches_miniworld_collision_everywhere(text_env):
    for seed in range(4):
        text_env.reset(seed=seed)
        world, (i0, j0) = text_env._world, text_env._origin
        rooms = text_env._layout.rooms
        for a in range(text_env._free.shape[0]):
            for b in range(text_env._free.shape[1]):
                x, z = text_env._xz(i0 + a, j0 + b)
                inside = min(r.min_x for r in rooms) < x < max(r.max_x for r in rooms) and min(
                    r.min_z for r in rooms) < z < max(r.max_z for r in rooms)
                assert text_env._free[a, b] == (inside and not world.blocked(x, z)), (seed, x, z)


def test_camera_tilt_stays_in_range(text_env):
    text_env.reset(seed=0, options={"layout": open_room([RED_BOX])})
    assert text_env.step("lookup")[4]["action_is_effective"]
    assert not text_env.step("lookup")[4]["action_is_effective"]  # 30 degrees up is the limit
    for _ in range(3):
        text_env.step("lookdown")
    assert text_env._pitch == -60 and "tilted down 60 degrees" in text_env.text()
    assert not text_env.step("lookdown")[4]["action_is_effective"]


def test_success_within_threshold_pays_and_ends(text_env):
    text_env.reset(seed=0, options={"layout": open_room([RED_BOX], start=(3.0, 4.0))})
    assert text_env.distance_to_target() == pytest.approx(3.0)
    _, reward, terminated, _, info = text_env.step("moveahead")  # 2.5 m: not yet
    assert (reward, terminated, info["success"]) == (0.0, False, False) and info["distance"] == 2.5
    text_env.step("moveahead")  # 2.0 m
    _, reward, terminated, truncated, info = text_env.step("moveahead")  # 1.5 m: VAGEN's threshold
    assert (reward, terminated, truncated, info["success"]) == (10.0, True, False, True)
    _, reward, _, _, info = text_env.step("moveahead")  # the episode is over: actions are refused
    assert not info["action_is_valid"] and reward == 0.0


def test_truncation_at_max_steps():
    env = NavigationEnv(mode="text", max_steps=3, layouts=["one_room"])
    env.reset(seed=0, options={"layout": open_room([RED_BOX], start=(2.0, 2.0), heading=2)})
    flags = [env.step("rotateleft")[2:4] for _ in range(3)]
    assert flags == [(False, False), (False, False), (False, True)]


@settings(max_examples=60, deadline=None)
@given(action=st.text(max_size=80))
def test_any_action_string_is_data_never_an_error(text_env, action):
    text_env.reset(seed=0, options={"layout": open_room([RED_BOX])})
    _, reward, _, _, info = text_env.step(action)
    canonical = "".join(action.lower().split()).replace("_", "").strip("`")
    assert info["action_is_valid"] == (canonical in ACTIONS)
    assert math.isfinite(reward)


def test_action_spellings(text_env):
    assert [text_env.canonical_action(a) for a in ("MoveAhead", " move ahead ", "move_ahead", "`rotateleft`")] == [
        "moveahead", "moveahead", "moveahead", "rotateleft"]
    assert text_env.canonical_action("fly") is None and text_env.canonical_action(3) is None


# --------------------------------------------------------------------------- solver
def test_expert_solves_validation_seeds_within_the_budget():
    env = NavigationEnv(mode="text")
    for seed in SeedSplits().val_seeds(8):
        env.reset(seed=seed)
        plan = env.solve()
        assert plan is not None and 3 <= len(plan) <= env.max_steps
        for action in plan:
            _, _, terminated, truncated, info = env.step(action)
        assert terminated and info["success"] and not truncated, seed


def test_plan_suffix_is_the_plan(text_env):
    text_env.reset(seed=3)
    plan = text_env.solve()
    for k, action in enumerate(plan[:-1]):
        text_env.step(action)
        assert text_env.solve() == plan[k + 1 :]


def test_solve_leaves_the_state_alone_and_prefers_walking_forward(text_env):
    text_env.reset(seed=0, options={"layout": open_room([RED_BOX], start=(2.0, 4.0), heading=2)})
    before = (text_env._cell, text_env._heading, text_env.state_facts())
    plan = text_env.solve()
    # Turn around, then walk 2.5 m to 1.5 m from the box (five backward steps are fewer actions but cost more).
    assert plan[:2] in (["rotateleft"] * 2, ["rotateright"] * 2) and plan[2:] == ["moveahead"] * 5
    assert (text_env._cell, text_env._heading, text_env.state_facts()) == before


# --------------------------------------------------------------------------- views and facts
@pytest.mark.parametrize(("vertical", "horizontal"), SECTORS)
def test_direction_words_state_both_axes_as_the_state_rewards_read_them(vertical, horizontal):
    """The matcher reads an unstated axis as wrong: "ahead" alone scored half of a target straight ahead."""
    assert parse_relation(direction_words(vertical, horizontal)) == (vertical, horizontal)


def test_the_experts_description_scores_one_on_the_state_rewards(text_env):
    """What the expert writes in <observation> (``describe()``) is exactly right by the grounding rule; it scored
    0.5 before, as "ahead" and "behind" were not words the rule knew."""
    text_env.reset(seed=0, options={"layout": open_room([RED_BOX, BLUE_BALL])})
    matcher, relations = RuleMatcher(), set()
    for action in ["rotateright", "rotateright", "rotateright", "moveleft", "rotateright", "moveahead"]:
        facts = text_env.state_facts()
        relations |= {(fact.vertical, fact.horizontal) for fact in facts.objects}
        assert matcher.score_one(MatchItem(facts.describe(), facts, "Navigation", "observation")) == 1.0
        text_env.step(action)
    assert {("ahead", "same"), ("same", "left"), ("behind", "same")} <= relations


def test_target_seen_when_faced_and_hidden_behind(image_env):
    obs, _ = image_env.reset(seed=0, options={"layout": open_room([RED_BOX, BLUE_BALL])})
    image = obs["image"]
    assert image.shape == (224, 224, 3) and image.dtype == np.uint8
    red = (image[..., 0] > 150) & (image[..., 1] < 60) & (image[..., 2] < 60)
    assert red[:, 80:144].sum() > 200  # the red box is straight ahead, in the middle of the frame
    facts = image_env.state_facts()
    assert isinstance(facts, NavigationFacts) and facts.target == "red box"
    first = facts.sightings[0]
    assert (first.name, first.direction, first.distance, first.visible) == ("red box", "straight ahead", 4.0, True)
    assert [s.name for s in facts.sightings] == ["red box"]  # the ball is 90 degrees right: out of a 90-degree view
    assert "The target, the red box, is straight ahead, 4.0 m away; I can see it." in facts.describe()
    assert obs["text"] == "Human instruction: Navigate to the red box and be as close as possible to it."
    image_env.step("rotateright")  # facing +z: the ball comes into view ahead, the box is now to the left
    facts = image_env.state_facts()
    assert facts.sightings[0].direction == "directly to the left" and not facts.sightings[0].visible
    assert [(s.name, s.direction, s.distance) for s in facts.sightings[1:]] == [("blue ball", "straight ahead", 3.0)]
    assert "I also see the blue ball straight ahead, 3.0 m away." in facts.describe()
    level = image_env.image()
    tilted, *_ = image_env.step("lookdown")
    assert not np.array_equal(tilted["image"], level)  # the camera tilts: a different frame of the same spot
    image_env.step("lookup")
    assert np.array_equal(image_env.image(), level)
    obs, *_ = image_env.step("rotateright")  # facing -x: the box is behind
    red = (obs["image"][..., 0] > 150) & (obs["image"][..., 1] < 60) & (obs["image"][..., 2] < 60)
    assert red.sum() == 0


def test_text_mode_describes_the_view(text_env):
    obs, _ = text_env.reset(seed=0, options={"layout": open_room([RED_BOX, BLUE_BALL], start=(2.0, 4.0))})
    assert obs["text"].splitlines() == [
        "Human instruction: Navigate to the red box and be as close as possible to it.",
        "You see the red box straight ahead, 4.0 m away. You can move ahead 6 steps (3 m).",
    ]
    obs, *_ = text_env.step("rotateleft")  # facing -z: the wall is 4 m ahead, nothing in view
    assert "You see no objects" in obs["text"]


def test_bearings_and_sectors():
    assert bearing(1.0, 0.0, 0) == 0.0 and bearing(0.0, 1.0, 0) == 90.0 and bearing(0.0, -1.0, 0) == -90.0
    assert sector(bearing(-1.0, 0.0, 0)) == ("behind", "same") and sector(30.0) == ("ahead", "right")


def test_worlds_in_one_process_do_not_mix(image_env):
    """MiniWorld compiles every world's rooms into one shared display list; each env must still draw its own."""
    first = image_env.reset(seed=1)[0]["image"]
    other = NavigationEnv(mode="image")
    other.reset(seed=2)
    other.image()
    assert np.array_equal(image_env.image(), first)
    assert np.array_equal(NavigationEnv(mode="image").reset(seed=1)[0]["image"], first)


def test_deepcopy_steps_independently(image_env):
    image_env.reset(seed=4)
    before = image_env.image()
    shadow = copy.deepcopy(image_env)
    plan = shadow.solve()
    for action in plan:
        shadow.step(action)
    assert shadow.success() and not image_env.success()
    assert np.array_equal(image_env.image(), before) and image_env.solve() == plan
    shadow.close()  # a copy leaves the shared world to the env it came from
    image_env.step("rotateleft")
    assert image_env.image().shape == (224, 224, 3)


def test_top_view(image_env):
    image_env.reset(seed=0)
    top = image_env.top_view()
    assert top.shape == (224, 224, 3) and len(np.unique(top.reshape(-1, 3), axis=0)) > 10


# --------------------------------------------------------------------------- OpenGL routes
def test_backend_choice():
    assert choose_backend("auto", has_display=True, has_egl=True, has_xvfb=True) == "display"
    assert choose_backend("auto", has_display=False, has_egl=True, has_xvfb=True) == "egl"
    assert choose_backend("auto", has_display=False, has_egl=False, has_xvfb=True) == "xvfb"
    assert choose_backend("xvfb", has_display=True, has_egl=True, has_xvfb=True) == "xvfb"
    with pytest.raises(RuntimeError, match="apt-get install"):
        choose_backend("auto", has_display=False, has_egl=False, has_xvfb=False)
    with pytest.raises(RuntimeError, match=GL_ENV_VAR):
        choose_backend("vulkan", has_display=False, has_egl=True, has_xvfb=True)


def test_xvfb_route_renders_the_same_frame(image_env):
    """A fresh process without a display, forced onto Xvfb, draws what this process draws (EGL or a display).

    With the same OpenGL renderer (Mesa's llvmpipe for both on a CPU machine) the frames are byte-identical;
    with different ones (a GPU's EGL driver here) they agree to a few grey levels.
    """
    script = (
        "import json, sys; sys.path.insert(0, 'tests/envs/games/navigation');"
        "from test_navigation import open_room, RED_BOX, BLUE_BALL;"
        "from turnrl.envs.games.navigation import NavigationEnv; from turnrl.envs.games.navigation.gl import ensure_gl;"
        "env = NavigationEnv(); obs, _ = env.reset(seed=0, options={'layout': open_room([RED_BOX, BLUE_BALL])});"
        "from pyglet.gl import gl_info;"
        "print(json.dumps([ensure_gl(), gl_info.get_renderer(), obs['image'].tolist()]))"
    )
    environ = {k: v for k, v in os.environ.items() if k != "DISPLAY"} | {GL_ENV_VAR: "xvfb"}
    root = Path(__file__).resolve().parents[4]
    done = subprocess.run([sys.executable, "-c", script], env=environ, cwd=root, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    backend, renderer, pixels = json.loads(done.stdout.splitlines()[-1])
    assert backend == "xvfb"
    image = image_env.reset(seed=0, options={"layout": open_room([RED_BOX, BLUE_BALL])})[0]["image"]
    from pyglet.gl import gl_info

    theirs = np.array(pixels, dtype=np.uint8)
    if renderer == gl_info.get_renderer():
        assert np.array_equal(theirs, image)
    else:
        assert np.abs(theirs.astype(int) - image).mean() < 4.0


def test_the_xvfb_route_draws_on_after_ctrl_c_and_a_sigterm_sent_to_the_runs_process_group():
    """A run stopped by Ctrl-C or a scheduler's SIGTERM finishes its step: the private Xvfb, out of the run's process
    group, lives on and the frames are drawn. (Mesa's software renderer draws on without the server; a GPU's
    driver would not.)"""
    script = (
        "import os, signal, time; from turnrl.envs.games.navigation import NavigationEnv, gl;"
        "env = NavigationEnv(); first = env.reset(seed=0)[0]['image'];"
        "[signal.signal(n, signal.SIG_IGN) for n in (signal.SIGINT, signal.SIGTERM)];"
        "[os.killpg(os.getpgid(0), n) for n in (signal.SIGINT, signal.SIGTERM)]; time.sleep(0.5);"
        "assert gl._GL.xvfb is not None and gl._GL.xvfb.poll() is None, 'Xvfb ended';"
        "again = env.reset(seed=0)[0]['image']; assert (again == first).all(); print('drawn')"
    )
    environ = {k: v for k, v in os.environ.items() if k != "DISPLAY"} | {GL_ENV_VAR: "xvfb"}
    done = subprocess.run([sys.executable, "-c", script], env=environ, capture_output=True, text=True, timeout=120,
                          start_new_session=True)  # a process group of its own, as a run's
    assert done.returncode == 0 and "drawn" in done.stdout, done.stderr[-2000:]


@pytest.mark.slow
def test_expert_succeeds_on_100_validation_seeds_replanning_every_step():
    """The expert as ``turnrl eval --policy expert`` runs it: a fresh plan at every step, the env's step budget."""
    env = NavigationEnv(mode="text")
    solved = 0
    for seed in SeedSplits().val_seeds(100):
        env.reset(seed=seed)
        terminated = truncated = False
        while not (terminated or truncated):
            _, _, terminated, truncated, info = env.step(env.solve()[0])
        solved += bool(info["success"])
    assert solved >= 95

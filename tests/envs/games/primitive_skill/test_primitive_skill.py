"""PrimitiveSkill on MuJoCo: action parsing, conformance, determinism, physics of the skills, the expert."""

import copy
import warnings

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env as gym_check_env
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.envs.games.episodes import assert_same_episode
from turnrl.agent.expert import expert_fields
from turnrl.agent.formats import get_format
from turnrl.envs import check_env
from turnrl.envs.contract import MAX_TEXT_LENGTH, OBS_CHARSET
from turnrl.envs.games.primitive_skill.primitive_skill_env import TASKS, PrimitiveSkillEnv, Skill, parse_skill, skill_text
from turnrl.envs.games.primitive_skill.sim import CUBE_HALF

if "turnrl/PrimitiveSkill-v0" not in gym.registry:  # registered by turnrl.envs once the registry lists it
    gym.register(id="turnrl/PrimitiveSkill-v0", entry_point="turnrl.envs.games.primitive_skill:PrimitiveSkillEnv")


@pytest.fixture(scope="module")
def envs():
    """One text env per task, shared by the tests of this module (compiling a scene takes a few ms)."""
    made = {task: PrimitiveSkillEnv(task=task) for task in TASKS}
    yield made
    for env in made.values():
        env.close()


def cube(env, name):
    return env.position(name)


# --------------------------------------------------------------------------- parsing
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("pick(62,-55,20)", Skill("pick", (0.062, -0.055, 0.02))),
        ("  PICK ( 62 , -55 , 20 ) ", Skill("pick", (0.062, -0.055, 0.02))),
        ("place(75.4,33,+50)", Skill("place", (0.0754, 0.033, 0.05))),
        ("push(1,2,3,4,5,6)", Skill("push", (0.001, 0.002, 0.003, 0.004, 0.005, 0.006))),
        ("pick(62,-55)", None),
        ("push(1,2,3)", None),
        ("grab(1,2,3)", None),
        ("pick(1e3,2,3)", None),
        ("pick(nan,2,3)", None),
        ("pick(1,,3)", None),
        ("pick(1,2,3) place(1,2,3)", None),
        ("pick(12345678,2,3)", None),
        ("", None),
    ],
)
def test_parse_skill(text, expected):
    skill = parse_skill(text)
    if expected is None:
        assert skill is None
    else:
        assert skill is not None and skill.name == expected.name and skill.coords == pytest.approx(expected.coords)


@given(st.text(max_size=300))
@settings(max_examples=300, deadline=None)
def test_parse_skill_never_raises(text):
    skill = parse_skill(text)
    assert skill is None or (skill.name in ("pick", "place", "push") and len(skill.coords) in (3, 6))


@given(st.lists(st.integers(-9_999_999, 9_999_999), min_size=3, max_size=3), st.sampled_from(["pick", "place"]))
def test_skill_text_round_trips(coords, name):
    skill = parse_skill(f"{name}({', '.join(map(str, coords))})")
    assert skill is not None and skill_text(skill.name, skill.coords) == f"{name}({','.join(map(str, coords))})"


_SPELLED_NUMBER = st.one_of(st.integers(-9_999_999, 9_999_999).map(str),
                            st.decimals("-9999999.999999", "9999999.999999", places=6).map(str),
                            st.sampled_from(["9999999.9", "-9999999.5", "+.5", "0.", "9999999.499999"]))


@given(st.sampled_from(["pick", "place", "push"]), st.lists(_SPELLED_NUMBER, min_size=6, max_size=6))
@settings(max_examples=200, deadline=None)
def test_the_canonical_spelling_of_any_readable_action_reads_back(envs, name, numbers):
    """Found by fuzzing: ``pick(9999999.9,0,0)`` was read, spelled ``pick(10000000,0,0)`` (eight digits, which the
    grammar refuses), and step() raised AssertionError reading its own spelling back."""
    action = f"{name}({','.join(numbers[:6 if name == 'push' else 3])})"
    assert parse_skill(action) is not None
    spelled = envs["place"].canonical_action(action)
    assert spelled is not None and parse_skill(spelled) is not None


_COORD = st.one_of(st.integers(-10_000, 10_000), st.floats(-1e6, 1e6, allow_nan=False).map(lambda v: round(v, 3)))


@given(st.sampled_from(["pick", "place", "push"]), st.lists(_COORD, min_size=6, max_size=6), st.integers(0, 3))
@settings(max_examples=25, deadline=None)
def test_any_well_formed_action_keeps_the_simulation_sound(name, coords, seed):
    env = PrimitiveSkillEnv(task="stack")
    env.reset(seed=seed)
    count = 6 if name == "push" else 3
    obs, reward, terminated, truncated, info = env.step(f"{name}({','.join(map(str, coords[:count]))})")
    assert info["action_is_valid"] and np.isfinite(reward) and np.all(np.isfinite(env.data.qpos))
    assert all(-0.2 <= z <= 0.3 for _, _, z in (env.position(n) for n in ("red_cube", "green_cube", "purple_cube")))
    assert set(obs["text"]) <= OBS_CHARSET


def test_an_action_past_the_millimetre_limit_is_played_clipped(envs):
    env = envs["place"]
    env.reset(seed=1)
    _, reward, terminated, _, info = env.step("pick(9999999.9,0,0)")
    assert info["action_is_valid"] and not terminated and reward == pytest.approx(-0.1)


def test_non_strings_and_malformed_actions_are_invalid_and_change_nothing(envs):
    env = envs["place"]
    obs, _ = env.reset(seed=3)
    for action in (None, 5, b"pick(1,2,3)", "pick(1,2)", "lift(1,2,3)", "x" * 10_000):
        new_obs, reward, terminated, _, info = env.step(action)
        assert not info["action_is_valid"] and reward == 0.0 and not terminated
        assert new_obs["text"] == obs["text"]


# --------------------------------------------------------------------------- contracts
@pytest.mark.parametrize("mode", ["text", "image"])
def test_gymnasium_check_env(mode):
    env = gym.make("turnrl/PrimitiveSkill-v0", task="stack", mode=mode, image_size=64, render_mode="rgb_array")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gym_check_env(env.unwrapped)
    env.close()


@pytest.mark.parametrize("task", TASKS)
def test_turnrl_check_env(task, envs):
    check_env(envs[task], seed=11, steps=6)


def test_turnrl_check_env_image_mode():
    env = PrimitiveSkillEnv(task="drawer", mode="image", image_size=64)
    check_env(env, seed=2, steps=4)
    env.close()


def test_truncation_at_max_steps():
    env = PrimitiveSkillEnv(task="place", max_steps=2)
    env.reset(seed=1)
    flags = [env.step("pick(150,-200,20)")[2:4] for _ in range(2)]  # nothing there to pick
    assert flags == [(False, False), (False, True)]
    env.close()


def test_observation_text_names_every_object_with_its_position(envs):
    env = envs["drawer"]
    obs, info = env.reset(seed=0)
    text = obs["text"]
    assert info == {"success": False}
    assert "Human instruction: Put the apple in the drawer and close the drawer." in text
    for name, position in env.positions().items():
        assert f"{name} ({', '.join(map(str, position))})" in text
    assert "Drawer opening: 120 mm." in text and "Gripper: empty." in text
    assert len(text) <= MAX_TEXT_LENGTH and set(text) <= OBS_CHARSET
    assert env.state_facts().extra["apple"] == env.positions()["apple"]
    assert "pick(x, y, z)" in env.instructions() and env.action_names() is None


# --------------------------------------------------------------------------- determinism
def test_same_seed_same_episode_images_rewards_and_infos_included():
    """The whole transitions of the expert's first two skills, on a fresh env and on one that played seed 6 first
    (the simulator's state must not carry over), and the simulator's positions after them."""
    fresh, used = (PrimitiveSkillEnv(task="place", mode="image", image_size=96) for _ in range(2))
    episode = assert_same_episode(fresh, used, 5, lambda env, k: env.solve()[0], steps=2)
    assert np.array_equal(fresh.data.qpos, used.data.qpos)
    assert episode[0].image != episode[2].image  # the cube moved in the picture
    fresh.close(), used.close()


def test_seeds_give_different_layouts_inside_the_workspace(envs):
    env = envs["stack"]
    layouts = set()
    for seed in range(20):
        env.reset(seed=seed)
        positions = env.positions()
        layouts.add(tuple(positions.values()))
        for name in ("red_cube", "green_cube", "purple_cube"):
            x, y, z = positions[name]
            assert -100 <= x <= 150 and -150 <= y <= 150 and abs(z - 20) <= 1
    assert len(layouts) == 20


def test_reset_after_play_restores_a_fresh_episode(envs):
    env = envs["place"]
    first = env.reset(seed=8)[0]["text"]
    for action in env.solve():
        env.step(action)
    assert env.reset(seed=8)[0]["text"] == first


# --------------------------------------------------------------------------- physics of the skills
def test_pick_lifts_the_cube_by_friction_and_place_sets_it_down(envs):
    env = envs["place"]
    env.reset(seed=1)
    start = cube(env, "red_cube")
    _, reward, _, _, info = env.step(f"pick({','.join(str(round(c * 1000)) for c in start)})")
    assert env.grasped() == "red_cube" and cube(env, "red_cube")[2] > 0.1
    assert info["action_is_effective"] and info["stage"] == 1 and reward == pytest.approx(2.0 - 0.1)
    env.step("place(0,0,60)")  # dropped from above: falls and lands flat
    assert env.grasped() is None
    assert np.allclose(cube(env, "red_cube"), [0, 0, CUBE_HALF], atol=0.006)


def test_pick_where_there_is_nothing_does_nothing(envs):
    env = envs["place"]
    env.reset(seed=1)
    before = env.positions()
    assert all(np.hypot(x - 150, y + 200) > 100 for x, y, _ in before.values())  # nothing near the corner
    _, reward, terminated, _, info = env.step("pick(150,-200,20)")
    assert info["action_is_valid"] and not info["action_is_effective"]
    assert env.grasped() is None and env.positions() == before
    assert reward == pytest.approx(-0.1) and not terminated


def test_a_placed_cube_rests_on_the_cube_below(envs):
    env = envs["stack"]
    env.reset(seed=4)
    green = cube(env, "green_cube")
    env.step("pick({},{},{})".format(*(round(c * 1000) for c in cube(env, "red_cube"))))
    env.step(f"place({round(green[0] * 1000)},{round(green[1] * 1000)},90)")
    red = cube(env, "red_cube")
    assert red[2] == pytest.approx(green[2] + 2 * CUBE_HALF, abs=0.004)
    assert np.linalg.norm(red[:2] - green[:2]) < 0.01
    assert env.stage() == 2 and not env.success()


def test_push_slides_a_cube_to_the_end_point(envs):
    env = envs["align"]
    env.reset(seed=0)
    x, y, z = env.positions()["red_cube"]
    env.step(f"push({x},{y},{z},{x + 40},{y},{z})")
    moved = env.positions()["red_cube"]
    # A cube that starts turned swings its face square to the fingers, which moves it a few mm more.
    assert moved[0] == pytest.approx(x + 40, abs=10) and abs(moved[1] - y) <= 10 and moved[2] == pytest.approx(z, abs=1)


def test_coordinates_are_clipped_to_the_workspace(envs):
    env = envs["place"]
    env.reset(seed=2)
    env.step("pick({},{},{})".format(*(round(c * 1000) for c in cube(env, "green_cube"))))
    env.step("place(9999999,-9999999,30)")  # clipped to (150, -200)
    assert np.allclose(cube(env, "green_cube")[:2], [0.15, -0.2], atol=0.006)


def test_pushing_the_drawer_shut_before_the_apple_is_in_leaves_no_way_to_finish(envs):
    env = envs["drawer"]
    env.reset(seed=0)
    x, y, z = env.positions()["drawer_handle"]
    env.step(f"push({x},{y},{z},{x - 140},{y},{z})")
    assert env.drawer_opening() < 0.01 and not env.success()
    assert env.solve() == []


# --------------------------------------------------------------------------- reward and the expert
@pytest.mark.parametrize("task", TASKS)
def test_expert_return_is_vagens_final_worth_minus_step_costs(task, envs):
    env = envs[task]
    env.reset(seed=21)
    plan = env.solve()
    total, terminated = 0.0, False
    for action in plan:
        _, reward, terminated, truncated, info = env.step(action)
        total += reward
    assert terminated and info["success"] and env.solve() == []
    assert total == pytest.approx(10.0 - 0.1 * len(plan))


@pytest.mark.parametrize("task", TASKS)
def test_expert_succeeds_within_the_default_budget(task, envs):
    """The expert re-plans after every action (as the expert policy does), five actions at most (eval's default)."""
    env = envs[task]
    successes = 0
    for seed in range(8):
        env.reset(seed=seed)
        for _ in range(5):
            plan = env.solve()
            if not plan:
                break
            _, _, terminated, truncated, _ = env.step(plan[0])
            if terminated or truncated:
                break
        successes += env.success()
    assert successes == 8


@pytest.mark.slow
@pytest.mark.parametrize("task", TASKS)
def test_expert_succeeds_on_95_percent_of_100_validation_seeds(task):
    env = PrimitiveSkillEnv(task=task)
    successes = 0
    for seed in range(100):
        env.reset(seed=seed)
        for _ in range(5):
            plan = env.solve()
            if not plan or any(env.step(plan[0])[2:4]):
                break
        successes += env.success()
    assert successes >= 95


def test_missing_opengl_is_a_clear_error(monkeypatch):
    import turnrl.envs.games.primitive_skill.primitive_skill_env as module

    def no_context(*args, **kwargs):
        raise module.mujoco.FatalError("an OpenGL platform library has not been loaded into this process")

    monkeypatch.setattr(module.mujoco, "Renderer", no_context)
    env = PrimitiveSkillEnv(task="place", mode="image", image_size=64)
    with pytest.raises(RuntimeError, match="MUJOCO_GL=egl.*osmesa.*mode='text'"):
        env.reset(seed=0)


def test_copies_simulate_on_their_own_data(envs):
    """The expert's world-model text steps a deep copy; the original must not move."""
    env = envs["place"]
    env.reset(seed=9)
    before = env.positions()
    plan = env.solve()
    fields = expert_fields(env, plan[:1], ("observation", "prediction"))
    assert env.positions() == before and env.grasped() is None
    assert "holding: red_cube" in fields["prediction"]
    shadow = copy.deepcopy(env)
    assert shadow.model is env.model and shadow.data is not env.data


def test_expert_response_parses_back_to_its_actions(envs):
    env = envs["stack"]
    env.reset(seed=0)
    fmt = get_format("free_think", action_separator="|", max_actions_per_turn=2)
    plan = env.solve()[:2]
    parsed = fmt.parse(fmt.render(plan, {"think": "plan"}), env.action_names())
    assert parsed.format_ok and list(parsed.actions) == plan

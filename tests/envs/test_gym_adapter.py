"""gym:<id>: Gymnasium envs that render rgb_array frames, as turnrl image envs (the VisGym contract)."""

from __future__ import annotations

from functools import cache

import gymnasium as gym
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from turnrl.agent.formats import get_format
from turnrl.config import AgentConfig, SamplingConfig
from turnrl.envs import GymImageEnv, StateFacts, check_env, make
from turnrl.envs.actions import parse_tuple
from turnrl.envs.contract import MAX_TEXT_LENGTH
from turnrl.envs.gym_adapter import DEFAULT_TEXT
from turnrl.policy.interface import Completion, Policy
from turnrl.rollout.runner import EpisodeSlot, Rollout
from turnrl.rollout.trajectory import DONE

LAKE = "gym:FrozenLake-v1"


def registered(*ids: str) -> str:
    """The first of ``ids`` that this Gymnasium registers (ids move between versions: Taxi-v3 -> v4)."""
    return next(env_id for env_id in ids if env_id in gym.registry)


CLIFF = "gym:" + registered("CliffWalking-v1", "CliffWalking-v0")
TAXI = "gym:" + registered("Taxi-v4", "Taxi-v3")


@pytest.fixture
def lake() -> GymImageEnv:
    """The non-slippery 4x4 lake: S at (0, 0), holes at (1, 1), (1, 3), (2, 3), (3, 0), G at (3, 3)."""
    return make(LAKE, is_slippery=False)


def cell(env: GymImageEnv) -> tuple[int, int]:
    return divmod(int(env.unwrapped.s), env.unwrapped.ncol)


# --------------------------------------------------------------------------- observations
def test_observations_are_the_envs_rendered_frames(lake):
    assert isinstance(lake, GymImageEnv) and lake.spec.id == "FrozenLake-v1"
    obs, info = lake.reset(seed=0)
    assert set(obs) == {"text", "image"} and obs["text"] == DEFAULT_TEXT
    assert obs["image"].shape == (256, 256, 3) and obs["image"].dtype == np.uint8
    assert np.array_equal(obs["image"], lake.env.render())
    assert info["success"] is False
    after, *_ = lake.step("right")
    assert not np.array_equal(after["image"], obs["image"])  # the figure moved
    assert lake.observation_space.contains(after)


def test_cliffwalking_renders_with_its_own_renderer():
    env = make(CLIFF)
    obs, _ = env.reset(seed=0)
    assert obs["image"].shape == (256, 768, 3) and env.action_names() == ["up", "right", "down", "left"]


@pytest.mark.parametrize("size, shape", [(128, (128, 128)), ((100, 200), (100, 200)), ([64, 32], (64, 32))])
def test_image_size_resizes_every_frame(size, shape):
    env = make(LAKE, is_slippery=False, image_size=size)
    obs, _ = env.reset(seed=0)
    assert obs["image"].shape == (*shape, 3) and obs["image"].dtype == np.uint8
    assert env.step("down")[0]["image"].shape == (*shape, 3)
    assert env.observation_space["image"].shape == (*shape, 3)


def test_a_long_side_keeps_the_aspect_ratio():
    env = make(CLIFF, image_size=336)
    assert env.reset(seed=0)[0]["image"].shape == (112, 336, 3)


@pytest.mark.parametrize("size", [0, -3, True, (1, 2, 3), "big", 1.5])
def test_a_bad_image_size_is_refused(size):
    with pytest.raises(ValueError, match="image_size"):
        make(LAKE, image_size=size)


def test_text_is_the_caption():
    env = make(LAKE, text="Look at the lake.")
    assert env.reset(seed=0)[0]["text"] == "Look at the lake."


def test_a_caption_longer_than_the_default_bound_needs_the_max_text_length_setting():
    """The caption is every observation's text: one past the bound would fail every episode, so it fails here; the
    setting raises the bound, which the text space and max_text_length() both hold."""
    caption = "A page of the manual. " * 500
    with pytest.raises(ValueError, match=f"the text setting can need {len(caption)} characters, more than the "
                                         f"{MAX_TEXT_LENGTH} an observation may hold; raise the max_text_length"):
        make(LAKE, text=caption)
    assert make(LAKE).max_text_length() == make(LAKE).observation_space["text"].max_length == MAX_TEXT_LENGTH
    env = make(LAKE, is_slippery=False, text=caption, max_text_length=16_384)
    assert env.max_text_length() == env.observation_space["text"].max_length == 16_384
    assert env.reset(seed=0)[0]["text"] == caption
    check_env(env)


@pytest.mark.parametrize("bound", [0, -1, True, "big", 1.5])
def test_a_bad_max_text_length_setting_is_refused(bound):
    with pytest.raises(ValueError, match="max_text_length must be an int >= 1, got a"):
        make(LAKE, max_text_length=bound)


# --------------------------------------------------------------------------- actions
@pytest.mark.parametrize(
    "spelling", ["right", "Right", "  RIGHT \n", "('right',)", '("Right")', "('move', 2)", "( 'move' ,2 )"]
)
def test_actions_by_name_or_tuple(lake, spelling):
    lake.reset(seed=0)
    _, reward, terminated, truncated, info = lake.step(spelling)
    assert info["action_is_valid"] is True and cell(lake) == (0, 1)
    assert (reward, terminated, truncated) == (0.0, False, False)


@pytest.mark.parametrize(
    "action",
    ["", "jump", "('move', 4)", "('move', '2')", "('stop', 'stop')", "__import__('os').system('true')",
     "eval('2')", "(2)", "[2]", "2", "x" * 10_000, None],
)
def test_invalid_actions_never_step_the_env(lake, action):
    lake.reset(seed=0)
    lake.step("right")
    lake.step("right")
    before = lake.step("down")[0]  # at (1, 2)
    result = lake.step(action)
    after, reward, terminated, truncated, info = result
    assert info["action_is_valid"] is False and info["success"] is False
    assert (reward, terminated, truncated) == (0.0, False, False)
    assert cell(lake) == (1, 2) and lake.unwrapped.lastaction == 1  # no env step
    assert lake.get_wrapper_attr("_elapsed_steps") == 3  # the TimeLimit did not count it
    assert np.array_equal(after["image"], before["image"]) and after["text"] == before["text"]


@cache
def fuzzed_lake() -> GymImageEnv:
    return make(LAKE, is_slippery=False, image_size=32)


TUPLE_LIKE = st.builds(
    lambda head, number, comma: f"({head!r}, {number}{comma})", st.text(max_size=8), st.integers(-10**12, 10**12),
    st.sampled_from(["", ",", " , "]),
)


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.text(max_size=600), TUPLE_LIKE, st.sampled_from(["left", "('move', 3)", "(' Up ',)"])))
def test_any_text_is_an_action_or_a_rejection_and_never_raises(action):
    env = fuzzed_lake()
    env.reset(seed=0)
    env.step("right")  # at (0, 1): every move changes the cell but up, which bumps into the edge
    obs, reward, terminated, truncated, info = env.step(action)
    chosen = env.env_action(action)
    assert info["action_is_valid"] is (chosen is not None) and isinstance(reward, float)
    if chosen is None:
        assert cell(env) == (0, 1) and (reward, terminated, truncated) == (0.0, False, False)
    else:
        assert chosen in (0, 1, 2, 3) and env.unwrapped.lastaction == chosen


def test_the_tuple_reader_never_evaluates():
    assert parse_tuple("('move', 0)") == ("move", 0) and parse_tuple("('left',)") == ("left",)
    assert parse_tuple('( "a b" , -3, )') == ("a b", -3) and parse_tuple("(1.5)") == (1.5,)
    for text in ("move, 0", "(move, 0)", "(('a',),)", "('a' + 'b',)", "(" + "1," * 9 + ")", "()", "(x)"):
        assert parse_tuple(text) is None, text


def test_an_action_map_renames_and_restricts_actions():
    env = make(LAKE, is_slippery=False, actions={"South": 1, "East": 2})
    assert env.action_names() == ["South", "East"]
    env.reset(seed=0)
    assert env.step("left")[4]["action_is_valid"] is False  # not in the map
    assert env.step("('move', 0)")[4]["action_is_valid"] is False  # action 0 is not mapped
    assert env.step("east")[4]["action_is_valid"] and env.step("('move', 1)")[4]["action_is_valid"]
    assert cell(env) == (1, 1)
    assert "Actions: South, East." in env.instructions()


def test_tuple_names_in_the_map_match_any_spelling():
    env = make(LAKE, is_slippery=False, actions={"('move', 0)": 2, "('move', 3)": 1})  # VisGym's numbering
    env.reset(seed=0)
    assert env.step('("MOVE",0)')[4]["action_is_valid"] and cell(env) == (0, 1)
    assert env.step("('move', 3)")[4]["action_is_valid"] and cell(env) == (1, 1)


@pytest.mark.parametrize(
    "actions, message",
    [
        ({"left": 9}, "9 is not an action"),
        ({"left": True}, "True is not an action"),
        ({"Left": 0, " left": 1}, "differ only in case or spacing"),
        ({}, "non-empty mapping"),
        ({"": 0}, "non-empty strs"),
    ],
)
def test_a_bad_action_map_is_refused(actions, message):
    with pytest.raises(ValueError, match=message):
        make(LAKE, actions=actions)


def test_a_list_names_the_actions_in_order_and_a_discrete_env_without_a_map_gets_numbers():
    env = make(LAKE, is_slippery=False, actions=["l", "d", "r", "u"])
    env.reset(seed=0)
    env.step("r")
    assert cell(env) == (0, 1)
    blackjack = make("gym:Blackjack-v1")
    assert blackjack.action_names() == ["0", "1"] and "Blackjack-v1" in blackjack.instructions()
    blackjack.reset(seed=0)
    assert blackjack.step("('move', 0)")[4]["action_is_valid"]  # stick: the hand ends
    check_env(blackjack, deterministic=False)


def test_a_box_action_space_needs_an_action_map():
    with pytest.raises(ValueError, match=r"Pendulum-v1 has a Box action space.*pass actions="):
        make("gym:Pendulum-v1")
    env = make("gym:Pendulum-v1", actions={"push left": [-2.0], "push right": [2.0]}, image_size=64)
    env.reset(seed=0)
    obs, reward, *_ = env.step("Push Right")
    assert obs["image"].shape == (64, 64, 3) and reward < 0
    with pytest.raises(ValueError, match="not an action"):
        make("gym:Pendulum-v1", actions={"too hard": [5.0]})


def test_a_box_action_of_another_float_precision_is_its_spaces_dtype():
    env = make("gym:Pendulum-v1", actions={"push": np.array([2.0])})  # float64; Pendulum's space is float32
    action = env.env_action("push")
    assert action.dtype == np.float32 and action.tolist() == [2.0]


class ActionRecorder(gym.Env):
    """Keeps every action it is given; its action space is the class attribute of a subclass."""

    metadata = {"render_modes": ["rgb_array"], "render_fps": 4}
    observation_space = gym.spaces.Discrete(1)
    action_space: gym.spaces.Space = gym.spaces.Discrete(2)

    def __init__(self, render_mode=None):
        self.render_mode = render_mode
        self.actions = []

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return 0, {}

    def step(self, action):
        self.actions.append(action)
        return 0, 0.0, False, False, {}

    def render(self):
        return np.zeros((4, 4, 3), np.uint8)


class TupleActions(ActionRecorder):
    action_space = gym.spaces.Tuple((gym.spaces.Discrete(3), gym.spaces.Box(-1.0, 1.0, (2,))))


class DictActions(ActionRecorder):
    action_space = gym.spaces.Dict({"gear": gym.spaces.Discrete(3), "throttle": gym.spaces.Box(0.0, 1.0, (1,))})


class GridActions(ActionRecorder):
    action_space = gym.spaces.MultiDiscrete([3, 3])


@pytest.fixture
def recorders():
    classes = {"TupleActions": TupleActions, "DictActions": DictActions, "GridActions": GridActions}
    for name, cls in classes.items():
        gym.register(f"turnrl-test/{name}-v0", entry_point=cls)
    yield
    for name in classes:
        gym.registry.pop(f"turnrl-test/{name}-v0")


def test_tuple_and_dict_action_spaces_get_their_own_kind_of_element(recorders):
    """As the space's ``sample()`` gives: a tuple for a Tuple space, a dict of arrays for a Dict space."""
    env = make("gym:turnrl-test/TupleActions-v0", actions={"fast": (2, [0.5, -0.5]), "slow": [0, [0.0, 0.0]]})
    env.reset(seed=0)
    env.step("fast")
    env.step("slow")
    fast, slow = env.unwrapped.actions
    assert isinstance(fast, tuple) and fast[0] == 2 and fast[1].dtype == np.float32
    assert fast[1].tolist() == [0.5, -0.5] and isinstance(slow, tuple)
    assert all(env.unwrapped.action_space.contains(action) for action in (fast, slow))
    env = make("gym:turnrl-test/DictActions-v0", actions={"go": {"gear": 1, "throttle": [0.75]}})
    env.reset(seed=0)
    env.step("go")
    (go,) = env.unwrapped.actions
    assert go["gear"] == 1 and isinstance(go["throttle"], np.ndarray) and go["throttle"].dtype == np.float32
    with pytest.raises(ValueError, match="not an action"):
        make("gym:turnrl-test/TupleActions-v0", actions={"short": (1,)})
    with pytest.raises(ValueError, match="not an action"):
        make("gym:turnrl-test/DictActions-v0", actions={"no throttle": {"gear": 1}})


def test_a_fraction_is_never_cut_to_an_integer_action(recorders):
    env = make("gym:turnrl-test/GridActions-v0", actions={"corner": [2, 2]})
    assert env.env_action("corner").tolist() == [2, 2]
    with pytest.raises(ValueError, match=r"'half': \[1.5, 0\] is not an action"):
        make("gym:turnrl-test/GridActions-v0", actions={"half": [1.5, 0]})


# --------------------------------------------------------------------------- rewards, termination, success
def test_rewards_and_termination_pass_through(lake):
    lake.reset(seed=0)
    steps = [lake.step(action) for action in ["down", "down", "right", "down", "right", "right"]]
    assert [s[1] for s in steps] == [0.0] * 5 + [1.0]
    assert [s[2] for s in steps] == [False] * 5 + [True] and not any(s[3] for s in steps)
    assert [s[4]["success"] for s in steps] == [False] * 5 + [True]
    _, reward, terminated, _, info = lake.step("left")  # the episode is over: nothing steps
    assert (reward, terminated, info["action_is_valid"], info["success"]) == (0.0, True, False, True)
    assert cell(lake) == (3, 3)


def test_a_hole_terminates_without_success(lake):
    lake.reset(seed=0)
    lake.step("down")
    _, reward, terminated, truncated, info = lake.step("right")
    assert (reward, terminated, truncated, info["success"]) == (0.0, True, False, False)
    assert lake.solve() is None  # no way out of a hole


def test_truncation_is_not_termination():
    env = make(LAKE, is_slippery=False, max_episode_steps=3)
    env.reset(seed=0)
    flags = [env.step("left")[2:4] for _ in range(3)]
    assert flags == [(False, False), (False, False), (False, True)]
    assert env.step("down")[4]["action_is_valid"] is False  # truncated: over too


def test_the_action_budget_is_the_envs_own_step_limit():
    """What ``turnrl eval`` gives by default: the step limit of the env's spec, never the agent's 5 turns."""
    assert make(LAKE, is_slippery=False).action_budget() == 100  # FrozenLake-v1 registers max_episode_steps=100
    assert make(LAKE, is_slippery=False, max_episode_steps=7).action_budget() == 7
    assert make(TAXI).action_budget() == gym.spec(TAXI.removeprefix("gym:")).max_episode_steps
    assert make(CLIFF).action_budget() is None  # no step limit: the caller keeps its own budget
    maze = make("gym:turnrl/Maze2D-v0", mode="image")
    assert maze.action_budget() == make("Maze2D").action_budget()  # a turnrl env's own, tighter budget


def test_cliffwalking_rewards_and_success():
    env = make(CLIFF)
    env.reset(seed=0)
    _, reward, terminated, _, info = env.step("right")  # off the cliff: back to the start
    assert (reward, terminated, info["success"]) == (-100.0, False, False)
    plan = env.solve()
    assert plan is not None and len(plan) == 13
    results = [env.step(action) for action in plan]
    assert sum(r[1] for r in results) == -13.0
    assert results[-1][2] and results[-1][4]["success"] and not any(r[2] for r in results[:-1])


def test_taxi_success_is_a_drop_off_at_the_destination():
    env = make(TAXI)
    env.reset(seed=3)
    plan = env.solve()
    results = [env.step(action) for action in plan]
    assert plan[-1] == "dropoff" and results[-1][1] == 20.0 and results[-1][2] and results[-1][4]["success"]
    assert not any(r[4]["success"] for r in results[:-1])


def test_same_seed_same_episode_on_slippery_ice():
    first, second = make(LAKE), make(LAKE)  # slippery: the seed fixes the slides
    actions = ["down", "right", "right", "down", "up", "right", "down", "down"] * 3

    def play(env):
        obs, _ = env.reset(seed=7)
        frames, cells = [obs["image"]], [cell(env)]
        for action in actions:
            obs, _, terminated, truncated, _ = env.step(action)
            frames.append(obs["image"])
            cells.append(cell(env))
        return frames, cells

    (frames_a, cells_a), (frames_b, cells_b) = play(first), play(second)
    assert cells_a == cells_b and all(np.array_equal(a, b) for a, b in zip(frames_a, frames_b))


# --------------------------------------------------------------------------- the turnrl contract
@pytest.mark.parametrize(
    "env_id, settings, deterministic",
    [
        (LAKE, {"is_slippery": False}, True),
        (LAKE, {}, False),
        (CLIFF, {}, True),
        (TAXI, {}, True),
        ("gym:FrozenLake8x8-v1", {"is_slippery": False, "image_size": 128}, True),
    ],
)
def test_check_env(env_id, settings, deterministic):
    check_env(make(env_id, **settings), deterministic=deterministic)


def test_instructions_say_what_the_image_shows_and_list_the_actions(lake):
    text = lake.instructions()
    assert "FrozenLake" in text and "hole" in text and "red flag" in text and "slippery" not in text
    assert "Actions: left, down, right, up." in text and "('move', k) is action number k: 0 = left" in text
    assert "slippery" in make(LAKE).instructions()
    assert make(LAKE, instructions="Reach the flag.").instructions() == "Reach the flag."
    assert "cliff" in make(CLIFF).instructions() and "passenger" in make(TAXI).instructions()


def test_state_facts_and_the_expert(lake):
    lake.reset(seed=0)
    facts = lake.state_facts()
    assert facts.player == (0, 0)
    assert {(o.name, o.position) for o in facts.objects} == {
        ("goal", (3, 3)), ("hole", (1, 1)), ("hole", (1, 3)), ("hole", (2, 3)), ("hole", (3, 0))
    }
    assert lake.solve() == ["down", "down", "right", "down", "right", "right"]
    lake.step("down")
    assert lake.state_facts().player == (1, 0) and len(lake.solve()) == 5
    assert make(LAKE).solve() is None  # slippery: no plan survives the ice
    assert make("gym:Blackjack-v1").state_facts() == StateFacts(player=None)
    assert make("gym:Blackjack-v1").solve() is None


# --------------------------------------------------------------------------- a turnrl env underneath
def test_maze2d_keeps_its_names_instructions_solver_and_visgym_tuples():
    env = make("gym:turnrl/Maze2D-v0", mode="image", reward_on="stop", image_size=112)
    maze = env.unwrapped
    assert env.action_names() == ["up", "down", "left", "right", "stop"]
    assert env.instructions() == maze.instructions() and "('move', 0) = right" in env.instructions()
    obs, _ = env.reset(seed=0)
    assert obs["image"].shape == (112, 112, 3) and env.state_facts() == maze.state_facts()
    plan = env.solve()
    assert plan == maze.solve() and plan[-1] == "stop"
    visgym = {"right": "('move', 0)", "up": "('move', 1)", "left": "('move', 2)", "down": "('move', 3)"}
    results = [env.step(visgym.get(action, "('stop', 'stop')")) for action in plan]
    assert all(r[4]["action_is_valid"] for r in results) and results[-1][1] == 1.0 and results[-1][4]["success"]
    check_env(env)


def test_maze2d_with_a_map_of_its_own():
    env = make("gym:turnrl/Maze2D-v0", mode="image", actions={"north": "up", "south": "down", "east": "right"})
    env.reset(seed=0)
    assert env.env_action("('move', 1)") == "up" and env.env_action("left") is None
    assert env.solve() == ["east"] * 6 + ["south"] * 6
    env.reset(seed=1)
    assert env.solve() is None  # the maze's plan needs left, which the map does not name


# --------------------------------------------------------------------------- settings and refusals
def test_unknown_settings_name_both_kinds():
    with pytest.raises(ValueError) as info:
        make(LAKE, colour="red")
    message = str(info.value)
    assert "gym:FrozenLake-v1 has no setting colour" in message
    assert "actions, instructions, image_size, text" in message and "is_slippery=True" in message
    assert "max_episode_steps" in message and "render_mode" not in message
    with pytest.raises(ValueError, match="render_mode is not a setting here"):
        make(LAKE, render_mode="human")
    with pytest.raises(ValueError, match="'Nope-v0' is not a registered Gymnasium id"):
        make("gym:Nope-v0")


class NoImages(gym.Env):
    """Draws text only."""

    metadata = {"render_modes": ["ansi"]}
    observation_space = gym.spaces.Discrete(2)
    action_space = gym.spaces.Discrete(2)

    def __init__(self, render_mode=None):
        self.render_mode = render_mode

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return 0, {}

    def step(self, action):
        return 0, 0.0, True, False, {}

    def render(self):
        return "a picture in words"


class SaysItDraws(NoImages):
    """Declares no render modes, and its render returns no image."""

    metadata: dict = {}


@pytest.fixture
def text_only_envs():
    ids = {"turnrl-test/NoImages-v0": NoImages, "turnrl-test/SaysItDraws-v0": SaysItDraws}
    for env_id, cls in ids.items():
        gym.register(env_id, entry_point=cls)
    yield
    for env_id in ids:
        gym.registry.pop(env_id)


@pytest.mark.filterwarnings("ignore:.*render:UserWarning")  # Gymnasium's own warnings about these envs
def test_an_env_without_rgb_array_rendering_is_refused(text_only_envs):
    with pytest.raises(ValueError, match=r"NoImages-v0 cannot render images \(its render_modes are \['ansi'\]\)"):
        make("gym:turnrl-test/NoImages-v0")
    with pytest.raises(ValueError, match="render\\(\\) must return an HxWx3 uint8 array.*'a picture in words'"):
        make("gym:turnrl-test/SaysItDraws-v0")
    with pytest.raises(ValueError, match="needs render_mode='rgb_array', got None"):
        GymImageEnv(gym.make("FrozenLake-v1"))


class OldReset(ActionRecorder):
    """Written for the old API: ``reset()`` takes neither a seed nor options."""

    def reset(self):  # type: ignore[override]
        return 0, {}


class SeedOnlyReset(ActionRecorder):
    def reset(self, seed=None):  # type: ignore[override]
        return super().reset(seed=seed)


@pytest.mark.filterwarnings("ignore:.*reset:DeprecationWarning")  # Gymnasium's own warnings about these envs
@pytest.mark.parametrize("cls, missing", [(OldReset, "seed or options"), (SeedOnlyReset, "options")])
def test_an_env_whose_reset_takes_no_seed_or_options_is_refused_with_what_to_define(cls, missing):
    gym.register("turnrl-test/OldApi-v0", entry_point=cls)
    try:
        with pytest.raises(ValueError, match=rf"OldApi-v0: its reset\(\) takes no {missing} keyword.*define reset"):
            make("gym:turnrl-test/OldApi-v0")
    finally:
        gym.registry.pop("turnrl-test/OldApi-v0")


def test_wrapping_an_env_by_hand():
    env = GymImageEnv(gym.make("FrozenLake-v1", render_mode="rgb_array", is_slippery=False), image_size=64)
    assert env.reset(seed=0)[0]["image"].shape == (64, 64, 3)
    check_env(env)


def test_headless_rendering_keeps_the_users_video_driver(monkeypatch):
    monkeypatch.setenv("SDL_VIDEODRIVER", "offscreen")
    make(LAKE)
    import os

    assert os.environ["SDL_VIDEODRIVER"] == "offscreen"
    monkeypatch.delenv("SDL_VIDEODRIVER")
    make(LAKE)
    assert os.environ["SDL_VIDEODRIVER"] == "dummy"


def test_the_registry_points_gymnasium_ids_at_the_adapter():
    with pytest.raises(TypeError, match="use env.id=gym:FrozenLake-v1"):
        make("FrozenLake-v1")
    with pytest.raises(ValueError, match="gym:<id>"):
        make("Tetris-v9")


# --------------------------------------------------------------------------- through the rollout loop
class ExpertPolicy(Policy):
    """A text-only policy that answers with the env's expert action; its first answer has no valid action."""

    def __init__(self, answer) -> None:
        self.answer = answer
        self.requests = []

    def generate(self, requests, sampling):
        completions = []
        for request in requests:
            first = not any(r.env is request.env for r in self.requests)
            self.requests.append(request)
            text = "<action>fly</action>" if first else self.answer(request.env, request.env.solve()[0])
            completions.append(Completion(text=text))
        return completions


@pytest.mark.parametrize(
    "fmt, answer",
    [
        ("visgym_keyword", lambda env, name: f"I will go {name}. <action>{name}</action>"),
        (
            "visgym_tuple",
            lambda env, name: (
                "<observation>The lake.</observation><justification>The expert says so.</justification>"
                f"<action>('move', {env.env_action(name)})</action>"
            ),
        ),
    ],
)
def test_a_rollout_plays_frozenlake_to_the_goal_one_image_per_turn(fmt, answer):
    envs = [make(LAKE, is_slippery=False, image_size=64) for _ in range(2)]
    slots = [EpisodeSlot(env=env, seed=seed, group=seed) for seed, env in enumerate(envs)]
    agent = AgentConfig(format=fmt, max_turns=10, max_actions_per_episode=10)
    policy = ExpertPolicy(answer)
    trajectories = Rollout(policy, get_format(fmt), agent, LAKE).run(slots, SamplingConfig(max_new_tokens=64))
    for env, trajectory in zip(envs, trajectories):
        assert trajectory.status == DONE and trajectory.success, trajectory.error
        assert len(trajectory.turns) == 7  # the invalid answer, then the six moves of the expert
        assert len(trajectory.images) == len(trajectory.turns)
        assert all(image.shape == (64, 64, 3) for image in trajectory.images)
        assert not trajectory.turns[0].has_valid_action
        assert np.array_equal(trajectory.images[0], trajectory.images[1])  # not stepped: the frame is resent
        assert not np.array_equal(trajectory.images[1], trajectory.images[2])
        assert trajectory.turns[-1].actions_valid == [True]
        resent = [r for r in policy.requests if r.env is env][1].messages[-1]
        assert "Valid actions: left, down, right, up." in str(resent["content"])
        assert len([r for r in policy.requests if r.env is env][-1].images) == 7  # images accumulate

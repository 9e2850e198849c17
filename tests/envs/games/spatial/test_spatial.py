"""Spatial env: conformance, RAGEN's rewards and step limit, dynamics on a hand-made room, the expert."""

import warnings

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env as gymnasium_check_env
from hypothesis import given, settings
from hypothesis import strategies as st

import turnrl.envs  # noqa: F401  (registers the built-in envs)
from tests.envs.games.episodes import assert_text_is_data
from turnrl.envs import check_env, make
from turnrl.envs.games.spatial import SpatialEnv
from turnrl.envs.games.spatial.questions import TASKS
from turnrl.envs.games.spatial.room import Room, Thing
from turnrl.envs.seeds import SeedSplits

ROOM = Room(
    size=6,
    things=(
        Thing("chair", (2, 4), 2),
        Thing("table", (5, 2), None),
        Thing("lamp", (0, 0), None),
        Thing("television", (4, 4), 3),
        Thing("sofa", (2, 0), 1),
    ),
    start=(2, 2),
)


def hand_made(task="dir", **settings):
    env = SpatialEnv(**settings)
    obs, info = env.reset(seed=0, options={"room": ROOM, "task": task})
    return env, obs


def wrong_letter(env):
    return "A" if env.question.letter != "A" else "B"


@pytest.mark.parametrize("mode", ["text", "image"])
@pytest.mark.parametrize("render_mode", [None, "ansi", "rgb_array"])
def test_gymnasium_checker(mode, render_mode):
    env = gym.make("turnrl/Spatial-v0", mode=mode, render_mode=render_mode)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gymnasium_check_env(env.unwrapped)


@pytest.mark.parametrize("mode", ["text", "image"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_turnrl_checker(mode, seed):
    check_env(make("Spatial", mode=mode), seed=seed)


def test_registered_and_listed():
    env = gym.make("turnrl/Spatial-v0")
    assert isinstance(env.unwrapped, SpatialEnv)
    assert env.unwrapped.action_names() is None


def test_same_seed_same_episode_and_seeds_differ():
    def episode(seed):
        env = SpatialEnv(mode="image")
        obs, _ = env.reset(seed=seed)
        record = [obs["text"], obs["image"].tobytes()]
        for action in env.solve()[:-1] + ["Actions: [JumpTo(chair), Rotate(180), Observe()]"]:
            obs, reward, *_ = env.step(action)
            record += [obs["text"], obs["image"].tobytes(), reward]
        return record

    assert episode(3) == episode(3)
    texts = {SpatialEnv().reset(seed=s)[0]["text"] for s in range(40)}
    assert len(texts) == 40


def test_tasks_and_rooms_vary_with_the_seed():
    env = SpatialEnv()
    tasks, starts = set(), set()
    for seed in range(200):
        env.reset(seed=seed)
        tasks.add(env.question.task)
        starts.add(env.room.start)
        assert len(env.room.things) == 5 and len(set(env.room.names)) == 5
    assert tasks == set(TASKS) and len(starts) > 20


def test_initial_observation_tells_the_room_and_the_question():
    env, obs = hand_made("dir")
    text = obs["text"]
    assert "6x6 room" in text and "facing north" in text
    assert "Objects in the room: chair, table, lamp, television, sofa." in text
    assert env.question.text() in text
    assert env.question.prompt.startswith("On the map seen from above")


def test_observe_rotate_and_jump():
    env, _ = hand_made()
    obs, reward, terminated, truncated, info = env.step("Actions: [Observe()]")
    assert (reward, terminated, truncated, info["action_is_valid"]) == (pytest.approx(-0.1), False, False, True)
    assert obs["text"].splitlines() == [
        "You observe:",
        "- chair: front, near, facing backward",
        "- television: front-right, mid distance, facing left",
        "Close pairs (taking the way you face as north):",
        "- chair is west of television, near",
    ]
    # The table has not been observed yet: the jump fails, the rest is skipped and the agent observes instead.
    obs, reward, _, _, info = env.step("Actions: [JumpTo(table), Rotate(180), Observe()]")
    assert info["failed_moves"] == 1 and reward == pytest.approx(-0.1)
    assert obs["text"].splitlines()[:3] == [
        "Cannot jump to the table: you have not observed it yet.",
        "The rest of the sequence is skipped; you observe instead.",
        "You observe:",
    ]
    assert (env.cell, env.heading) == ((2, 2), 0)
    obs, *_ = env.step("Actions: [Rotate(90), Observe()]")
    assert env.heading == 1 and "- table: front, mid distance" in obs["text"]
    obs, *_ = env.step("Actions: [JumpTo(table), Rotate(-270), Observe()]")  # -270 is a quarter turn clockwise
    assert (env.cell, env.heading) == ((5, 2), 2)
    assert obs["text"].startswith("You jumped to the table.\nYou turned counterclockwise by 270 degrees.")
    # From the table facing south nothing is in view; the television is behind: no jump to it.
    assert "Nothing is in your field of view." in obs["text"]
    obs, _, _, _, info = env.step("Actions: [JumpTo(television), Observe()]")
    assert info["failed_moves"] == 1 and "it is not in your field of view" in obs["text"]
    obs, _, _, _, info = env.step("Actions: [Rotate(45), Observe()]")
    assert info["failed_moves"] == 1 and obs["text"].startswith("Cannot rotate by 45 degrees")
    obs, _, _, _, info = env.step("Actions: [JumpTo(unicorn), Observe()]")
    assert "there is no such object" in obs["text"] and env.heading == 2


def test_a_repeated_view_changes_nothing():
    env, _ = hand_made()
    assert env.step("Actions: [Observe()]")[4]["action_is_effective"]
    assert not env.step("Actions: [Rotate(0), Observe()]")[4]["action_is_effective"]


def test_right_answer_pays_ten_and_ends():
    env, _ = hand_made()
    obs, reward, terminated, truncated, info = env.step(f"Actions: [Term({env.question.letter})]")
    assert (reward, terminated, truncated, info["success"]) == (10.0, True, False, True)
    assert info["answer"] == info["correct_answer"] == env.question.letter and info["task"] == "dir"
    assert obs["text"].startswith(f"You answered {env.question.letter}: correct.")
    assert env.success() and env.solve() == []
    # After the end every action is rejected and changes nothing.
    _, reward, terminated, _, info = env.step("Actions: [Observe()]")
    assert not info["action_is_valid"] and terminated and reward == -1.0


def test_wrong_answer_pays_ragens_penalty():
    env, _ = hand_made()
    _, reward, terminated, _, info = env.step(f"Actions: [Term({wrong_letter(env)})]")
    assert (reward, terminated, info["success"]) == (-1.0, True, False)
    env, _ = hand_made(wrong_reward=0.0, correct_reward=1.0, step_reward=0.0)
    assert env.step(f"Actions: [Term({wrong_letter(env)})]")[1] == 0.0
    env, _ = hand_made()
    assert env.step("Actions: [Term(Z)]")[1] == -1.0  # a letter that is no choice is a wrong answer


@pytest.mark.parametrize("action", ["", "hello", "Actions: [Rotate(90)]", "Actions: [Term()]", None, 3, b"x"])
def test_unreadable_turns_pay_minus_one_and_change_nothing(action):
    env, obs = hand_made(mode="image")
    facts = env.state_facts()
    new_obs, reward, terminated, truncated, info = env.step(action)
    assert (reward, terminated, truncated) == (-1.0, False, False)
    assert not info["action_is_valid"] and not info["action_is_effective"]
    assert new_obs["text"] == obs["text"] and np.array_equal(new_obs["image"], obs["image"])
    assert env.state_facts() == facts and env.steps == 1


def test_ragen_step_limit_truncates():
    env, _ = hand_made()
    assert env.max_steps == 11
    for k in range(1, 12):
        _, _, terminated, truncated, _ = env.step("Actions: [Observe()]")
        assert not terminated and truncated == (k == 11)


def test_state_facts_list_what_was_observed():
    env, _ = hand_made()
    assert env.state_facts().objects == () and env.state_facts().player == (3, 2)  # row 3 of 0..5 from the north
    env.step("Actions: [Observe()]")
    facts = env.state_facts()
    assert {f.name for f in facts.objects} == {"chair", "television"}
    chair = next(f for f in facts.objects if f.name == "chair")
    assert (chair.position, chair.vertical, chair.horizontal) == ((1, 2), "above", "same")
    assert facts.extra == {"facing": "north"}
    assert "chair is directly above the player" in facts.describe()


def test_grounding_rewards_read_the_facts_of_two_word_objects():
    from turnrl.rewards.matching import MatchItem, RuleMatcher

    matcher, env = RuleMatcher(), SpatialEnv()
    for seed in range(30):
        env.reset(seed=seed)
        for action in env.solve()[:-1]:
            env.step(action)
        facts = env.state_facts()
        assert matcher.score_one(MatchItem(facts.describe(), facts, "Spatial", "observation")) == 1.0
    room = Room(6, (Thing("air conditioner", (2, 4), 2), Thing("trash can", (3, 3), None), *ROOM.things[2:]), (2, 2))
    env.reset(seed=0, options={"room": room})
    env.step("Actions: [Observe()]")
    text = "The air conditioner is directly above the player; the trash can is above and to the right."
    assert matcher.score_one(MatchItem(text, env.state_facts(), "Spatial", "observation")) == pytest.approx(2 / 3)


def test_image_map_shows_what_was_observed():
    env, obs = hand_made(mode="image", cell_px=20)
    image = obs["image"]
    assert image.shape == env.observation_space["image"].shape and image.dtype == np.uint8
    assert "map shows" in obs["text"]

    def centre(cell, picture):
        return tuple(picture[(6 - cell[1]) * 20 + 10, (cell[0] + 1) * 20 + 10])

    chair_cell = (2, 4)
    assert centre(chair_cell, image) == (160, 160, 160)  # unseen floor
    obs, *_ = env.step("Actions: [Observe()]")
    assert obs["text"] == "You observe: chair, television (the map shows where)."
    assert centre(chair_cell, obs["image"]) not in ((160, 160, 160), (236, 236, 226))  # a dot now
    assert centre((3, 5), obs["image"]) == (236, 236, 226)  # seen, empty floor
    assert centre((5, 2), obs["image"]) == (160, 160, 160)  # the table is outside the view
    assert "JumpTo(<object>)" in env.instructions() and "numbered dot" in env.instructions()


def test_solve_explores_then_answers_from_the_views():
    env, _ = hand_made("rot")
    plan = env.solve()
    assert plan == ["Actions: [Observe()]", "Actions: [Rotate(90), Observe()]", "Actions: [Rotate(90), Observe()]",
                    "Actions: [Rotate(90), Observe()]", f"Actions: [Term({env.question.letter})]"]
    env.step(plan[0])
    env.step("Actions: [Rotate(180), Observe()]")  # off the plan: south seen, east and west still missing
    assert env.solve() == ["Actions: [Rotate(90), Observe()]", "Actions: [Rotate(180), Observe()]",
                           f"Actions: [Term({env.question.letter})]"]
    short = SpatialEnv(max_steps=3)
    short.reset(seed=0)
    assert len(short.solve()) == 3  # two views fit before the answer


@pytest.mark.parametrize("task", TASKS)
def test_the_expert_solves_every_task(task):
    env = SpatialEnv()
    for seed in range(15):
        env.reset(seed=seed, options={"task": task})
        for action in env.solve():
            _, reward, terminated, truncated, info = env.step(action)
        assert terminated and not truncated and info["success"] and reward == 10.0, (task, seed)


def test_expert_success_on_500_validation_seeds():
    """The number reported for the expert: its success over the first 500 validation seeds."""
    env = SpatialEnv()
    solved = 0
    seeds = SeedSplits().val_seeds(500)
    for seed in seeds:
        env.reset(seed=seed)
        for action in env.solve():
            _, _, terminated, truncated, info = env.step(action)
            if terminated or truncated:
                break
        solved += bool(info["success"])
    rate = solved / len(seeds)
    print(f"Spatial expert success on {len(seeds)} validation seeds: {rate:.3f}")
    assert rate >= 0.99


@pytest.mark.parametrize(("room_size", "n_objects"), [(3, 3), (3, 8), (5, 20), (8, 12), (20, 20)])
def test_other_sizes_generate_solve_and_fit_the_spaces(room_size, n_objects):
    env = SpatialEnv(room_size=room_size, n_objects=n_objects, mode="image", cell_px=8)
    for seed in range(10):
        obs, _ = env.reset(seed=seed)
        assert env.observation_space.contains(obs)
        for action in env.solve():
            obs, *_, info = env.step(action)
            assert env.observation_space.contains(obs)
        assert info["success"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"room_size": 2}, "room_size"),
        ({"room_size": 6.0}, "room_size"),
        ({"n_objects": 2}, "n_objects"),
        ({"room_size": 3, "n_objects": 9}, "n_objects"),
        ({"tasks": ["dir", "nope"]}, "tasks"),
        ({"tasks": []}, "tasks"),
        ({"wrong_reward": float("nan")}, "wrong_reward"),
        ({"cell_px": 2}, "cell_px"),
        ({"mode": "video"}, "mode"),
        ({"max_steps": 0}, "max_steps"),
    ],
)
def test_constructor_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SpatialEnv(**kwargs)


def test_tasks_setting_and_bad_options():
    assert SpatialEnv().tasks == SpatialEnv(tasks="all").tasks == TASKS
    assert SpatialEnv(tasks=["e2a"]).tasks == ("e2a",)
    env = SpatialEnv(tasks="rot, rot_dual")
    assert {env.reset(seed=s)[0] and env.question.task for s in range(20)} == {"rot", "rot_dual"}
    with pytest.raises(ValueError, match="options\\['task'\\]"):
        env.reset(seed=0, options={"task": "nope"})
    with pytest.raises(ValueError, match="room_size=6"):
        SpatialEnv(room_size=5).reset(options={"room": ROOM})
    bad = Room(6, (Thing("chair", (2, 2), 0), *ROOM.things[1:]), (2, 2))
    with pytest.raises(ValueError, match="distinct cells"):
        SpatialEnv().reset(options={"room": bad})
    with pytest.raises(ValueError, match="Room"):
        SpatialEnv().reset(options={"room": "chair at 1,2"})


@settings(max_examples=150, deadline=None)
@given(st.one_of(st.text(max_size=200),
                 st.sampled_from(["Actions: [Observe()]", "Actions: [Term(A)]", "Actions: [JumpTo(chair), Observe()]"]),
                 st.builds(lambda calls: f"Actions: [{', '.join(calls)}]",
                           st.lists(st.sampled_from(["Observe()", "Rotate(90)", "Rotate(-45)", "JumpTo(table)",
                                                     "JumpTo(sofa)", "Term(B)", "Rotate(x)"]), max_size=5))))
def test_any_turn_is_data_never_an_exception(action):
    env, obs = hand_made()
    new_obs, reward, terminated, truncated, info = env.step(action)
    assert env.observation_space.contains(new_obs)
    assert reward in (-1.0, pytest.approx(-0.1), 10.0)
    if not info["action_is_valid"]:
        assert reward == -1.0 and new_obs["text"] == obs["text"] and not terminated


@pytest.mark.parametrize("name_length", range(1965, 1990))
def test_a_sequence_at_the_length_limit_is_played_or_refused_never_an_error(name_length):
    """A readable sequence just under MAX_CHARS (2000) once had a canonical spelling over it, ``Actions: [`` and a
    space after the comma added: step() could not read it back and raised AssertionError. Shortest such action:
    ``JumpTo(<1971 letters>),Observe()``, 1989 characters, spelled in 2001. A spelling of at most 2000 characters
    (names of up to 1970 letters) is played; a longer one is refused as unreadable."""
    env, _ = hand_made()
    info = assert_text_is_data(env, f"JumpTo({'a' * name_length}),Observe()")
    assert info["action_is_valid"] == (name_length <= 1970)

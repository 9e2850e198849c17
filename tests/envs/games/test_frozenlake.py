"""FrozenLake: Gymnasium conformance, dynamics on hand-written maps, solvable generation."""

import re
import warnings
from collections import Counter

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env
from hypothesis import given, settings
from hypothesis import strategies as st

import turnrl.envs  # noqa: F401  (registers the built-in envs)
from tests.envs.games.episodes import assert_same_episode, assert_text_is_data, cycle, expert_or
from tests.envs.games.given_levels import refused_or_won, square_levels
from turnrl.envs import check_env as turnrl_check_env
from turnrl.envs.contract import IMAGE_CAPTION
from turnrl.envs.games.frozenlake import (
    ACTIONS,
    SYMBOL_STYLES,
    FrozenLakeEnv,
    _carve_path,
    move_table,
    parse_level,
    shortest_path,
)

LEVEL = """
P_O_
__O_
____
O__G
"""


def make(**kwargs) -> FrozenLakeEnv:
    return FrozenLakeEnv(**kwargs)


@pytest.mark.parametrize("mode", ["text", "image"])
@pytest.mark.parametrize("render_mode", [None, "ansi", "rgb_array"])
@pytest.mark.parametrize("slippery", [False, True])
def test_check_env(mode, render_mode, slippery):
    env = gym.make("turnrl/FrozenLake-v0", mode=mode, render_mode=render_mode, is_slippery=slippery)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a checker warning is a failure
        check_env(env.unwrapped)


@pytest.mark.filterwarnings("error")  # a warning of Gymnasium's checker is a failure too
@pytest.mark.parametrize("symbols", SYMBOL_STYLES)
@pytest.mark.parametrize("mode", ["text", "image"])
def test_every_text_style_passes_both_checkers(symbols, mode):
    env = gym.make("turnrl/FrozenLake-v0", symbols=symbols, mode=mode, render_mode="ansi").unwrapped
    check_env(env)
    for seed in (0, 1):
        turnrl_check_env(env, seed=seed)
    for seed in range(3):
        turnrl_check_env(make(symbols=symbols, is_slippery=True, success_rate=0.8), seed=seed, deterministic=False)


def test_render_modes():
    env = make(render_mode="ansi")
    obs, _ = env.reset(seed=0)
    assert env.render() == obs["text"]
    env = make(render_mode="rgb_array", size=6, cell_px=10)
    env.reset(seed=0)
    assert env.render().shape == (60, 60, 3)


def test_text_symbols_and_facts():
    env = make()
    obs, info = env.reset(seed=0, options={"level": LEVEL})
    assert obs["text"] == "P_O_\n__O_\n____\nO__G"
    assert info == {"success": False}
    facts = env.state_facts()
    assert facts.player == (0, 0)
    assert ("goal", (3, 3), "below", "right") in [(f.name, f.position, f.vertical, f.horizontal) for f in facts.objects]
    assert sorted(f.position for f in facts.objects if f.name == "hole") == [(0, 2), (1, 2), (3, 0)]
    assert "goal is below and to the right of the player" in facts.describe()


def test_coords_lists_the_player_the_goal_and_the_holes_and_says_where_the_player_stands():
    env = make(symbols="coords")
    holes = "Holes: (0, 2), (1, 2), (3, 0)."
    assert env.reset(options={"level": LEVEL})[0]["text"] == f"Player: (0, 0). Goal: (3, 3). {holes}"
    env.step("Right")
    assert env.step("Right")[0]["text"] == f"Player: (0, 2) (in a hole). Goal: (3, 3). {holes}"
    env = make(size=2, symbols="coords")
    assert env.reset(options={"level": "PG\n__"})[0]["text"] == "Player: (0, 0). Goal: (0, 1). Holes: none."
    assert env.step("Right")[0]["text"] == "Player: (0, 1) (on the goal). Goal: (0, 1). Holes: none."


GRID_COORDS_HEADER = "Coordinates: \nBoard size: 4 rows x 4 cols (zero-indexed).\n"
"""The first two lines of RAGEN's CoordFrozenLake text on a 4x4 lake (the first ends with a space, as RAGEN's)."""


def test_grid_coords_is_ragens_coord_frozen_lake_text_from_the_start_to_the_goal():
    """RAGEN (mll-lab-nu/RAGEN 20daedc, frozen_lake/env.py ``_render_text('grid_coord')`` and utils.py): the start
    stays listed after the player leaves it (its map keeps the ``S``) and shows as ice in the grid; the player's
    label says when it stands on the goal or in a hole, whose cell the goal and hole lines still list."""
    env = make(symbols="grid_coords")
    obs, _ = env.reset(options={"level": LEVEL})
    holes = "Holes: (0, 2), (1, 2), (3, 0)\n"
    assert obs["text"] == (GRID_COORDS_HEADER + "Start: (0, 0)\nGoal: (3, 3)\nPlayer: (0, 0)\n" + holes
                           + "Grid Map: \nP_O_\n__O_\n____\nO__G")
    for action in ["Down", "Down", "Right"]:
        obs, *_ = env.step(action)
    assert obs["text"] == (GRID_COORDS_HEADER + "Start: (0, 0)\nGoal: (3, 3)\nPlayer: (2, 1)\n" + holes
                           + "Grid Map: \n__O_\n__O_\n_P__\nO__G")
    for action in ["Right", "Right"]:
        env.step(action)
    obs, reward, terminated, *_ = env.step("Down")
    assert (reward, terminated) == (1.0, True)
    assert obs["text"] == (GRID_COORDS_HEADER + "Start: (0, 0)\nGoal: (3, 3)\nPlayer on goal: (3, 3)\n" + holes
                           + "Grid Map: \n__O_\n__O_\n____\nO__√")


def test_grid_coords_of_a_player_in_a_hole_and_of_a_start_written_s():
    env = make(symbols="grid_coords")
    env.reset(options={"level": ["FFHF", "FSHF", "FFFF", "HFFG"]})  # gymnasium's symbols, the start mid-lake
    obs, _, terminated, *_ = env.step("Right")
    assert terminated
    assert obs["text"] == (GRID_COORDS_HEADER + "Start: (1, 1)\nGoal: (3, 3)\nPlayer in hole: (1, 2)\n"
                           "Holes: (0, 2), (1, 2), (3, 0)\nGrid Map: \n__O_\n__X_\n____\nO__G")
    env = make(symbols="grid_coords", size=2)
    env.reset(options={"level": "_G\nP_"})
    assert env.ansi() == (
        "Coordinates: \nBoard size: 2 rows x 2 cols (zero-indexed).\nStart: (1, 0)\nGoal: (0, 1)\n"
        "Player: (1, 0)\nGrid Map: \n_G\nP_"  # no hole: no Holes line
    )


def test_grid_coords_instructions_describe_the_coordinates_and_the_grid():
    text = make(symbols="grid_coords", size=6).instructions()
    assert "coordinates of the start, the goal, your position and the holes" in text
    assert "bottom-right corner (5, 5)" in text and "P is you" in text


def test_grid_coords_episodes_are_a_function_of_the_seed():
    env = make(symbols="grid_coords", p_frozen=0.9)
    texts = [env.reset(seed=s)[0]["text"] for s in range(30)]
    assert texts == [make(symbols="grid_coords", p_frozen=0.9).reset(seed=s)[0]["text"] for s in range(30)]
    assert len(set(texts)) > 25
    episode = assert_same_episode(make(symbols="grid_coords"), make(symbols="grid_coords"), seed=5,
                                  policy=expert_or("jump"), steps=30)
    assert episode[-1].reward == 1.0 and episode[-1].text.count("Player on goal: ") == 1


def test_gymnasium_symbols_accepted():
    cells, rows, cols, start, goal = parse_level(["SFFH", "FHFF", "FFFF", "HFFG"])
    assert (rows, cols, start, goal) == (4, 4, 0, 15)
    assert cells == "___O" + "_O__" + "____" + "O__G"


def test_edge_is_a_valid_no_move():
    env = make()
    env.reset(seed=0, options={"level": LEVEL})
    obs, reward, terminated, truncated, info = env.step("Up")
    assert (reward, terminated, truncated) == (0.0, False, False)
    assert info["action_is_valid"] and not info["action_is_effective"]
    assert env.player == (0, 0) and obs["text"].startswith("P_O_")


def test_hole_terminates_with_zero():
    env = make()
    env.reset(seed=0, options={"level": LEVEL})
    env.step("Right")
    obs, reward, terminated, truncated, info = env.step("Right")
    assert (reward, terminated, truncated, info["success"]) == (0.0, True, False, False)
    assert obs["text"].splitlines()[0] == "__X_"
    assert env.solve() is None
    # After the end every action is invalid and changes nothing.
    _, reward, terminated, _, info = env.step("Left")
    assert not info["action_is_valid"] and terminated and env.player == (0, 2)


def test_goal_pays_one_and_terminates():
    env = make()
    env.reset(seed=0, options={"level": LEVEL})
    for action in ["Down", "Down", "Right", "Right", "Right"]:
        env.step(action)
    obs, reward, terminated, truncated, info = env.step("Down")
    assert (reward, terminated, info["success"]) == (1.0, True, True)
    assert obs["text"].splitlines()[3] == "O__√"
    assert env.success() and env.solve() == []


def test_the_step_onto_the_goal_is_effective_and_says_where_it_moved():
    env = make(size=2)
    env.reset(options={"level": "PG\n__"})
    _, reward, terminated, _, info = env.step("Right")
    assert (reward, terminated, info["action_is_effective"], info["moved"]) == (1.0, True, True, "Right")


def test_solve_is_shortest_and_none_when_blocked():
    env = make()
    env.reset(options={"level": LEVEL})
    assert len(env.solve()) == 6
    assert shortest_path("__O" "_OO" "O_G", move_table(3, 3), 0, 8) is None


@pytest.mark.parametrize(("level", "size"), [("P_O\n_OO\nO_G", 3), ("PO\nOG", 2), (["SH", "HG"], 2),
                                             ("G_O\nOOO\n__P", 3)])
def test_a_given_map_without_a_path_to_the_goal_is_refused(level, size):
    """Such a map was played: every episode on it scored 0, whatever the agent did."""
    with pytest.raises(ValueError, match="level: holes cut every path"):
        make(size=size).reset(options={"level": level})


def flood(cells: str, size: int, start: int) -> set[int]:
    """The cells reachable from ``start`` over frozen ice and the goal, by a plain flood fill."""
    seen, todo = {start}, [start]
    while todo:
        r, c = divmod(todo.pop(), size)
        for nr, nc in ((r + 1, c), (r - 1, c), (r, c + 1), (r, c - 1)):
            cell = nr * size + nc
            if 0 <= nr < size and 0 <= nc < size and cells[cell] != "O" and cell not in seen:
                seen.add(cell)
                todo.append(cell)
    return seen


@settings(max_examples=150, deadline=None)
@given(st.integers(2, 5).flatmap(lambda n: st.tuples(
    st.just(n), st.lists(st.sampled_from("_O"), min_size=n * n, max_size=n * n),
    st.lists(st.integers(0, n * n - 1), min_size=2, max_size=2, unique=True))))
def test_a_given_map_is_refused_exactly_when_its_goal_cannot_be_reached(drawn):
    size, cells, (start, goal) = drawn
    cells[start], cells[goal] = "P", "G"
    level = ["".join(cells[r * size : (r + 1) * size]) for r in range(size)]
    refused_or_won(make(size=size), level, goal in flood("".join(cells), size, start), "holes cut every path")


def test_truncation_at_max_steps():
    env = make(max_steps=3)
    env.reset(options={"level": LEVEL})
    results = [env.step("Up")[2:4] for _ in range(3)]
    assert results == [(False, False), (False, False), (False, True)]


@pytest.mark.parametrize("success_rate", [None, 0.8])
def test_slippery_distribution(success_rate):
    env = make(size=5, is_slippery=True, success_rate=success_rate)
    level = "_____\n_____\n__P__\n_____\n____G"
    env.reset(seed=123)
    counts = Counter()
    trials = 3000
    for _ in range(trials):
        env.reset(options={"level": level})  # no seed: the generator keeps running
        counts[env.step("Up")[4]["moved"]] += 1
    p = 1 / 3 if success_rate is None else success_rate
    assert counts["Down"] == 0
    assert abs(counts["Up"] / trials - p) < 0.04
    assert abs(counts["Left"] / trials - (1 - p) / 2) < 0.04
    assert abs(counts["Right"] / trials - (1 - p) / 2) < 0.04


PERPENDICULAR = {"Left": {"Up", "Down"}, "Right": {"Up", "Down"}, "Up": {"Left", "Right"}, "Down": {"Left", "Right"}}


@pytest.mark.parametrize("action", ACTIONS)
@pytest.mark.parametrize("success_rate", [1.0, 0.0])
def test_success_rate_one_always_moves_as_intended_and_zero_always_slips_sideways(action, success_rate):
    env = make(size=5, is_slippery=True, success_rate=success_rate)
    env.reset(seed=0)
    seen = set()
    for _ in range(100):
        env.reset(options={"level": "_____\n_____\n__P__\n_____\n____G"})
        seen.add(env.step(action)[4]["moved"])
    assert seen == ({action} if success_rate == 1.0 else PERPENDICULAR[action])


def test_slippery_is_reproducible():
    def rollout(seed):
        env = make(size=6, is_slippery=True)
        obs, _ = env.reset(seed=seed)
        texts = [obs["text"]]
        for k in range(30):
            obs, _, terminated, truncated, _ = env.step(ACTIONS[k % 4])
            texts.append(obs["text"])
            if terminated or truncated:
                break
        return texts

    assert rollout(7) == rollout(7)
    assert any(rollout(7) != rollout(s) for s in range(8, 12))


def test_same_seed_same_whole_episode_on_slippery_ice_infos_included():
    """Each slip shows in info["moved"]: two plays of one seed, one after another episode, slip alike."""
    episode = assert_same_episode(make(is_slippery=True, mode="image"), make(is_slippery=True, mode="image"),
                                  seed=7, policy=cycle(["Down", "Right", "jump", "Up", "Left"]), steps=30)
    assert any(step.info.get("moved") not in (None, step.action) for step in episode)  # chance was in play


def test_maps_are_a_function_of_the_seed():
    env = make(size=5)
    first = [env.reset(seed=s)[0]["text"] for s in range(50)]
    again = [make(size=5).reset(seed=s)[0]["text"] for s in range(50)]
    assert first == again
    assert len(set(first)) > 45
    # Start and goal positions vary.
    starts = {text.replace("\n", "").index("P") for text in first}
    goals = {text.replace("\n", "").index("G") for text in first}
    assert len(starts) > 10 and len(goals) > 10


@pytest.mark.parametrize("size", [4, 8])
def test_generated_maps_are_solved_by_the_solver(size):
    env = make(size=size)
    for seed in range(1000):
        env.reset(seed=seed)
        plan = env.solve()
        assert plan is not None and 0 < len(plan) <= env.max_steps
        for k, action in enumerate(plan):
            _, reward, terminated, truncated, info = env.step(action)
            assert info["action_is_valid"] and not truncated
            assert terminated == (k == len(plan) - 1)
        assert reward == 1.0 and env.success()


def test_start_and_goal_are_any_two_distinct_cells():
    env = make(size=2)
    pairs = set()
    for seed in range(300):
        cells = env.reset(seed=seed)[0]["text"].replace("\n", "")
        pairs.add((cells.index("P"), cells.index("G")))
    assert pairs == {(start, goal) for start in range(4) for goal in range(4) if start != goal}


def test_p_frozen_one_draws_a_lake_without_holes():
    env = make(size=6, p_frozen=1.0)
    for seed in range(20):
        assert "O" not in env.reset(seed=seed)[0]["text"]


@pytest.mark.parametrize(("start", "goal"), [(0, 63), (63, 0), (7, 56), (56, 7), (3, 59), (24, 31)])
def test_the_fallback_carves_a_shortest_staircase_from_start_to_goal(start, goal):
    """When rejection sampling gives up, a monotone path is thawed: it joins the start to the goal in as many
    moves as they are apart, and no other hole thaws."""
    cells = ["O"] * 64
    cells[start], cells[goal] = "_", "G"
    carved = _carve_path(np.random.default_rng(0), "".join(cells), 8, start, goal)
    (row, col), (goal_row, goal_col) = divmod(start, 8), divmod(goal, 8)
    distance = abs(goal_row - row) + abs(goal_col - col)
    path = shortest_path(carved, move_table(8, 8), start, goal)
    assert path is not None and len(path) == distance
    assert carved.count("_") == distance and carved[goal] == "G"  # the start and the cells before the goal


def test_low_p_frozen_still_solvable():
    env = make(size=8, p_frozen=0.05)
    for seed in range(20):
        env.reset(seed=seed)
        plan = env.solve()
        assert plan is not None
        for action in plan:
            env.step(action)
        assert env.success()


BAD_ACTIONS = ["", "   ", "Jump", "Left Right", "x" * 100_000, "↑", "左", "\x00", None, 3, 2.5, b"Up", ["Up"], {"a": 1}]


@pytest.mark.parametrize("action", BAD_ACTIONS, ids=range(len(BAD_ACTIONS)))
def test_bad_actions_never_raise(action):
    env = make(mode="image")
    obs, _ = env.reset(seed=3)
    state = (env.player, obs["text"], env.solve())
    new_obs, reward, terminated, truncated, info = env.step(action)
    assert not info["action_is_valid"] and not info["action_is_effective"]
    assert (reward, terminated) == (0.0, False)
    assert (env.player, new_obs["text"], env.solve()) == state
    assert np.array_equal(new_obs["image"], obs["image"])
    assert env.steps == 1
    assert env.observation_space.contains(new_obs)


@settings(max_examples=150, deadline=None)
@given(st.one_of(st.text(max_size=200), st.sampled_from(ACTIONS).map(lambda name: f"\t{name.upper()} ")))
def test_any_text_is_a_move_or_a_rejection_that_changes_nothing(action):
    env = make()
    env.reset(seed=3)
    info = assert_text_is_data(env, action)
    assert info["action_is_valid"] == (action.strip().lower() in {name.lower() for name in ACTIONS})


def test_action_names_are_case_insensitive():
    env = make()
    env.reset(options={"level": LEVEL})
    assert env.step("  down ")[4]["action_is_valid"]
    assert env.player == (1, 0)


def test_image_tiles_are_distinct():
    env = make(mode="image", cell_px=20)
    obs, _ = env.reset(options={"level": LEVEL})
    image = obs["image"]
    centre = {pos: tuple(image[pos[0] * 20 + 10, pos[1] * 20 + 10]) for pos in [(0, 0), (0, 1), (0, 2), (3, 3)]}
    assert len(set(centre.values())) == 4  # player, ice, hole, goal


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"size": 1}, "size"),
        ({"size": 100}, "size"),
        ({"p_frozen": 0.0}, "p_frozen"),
        ({"p_frozen": 1.5}, "p_frozen"),
        ({"is_slippery": True, "success_rate": -0.1}, "success_rate"),
        ({"cell_px": 3}, "cell_px"),
        ({"cell_px": 257}, "cell_px"),
        ({"success_rate": 0.5}, "slippery"),
        ({"is_slippery": True, "success_rate": 1.5}, "success_rate"),
        ({"mode": "video"}, "mode"),
        ({"max_steps": 0}, "max_steps"),
        ({"symbols": "grid_coord"},
         r"symbols must be one of \['ragen', 'coords', 'grid_coords', 'vagen'\], got 'grid_coord'"),
        ({"symbols": None}, "symbols must be one of"),
    ],
)
def test_constructor_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        make(**kwargs)


@pytest.mark.parametrize("kwargs", [{"cell_px": 4}, {"cell_px": 256}, {"is_slippery": True, "success_rate": 0.0},
                                    {"is_slippery": True, "success_rate": 1.0}, {"p_frozen": 1.0}])
def test_settings_at_the_ends_of_their_ranges_are_taken(kwargs):
    make(**kwargs).reset(seed=0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"is_slippery": "false"}, "is_slippery must be True or False"),  # bool("false") is True: slippery ice
        ({"is_slippery": 1}, "is_slippery must be True or False"),
        ({"p_frozen": "0.8"}, "p_frozen must be a number"),
        ({"p_frozen": True}, "p_frozen must be a number"),
        ({"is_slippery": True, "success_rate": "0.8"}, "success_rate must be a number"),
    ],
)
def test_settings_of_the_wrong_type_are_named(kwargs, message):
    """These once passed (a string "false" made the ice slippery) or failed with Python's TypeError."""
    with pytest.raises(ValueError, match=message):
        make(**kwargs)


@pytest.mark.parametrize(("symbols", "size", "fallen"), [("coords", 28, "(in a hole)"),
                                                      ("grid_coords", 27, "Player in hole: (1, 0)")])
def test_coordinate_texts_always_fit_the_observation_space(symbols, size, fallen):
    # The longest listing: a lake of holes but the start and the goal, the player fallen into one.
    env = FrozenLakeEnv(size=size, symbols=symbols)
    level = "PG" + "O" * (size * size - 2)  # the goal beside the start: a map with a way to it
    env.reset(options={"level": [level[r * size : (r + 1) * size] for r in range(size)]})
    obs, *_ = env.step("Down")
    assert fallen in obs["text"] and env.observation_space.contains(obs)
    with pytest.raises(ValueError, match="characters"):  # a larger lake could overflow it, so it is refused
        FrozenLakeEnv(size=size + 1, symbols=symbols)
    FrozenLakeEnv(size=64)  # the grid always fits


@pytest.mark.parametrize(
    ("level", "message"),
    [
        ("P_\n_Z", "unknown"),
        ("P_\nPG", "exactly one"),
        ("P__\n_G", "same length"),
        ("X_\n_G", "unknown"),
        ("", "empty"),
        (42, "string"),
        (["P_", 5], "string or a list of row strings"),
        ("P__\n___\n__G", "size=3"),
    ],
)
def test_bad_levels(level, message):
    with pytest.raises(ValueError, match=message):
        make(size=2).reset(options={"level": level})


@settings(max_examples=100, deadline=None)
@given(st.one_of(st.text(), st.text("PS_FOHG \n"),
                 square_levels((2, 4), "_FOH _", ["PG", "SG", "PG", "P", "PSG", "PGG"])))
def test_any_level_text_is_a_map_or_a_value_error_also_through_reset(text):
    """A remote client sends the map as reset's option: a bad one is refused with a reason, never another
    exception."""
    try:
        cells, rows, cols, start, goal = parse_level(text)
    except ValueError as error:
        assert "FrozenLake" in str(error), error
        with pytest.raises(ValueError, match="FrozenLake"):
            make(size=3).reset(options={"level": text})
        return
    assert len(cells) == rows * cols and set(cells) <= {"_", "O", "G"} and cells.count("G") == 1
    assert cells[start] == "_" and cells[goal] == "G"
    try:
        obs, _ = make(size=3).reset(options={"level": text})
    except ValueError as error:
        assert re.search("size=3|holes cut every path", str(error)), error
        return
    assert obs["text"].count("G") == 1


def test_image_mode_text_gives_the_board_away_nowhere():
    env = FrozenLakeEnv(mode="image", render_mode="ansi")
    obs, _ = env.reset(seed=0)
    assert obs["text"] == IMAGE_CAPTION and "P" not in obs["text"]
    assert env.render() == FrozenLakeEnv().reset(seed=0)[0]["text"]  # ansi still draws the board


@pytest.mark.parametrize("size", [4, 8])
def test_action_budget_covers_the_shortest_path_and_slippery_ice_keeps_max_steps(size):
    env = FrozenLakeEnv(size=size)
    longest = 0
    for seed in range(200):
        env.reset(seed=seed)
        longest = max(longest, len(env.solve()))
    assert longest <= env.action_budget() == size**2 - 1
    assert FrozenLakeEnv(size=size, is_slippery=True, max_steps=70).action_budget() == 70

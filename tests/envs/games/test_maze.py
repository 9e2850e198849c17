"""Maze2D: conformance, perfect mazes, walls, stop rules, VisGym tuple actions."""

import re
import warnings
from collections import deque

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env
from hypothesis import example, given, settings
from hypothesis import strategies as st

import turnrl.envs  # noqa: F401  (registers the built-in envs)
from tests.envs.games.episodes import assert_same_episode, assert_text_is_data, cycle
from tests.envs.games.given_levels import refused_or_won, square_levels
from turnrl.envs.contract import IMAGE_CAPTION
from turnrl.envs.games.maze import Maze2DEnv, parse_action, parse_level, visgym_action

LEVEL = """
#######
#A..#.#
###.#.#
#...#.#
#.###.#
#....T#
#######
"""


@pytest.mark.parametrize("mode", ["text", "image"])
@pytest.mark.parametrize("render_mode", [None, "ansi", "rgb_array"])
@pytest.mark.parametrize("reward_on", ["reach", "stop"])
def test_check_env(mode, render_mode, reward_on):
    env = gym.make("turnrl/Maze2D-v0", mode=mode, render_mode=render_mode, reward_on=reward_on)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_env(env.unwrapped)


@pytest.mark.parametrize(("kwargs", "side"), [({}, 9), ({"difficulty": "hard"}, 11), ({"size": 7, "difficulty": "hard"}, 7)])
def test_sizes(kwargs, side):
    env = Maze2DEnv(mode="image", **kwargs)
    obs, _ = env.reset(seed=0)
    assert obs["image"].shape == (side * 25, side * 25, 3)
    assert [len(row) for row in env.ansi().split("\n")] == [side] * side
    assert obs["text"] == IMAGE_CAPTION  # the image is the observation: the text gives no maze away


def open_cells(text):
    rows = text.split("\n")
    return {(r, c) for r, row in enumerate(rows) for c, ch in enumerate(row) if ch != "#"}


def reachable(cells, start):
    seen, queue = {start}, deque([start])
    while queue:
        r, c = queue.popleft()
        for nxt in ((r + 1, c), (r - 1, c), (r, c + 1), (r, c - 1)):
            if nxt in cells and nxt not in seen:
                seen.add(nxt)
                queue.append(nxt)
    return seen


@pytest.mark.parametrize("generator", ["backtracker", "wilson"])
@pytest.mark.parametrize("size", [5, 9, 11, 15])
def test_mazes_are_perfect(size, generator):
    env = Maze2DEnv(size=size, generator=generator)
    m = (size - 1) // 2
    for seed in range(20):
        obs, _ = env.reset(seed=seed)
        rows = obs["text"].split("\n")
        assert set(rows[0]) == set(rows[-1]) == {"#"}
        assert all(row[0] == row[-1] == "#" for row in rows)
        cells = open_cells(obs["text"])
        # A spanning tree of the m*m rooms: m*m rooms plus m*m - 1 opened walls, all connected.
        assert len(cells) == 2 * m * m - 1
        assert reachable(cells, env.agent) == cells
        corners = {(1, 1), (1, size - 2), (size - 2, 1), (size - 2, size - 2)}
        assert env.agent in corners and env.target in corners
        assert env.agent[0] != env.target[0] and env.agent[1] != env.target[1]  # opposite corners


def test_the_agent_and_the_target_start_in_each_of_the_four_opposite_corner_placements():
    env = Maze2DEnv()
    placements = set()
    for seed in range(60):
        env.reset(seed=seed)
        placements.add((env.agent, env.target))
    assert placements == {((1, 1), (7, 7)), ((7, 7), (1, 1)), ((7, 1), (1, 7)), ((1, 7), (7, 1))}


def test_same_seed_same_maze():
    first = [Maze2DEnv().reset(seed=s)[0]["text"] for s in range(30)]
    again = [Maze2DEnv().reset(seed=s)[0]["text"] for s in range(30)]
    assert first == again and len(set(first)) == 30


def test_same_seed_same_whole_episode_infos_included():
    actions = ["up", "('move', 0)", "north", "down", "left", "right", "RIGHT", "('move', 3)"]
    episode = assert_same_episode(Maze2DEnv(mode="image"), Maze2DEnv(mode="image"), 5, cycle(actions), steps=24)
    assert {step.info.get("action_is_effective") for step in episode[1:]} == {True, False}


@pytest.mark.parametrize(("difficulty", "reward_on"), [("easy", "reach"), ("hard", "stop")])
def test_generated_mazes_are_solved(difficulty, reward_on):
    env = Maze2DEnv(difficulty=difficulty, reward_on=reward_on)
    for seed in range(1000):
        env.reset(seed=seed)
        plan = env.solve()
        assert plan and len(plan) <= env.max_steps
        assert (plan[-1] == "stop") == (reward_on == "stop")
        for k, action in enumerate(plan):
            _, reward, terminated, truncated, info = env.step(action)
            assert info["action_is_valid"] and info["action_is_effective"] and not truncated
            assert terminated == (k == len(plan) - 1)
        assert reward == 1.0 and env.success()


def test_text_symbols_and_facts():
    env = Maze2DEnv(size=7)
    obs, _ = env.reset(options={"level": LEVEL})
    assert obs["text"] == LEVEL.strip()
    facts = env.state_facts()
    assert facts.player == (1, 1)
    assert [(f.name, f.position, f.vertical, f.horizontal) for f in facts.objects] == [("target", (5, 5), "below", "right")]


def test_walls_block_without_ending():
    env = Maze2DEnv(size=7)
    env.reset(options={"level": LEVEL})
    for action in ["up", "left", "down"]:
        obs, reward, terminated, truncated, info = env.step(action)
        assert info["action_is_valid"] and not info["action_is_effective"]
        assert (reward, terminated, truncated) == (0.0, False, False)
        assert env.agent == (1, 1)
    assert env.step("right")[4]["action_is_effective"] and env.agent == (1, 2)


def test_a_step_into_a_wall_says_it_hit_the_wall_and_a_move_does_not():
    env = Maze2DEnv(size=7)
    env.reset(options={"level": LEVEL})
    assert env.step("up")[4]["hit_wall"] is True
    assert "hit_wall" not in env.step("right")[4]


def walk_to_target(env):
    for action in env.solve():
        if action != "stop":
            result = env.step(action)
    return result


def test_truncation_at_max_steps():
    env = Maze2DEnv(size=7, max_steps=12)  # the fewest that LEVEL takes
    env.reset(options={"level": LEVEL})
    flags = [env.step("up")[2:4] for _ in range(12)]  # into the wall every time
    assert flags == [(False, False)] * 11 + [(False, True)]


def test_reach_rule():
    env = Maze2DEnv(size=7, reward_on="reach")
    env.reset(options={"level": LEVEL})
    assert env.solve() == ["right", "right", "down", "down", "left", "left", "down", "down", "right", "right", "right", "right"]
    obs, reward, terminated, _, info = walk_to_target(env)
    assert (reward, terminated, info["success"]) == (1.0, True, True)
    assert "*" in obs["text"] and env.solve() == []
    # stop elsewhere ends the game with nothing
    env.reset(options={"level": LEVEL})
    _, reward, terminated, _, info = env.step("stop")
    assert (reward, terminated, info["success"]) == (0.0, True, False)


def test_stop_rule():
    env = Maze2DEnv(size=7, reward_on="stop")
    env.reset(options={"level": LEVEL})
    _, reward, terminated, _, info = walk_to_target(env)
    assert (reward, terminated, info["success"]) == (0.0, False, False)  # no pay before stop
    assert env.solve() == ["stop"] and not env.success()
    # Leaving the target and stopping elsewhere pays 0.
    env.step("left")
    _, reward, terminated, _, info = env.step("stop")
    assert (reward, terminated, info["success"]) == (0.0, True, False)
    # Stopping on the target pays 1.
    env.reset(options={"level": LEVEL})
    walk_to_target(env)
    _, reward, terminated, _, info = env.step("('stop', 'stop')")
    assert (reward, terminated, info["success"]) == (1.0, True, True)
    assert env.solve() == []
    assert not env.step("up")[4]["action_is_valid"]  # the episode is over


@pytest.mark.parametrize(
    ("action", "name"),
    [
        ("('move', 0)", "right"),
        ("('move', 1)", "up"),
        ("('move', 2)", "left"),
        ("('move', 3)", "down"),
        ('("move", 3)', "down"),
        ("(move,3)", None),  # one tuple grammar everywhere: strings are quoted
        ("`('move', 0)`", "right"),
        (" ('stop', 'stop') ", "stop"),
        ("UP", "up"),
        (" Stop ", "stop"),
    ],
)
def test_action_forms(action, name):
    assert parse_action(action) == name


def test_visgym_action_round_trip():
    for name in ["up", "down", "left", "right", "stop"]:
        assert parse_action(visgym_action(name)) == name


BAD_ACTIONS = [
    "", "  ", "north", "('move', 4)", "('move', -1)", "('move', '0', 1)", "('jump', 1)", "('stop', 0)",
    "move 0", "__import__('os').system('ls')", "('move', 0) ('move', 1)", "x" * 100_000, "↑", "上",
    "('move', ٣)", None, 0, 2.5, b"up", ("move", 0), ["up"],
]  # fmt: skip


@pytest.mark.parametrize("action", BAD_ACTIONS, ids=range(len(BAD_ACTIONS)))
def test_bad_actions_never_raise(action):
    env = Maze2DEnv(mode="image", reward_on="stop")
    obs, _ = env.reset(seed=4)
    state = (env.agent, obs["text"], env.solve())
    new_obs, reward, terminated, truncated, info = env.step(action)
    assert not info["action_is_valid"] and (reward, terminated) == (0.0, False)
    assert (env.agent, new_obs["text"], env.solve()) == state
    assert np.array_equal(new_obs["image"], obs["image"])
    assert env.observation_space.contains(new_obs)


def visgym_spelling(name: str, n: int, quote: str) -> tuple[str, bool]:
    """``('move', 2)`` spelled with other names, numbers and quotes, and whether it is one of the four moves."""
    return f" ({quote}{name}{quote},{n}) ", bool(quote) and name.lower() == "move" and 0 <= n <= 3


SPELLED = st.one_of(
    st.text(max_size=200).map(lambda text: (text, None)),  # valid or not: only that it is data
    st.builds(visgym_spelling, st.sampled_from(["move", "Move", "stop", "jump"]), st.integers(-2, 6),
              st.sampled_from(["'", '"', ""])),
    st.sampled_from(["up", "down", "left", "right", "stop"]).map(lambda name: (f" `{name.upper()}` ", True)),
)
"""An action and whether the maze takes it (None: either)."""


@settings(max_examples=200, deadline=None)
@given(SPELLED)
def test_any_text_is_a_move_or_a_rejection_that_changes_nothing(spelled):
    action, valid = spelled
    env = Maze2DEnv(reward_on="stop")
    env.reset(seed=4)
    info = assert_text_is_data(env, action)
    assert valid is None or info["action_is_valid"] == valid


def test_instructions_document_the_mapping():
    for mode in ["text", "image"]:
        text = Maze2DEnv(mode=mode, reward_on="stop").instructions()
        assert "('move', 0) = right" in text and "('move', 3) = down" in text and "stop" in text


def test_image_agent_and_target_are_distinct():
    env = Maze2DEnv(size=7, mode="image")
    obs, _ = env.reset(options={"level": LEVEL})
    image = obs["image"]
    pixel = lambda r, c: tuple(image[r * 25 + 12, c * 25 + 12])  # noqa: E731
    assert len({pixel(1, 1), pixel(5, 5), pixel(0, 0), pixel(1, 2)}) == 4  # agent, target, wall, path


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"difficulty": "medium"}, "difficulty"),
        ({"size": 8}, "odd"),
        ({"size": 3}, "odd"),
        ({"reward_on": "goal"}, "reward_on"),
        ({"cell_px": 1}, "cell_px"),
        ({"cell_px": 3}, "cell_px"),
        ({"cell_px": 257}, "cell_px"),
        ({"size": 7.0}, "odd int"),
        ({"size": 65}, "odd int"),
    ],
)
def test_constructor_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Maze2DEnv(**kwargs)


@pytest.mark.parametrize("kwargs", [{"size": 5}, {"size": 63}, {"cell_px": 4}, {"cell_px": 256}])
def test_settings_at_the_ends_of_their_ranges_are_taken(kwargs):
    Maze2DEnv(**kwargs).reset(seed=0)


@pytest.mark.parametrize(
    ("level", "message"),
    [
        ("#####\n#A.T#\n#####", "square"),
        ("#####\n#A..#\n#...#\n#...#\n#####", "exactly one"),
        ("#####\n#A.T#\n#.?.#\n#...#\n#####", "unknown"),
        (LEVEL, "size=7"),
        ("", "non-empty square grid"),
        ("#####\n#A.T#\n#...\n#...#\n#####", "square"),
        (["A.T", 5], "string or a list of row strings"),
    ],
)
def test_bad_levels(level, message):
    with pytest.raises(ValueError, match=message):
        Maze2DEnv(size=5).reset(options={"level": level})


@settings(max_examples=100, deadline=None)
@given(st.one_of(st.text(), st.text("#.AT \n"),
                 square_levels((4, 6), "#. ", ["AT", "AT", "AT", "A", "ATT", "AAT"])))
def test_any_level_text_is_a_maze_or_a_value_error_also_through_reset(text):
    """A remote client sends the maze as reset's option: a bad one is refused with a reason, never another
    exception."""
    try:
        grid, size, agent, target = parse_level(text)
    except ValueError as error:
        assert "maze" in str(error), error
        with pytest.raises(ValueError, match="maze"):
            Maze2DEnv(size=5).reset(options={"level": text})
        return
    assert len(grid) == size * size and set(grid) <= {"#", "."}
    assert 0 <= agent < size * size and 0 <= target < size * size and agent != target
    try:
        obs, _ = Maze2DEnv(size=5).reset(options={"level": text})
    except ValueError as error:
        assert re.search("size=5|walls cut every path|max_steps", str(error)), error
        return
    assert obs["text"].count("T") == 1


def test_a_given_maze_without_a_path_to_the_target_is_refused():
    """Such a maze was played: every episode on it scored 0, whatever the agent did."""
    walled_in = LEVEL.replace("#....T#", "#...#T#")
    with pytest.raises(ValueError, match="level: walls cut every path"):
        Maze2DEnv(size=7).reset(options={"level": walled_in})


@settings(max_examples=150, deadline=None)
@given(st.lists(st.sampled_from("#."), min_size=9, max_size=9),
       st.lists(st.integers(0, 8), min_size=2, max_size=2, unique=True))
def test_a_given_maze_is_refused_exactly_when_its_target_cannot_be_reached(inside, ends):
    """Random 5x5 mazes (3x3 inside the border): a refused one has no path (by a plain flood fill), an accepted
    one is won by the expert's plan."""
    inside[ends[0]], inside[ends[1]] = "A", "T"
    rows = ["#####"] + ["#" + "".join(inside[3 * r : 3 * r + 3]) + "#" for r in range(3)] + ["#####"]
    agent, target = (divmod(k, 3) for k in ends)
    agent, target = (agent[0] + 1, agent[1] + 1), (target[0] + 1, target[1] + 1)
    refused_or_won(Maze2DEnv(size=5), rows, target in reachable(open_cells("\n".join(rows)), agent),
                   "walls cut every path")


@pytest.mark.parametrize(("difficulty", "reward_on"), [("easy", "reach"), ("hard", "stop")])
def test_action_budget_covers_the_shortest_path(difficulty, reward_on):
    env = Maze2DEnv(difficulty=difficulty, reward_on=reward_on)
    longest = 0
    for seed in range(200):
        env.reset(seed=seed)
        longest = max(longest, len(env.solve()))
    assert longest <= env.action_budget() <= env.max_steps
    assert Maze2DEnv(difficulty=difficulty, max_steps=9).action_budget() == 9


@pytest.mark.parametrize(("reward_on", "budget"), [("reach", 31), ("stop", 32)])
def test_the_action_budget_before_the_first_reset_is_a_generated_mazes(reward_on, budget):
    env = Maze2DEnv(reward_on=reward_on)
    assert env.action_budget() == budget  # 9x9: 16 rooms and the 15 passages between them (+ stop)
    env.reset(seed=0)
    assert env.action_budget() == budget


SNAKE = ["A....", "####.", ".....", ".####", "....T"]
"""A 5x5 given maze without a border: its one path takes 16 moves, where a generated 5x5 maze's takes at most 6."""


def bfs_moves(rows: list[str], start: tuple[int, int], goal: tuple[int, int]) -> int | None:
    """Moves of a shortest path (a plain breadth-first search over the open cells), None where there is none."""
    cells = {(r, c) for r, row in enumerate(rows) for c, ch in enumerate(row) if ch != "#"}
    seen, queue = {start: 0}, deque([start])
    while queue:
        r, c = queue.popleft()
        for nxt in ((r + 1, c), (r - 1, c), (r, c + 1), (r, c - 1)):
            if nxt in cells and nxt not in seen:
                seen[nxt] = seen[(r, c)] + 1
                queue.append(nxt)
    return seen.get(goal)


@st.composite
def given_mazes(draw):
    """Any square grid of walls and paths (loops, open cells between the rooms, no border), A and T apart."""
    n = draw(st.sampled_from([5, 7]))
    cells = draw(st.lists(st.sampled_from("#."), min_size=n * n, max_size=n * n))
    agent, target = draw(st.lists(st.integers(0, n * n - 1), min_size=2, max_size=2, unique=True))
    cells[agent], cells[target] = "A", "T"
    return ["".join(cells[r * n : (r + 1) * n]) for r in range(n)], divmod(agent, n), divmod(target, n)


@settings(max_examples=300, deadline=None)
@given(given_mazes(), st.sampled_from(["reach", "stop"]))
@example((SNAKE, (0, 0), (4, 4)), "reach")
def test_the_action_budget_covers_the_shortest_path_of_any_given_maze(maze, reward_on):
    """The budget counted the open cells of a perfect maze of the size (7 at 5x5), whatever the maze played: the
    snake above takes 16 moves, and an agent held to the budget could never win it. Now the maze played counts."""
    rows, agent, target = maze
    moves = bfs_moves(rows, agent, target)
    env = Maze2DEnv(size=len(rows), reward_on=reward_on)
    if moves is None:
        with pytest.raises(ValueError, match="walls cut every path"):
            env.reset(options={"level": rows})
        return
    env.reset(options={"level": rows})
    assert moves + (reward_on == "stop") <= env.action_budget() <= env.max_steps


@pytest.mark.parametrize(("reward_on", "needed"), [("reach", 16), ("stop", 17)])
def test_a_given_maze_longer_than_max_steps_is_refused(reward_on, needed):
    """The snake takes 16 moves (17 actions with stop): with fewer steps allowed it cannot be won, and was played."""
    refusal = f"takes {needed} actions, more than max_steps={needed - 1}.*max_steps={needed}"
    with pytest.raises(ValueError, match=refusal):
        Maze2DEnv(size=5, reward_on=reward_on, max_steps=needed - 1).reset(options={"level": SNAKE})
    env = Maze2DEnv(size=5, reward_on=reward_on, max_steps=needed)
    env.reset(options={"level": SNAKE})
    assert len(env.solve()) == needed == env.action_budget()

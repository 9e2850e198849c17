"""Sokoban: Gymnasium conformance, push rules and rewards, generator, solver, views."""

from __future__ import annotations

import re
from collections import deque

import gymnasium
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env
from hypothesis import given, settings
from hypothesis import strategies as st

import turnrl.envs  # noqa: F401  (registers turnrl/Sokoban-v0)
from tests.envs.games.episodes import assert_text_is_data
from turnrl.envs.draw import draw_grid
from turnrl.envs.games.sokoban.levels import (
    ALT_SYMBOLS,
    DIRECTIONS,
    RAGEN_SYMBOLS,
    Level,
    apply_moves,
    check_level,
    generate_level,
    level_text,
    live_cells,
    parse_level,
    solve,
)
from turnrl.envs.games.sokoban.sokoban_env import TILES, SokobanEnv

ACTIONS = list(DIRECTIONS)


def board(text: str, **kwargs) -> SokobanEnv:
    """An env reset to a hand-written level (image mode needs the env sized to it)."""
    if kwargs.get("mode") == "image":
        level = parse_level(text)
        kwargs["dim_room"] = (level.rows, level.cols)
    env = SokobanEnv(**kwargs)
    env.reset(seed=0, options={"level": text})
    return env


# ---------------------------------------------------------------------- conformance
@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"mode": "image"},
        {"render_mode": "rgb_array"},
        {"render_mode": "ansi"},
        {"mode": "image", "render_mode": "rgb_array"},
        {"mode": "image", "render_mode": "ansi"},
        {"symbols": "alt", "render_mode": "ansi"},
        {"symbols": "coords", "render_mode": "ansi"},
        {"size": 8, "num_boxes": 2},
    ],
)
def test_check_env(kwargs):
    check_env(gymnasium.make("turnrl/Sokoban-v0", **kwargs).unwrapped)


def test_registry_make_and_description():
    env = turnrl.envs.make("sokoban", size=8, num_boxes=2)
    obs, info = env.reset(seed=1)
    assert len(obs["text"].splitlines()) == 8 and info["success"] is False
    assert SokobanEnv.description and SokobanEnv.modes == ("text", "image")
    assert env.action_names() == ["Up", "Down", "Left", "Right"]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"dim_room": (6, 6), "size": 7}, "disagree"),
        ({"symbols": "emoji"}, "symbols"),
        ({"size": 3, "num_boxes": 1}, "inner cells"),
        ({"size": 2}, "3x3"),
        ({"size": 4}, "too small to move a box"),  # a 2x2 inside has no three cells in a line to pull along
        ({"num_boxes": 0}, "num_boxes"),
        ({"mode": "video"}, "mode"),
        ({"size": 200}, "characters"),
    ],
)
def test_bad_constructor_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SokobanEnv(**kwargs)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"dim_room": (6,)}, r"dim_room must be two ints \(rows, cols\)"),
        ({"dim_room": 6}, r"dim_room must be two ints \(rows, cols\)"),
        ({"dim_room": (6.5, 6)}, r"dim_room must be two ints \(rows, cols\)"),
        ({"size": 6.5}, "size must be an int"),
        ({"size": "6"}, "size must be an int"),
        ({"num_boxes": 1.5}, "num_boxes must be an int"),
        ({"num_boxes": True}, "num_boxes must be an int"),
    ],
)
def test_room_settings_of_the_wrong_type_are_refused_not_truncated(kwargs, message):
    """A fractional size or box count once became a smaller room silently (6.5 -> 6, 1.5 boxes -> 1), and a
    one-number dim_room failed with Python's unpacking error."""
    with pytest.raises(ValueError, match=message):
        SokobanEnv(**kwargs)


@pytest.mark.parametrize("search_depth", [0, -3, True, 1.5, "3"])
def test_search_depth_must_be_a_positive_int(search_depth):
    with pytest.raises(ValueError, match="search_depth must be a positive int or None"):
        SokobanEnv(search_depth=search_depth)


def test_search_depth_of_one_is_taken():
    assert SokobanEnv(search_depth=1).search_depth == 1


@pytest.mark.parametrize("cell_px", [0, 1, 3, 257, 10**6])
def test_cells_too_small_to_draw_or_too_large_to_hold_are_refused(cell_px):
    with pytest.raises(ValueError, match="cell_px must be from 4 to 256"):
        SokobanEnv(mode="image", cell_px=cell_px)


@pytest.mark.parametrize("cell_px", [4, 256])
def test_cells_at_the_ends_of_their_range_draw(cell_px):
    assert SokobanEnv(mode="image", cell_px=cell_px).reset(seed=0)[0]["image"].shape == (6 * cell_px, 6 * cell_px, 3)


def test_room_settings_accept_lists_and_numpy_ints():
    assert SokobanEnv(dim_room=[5, 7]).dim_room == (5, 7)
    assert SokobanEnv(size=np.int64(7), num_boxes=np.int64(2)).dim_room == (7, 7)


def test_dim_room_is_rows_by_cols():
    env = SokobanEnv(dim_room=(5, 9), mode="image", cell_px=10)
    obs, _ = env.reset(seed=0)
    assert obs["image"].shape == (50, 90, 3)
    assert env.grid_text().count("\n") == 4 and len(env.grid_text().splitlines()[0]) == 9


# ---------------------------------------------------------------------- determinism
def test_same_seed_same_episode():
    a, b = SokobanEnv(), SokobanEnv()
    b.reset(seed=99)  # history must not matter
    for env in (a, b):
        env.reset(seed=7)
    assert a.text() == b.text()
    for action in ["Up", "Left", "Left", "Down", "Right", "Right", "Up", "Down"]:
        assert a.step(action) == b.step(action)
    a2 = SokobanEnv()
    assert a2.reset(seed=7)[0] == SokobanEnv().reset(seed=7)[0]


def test_different_seeds_mostly_different_levels():
    env = SokobanEnv()
    texts = {env.reset(seed=seed)[0]["text"] for seed in range(200)}
    assert len(texts) >= 190


def test_generate_level_is_a_pure_function_of_the_seed():
    assert generate_level(8, 8, 2, 1234) == generate_level(8, 8, 2, 1234)
    assert generate_level(8, 8, 2, 1234, max_moves=50) == generate_level(8, 8, 2, 1234, max_moves=50)


# ---------------------------------------------------------------------- generator + solver
@pytest.mark.parametrize("size, num_boxes", [(6, 1), (8, 2)])
def test_generated_levels_are_solved_by_replaying_the_solver(size, num_boxes):
    env = SokobanEnv(size=size, num_boxes=num_boxes)
    lengths = []
    for seed in range(1000):
        env.reset(seed=seed)
        level = env.initial_level
        assert not env.success(), "a level must not start solved"
        assert len(level.boxes) == len(level.targets) == num_boxes
        assert all(level.walls[cell] for cell in range(size)), "top border is wall"
        plan = env.solve()
        assert plan is not None and 0 < len(plan) <= env.max_steps
        lengths.append(len(plan))
        for i, action in enumerate(plan):
            _, reward, terminated, truncated, info = env.step(action)
            assert info["action_is_valid"] and not truncated
            assert terminated == (i == len(plan) - 1)
        assert env.success() and info["success"] and reward == pytest.approx(10.9)
    # Harder than one push on average (gym-sokoban's levels average about 3 moves at 6x6, 14 at 8x8/2).
    assert np.mean(lengths) > (3 if num_boxes == 1 else 9)


def naive_shortest(level: Level, limit: int = 200_000) -> int | None:
    """Length of a shortest solution by plain BFS over the reference rules."""
    start = (level.player, level.boxes)
    seen, queue = {start}, deque([(level, 0)])
    while queue and len(seen) < limit:
        current, depth = queue.popleft()
        if current.is_solved():
            return depth
        for d in range(4):
            nxt = apply_moves(current, [d])
            key = (nxt.player, nxt.boxes)
            if key not in seen:
                seen.add(key)
                queue.append((nxt, depth + 1))
    return None


@pytest.mark.parametrize("size, num_boxes, count", [(6, 1, 200), (7, 2, 40), (8, 2, 20)])
def test_solver_is_optimal(size, num_boxes, count):
    for seed in range(count):
        level = generate_level(size, size, num_boxes, seed)
        plan = solve(level)
        assert plan is not None and len(plan) == naive_shortest(level)
        assert apply_moves(level, plan).is_solved()


def test_solver_none_when_stuck_and_empty_when_solved():
    stuck = parse_level(
        """
        #####
        #X__#
        #_P_#
        #__O#
        #####
        """
    )
    assert solve(stuck) is None
    # Every box on a live cell, but the front box blocks the one behind it: the search runs dry.
    assert solve(parse_level("########\n#PXX_OO#\n########")) is None
    assert solve(parse_level("########\n#P_X_O_#\n########")) == [3, 3, 3]
    assert solve(parse_level("#####\n#P√_#\n#####")) == []
    env = board("######\n#P_XO#\n#____#\n######")
    assert env.solve() == ["Right", "Right"]
    env = board("######\n#_PX_#\n#___O#\n######")
    env.step("Right")  # box into the right corner, off target
    assert env.current_level().boxes == (10,)
    assert env.solve() is None


def test_figures_say_boxes_on_targets_and_when_a_box_is_past_saving():
    env = board("######\n#P___#\n#_X__#\n#___O#\n######")
    assert env.episode_metrics() == {"boxes_on_target": 0.0, "deadlocked": 0.0}
    for action in ("Down", "Right", "Right", "Down", "Right"):  # the box along row 2 to the right wall: still live
        assert env.step(action)[4]["metrics"] == {"boxes_on_target": 0.0, "deadlocked": 0.0}
    assert env.step("Up")[4]["metrics"] == {"boxes_on_target": 0.0, "deadlocked": 1.0}  # into the top right corner
    # Against a wall without a target: no corner, but no push takes it to a target any more.
    wall = board("#######\n#_____#\n#__X__#\n#__P_O#\n#######")
    assert wall.step("Up")[4]["metrics"]["deadlocked"] == 1.0
    two = board("#######\n#_P___#\n#_XX__#\n#_OO__#\n#######")
    assert two.step("Down")[4]["metrics"] == {"boxes_on_target": 0.5, "deadlocked": 0.0}
    # A given level is checked from its start: this box can only slide along the top wall.
    assert board("######\n#_PX_#\n#___O#\n######").episode_metrics()["deadlocked"] == 1.0


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), actions=st.lists(st.sampled_from(ACTIONS), max_size=30))
def test_a_deadlocked_level_has_no_solution_and_a_generated_one_starts_live(seed, actions):
    env = SokobanEnv(size=6, max_steps=1000)
    env.reset(seed=seed)
    assert env.episode_metrics()["deadlocked"] == 0.0
    for action in actions:
        figures = env.step(action)[4]["metrics"]
        state = env.current_level()
        assert figures["boxes_on_target"] == len(set(state.boxes) & set(state.targets)) / len(state.boxes)
        if figures["deadlocked"]:
            assert env.solve() is None


def test_dead_cells_exclude_corners_without_targets():
    level = parse_level("#####\n#P__#\n#_X_#\n#__O#\n#####")
    live = live_cells(level.rows, level.cols, level.walls, level.targets)
    corner, target = 1 * 5 + 1, 3 * 5 + 3
    assert live[target] == 1 and live[corner] == 0
    assert all(live[cell] == 0 for cell in range(25) if level.walls[cell])


def test_generated_levels_are_solvable_within_search_depth_when_it_is_below_max_steps():
    env = SokobanEnv(max_steps=100, search_depth=3)
    for seed in range(60):
        env.reset(seed=seed)
        assert 0 < len(env.solve()) <= 3


def test_deadlocked_says_exactly_whether_a_box_stands_on_a_dead_cell_in_generated_levels():
    env = SokobanEnv(max_steps=1000)
    rng = np.random.default_rng(0)
    seen = set()
    for seed in range(40):
        env.reset(seed=seed)
        level = env.initial_level
        live = live_cells(level.rows, level.cols, level.walls, level.targets)
        for action in rng.choice(ACTIONS, 30):
            _, _, terminated, _, info = env.step(str(action))
            dead = any(not live[box] for box in env.current_level().boxes)
            assert info["metrics"]["deadlocked"] == float(dead)
            seen.add(dead)
            if terminated:
                break
    assert seen == {False, True}


def test_generator_respects_max_moves_and_odd_shapes():
    for seed in range(100):
        level = generate_level(8, 8, 2, seed, max_moves=12)
        plan = solve(level)
        assert plan is not None and len(plan) <= 12
    for rows, cols, boxes in [(3, 5, 1), (5, 12, 3), (12, 7, 4)]:
        level = generate_level(rows, cols, boxes, seed=3)
        assert (level.rows, level.cols) == (rows, cols) and not level.is_solved()
        assert solve(level) is not None


# ---------------------------------------------------------------------- push rules and rewards
def test_move_and_walk_onto_target_shows_S():
    env = board("#####\n#PO_#\n#_X_#\n#####")
    _, reward, terminated, truncated, info = env.step("Right")
    assert env.text().splitlines()[1] == "#_S_#"
    assert reward == pytest.approx(-0.1) and not terminated and not truncated
    assert info["action_is_valid"] and info["action_is_effective"]
    env.step("Right")
    assert env.text().splitlines()[1] == "#_OP#"


def test_push_into_wall_is_a_costly_no_op():
    env = board("#####\n#_PX#\n#__O#\n#####")
    before = env.text()
    _, reward, terminated, _, info = env.step("right")
    assert env.text() == before and reward == pytest.approx(-0.1) and not terminated
    assert info["action_is_valid"] and not info["action_is_effective"]
    _, reward, _, _, info = env.step("Up")  # walking into a wall
    assert env.text() == before and not info["action_is_effective"]


def test_box_behind_box_does_not_move():
    env = board("#######\n#PXX_O#\n#____O#\n#######")
    before = env.text()
    _, reward, _, _, info = env.step("Right")
    assert env.text() == before and reward == pytest.approx(-0.1) and not info["action_is_effective"]


def test_onto_target_off_target_and_solved():
    env = board("#######\n#PX_O_#\n#_X__O#\n#######")
    env.step("Right")
    _, reward, terminated, _, _ = env.step("Right")  # box onto the first target: +1
    assert reward == pytest.approx(0.9) and not terminated
    assert env.text().splitlines()[1] == "#__P√_#"
    _, reward, _, _, _ = env.step("Right")  # pushed off again: -1
    assert reward == pytest.approx(-1.1)
    assert env.text().splitlines()[1] == "#___SX#"
    assert env.state_facts().player == (1, 4)


def test_solving_pays_ten_and_terminates():
    env = board("######\n#PXO_#\n#_X_O#\n#____#\n######")
    rewards = []
    for action in ["Right", "Left", "Down", "Right", "Right"]:
        obs, reward, terminated, truncated, info = env.step(action)
        rewards.append(reward)
    assert terminated and not truncated and info["success"] and env.success()
    assert rewards == pytest.approx([0.9, -0.1, -0.1, -0.1, -0.1 + 1 + 10])
    assert "X" not in obs["text"] and obs["text"].count("√") == 2
    _, reward, terminated, _, info = env.step("Left")  # after the end: ignored, not valid
    assert not info["action_is_valid"] and terminated


def test_truncation_at_max_steps():
    env = board("######\n#P__O#\n#__X_#\n######", max_steps=3)
    outcomes = [env.step(a) for a in ["Right", "Left", "Right"]]
    assert [o[3] for o in outcomes] == [False, False, True]
    assert not any(o[2] for o in outcomes)


def test_levels_without_border_walls_block_at_the_edge():
    env = board("PX_O")
    _, _, _, _, info = env.step("Left")
    assert not info["action_is_effective"]
    env.step("Right")
    _, reward, terminated, _, _ = env.step("Right")
    assert terminated and reward == pytest.approx(10.9)
    env = board("P_XO")
    env.step("Up")
    assert env.text() == "P_XO"


def test_cell_zero_of_a_level_without_border_is_ordinary_floor():
    env = board("_PXO")
    _, reward, _, _, info = env.step("Left")  # the player onto cell 0
    assert info["action_is_effective"] and env.state_facts().player == (0, 0) and reward == pytest.approx(-0.1)
    env = board("OXP_")
    _, reward, terminated, _, info = env.step("Left")  # the box onto cell 0, a target
    assert info["action_is_effective"] and env.text() == "√P__"
    assert terminated and reward == pytest.approx(10.9)


def test_a_box_at_the_edge_of_a_level_without_border_is_not_pushed_off_the_grid():
    env = board("XP_\nO__")
    before = env.text()
    _, reward, terminated, _, info = env.step("Left")
    assert env.text() == before and env.current_level().boxes == (0,)
    assert not info["action_is_effective"] and not terminated and reward == pytest.approx(-0.1)


# ---------------------------------------------------------------------- bad actions
BAD_ACTIONS = ["", " ", "jump", "Up Up", "Up,", "x" * 100_000, "上", "Ⓤp", "\x00"]
BAD_ACTIONS += [None, 3, 1.5, b"Up", ["Up"], {"a": 1}]  # not strings at all


@pytest.mark.parametrize("action", BAD_ACTIONS)
def test_bad_actions_never_raise(action):
    env = SokobanEnv()
    env.reset(seed=5)
    before = env.text()
    _, reward, terminated, truncated, info = env.step(action)
    assert env.text() == before and env.steps == 1
    assert reward == pytest.approx(-0.1) and not terminated and not truncated
    assert not info["action_is_valid"] and not info["action_is_effective"]


def test_actions_are_case_insensitive():
    env = board("#####\n#P_O#\n#_X_#\n#####")
    env.step("  rIGHT ")
    assert env.state_facts().player == (1, 2)


@settings(max_examples=150, deadline=None)
@given(st.one_of(st.text(max_size=200), st.sampled_from(ACTIONS).map(lambda name: f" {name.swapcase()}\n")))
def test_any_text_is_a_move_or_a_rejection_that_changes_nothing(action):
    env = SokobanEnv()
    env.reset(seed=5)
    info = assert_text_is_data(env, action)
    assert info["action_is_valid"] == (action.strip().lower() in {"up", "down", "left", "right"})


# ---------------------------------------------------------------------- invariants (hypothesis)
@settings(max_examples=200, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    size=st.sampled_from([(6, 6), (8, 8, 2), (7, 9, 3), (6, 6, 3)]),
    actions=st.lists(
        # Mostly valid moves (so boxes get pushed into each other), some odd spellings and junk.
        st.one_of(
            st.sampled_from(ACTIONS), st.sampled_from(ACTIONS), st.sampled_from(["up", "LEFT"]), st.text(max_size=5)
        ),
        max_size=80,
    ),
)
def test_random_play_keeps_invariants_and_matches_reference_rules(seed, size, actions):
    rows, cols, *boxes = size
    env = SokobanEnv(dim_room=(rows, cols), num_boxes=boxes[0] if boxes else 1, max_steps=1000)
    env.reset(seed=seed)
    reference = env.initial_level
    for action in actions:
        before = env.current_level()
        on_before = len(set(before.boxes) & set(before.targets))
        _, reward, terminated, _, info = env.step(action)
        if info["action_is_valid"]:
            reference = apply_moves(reference, [ACTIONS.index(action.strip().capitalize())])
        state = env.current_level()
        assert state == reference
        assert len(state.boxes) == len(state.targets)
        assert not state.walls[state.player] and state.player not in state.boxes
        assert not any(state.walls[b] for b in state.boxes)
        on_after = len(set(state.boxes) & set(state.targets))
        if info["action_is_valid"]:
            expected = -0.1 + (on_after - on_before) + (10 if terminated else 0)
            assert reward == pytest.approx(expected)
        grid = env.text()
        assert sum(grid.count(s) for s in "PS") == 1
        assert grid.count("X") + grid.count("√") == len(state.boxes)
        assert level_text(state) == grid
        if terminated:
            break


# ---------------------------------------------------------------------- levels as text
def test_parse_level_round_trip_and_indentation():
    text = "######\n#_P__#\n#_X√_#\n#_O__#\n#____#\n######"
    assert level_text(parse_level(text)) == text
    indented = "\n        " + text.replace("\n", "\n        ") + "\n    "
    assert parse_level(indented) == parse_level(text)
    alt = level_text(parse_level(text), ALT_SYMBOLS)
    assert alt.splitlines()[2] == "W.BC.W"
    assert parse_level(alt, ALT_SYMBOLS) == parse_level(text)


@pytest.mark.parametrize(
    "text, message",
    [
        ("", "empty"),
        ("####\n#P#\n####", "not rectangular"),
        ("#####\n#_XO#\n#####", "exactly one player"),
        ("#####\n#PXP#\n#O__#\n#####", "exactly one player"),
        ("#####\n#P_O#\n#####", "at least one box"),
        ("#####\n#PXX#\n#O__#\n#####", "as many boxes as targets"),
        ("#####\n#PX?#\n#O__#\n#####", "unknown symbol '\\?' at row 1, column 3"),
    ],
)
def test_bad_levels_are_rejected_with_a_reason(text, message):
    env = SokobanEnv()
    with pytest.raises(ValueError, match=message):
        env.reset(options={"level": text})


@st.composite
def level_grids(draw) -> str:
    """Rectangular grids of the level's symbols with one player and as many boxes as targets, mostly: levels
    that get past the parser's checks to the env's."""
    rows, cols = draw(st.integers(1, 7)), draw(st.integers(1, 7))
    cells = draw(st.lists(st.sampled_from("#__"), min_size=rows * cols, max_size=rows * cols))
    pieces = "P" + "".join(draw(st.lists(st.sampled_from(["XO", "√", "SX", "X", "O", "P"]), min_size=1, max_size=3)))
    count = min(len(pieces), rows * cols)
    spots = draw(st.lists(st.integers(0, rows * cols - 1), min_size=count, max_size=count, unique=True))
    for piece, spot in zip(pieces, spots):
        cells[spot] = piece
    return "\n".join("".join(cells[row * cols : (row + 1) * cols]) for row in range(rows))


@settings(max_examples=100, deadline=None)
@given(st.one_of(st.text(), st.text("#_OX√PS \n"), level_grids()))
def test_any_level_text_is_a_level_or_a_value_error_also_through_reset(text):
    """A remote client sends the level as reset's option: a bad one is refused with the parser's reason, never
    another exception."""
    try:
        level = parse_level(text)
    except ValueError as error:
        assert re.search("level|symbol", str(error)), error
        with pytest.raises(ValueError, match="level|symbol"):
            SokobanEnv().reset(options={"level": text})
        return
    assert check_level(level) is level
    assert level_text(level) == "\n".join(line.strip() for line in text.strip().splitlines())
    obs, _ = SokobanEnv().reset(options={"level": text})
    assert obs["text"] == level_text(level)


def test_bad_reset_options():
    with pytest.raises(ValueError, match="unknown"):
        SokobanEnv().reset(options={"lvl": "#"})
    with pytest.raises(ValueError, match="draws 6x6"):
        SokobanEnv(mode="image").reset(options={"level": "#####\n#PXO#\n#####"})
    with pytest.raises(ValueError, match="must be a string"):
        SokobanEnv().reset(options={"level": 5})


_ROOM = parse_level("#####\n#_P_#\n#_X_#\n#_O_#\n#####")  # the player on cell 7, the box on 12


@pytest.mark.parametrize(
    "level, message",
    [
        (Level(5, 5, _ROOM.walls, _ROOM.targets, _ROOM.boxes, 0), "not on a wall"),  # the player in the wall
        (Level(5, 5, _ROOM.walls, _ROOM.targets, (), 7), "as many boxes as targets"),  # once divided by 0 boxes
        (Level(5, 5, _ROOM.walls, _ROOM.targets, _ROOM.boxes, 99), "from 0 to 24"),  # once an IndexError
        (Level(5, 5, _ROOM.walls, _ROOM.targets, (12,), 12), "a cell each"),  # the player on the box
        (Level(5, 5, _ROOM.walls[:-1], _ROOM.targets, _ROOM.boxes, 7), "25 wall flags"),
    ],
)
def test_a_hand_built_level_that_cannot_be_played_is_refused(level, message):
    env = SokobanEnv()
    with pytest.raises(ValueError, match=message):
        env.reset(options={"level": level})


def test_a_hand_built_level_that_can_be_played_is_taken():
    env = SokobanEnv()
    obs, _ = env.reset(options={"level": Level(5, 5, _ROOM.walls, _ROOM.targets, _ROOM.boxes, np.int64(7))})
    assert obs["text"] == level_text(_ROOM)
    assert env.step("Down")[1:3] == (10.9, True)


# ---------------------------------------------------------------------- views
def test_alt_vocabulary():
    env = board("#######\n#PO__√#\n#_X___#\n#######", symbols="alt")
    assert env.text() == "WWWWWWW\nWAG..CW\nW.B...W\nWWWWWWW"
    env.step("Right")
    assert env.text().splitlines()[1] == "W.@..CW"
    legend = env.instructions()
    for symbol in "W.GCBA@":
        assert f"{symbol} " in legend
    assert env.render() is None


def test_coords_mode_lists_positions():
    env = board("######\n#PX_O#\n#__√_#\n######", symbols="coords", render_mode="ansi")
    lines = dict(line.split(": ", 1) for line in env.text().splitlines())
    assert lines["Player"] == "(1, 1)"
    assert lines["Boxes"] == "(1, 2), (2, 3)"
    assert lines["Targets"] == "(1, 4), (2, 3)"
    assert lines["Boxes on targets"] == "1 of 2"
    assert lines["Walls"].startswith("(0, 0), (0, 1)") and lines["Walls"].count("(") == 6 + 6 + 4
    env.step("Right")
    assert "Player: (1, 2)" in env.render() and "Boxes: (1, 3), (2, 3)" in env.text()
    assert "(row, column)" in env.instructions()


GRID_COORDS_HEADER = "Coordinates: \nBoard size: 4 rows x 6 cols (zero-indexed).\nTargets: (1, 4), (2, 3)\n"


def test_grid_coords_lists_boxes_off_and_on_targets_and_the_player_then_the_grid():
    env = board("######\n#PX_O#\n#__√_#\n######", symbols="grid_coords")
    assert env.text() == GRID_COORDS_HEADER + (
        "Boxes: (1, 2)\nBoxes on target: (2, 3)\nPlayer: (1, 1)\nGrid Map: \n######\n#PX_O#\n#__√_#\n######"
    )
    env.step("Right")
    env.step("Right")  # the second box onto its target: no box is off a target any more
    assert env.text() == GRID_COORDS_HEADER + (
        "Boxes on target: (1, 4), (2, 3)\nPlayer: (1, 3)\nGrid Map: \n######\n#__P√#\n#__√_#\n######"
    )


def test_grid_coords_names_the_player_on_a_target():
    env = board("#####\n#PO_#\n#X__#\n#___#\n#####", symbols="grid_coords")
    env.step("Right")
    lines = env.text().splitlines()
    assert lines[2:6] == ["Targets: (1, 2)", "Boxes: (2, 1)", "Player on target: (1, 2)", "Grid Map: "]


def test_ansi_render_of_a_coords_env_in_image_mode_is_the_grid():
    env = board("#####\n#PXO#\n#___#\n#####", mode="image", symbols="coords", render_mode="ansi")
    assert env.render() == "#####\n#PXO#\n#___#\n#####"


def test_instructions_name_the_symbols_and_actions():
    text = SokobanEnv().instructions()
    for symbol in "#_O√XPS":
        assert symbol in text
    for action in ACTIONS:
        assert action in text
    assert "image" in SokobanEnv(mode="image").instructions()


def test_image_mode_tiles_and_status_text():
    env = board("######\n#SX_√#\n#____#\n######", mode="image", cell_px=12)
    obs = env.observation()
    assert obs["image"].shape == env.observation_space["image"].shape == (48, 72, 3)
    assert obs["image"].dtype == np.uint8
    assert obs["text"] == "Boxes on targets: 1 of 2."
    assert env.render() is None
    # Every cell kind has its own tile, and the frame is made of them.
    tile_of = dict(zip(RAGEN_SYMBOLS.symbols, TILES))
    pictures = {symbol: draw_grid([symbol], tile_of, 12) for symbol in RAGEN_SYMBOLS.symbols}
    assert len({picture.tobytes() for picture in pictures.values()}) == len(TILES)
    for r, line in enumerate(env.grid_text().splitlines()):
        for c, symbol in enumerate(line):
            assert np.array_equal(obs["image"][r * 12 : (r + 1) * 12, c * 12 : (c + 1) * 12], pictures[symbol])


def test_ansi_render_shows_the_grid_in_image_mode():
    env = board("#####\n#PXO#\n#####", mode="image", render_mode="ansi")
    assert env.render() == "#####\n#PXO#\n#####"
    env = board("#####\n#PXO#\n#####", render_mode="rgb_array", cell_px=4)
    assert env.render().shape == (12, 20, 3)


def test_state_facts_relations():
    env = board("######\n#_X__#\n#__P_#\n#O___#\n######")
    facts = env.state_facts()
    assert facts.player == (2, 3)
    by_name = {fact.name: fact for fact in facts.objects}
    assert (by_name["box"].position, by_name["box"].vertical, by_name["box"].horizontal) == ((1, 2), "above", "left")
    assert (by_name["target"].vertical, by_name["target"].horizontal) == ("below", "left")
    assert "box is above and to the left of the player" in facts.describe()


@pytest.mark.parametrize(("size", "boxes"), [(6, 1), (7, 2)])
def test_action_budget_covers_the_fewest_moves_solution(size, boxes):
    env = SokobanEnv(size=size, num_boxes=boxes)
    lengths = []
    for seed in range(100):
        env.reset(seed=seed)
        lengths.append(len(env.solve()))
    assert max(lengths) <= env.action_budget() <= env.max_steps
    assert SokobanEnv(size=size, num_boxes=boxes, max_steps=5).action_budget() == 5

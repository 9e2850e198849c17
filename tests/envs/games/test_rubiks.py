"""Rubik's cube (2x2): face turns checked by hand, scrambles, the optimal solver against published counts and a
plain breadth-first search, the checkers, and the expert from any state."""

from __future__ import annotations

import warnings
from collections import deque

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env as gym_check_env
from hypothesis import given, settings
from hypothesis import strategies as st

import turnrl.envs  # noqa: F401  (registers the built-in envs)
from tests.envs.games.episodes import assert_same_episode, expert_or
from turnrl.envs import check_env
from turnrl.envs.contract import IMAGE_CAPTION
from turnrl.envs.games.rubiks import (
    ACTIONS,
    DIAMETER,
    SOLVED,
    RubiksCubeEnv,
    apply,
    distance_table,
    is_solved,
    optimal_solution,
    parse_moves,
    scramble,
)


def after(moves: str) -> RubiksCubeEnv:
    env = RubiksCubeEnv()
    env.reset(options={"scramble": moves})
    return env


def run(state, moves: str):
    for move in moves.split():
        state = apply(state, move)
    return state


# --------------------------------------------------------------------------- turns, by hand
def test_u_turns_the_top_layer_clockwise_seen_from_above():
    env = after("U")
    # Clockwise from above: the front's top row goes to the left face, the right's to the front, and so on.
    assert env.face("F") == ("R", "R", "G", "G")
    assert env.face("L") == ("G", "G", "O", "O")
    assert env.face("B") == ("O", "O", "B", "B")
    assert env.face("R") == ("B", "B", "R", "R")
    assert env.face("U") == ("W",) * 4 and env.face("D") == ("Y",) * 4


def test_r_turns_the_front_right_column_up():
    env = after("R")
    assert env.face("U") == ("W", "G", "W", "G")  # the front's right column went up
    assert env.face("B") == ("W", "B", "W", "B")  # the top's right column went to the back (its left, seen from behind)
    assert env.face("D") == ("Y", "B", "Y", "B")
    assert env.face("F") == ("G", "Y", "G", "Y")


def test_f_turns_the_top_row_onto_the_right_face():
    env = after("F")
    assert env.face("R") == ("W", "R", "W", "R")
    assert env.face("D") == ("R", "R", "Y", "Y")
    assert env.face("L") == ("O", "Y", "O", "Y")
    assert env.face("U") == ("W", "W", "O", "O")


def test_text_layout_after_u():
    assert after("U").observation()["text"] == "\n".join([
        "=== Rubik's Cube 2x2 State ===",
        "",
        "Up (U):    [W, W]",
        "           [W, W]",
        "Left (L):  [G, G]",
        "           [O, O]",
        "Front (F): [R, R]",
        "           [G, G]",
        "Right (R): [B, B]",
        "           [R, R]",
        "Back (B):  [O, O]",
        "           [B, B]",
        "Down (D):  [Y, Y]",
        "           [Y, Y]",
        "",
        "Available Actions:",
        "U, U', D, D', L, L', R, R', F, F', B, B'",
        "",
        "What is your next move?",
    ])


@pytest.mark.parametrize("face", "ULFRBD")
def test_each_turn_has_order_four_and_its_prime_undoes_it(face):
    state = run(SOLVED, "R U F' L D B")  # any mixed state
    assert run(state, f"{face} {face}'") == state == run(state, f"{face}' {face}")
    assert run(state, f"{face} {face} {face} {face}") == state
    assert run(state, f"{face} {face} {face}") == run(state, f"{face}'")
    assert run(state, face) != state


def test_the_sexy_move_has_order_six():
    state = SOLVED
    for k in range(1, 7):
        state = run(state, "R U R' U'")
        assert (state == SOLVED) == (k == 6)


def test_opposite_faces_commute_and_u_d_prime_turns_the_whole_cube():
    assert run(SOLVED, "U D") == run(SOLVED, "D U")
    assert run(SOLVED, "R U") != run(SOLVED, "U R")
    turned = run(SOLVED, "U D'")
    assert turned != SOLVED and is_solved(turned)


def test_every_turn_moves_twelve_stickers_and_keeps_each_colour_four_times():
    for action in ACTIONS:
        state = apply(SOLVED, action)
        assert sum(a != b for a, b in zip(state, SOLVED)) == 8  # 4 stickers of the face keep their colour
        assert sorted(state) == sorted(SOLVED)


# --------------------------------------------------------------------------- scrambles
def test_scrambles_never_undo_a_turn_nor_turn_a_face_three_times():
    rng = np.random.default_rng(0)
    for _ in range(300):
        moves = scramble(rng, 12)
        assert len(moves) == 12
        for a, b in zip(moves, moves[1:]):
            assert b != (a[0] if a.endswith("'") else a + "'")
        for a, b, c in zip(moves, moves[1:], moves[2:]):
            assert not a == b == c


@pytest.mark.parametrize("depth", [1, 2, 5, 20])
def test_reset_is_scrambled_never_solved_and_a_function_of_the_seed(depth):
    env = RubiksCubeEnv(scramble_depth=depth)
    texts = []
    for seed in range(60):
        obs, info = env.reset(seed=seed)
        assert not info["success"] and not env.success() and len(env.scramble) == depth
        texts.append(obs["text"])
    assert texts == [RubiksCubeEnv(scramble_depth=depth).reset(seed=s)[0]["text"] for s in range(60)]
    assert len(set(texts)) > (10 if depth == 1 else 40)


def test_same_seed_same_whole_episode_infos_included():
    episode = assert_same_episode(RubiksCubeEnv(mode="image", scramble_depth=3),
                                  RubiksCubeEnv(mode="image", scramble_depth=3), 4, expert_or("X", every=2), 8)
    assert episode[-1].terminated and episode[-1].info["success"]


def test_a_solving_turn_pays_one_and_ends_the_episode():
    env = after("R'")
    obs, reward, terminated, truncated, info = env.step("F")
    assert (reward, terminated, info["success"]) == (0.0, False, False)
    env.step("F'")
    obs, reward, terminated, truncated, info = env.step("R")
    assert (reward, terminated, truncated, info["success"]) == (1.0, True, False, True)


def test_truncation_at_max_steps_and_unknown_actions_pay_nothing():
    env = RubiksCubeEnv(max_steps=3)
    env.reset(seed=0)
    state = env.state
    obs, reward, terminated, truncated, info = env.step("X")
    assert not info["action_is_valid"] and reward == 0.0 and env.state == state
    assert env.step("u")[4]["action_is_valid"]  # names are case-insensitive
    assert env.step("U'")[2:4] == (False, True)


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=40))
def test_any_action_steps_without_raising(action):
    env = RubiksCubeEnv()
    env.reset(seed=1)
    state = env.state
    obs, reward, terminated, truncated, info = env.step(action)
    assert reward in (0.0, 1.0) and isinstance(obs["text"], str)
    if not info["action_is_valid"]:
        assert env.state == state


def test_given_scrambles_are_checked():
    assert parse_moves("r u' F") == ["R", "U'", "F"]
    with pytest.raises(ValueError, match="unknown turns"):
        parse_moves("R U2")
    with pytest.raises(ValueError, match="string of turns"):
        parse_moves(3)


@settings(max_examples=100, deadline=None)
@given(st.one_of(st.text(), st.text("UDLRFBudlrfb'2 \t\n"), st.lists(st.text("UDLRFBudlrfb' "), max_size=5)))
def test_any_scramble_a_client_sends_is_turns_or_a_value_error_also_through_reset(moves):
    """A remote client sends the scramble as reset's option: a bad one is refused with a reason, never another
    exception."""
    try:
        turns = parse_moves(moves)
    except ValueError as error:
        assert "turns" in str(error), error
        with pytest.raises(ValueError, match="turns"):
            RubiksCubeEnv().reset(options={"scramble": moves})
        return
    assert set(turns) <= set(ACTIONS)
    assert len(turns) == len(moves.split() if isinstance(moves, str) else moves)
    env = RubiksCubeEnv()
    env.reset(options={"scramble": moves})
    assert env.scramble == turns


# --------------------------------------------------------------------------- the solver
def test_the_distance_table_matches_the_published_counts():
    # Positions of the pocket cube by quarter-turn distance, one corner fixed (e.g. the OEIS / Wikipedia tables).
    counts = np.bincount(distance_table()[distance_table() >= 0])
    assert counts.tolist() == [1, 6, 27, 120, 534, 2256, 8969, 33058, 114149, 360508, 930588, 1350852, 782536,
                               90280, 276]
    assert len(counts) - 1 == DIAMETER


def plain_bfs_distance(state, limit: int) -> int | None:
    """Quarter turns to any solved state by breadth-first search over stickers and all twelve turns."""
    frontier, seen = deque([(state, 0)]), {state}
    while frontier:
        current, depth = frontier.popleft()
        if is_solved(current):
            return depth
        if depth == limit:
            continue
        for action in ACTIONS:
            nxt = apply(current, action)
            if nxt not in seen:
                seen.add(nxt)
                frontier.append((nxt, depth + 1))
    return None


def test_the_solver_is_optimal_against_a_plain_search():
    rng = np.random.default_rng(3)
    for _ in range(12):
        state = run(SOLVED, " ".join(scramble(rng, 5)))
        plan = optimal_solution(state)
        assert len(plan) == plain_bfs_distance(state, 5)
        assert is_solved(run(state, " ".join(plan))) if plan else is_solved(state)


def test_the_solver_solves_deep_random_states_within_the_diameter():
    rng = np.random.default_rng(4)
    for _ in range(100):
        state = run(SOLVED, " ".join(scramble(rng, 60)))
        plan = optimal_solution(state)
        assert len(plan) <= DIAMETER and is_solved(run(state, " ".join(plan)))
    assert optimal_solution(run(SOLVED, "U D'")) == []


def test_solve_works_from_the_current_state_not_only_from_reset():
    env = RubiksCubeEnv(scramble_depth=4)
    env.reset(seed=9)
    for action in ["D", "L'", "B", "B"]:  # turns the solver never uses: the down-left-back corner moves
        env.step(action)
    plan = env.solve()
    assert len(plan) <= 8 and plan
    for k, action in enumerate(plan):
        _, reward, terminated, _, info = env.step(action)
        assert terminated == (k == len(plan) - 1)
    assert info["success"] and reward == 1.0 and env.solve() == []


# --------------------------------------------------------------------------- views and checkers
def test_image_mode_draws_the_net():
    env = RubiksCubeEnv(mode="image", sticker_px=10)
    obs, _ = env.reset(options={"scramble": "U"})
    assert obs["text"].startswith(IMAGE_CAPTION + "\n\nAvailable Actions:")
    image = obs["image"]
    assert image.shape == env.image_shape + (3,)
    colours = {tuple(int(v) for v in image[y, x]) for y in range(image.shape[0]) for x in range(image.shape[1])}
    assert {(245, 245, 245), (255, 140, 0), (0, 155, 72), (200, 20, 30), (0, 70, 173), (255, 213, 0)} <= colours
    # The front face's top-left sticker (net block row 1, column 1) shows red after U.
    face = 2 * 10 + 2
    x, y = 6 + (face + 8) + 5, 6 + (face + 8) + 5
    assert tuple(image[y, x]) == (200, 20, 30)


def test_state_facts_name_each_face():
    facts = after("U").state_facts()
    assert facts.extra["Front face"] == "R R G G" and facts.extra["faces of one colour"] == 2
    assert "Up face: W W W W" in facts.describe()


@pytest.mark.parametrize("mode", ["text", "image"])
@pytest.mark.parametrize("render_mode", [None, "ansi", "rgb_array"])
def test_gymnasium_checker(mode, render_mode):
    env = gym.make("turnrl/RubiksCube-v0", mode=mode, render_mode=render_mode)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gym_check_env(env.unwrapped)


@pytest.mark.parametrize("kwargs", [{}, {"scramble_depth": 7}, {"mode": "image", "scramble_depth": 3}])
def test_turnrl_checker(kwargs):
    for seed in (0, 5):
        check_env(RubiksCubeEnv(**kwargs), seed=seed)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"scramble_depth": 0}, "scramble_depth"), ({"scramble_depth": 2.5}, "scramble_depth"),
     ({"sticker_px": 2}, "sticker_px"), ({"max_steps": 0}, "max_steps")],
)
def test_constructor_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RubiksCubeEnv(**kwargs)


@pytest.mark.parametrize("depth", [1, 3, 8, 20])
def test_the_expert_solves_200_validation_seeds_within_the_budget(depth):
    env = RubiksCubeEnv(scramble_depth=depth)
    for seed in range(200):
        env.reset(seed=seed)
        plan = env.solve()
        assert 1 <= len(plan) <= env.action_budget() == min(depth, DIAMETER, 20)
        for action in plan:
            _, _, terminated, truncated, info = env.step(action)
        assert terminated and info["success"]


def test_the_budget_covers_a_longer_scramble_given_at_reset():
    """A 20-move scramble given to an env of the default depth (1) once had a budget of 1 action, where its
    optimal solution takes 10."""
    env = RubiksCubeEnv()
    env.reset(options={"scramble": "B R' D' D' U U D F' R' B R B' F R' B' D' F' U L B"})
    plan = env.solve()
    assert len(plan) == 10 and env.action_budget() == 14
    for action in plan:
        *_, info = env.step(action)
    assert info["success"]
    env.reset(seed=0)  # a seed's episode: the settings' budget again
    assert env.action_budget() == 1
    deeper = RubiksCubeEnv(scramble_depth=6)
    deeper.reset(options={"scramble": "U"})  # a shorter one keeps what the settings' episodes need
    assert deeper.action_budget() == 6

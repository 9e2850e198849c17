"""Sudoku: the solver on known puzzles, unique generation at RAGEN's sizes, placements and their rewards, the
action parser (fuzzed), the checkers, and the expert."""

from __future__ import annotations

import warnings

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env as gym_check_env
from hypothesis import example, given, settings
from hypothesis import strategies as st

import turnrl.envs  # noqa: F401  (registers the built-in envs)
from tests.envs.games.episodes import assert_same_episode
from turnrl.envs import check_env
from turnrl.envs.contract import IMAGE_CAPTION
from turnrl.envs.games.sudoku import (
    EMPTY_FRACTION,
    Move,
    SudokuEnv,
    candidates,
    generate_puzzle,
    has_conflict,
    parse_action,
    parse_puzzle,
    solutions,
)

# The puzzle of Wikipedia's Sudoku article, and its solution.
WIKI = "530070000600195000098000060800060003400803001700020006060000280000419005000080079"
WIKI_SOLUTION = "534678912672195348198342567859761423426853791713924856961537284287419635345286179"
# Arto Inkala's "world's hardest Sudoku" (2012): propagation alone does not crack it, search must.
INKALA = "800000000003600000070090200050007000000045700000100030001000068008500010090000400"
INKALA_SOLUTION = "812753649943682175675491283154237896369845721287169534521974368438526917796318452"
SMALL = "..32 321. .321 2..3"  # a 4x4 puzzle with one solution: 1432 3214 4321 2143
SMALL_SOLUTION = "1432321443212143"


def grid(text: str) -> tuple[int, ...]:
    return tuple(int(ch) if ch.isdigit() else 0 for ch in text if ch.isdigit() or ch == ".")


def valid_solution(values: tuple[int, ...], size: int) -> bool:
    return all(values) and not has_conflict(values, size)


# --------------------------------------------------------------------------- solver
@pytest.mark.parametrize(("puzzle", "solution"), [(WIKI, WIKI_SOLUTION), (INKALA, INKALA_SOLUTION)])
def test_the_solver_finds_the_one_solution_of_known_puzzles(puzzle, solution):
    assert solutions(grid(puzzle), 9) == [grid(solution)]


def test_the_solver_counts_up_to_the_limit():
    first_row_only = grid(WIKI)[:9] + (0,) * 72
    found = solutions(first_row_only, 9, limit=2)
    assert len(found) == 2 and found[0] != found[1] and all(valid_solution(s, 9) for s in found)
    assert len(solutions((0,) * 16, 4, limit=5)) == 5
    assert solutions(grid(WIKI_SOLUTION), 9) == [grid(WIKI_SOLUTION)]


def test_the_solver_rejects_grids_that_break_the_rules_or_have_no_solution():
    repeated = list(grid(WIKI))
    repeated[2] = 5  # a second 5 in row 1
    assert solutions(tuple(repeated), 9) == []
    wrong_but_legal = list(grid(WIKI))
    wrong_but_legal[2] = 2  # allowed by row, column and box, but the only solution has 4 there
    assert solutions(tuple(wrong_but_legal), 9) == []


def test_candidates_follow_row_column_and_box():
    values = grid(WIKI)
    assert candidates(values, 9, 2) == [1, 2, 4]  # row 1 col 3
    assert candidates(values, 9, 0) == []  # a filled cell


# --------------------------------------------------------------------------- generation
@pytest.mark.parametrize("difficulty", list(EMPTY_FRACTION))
def test_generated_puzzles_have_ragens_size_and_exactly_one_solution(difficulty):
    env = SudokuEnv(difficulty=difficulty)
    expected = int(81 * EMPTY_FRACTION[difficulty])
    assert env.empty_cells == expected == {"easy": 32, "medium": 40, "hard": 48}[difficulty]
    for seed in range(10):
        env.reset(seed=seed)
        assert env.puzzle.count(0) == expected
        assert solutions(env.puzzle, 9) == [env.solution]
        assert valid_solution(env.solution, 9)
        assert all(p in (0, s) for p, s in zip(env.puzzle, env.solution))


def test_generation_is_a_function_of_the_seed():
    first = [SudokuEnv().reset(seed=s)[0]["text"] for s in range(8)]
    assert first == [SudokuEnv().reset(seed=s)[0]["text"] for s in range(8)]
    assert len(set(first)) == 8
    rng_a, rng_b = np.random.default_rng(5), np.random.default_rng(5)
    assert generate_puzzle(rng_a, 4, 6) == generate_puzzle(rng_b, 4, 6)


def test_same_seed_same_whole_episode_infos_included():
    """Right, wrong, rule-breaking and unreadable moves: each step's feedback and reward the same on both plays."""
    moves = ["place 1 at row 1 col 1", "erase row 1 col 1", "put a five somewhere", "place 2 at row 1 col 2"]

    def policy(env, k):
        return moves[k % 4] if k % 2 else env.solve()[0]

    episode = assert_same_episode(SudokuEnv(size=4, mode="image"), SudokuEnv(size=4, mode="image"), 3, policy, 12)
    assert {step.reward for step in episode[1:]} >= {1.0, -0.1}


# --------------------------------------------------------------------------- the parser
@pytest.mark.parametrize(
    ("text", "move"),
    [
        ("place 5 at row 2 col 3", Move(1, 2, 5)),
        ("Place 5 at Row 2 Column 3.", Move(1, 2, 5)),
        ("  `place 5 at row 2, col 3`  ", Move(1, 2, 5)),
        ("place 5 at (2,3)", Move(1, 2, 5)),
        ("place 5 at ( 2 , 3 )", Move(1, 2, 5)),
        ("place 5 at 2,3", Move(1, 2, 5)),
        ("5 at 2,3", Move(1, 2, 5)),
        ("(2,3,5)", Move(1, 2, 5)),
        ("2, 3, 5", Move(1, 2, 5)),
        ("erase row 9 col 1", Move(8, 0, 0)),
        ("clear (9, 1)", Move(8, 0, 0)),
        ("place 5 at row 2 col 3 and place 6 at row 1 col 1", Move(1, 2, 5)),  # the first found, as re.search
    ],
)
def test_ragens_spellings_parse(text, move):
    assert parse_action(text, 9) == move


@pytest.mark.parametrize(
    "text",
    ["", "place", "place 0 at row 1 col 1", "place 10 at row 1 col 1", "place 5 at row 10 col 1",
     "0,1,1", "1,1,0", "place 5 at row 2 col 3" + " " * 240,
     "erase row 0 col 3", "5", "Up"],
)
def test_unreadable_or_out_of_range_actions_are_none(text):
    assert parse_action(text, 9) is None


def test_four_by_four_limits_digits_and_cells_to_four():
    assert parse_action("place 4 at row 4 col 4", 4) == Move(3, 3, 4)
    assert parse_action("place 5 at row 1 col 1", 4) is None
    assert parse_action("place 1 at row 5 col 1", 4) is None


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=120))
def test_the_parser_takes_any_string(text):
    move = parse_action(text, 9)
    assert move is None or (0 <= move.row < 9 and 0 <= move.col < 9 and 0 <= move.digit <= 9)
    if move is not None:
        assert parse_action(move.text(), 9) == move


@settings(max_examples=150, deadline=None)
@given(st.one_of(st.text(max_size=80), st.from_regex(r"place [0-9]{1,2} at row [0-9]{1,2} col [0-9]{1,2}")))
def test_any_action_steps_without_raising(action):
    env = SudokuEnv()
    env.reset(seed=0, options={"puzzle": WIKI})
    before = env.grid
    obs, reward, terminated, truncated, info = env.step(action)
    assert isinstance(obs["text"], str) and np.isfinite(reward) and not terminated
    if not info["action_is_valid"] or not info["action_is_effective"]:
        assert env.grid == before and reward == -0.1


# --------------------------------------------------------------------------- dynamics
def wiki_env(**kwargs) -> SudokuEnv:
    env = SudokuEnv(**kwargs)
    env.reset(seed=0, options={"puzzle": WIKI})
    return env


def test_a_correct_placement_pays_one_and_shows_in_the_grid():
    env = wiki_env()
    obs, reward, terminated, truncated, info = env.step("place 4 at row 1 col 3")
    assert (reward, terminated, truncated) == (1.0, False, False)
    assert info["action_is_valid"] and info["action_is_effective"] and info["correct_placement"]
    assert obs["text"].splitlines()[1] == " 1 [5][3] 4 | . [7] . | .  .  ."
    assert "Placed 4 at row 1 col 3." in obs["text"] and "Empty cells: 50." in obs["text"]


def test_a_legal_wrong_digit_pays_half_and_an_overwrite_pays_the_difference():
    env = wiki_env()
    assert env.step("place 2 at row 1 col 3")[1] == 0.5  # 2 is allowed there, but the solution has 4
    assert env.step("place 4 at row 1 col 3")[1] == 0.5  # wrong -> right: 1 - 0.5
    assert env.step("erase row 1 col 3")[1] == -1.0


def test_no_cycle_of_actions_earns_reward():
    env = wiki_env()
    total = 0.0
    for _ in range(5):
        for action in ("place 2 at row 1 col 3", "place 1 at row 1 col 3", "place 4 at row 1 col 3",
                       "erase row 1 col 3"):
            total += env.step(action)[1]
    assert total == pytest.approx(0.0)
    assert env.grid == grid(WIKI)


@pytest.mark.parametrize(
    ("action", "problem"),
    [
        ("place 5 at row 1 col 3", "5 at row 1 col 3 repeats a digit of its row and box"),
        ("place 7 at row 1 col 3", "7 at row 1 col 3 repeats a digit of its row"),
        ("place 6 at row 1 col 3", "6 at row 1 col 3 repeats a digit of its box"),
        ("place 8 at row 1 col 3", "8 at row 1 col 3 repeats a digit of its column and box"),
        ("place 6 at row 2 col 2", "6 at row 2 col 2 repeats a digit of its row and column and box"),
        ("place 1 at row 1 col 1", "row 1 col 1 is a given cell"),
        ("erase row 1 col 1", "row 1 col 1 is a given cell"),
        ("erase row 1 col 3", "row 1 col 3 is already empty"),
    ],
)
def test_a_rule_breaking_action_changes_nothing_pays_the_penalty_and_says_why(action, problem):
    env = wiki_env()
    obs, reward, terminated, _, info = env.step(action)
    assert info["action_is_valid"] and not info["action_is_effective"]
    assert (reward, terminated, env.grid) == (-0.1, False, grid(WIKI))
    assert info["illegal"] == problem and f"Not done: {problem}." in obs["text"]


def test_placing_the_digit_a_cell_already_holds_is_refused():
    env = wiki_env()
    env.step("place 4 at row 1 col 3")
    obs, reward, _, _, info = env.step("place 4 at row 1 col 3")
    assert reward == -0.1 and info["illegal"] == "row 1 col 3 already holds 4"


def test_unreadable_text_is_an_invalid_action_that_leaves_the_observation():
    env = wiki_env()
    before = env.observation()["text"]
    obs, reward, terminated, truncated, info = env.step("put a five somewhere")
    assert not info["action_is_valid"] and reward == -0.1 and obs["text"] == before and env.steps == 1


def test_the_last_placement_solves_with_the_bonus():
    env = SudokuEnv(size=4)
    env.reset(options={"puzzle": SMALL})
    plan = env.solve()
    rewards = [env.step(action)[1] for action in plan[:-1]]
    assert rewards == [1.0] * 5
    obs, reward, terminated, truncated, info = env.step(plan[-1])
    assert (reward, terminated, info["success"]) == (11.0, True, True)
    assert env.grid == grid(SMALL_SOLUTION) and "The puzzle is solved." in obs["text"]
    assert env.solve() == []


def test_truncation_at_max_steps():
    env = wiki_env(max_steps=2)
    assert env.step("place 4 at row 1 col 3")[2:4] == (False, False)
    assert env.step("place 5 at row 1 col 1")[2:4] == (False, False)  # illegal: RAGEN does not end there
    assert env.step("erase row 1 col 3")[2:4] == (False, True)


# --------------------------------------------------------------------------- views
def test_text_layout_of_a_small_puzzle():
    env = SudokuEnv(size=4)
    obs, info = env.reset(options={"puzzle": SMALL})
    assert info == {"success": False}
    assert obs["text"] == "\n".join([
        "    1  2   3  4",
        " 1  .  . |[3][2]",
        " 2 [3][2]|[1] .",
        "   ------+------",
        " 3  . [3]|[2][1]",
        " 4 [2] . | . [3]",
        "Empty cells: 6.",
        "Candidates: row 1 col 1: 1 4; row 1 col 2: 1 4; row 2 col 4: 4; row 3 col 1: 4; row 4 col 2: 1 4; "
        "row 4 col 3: 4.",
    ])


def test_candidates_are_listed_only_when_few_cells_are_empty():
    env = wiki_env()
    assert "Candidates" not in env.observation()["text"]
    solution = grid(WIKI_SOLUTION)
    missing = [cell for cell, value in enumerate(env.grid) if not value]
    for cell in missing[:-10]:
        env.step(f"place {solution[cell]} at row {cell // 9 + 1} col {cell % 9 + 1}")
    assert "Empty cells: 10." in env.observation()["text"] and "Candidates: row" in env.observation()["text"]


def test_state_facts_give_the_rows_and_the_empty_count():
    facts = wiki_env().state_facts()
    assert facts.player is None and facts.objects == ()
    assert facts.extra["row 1"] == "5 3 . . 7 . . . ." and facts.extra["empty cells"] == 51
    assert "row 9: . . . . 8 . . 7 9" in facts.describe()


def test_image_mode_draws_the_grid_and_says_nothing_of_it_in_text():
    env = SudokuEnv(mode="image", cell_px=20)
    obs, _ = env.reset(seed=0, options={"puzzle": WIKI})
    assert obs["image"].shape == (9 * 20 + 8, 9 * 20 + 8, 3)
    assert obs["text"].startswith(IMAGE_CAPTION) and "[5]" not in obs["text"]
    after, *_ = env.step("place 4 at row 1 col 3")
    changed = np.argwhere((after["image"] != obs["image"]).any(axis=2))
    rows, cols = changed[:, 0], changed[:, 1]
    # Only the cell at row 1, column 3 changed (pixels 4 + 2*20 ... 4 + 3*20), in blue ink.
    assert rows.min() >= 4 and rows.max() < 4 + 20 and cols.min() >= 4 + 40 and cols.max() < 4 + 60
    ink = after["image"][rows, cols]
    assert (ink[:, 2] > ink[:, 0]).any()


def test_state_key_is_the_grid():
    env = wiki_env()
    env.step("place 5 at row 1 col 1")  # refused: feedback changes, the state does not
    assert env.state_key() == "".join(map(str, grid(WIKI)))


# --------------------------------------------------------------------------- checkers
@pytest.mark.parametrize("mode", ["text", "image"])
@pytest.mark.parametrize("render_mode", [None, "ansi", "rgb_array"])
def test_gymnasium_checker(mode, render_mode):
    env = gym.make("turnrl/Sudoku-v0", mode=mode, render_mode=render_mode)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gym_check_env(env.unwrapped)


@pytest.mark.parametrize("kwargs", [{}, {"size": 4}, {"difficulty": "hard"}, {"mode": "image"}])
def test_turnrl_checker(kwargs):
    for seed in (0, 7):
        check_env(SudokuEnv(**kwargs), seed=seed)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"size": 16}, "size"), ({"difficulty": "expert"}, "difficulty"), ({"cell_px": 2}, "cell_px"),
     ({"mode": "video"}, "mode")],
)
def test_constructor_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SudokuEnv(**kwargs)


@pytest.mark.parametrize(
    ("puzzle", "message"),
    [(WIKI[:-1], "81 cells"), (WIKI.replace("5", "x", 1), "unknown Sudoku symbols"), (42, "string"),
     ("0" * 81, "more than one solution"), ("55" + WIKI[2:], "no solution")],
)
def test_bad_given_puzzles(puzzle, message):
    with pytest.raises(ValueError, match=message):
        SudokuEnv().reset(options={"puzzle": puzzle})


@settings(max_examples=100, deadline=None)
@given(st.one_of(st.text(), st.text("012345.|-+ \n"), st.text("012345.", min_size=16, max_size=16)))
@example("000000000000000²")  # once int()'s own ValueError, "invalid literal for int()", naming no Sudoku rule
def test_any_puzzle_text_is_a_grid_or_a_value_error_also_through_reset(text):
    """A remote client sends the puzzle as reset's option: a bad one is refused with a reason, never another
    exception."""
    try:
        puzzle = parse_puzzle(text, 4)
    except ValueError as error:
        assert "Sudoku" in str(error), error
        with pytest.raises(ValueError, match="Sudoku"):
            SudokuEnv(size=4).reset(options={"puzzle": text})
        return
    assert len(puzzle) == 16 and all(value in range(5) for value in puzzle)
    try:
        SudokuEnv(size=4).reset(options={"puzzle": text})
    except ValueError as error:
        assert "solution" in str(error), error


def test_parse_puzzle_ignores_layout():
    assert parse_puzzle("..32|\n321.\n-----\n.321\n2..3", 4) == grid(SMALL)


# --------------------------------------------------------------------------- the expert
def play_expert(env: SudokuEnv) -> tuple[bool, int]:
    plan = env.solve()
    info = {"success": False}
    for action in plan:
        _, _, terminated, truncated, info = env.step(action)
        assert info["action_is_valid"] and info["action_is_effective"]
        if terminated or truncated:
            break
    return info["success"], len(plan)


@pytest.mark.parametrize("difficulty", ["easy", "hard"])
def test_the_expert_solves_validation_seeds_within_the_budget(difficulty):
    env = SudokuEnv(difficulty=difficulty)
    for seed in range(25):
        env.reset(seed=seed)
        solved, length = play_expert(env)
        assert solved and length == env.action_budget() == env.empty_cells


def test_the_expert_solves_200_validation_seeds():
    env = SudokuEnv()
    results = [play_expert(env) for seed in range(200) if env.reset(seed=seed)]
    assert all(solved for solved, _ in results)


def test_the_expert_fixes_wrong_digits_first_from_any_state():
    env = wiki_env()
    wrong = []
    for cell in (2, 3, 5):  # row 1, columns 3, 4 and 6: put a legal digit that is not the solution's
        digit = next(d for d in candidates(env.grid, 9, cell) if d != env.solution[cell])
        env.step(f"place {digit} at row 1 col {cell + 1}")
        wrong.append(cell)
    assert [env.grid[c] != env.solution[c] and env.grid[c] != 0 for c in wrong] == [True] * 3
    plan = env.solve()
    assert plan[:3] == ["erase row 1 col 3", "erase row 1 col 4", "erase row 1 col 6"]
    solved, _ = play_expert(env)
    assert solved


def test_the_expert_fills_forced_cells_first():
    env = wiki_env()
    first = parse_action(env.solve()[0], 9)
    assert first is not None
    assert len(candidates(env.grid, 9, first.row * 9 + first.col)) == 1

"""VAGEN's Sokoban, FrozenLake, Navigation and PrimitiveSkill against turnrl's envs and recipes.

Source: RAGEN-AI/VAGEN@d2b8b30b4db41073e2b3ecad269f9c1c52522362:

- vagen/env/sokoban/env.py, env_config.py: gym-sokoban's dynamics and rewards (-0.1 a step,
  +1 a box onto a target, -1 off one, +10 when the last box lands), 6x6 rooms, 1 box;
  text symbols ``#`` wall, ``_`` floor, ``O`` target, ``√`` box on target, ``X`` box,
  ``P`` player, ``S`` player on target; actions Up, Down, Left, Right.
- vagen/env/frozenlake/env.py, env_config.py, utils.py: 4x4, 80% frozen, not slippery;
  start and goal two distinct random cells, the map redrawn until the goal is reachable;
  a hole or the goal ends the episode; actions Left, Down, Right, Up; reaching the goal pays
  gymnasium's 1 plus a bonus of 9.
- vagen/env/navigation/env.py, env_config.py: actions moveahead, moveback, moveright,
  moveleft, rotateright, rotateleft, lookup, lookdown (any case); 0.5 m moves, 90-degree
  turns, 30-degree tilts; success within 1.5 m pays 10 and ends the episode; 30 env steps.
- vagen/env/primitive_skill/env.py, env_config.py: ``pick(x,y,z)``, ``place(x,y,z)``,
  ``push(x1,y1,z1,x2,y2,z2)`` in millimetres, name in any case, the wrong count of
  coordinates or another name is invalid; 2 actions a turn separated by ``|``.

Deliberate differences (docs/fidelity.md): FrozenLake's goal pays 1 (VAGEN 10: the VAGEN
FrozenLake recipes weigh the env's reward by 10, ``rewards.env_weight``); VAGEN draws one FrozenLake map per env
object (no seed), turnrl one per seed; Navigation runs on MiniWorld with a 90-degree field
of view (VAGEN: AI2-THOR, 100); Sokoban's and FrozenLake's text grids are RAGEN's unless ``symbols: vagen`` asks
for VAGEN's (a space, the symbol, a space and a tab a cell).
"""

import inspect
from dataclasses import replace

import pytest

from turnrl.agent.formats import get_format
from turnrl.config import load_config
from turnrl.envs.games.frozenlake import ACTIONS as LAKE_ACTIONS
from turnrl.envs.games.frozenlake import FrozenLakeEnv, shortest_path
from turnrl.envs.games.navigation.navigation_env import ACTIONS as NAV_ACTIONS
from turnrl.envs.games.navigation.navigation_env import PITCH_STEP, NavigationEnv
from turnrl.envs.games.primitive_skill.primitive_skill_env import parse_skill
from turnrl.envs.games.sokoban.sokoban_env import SokobanEnv
from turnrl.rewards import FinishedTurn, Rewards
from turnrl.training.train_config import TrainConfig

SOLVED_IN_ONE = "#####\n#___#\n#PXO#\n#___#\n#####"



def test_sokoban_rewards():
    env = SokobanEnv(dim_room=(5, 5), num_boxes=1)
    env.reset(seed=0, options={"level": "#####\n#P__#\n#_X_#\n#__O#\n#####"})
    rewards = [env.step(a)[1] for a in ("Up", "Right", "Down")]  # bump the wall, step, push the box down
    assert rewards == pytest.approx([-0.1, -0.1, -0.1])
    _, reward, terminated, _, info = env.step("Right")  # walk round to push it right onto the target
    assert reward == pytest.approx(-0.1) and not terminated
    env.reset(seed=0, options={"level": SOLVED_IN_ONE})
    _, reward, terminated, _, info = env.step("Right")
    assert reward == pytest.approx(-0.1 + 1 + 10) and terminated and info["success"]


def test_sokoban_symbols_and_defaults():
    env = SokobanEnv(dim_room=(5, 5), num_boxes=1)
    obs, _ = env.reset(seed=0, options={"level": SOLVED_IN_ONE})
    assert set(obs["text"]) >= {"#", "_", "P", "X", "O"}
    defaults = inspect.signature(SokobanEnv.__init__).parameters
    assert defaults["num_boxes"].default == 1 and defaults["max_steps"].default == 100
    assert env.action_names() == ["Up", "Down", "Left", "Right"]


def test_frozenlake_defaults_and_actions():
    env = FrozenLakeEnv()
    assert (env.size, env.p_frozen, env.is_slippery) == (4, 0.8, False)
    assert tuple(env.action_names()) == LAKE_ACTIONS == ("Left", "Down", "Right", "Up")


def test_frozenlake_maps_are_solvable_with_distinct_start_and_goal():
    env = FrozenLakeEnv()
    for seed in range(50):
        env.reset(seed=seed)
        assert env._player != env._goal
        assert shortest_path(env._cells, env._moves, env._player, env._goal) is not None


def test_frozenlake_goal_and_hole_end_the_episode():
    env = FrozenLakeEnv(size=2)
    env.reset(seed=0, options={"level": ["P_", "OG"]})
    _, reward, terminated, _, _ = env.step("Down")
    assert terminated and reward == 0.0  # a hole
    env.reset(seed=0, options={"level": ["P_", "OG"]})
    env.step("Right")
    _, reward, terminated, _, info = env.step("Down")
    assert terminated and info["success"] and reward == 1.0  # VAGEN pays 10: a documented difference


@pytest.mark.parametrize("recipe", ["vagen_frozenlake", "vagen_full_frozenlake"])
def test_the_vagen_frozenlake_recipes_pay_vagens_ten_for_the_goal(recipe):
    """A turn that reaches the goal, scored by the recipe's rewards (its added state rewards left out): VAGEN's
    1 + 9 for the goal and its 0.5 for the format; a turn into a hole: the format's 0.5 alone."""
    config = load_config(TrainConfig, f"configs/{recipe}.yaml")
    rewards = Rewards(replace(config.rewards, extra=[]))
    env = FrozenLakeEnv(size=2)
    env.reset(seed=0, options={"level": ["P_", "OG"]})
    env.step("Right")
    _, goal, _, _, info = env.step("Down")
    env.reset(seed=0, options={"level": ["P_", "OG"]})
    _, hole, _, _, _ = env.step("Down")
    fmt = get_format(config.agent.format)
    parsed = fmt.parse("<think><observation>o</observation><reasoning>r</reasoning><prediction>p</prediction>"
                       "</think><answer>Down</answer>", env.action_names())
    turns = [FinishedTurn(env_id="FrozenLake", seed=0, turn=1, observation="", response="", response_tokens=0,
                          finish_reason="stop", parsed=parsed, actions=("Down",), actions_valid=(True,),
                          env_reward=reward, format_reward=config.agent.format_reward, terminated=True,
                          success=reward > 0) for reward in (goal, hole)]
    assert info["success"] and [scores.reward for scores in rewards.score(turns)] == pytest.approx([10.5, 0.5])


def test_navigation_actions_and_defaults():
    assert NAV_ACTIONS == ("moveahead", "moveback", "moveright", "moveleft", "rotateright", "rotateleft",
                           "lookup", "lookdown")
    assert PITCH_STEP == 30
    defaults = inspect.signature(NavigationEnv.__init__).parameters
    assert defaults["step_length"].default == 0.5 and defaults["success_threshold"].default == 1.5
    assert defaults["success_reward"].default == 10.0 and defaults["max_steps"].default == 30


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("pick(62,-55,20)", ("pick", (0.062, -0.055, 0.02))),
        ("Place(10, 20, 30)", ("place", (0.01, 0.02, 0.03))),
        ("push(0,10,20,30,40,50)", ("push", (0.0, 0.01, 0.02, 0.03, 0.04, 0.05))),
        ("place(1,2)", None),
        ("push(1,2,3)", None),
        ("grab(1,2,3)", None),
    ],
)
def test_primitive_skill_actions(text, expected):
    skill = parse_skill(text)
    if expected is None:
        assert skill is None
    else:
        assert skill.name == expected[0] and skill.coords == pytest.approx(expected[1])

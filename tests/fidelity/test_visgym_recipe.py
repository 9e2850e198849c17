"""SkyRL's VisGym maze recipes against configs/visgym_maze.yaml.

Source: NovaSky-AI/SkyRL@a9564572eb8e91076be43c1bd5e4615e3de17265,
examples/train/visgym/run_visgym_from_sft.sh, run_visgym_from_instruct.sh, env_sft.py and
env_instruct.py. What the source does:

- SFT recipe (tuple actions, from an SFT checkpoint): reward paid once, at the episode's
  end, ``0.8 * task + 0.2 * (well-formed turns / turns)``; a turn is well-formed when
  ``<observation>``, ``<justification>`` and ``<action>`` each appear with non-blank
  content (anywhere, any order). 15 turns, temperature 0.7, no KL, GRPO with 8 samples,
  lr 1e-6. A 5-turn episode that stops on the target with every turn well-formed: 1.0.
- Instruct recipe (keyword actions, from the instruct model): task reward only, 18 turns,
  temperature 1.0, k3 KL loss 0.005, GRPO with 8 samples, lr 1e-6.

configs/visgym_maze.yaml takes the SFT recipe's warm start, turns, temperature and
0.8 / 0.2 weights, the instruct recipe's keyword actions and KL, and pays the format part
per well-formed turn (1/15 a turn): a deliberate difference listed with the overrides
that give each source recipe in docs/fidelity.md. The same 5-turn episode
pays 0.8 + 0.2 * 5/15 = 0.867 there.
"""

import pytest

from turnrl.agent.formats import get_format, turn_format_reward
from turnrl.config import load_config
from turnrl.envs.games.maze import ACTIONS
from turnrl.training.train_config import TrainConfig

RECIPE = load_config(TrainConfig, "configs/visgym_maze.yaml")



def test_shared_settings():
    assert RECIPE.env.id == "Maze2D"
    assert RECIPE.env.settings["difficulty"] == "easy" and RECIPE.env.settings["reward_on"] == "stop"
    assert RECIPE.algorithm.advantage == "grpo" and RECIPE.groups.group_size == 8
    assert RECIPE.optim.actor_lr == pytest.approx(1e-6)


def test_sft_recipe_settings_taken():
    assert RECIPE.sft.enabled
    assert RECIPE.agent.max_turns == 15
    assert RECIPE.sampling.temperature == pytest.approx(0.7)
    assert (RECIPE.rewards.env_weight, RECIPE.rewards.format_weight) == (0.8, 0.2)


def test_instruct_recipe_settings_taken():
    assert RECIPE.agent.format == "visgym_keyword"
    assert (RECIPE.algorithm.kl_coef, RECIPE.algorithm.kl_kind) == (0.005, "k3")


def episode_return(turns_well_formed, task):
    """turnrl's return of an episode under the recipe: per-turn format rewards plus the task at the end."""
    fmt = get_format(RECIPE.agent.format)
    good = fmt.parse("I go there. <action>right</action>", ACTIONS)
    total = RECIPE.rewards.env_weight * task
    for _ in range(turns_well_formed):
        total += RECIPE.rewards.format_weight * turn_format_reward(
            good, format_reward=RECIPE.agent.format_reward, no_action_penalty=RECIPE.agent.no_action_penalty)
    return total


def test_full_length_episode_matches_skyrls_split():
    # SkyRL: 0.8 * 1 + 0.2 * 15/15 = 1.0 for 15 well-formed turns ending on the target.
    assert episode_return(15, 1.0) == pytest.approx(1.0, abs=0.001)


def test_short_episode_format_share_is_a_documented_difference():
    # SkyRL: 0.8 + 0.2 * 5/5 = 1.0; turnrl pays 1/15 of the format part a turn: 0.8 + 0.2 * 5/15.
    assert episode_return(5, 1.0) == pytest.approx(0.8 + 0.2 * 5 / 15, abs=0.001)


def test_no_action_turn_costs_nothing():
    """SkyRL's parse failure pays 0 (and counts a turn); the recipe sets no penalty."""
    assert RECIPE.agent.no_action_penalty == 0.0
    assert RECIPE.agent.feedback_on_invalid  # the next observation tells the model and repeats the frame

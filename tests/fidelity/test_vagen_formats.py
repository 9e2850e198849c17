"""VAGEN's reasoning formats, parsers and format reward against turnrl's VAGEN formats.

Source: RAGEN-AI/VAGEN@d2b8b30b4db41073e2b3ecad269f9c1c52522362,
vagen/env/utils/parse_utils.py (``parse_freethink``, ``parse_no_think``,
``parse_grounding``, ``parse_worldmodeling``, ``parse_grounding_worldmodeling``),
vagen/env/sokoban/env.py and vagen/env/frozenlake/env.py (``step``), their
env_config.py files. What the source does:

- Formats: no_think ``<answer>``; free_think ``<think><answer>``; grounding
  ``<think><observation><reasoning></think><answer>``; worldmodeling
  ``<think><reasoning><prediction></think><answer>``; grounding_worldmodeling
  ``<think><observation><reasoning><prediction></think><answer>`` (the default).
  Whitespace between tags is allowed; ``format_correct`` needs nothing else around them.
- The answer is split on ``action_sep`` ("," by default), pieces stripped, empties dropped;
  only the first ``max_actions_per_step`` (3 for Sokoban and FrozenLake) are kept.
- A malformed response yields no actions: it steps nothing (free_think, no_think; the
  grounding parsers also take the tag sequence from inside surrounding text).
- Format reward (``format_reward`` 0.5 in the recipes) when the response is format-correct and
  every action is valid; the env executes actions in order and stops at the first
  invalid one (an unknown name).

Deliberate differences (docs/fidelity.md): by default turnrl takes actions from
the last complete answer tag of any response (``agent.strict_format: true`` gives VAGEN's
rule); an empty tag breaks the format (VAGEN accepts ``<think></think>``); names match in any
case (VAGEN's Sokoban and FrozenLake take ``Up``, not ``up``); an unknown name is dropped and
the rest run (VAGEN stops at it); actions past the limit withhold the format reward (VAGEN
cuts them and pays).
"""

import pytest

from turnrl.agent.formats import get_format, turn_format_reward
from turnrl.config import load_config
from turnrl.training.train_config import TrainConfig

SOKOBAN = ("Up", "Down", "Left", "Right")
GWM = ("<think><observation>The box is below me.</observation><reasoning>Push it down.</reasoning>"
       "<prediction>The box will be on the target.</prediction></think><answer>{}</answer>")


def vagen(name, **kwargs):
    return get_format(name, max_actions_per_turn=3, **kwargs)



@pytest.mark.parametrize(
    ("name", "text", "fields"),
    [
        ("no_think", "<answer>Down</answer>", {}),
        ("free_think", "<think>Go down.</think>\n<answer>Down</answer>", {"think": "Go down."}),
        ("grounding", "<think> <observation>o</observation> <reasoning>r</reasoning> </think> <answer>Down</answer>",
         {"observation": "o", "reasoning": "r"}),
        ("worldmodeling", "<think><reasoning>r</reasoning><prediction>p</prediction></think><answer>Down</answer>",
         {"reasoning": "r", "prediction": "p"}),
        ("grounding_worldmodeling", GWM.format("Down"),
         {"observation": "The box is below me.", "reasoning": "Push it down.",
          "prediction": "The box will be on the target."}),
    ],
)
def test_well_formed_responses(name, text, fields):
    parsed = vagen(name).parse(text, SOKOBAN)
    assert parsed.format_ok and parsed.actions == ("Down",)
    for tag, content in fields.items():
        assert parsed.fields[tag] == content


def test_comma_separator_and_three_actions_kept():
    parsed = vagen("grounding_worldmodeling").parse(GWM.format("Up, Up,Left , Down"), SOKOBAN)
    assert parsed.actions == ("Up", "Up", "Left")  # VAGEN: actions[:3]


@pytest.mark.parametrize("name", ["free_think", "grounding_worldmodeling"])
def test_strict_takes_no_actions_from_a_malformed_response(name):
    text = "Sure! <answer>Down</answer>"
    assert vagen(name, strict=True).parse(text, SOKOBAN).actions == ()  # VAGEN: no actions, nothing steps
    assert vagen(name).parse(text, SOKOBAN).actions == ("Down",)  # turnrl's lenient default


def test_strict_format_reaches_the_parser_from_the_config():
    config = load_config(TrainConfig, "configs/vagen_frozenlake.yaml", ["agent.strict_format=true"])
    assert config.agent.strict_format
    assert not load_config(TrainConfig, "configs/vagen_frozenlake.yaml").agent.strict_format


def test_format_reward_for_a_well_formed_turn_with_valid_actions():
    parsed = vagen("grounding_worldmodeling").parse(GWM.format("Down, Left"), SOKOBAN)
    assert turn_format_reward(parsed, format_reward=0.5, no_action_penalty=0.0) == 0.5


def test_unknown_action_withholds_the_format_reward():
    parsed = vagen("grounding_worldmodeling").parse(GWM.format("Down, Jump, Left"), SOKOBAN)
    assert turn_format_reward(parsed, format_reward=0.5, no_action_penalty=0.0) == 0.0  # as VAGEN
    assert parsed.actions == ("Down", "Left")  # VAGEN runs Down and stops at Jump: a documented difference


def test_malformed_turn_earns_no_format_reward():
    parsed = vagen("free_think").parse("<answer>Down</answer>", SOKOBAN)
    assert turn_format_reward(parsed, format_reward=0.5, no_action_penalty=0.0) == 0.0


def test_documented_differences():
    fmt = vagen("free_think")
    assert not fmt.parse("<think></think><answer>Up</answer>", SOKOBAN).format_ok  # VAGEN: format-correct
    assert fmt.parse("<think>x</think><answer>up</answer>", SOKOBAN).actions == ("Up",)  # VAGEN: invalid "up"
    too_many = fmt.parse("<think>x</think><answer>Up, Up, Up, Up</answer>", SOKOBAN)
    assert turn_format_reward(too_many, format_reward=0.5, no_action_penalty=0.0) == 0.0  # VAGEN pays 0.5


@pytest.mark.parametrize("recipe", ["vagen_frozenlake", "vagen_full_sokoban", "navigation", "primitive_skill"])
def test_recipes_use_vagens_format_and_reward(recipe):
    config = load_config(TrainConfig, f"configs/{recipe}.yaml")
    assert config.agent.format == "grounding_worldmodeling"  # VAGEN's default prompt_format
    assert config.agent.format_reward == 0.5 and config.agent.no_action_penalty == 0.0


@pytest.mark.parametrize(("recipe", "limit", "separator"),
                         [("vagen_frozenlake", 3, None), ("navigation", 5, None), ("primitive_skill", 2, "|")])
def test_actions_per_turn_and_separator(recipe, limit, separator):
    """VAGEN: FrozenLake and Sokoban 3 actions a turn, Navigation 5, PrimitiveSkill 2 separated by "|"."""
    config = load_config(TrainConfig, f"configs/{recipe}.yaml")
    assert config.agent.max_actions_per_turn == limit and config.agent.action_separator == separator

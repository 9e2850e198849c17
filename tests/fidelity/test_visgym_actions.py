"""SkyRL's VisGym action extraction against turnrl's ``visgym_keyword`` and ``visgym_tuple`` formats.

Source: NovaSky-AI/SkyRL@a9564572eb8e91076be43c1bd5e4615e3de17265,
examples/train/visgym/utils.py (``extract_relaxed_action``, ``extract_action``) and
env_instruct.py / env_sft.py. What the source does:

- Instruct recipe: the *last* ``<action>word</action>`` of the response counts; the word
  must be one of left, right, up, down, stop, in any case, surrounding spaces allowed;
  free text anywhere. ``"...<action>up</action> ... <action>left</action>"`` -> left;
  a last tag with another word (``<action>jump</action>``) -> no action, even after a
  valid earlier tag. The tag itself is matched in any case (``<ACTION>left</ACTION>``).
- SFT recipe: the *first* tuple anywhere in the response whose first element is a name
  (quoted or not) and that has two elements; the ``<action>`` tag is not needed.
- A response without an action does not step the env: the same frame comes back with an
  error naming the valid actions, and the turn still counts toward ``max_turns``.

Deliberate differences (docs/fidelity.md): turnrl matches the tag names
exactly (``<ACTION>`` is text), tuples take quoted names only (``(move, 3)`` is
refused, SkyRL adds the quotes), and ``visgym_tuple`` reads the tuple inside
``<action>`` only (SkyRL's first tuple anywhere takes ``(1,1)`` written in the
observation as the action ``('1', 1)``).
"""

import pytest

from turnrl.agent.formats import get_format
from turnrl.envs.games.maze import ACTIONS

KEYWORD = get_format("visgym_keyword")
TUPLE = get_format("visgym_tuple")



@pytest.mark.parametrize(
    ("text", "actions"),
    [
        ("I should go left.\n<action>left</action>", ("left",)),
        ("<action>up</action> no, better: <action>left</action>", ("left",)),
        ("<action> LEFT </action>", ("left",)),
        ("<action>Stop</action>", ("stop",)),
        ("<action>up</action> then <action>jump</action>", ()),
        ("go left", ()),
        ("<action>left", ()),
    ],
)
def test_keyword_last_tag_wins(text, actions):
    assert KEYWORD.parse(text, ACTIONS).actions == actions


def test_keyword_has_no_format_requirement():
    """The instruct recipe pays the task only: any response with a valid last tag is as good as another."""
    assert KEYWORD.parse("Thinking out loud... <action>down</action> done.", ACTIONS).format_ok


def test_tag_case_is_a_documented_difference():
    # SkyRL: re.IGNORECASE on the tag, so this is "left"; turnrl reads tags exactly.
    assert KEYWORD.parse("<ACTION>left</ACTION>", ACTIONS).actions == ()


@pytest.mark.parametrize(
    ("text", "action"),
    [
        ("<observation>a maze</observation><justification>east</justification><action>('move', 0)</action>",
         "('move', 0)"),
        ('<observation>x</observation><justification>y</justification><action>("stop", "stop")</action>',
         "('stop', 'stop')"),
    ],
)
def test_tuple_actions(text, action):
    parsed = TUPLE.parse(text, ACTIONS)
    assert parsed.actions == (action,) and parsed.format_ok


def test_unquoted_name_is_a_documented_difference():
    # SkyRL adds the quotes ("(move, 3)" -> "('move', 3)"); turnrl's tuple grammar takes literals only.
    text = "<observation>x</observation><justification>y</justification><action>(move, 3)</action>"
    assert TUPLE.parse(text, ACTIONS).actions == ()


def test_tuple_outside_the_action_tag_is_a_documented_difference():
    # SkyRL's extract_action takes the first tuple anywhere: "(1, 1)" -> "('1', 1)", which the maze rejects.
    text = ("<observation>I am at (1, 1)</observation><justification>go right</justification>"
            "<action>('move', 0)</action>")
    assert TUPLE.parse(text, ACTIONS).actions == ("('move', 0)",)


def test_tuple_without_the_tag_gives_no_action():
    # SkyRL would take it (no tag needed); turnrl's format asks for the tag the recipe's SFT model writes.
    assert TUPLE.parse("('move', 0)", ACTIONS).actions == ()

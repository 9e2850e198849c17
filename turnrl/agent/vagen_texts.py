"""VAGEN's words for Sokoban and FrozenLake: its system prompt and per-turn observation texts, character for
character, for a run that reproduces VAGEN's prompts.

Source: RAGEN-AI/VAGEN at d2b8b30 (d2b8b30b4db41073e2b3ecad269f9c1c52522362), ``vagen/env/sokoban/prompt.py`` and
``vagen/env/frozenlake/prompt.py`` (the texts, kept verbatim below), and each env's ``env.py``, which joins them:

- ``system_prompt()`` returns ``system_prompt() + "\\n" + format_prompt(add_example=True)``;
- ``_render`` returns ``init_observation_template(...)`` on reset, else ``action_template(valid_action=
  self.valid_actions, ...)``, then ``"\\n" + format_prompt(add_example=False)``.

The observation slot holds the config's ``image_placeholder`` (``<image>``) in vision mode, which VAGEN's rollout
replaces with the image's tokens, or the env's text grid in text mode. ``valid_action`` is the list of actions the
env stepped, written as Python writes a list (``['Down', 'Left']``, ``[]``). The two envs differ in small ways that
the texts keep: FrozenLake's system prompt ends with ``"Up. \\n"`` and its observation templates with a newline (so
a blank line comes before the format text); its ``grounding`` format line has no ``<answer>``.

Only the formats turnrl registers (:mod:`turnrl.agent.formats`) are here; VAGEN's ``*_symbolic`` and
``*_structured`` formats are not.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

VAGEN_DEFAULT_SEPARATOR = ","
"""VAGEN's ``action_sep`` default (``BaseEnvConfig``), for a format that names no separator of its own."""


@dataclass(frozen=True)
class VagenFormat:
    """One entry of VAGEN's ``FORMAT_CONFIGS``: how the response is to be shaped."""

    format: str
    """The response's shape, after ``Your response should be in the format of:``."""
    description: str
    """One sentence on what the response holds, in order."""
    example: str
    """A response, with ``{action_sep}`` where the separator goes (filled by ``str.format``, as VAGEN does)."""
    additional_info: str | None = None
    """A line after the description on what ``<observation>``/``<prediction>`` describe; None where VAGEN has none."""


@dataclass(frozen=True)
class VagenEnvTexts:
    """One env's texts from VAGEN's ``prompt.py``."""

    system_prompt: str
    """What ``system_prompt()`` returns."""
    initial_template: str
    """``init_observation_template``'s f-string, with ``{observation}`` for the image placeholder or text grid."""
    action_template: str
    """``action_template``'s f-string, with ``{valid_action}`` (the stepped actions' list) and ``{observation}``."""
    formats: Mapping[str, VagenFormat]
    """``FORMAT_CONFIGS`` by format name (turnrl's formats only)."""


# --------------------------------------------------------------------------- Sokoban: vagen/env/sokoban/prompt.py

_SOKOBAN_ADDITIONAL_INFO = (
    "describe the position of the `target` (red) and each `box`(yellow) relative to the player. For each object, "
    "you must specify **both** its vertical (`above`, `below`, `same`) and horizontal (`left`, `right`, `same`) "
    "direction."
)

SOKOBAN = VagenEnvTexts(
    system_prompt=(
        "You are a Sokoban solver.\n"
        "Sokoban Quick Guide\n"
        "Goal: Push all boxes onto targets.\n"
        "Symbols (If image is provided there are no symbols):\n"
        "# Wall | _ Floor | O Target | X Box | P You | √ Box on Target | S You on Target\n"
        "Rules:\n"
        "1. Push boxes (can't pull).\n"
        "2. Avoid walls.\n"
        "Actions you can take: Left, Down, Right, Up."
    ),
    initial_template="[Initial Observation]:\n{observation}\nDecide your next action(s).",
    action_template=(
        "After your answer, the extracted valid action is {valid_action}.\n"
        "After that, the observation is:\n"
        "{observation}\n"
        "Decide your next action(s)."
    ),
    formats={
        "free_think": VagenFormat(
            format="<think>...</think><answer>...</answer>",
            description="You should first give your reasoning, and then your answer.",
            example=(
                "<think><reasoning>The box is one step below me, and the target is two steps below me, I need to go "
                "down then push the box down to the target.</reasoning></think><answer>Down{action_sep}Down</answer>"
            ),
        ),
        "no_think": VagenFormat(
            format="<answer>...</answer>",
            description="You should provide only your answer.",
            example="<answer>Down{action_sep}Down</answer>",
        ),
        "grounding": VagenFormat(
            format="<think><observation>...</observation><reasoning>...</reasoning></think><answer>...</answer>",
            description=(
                "You should first give the description of your observation, then your reasoning, and finally your "
                "answer."
            ),
            example=(
                "<think><observation>The box is below the player and the target is below the box</observation>"
                "<reasoning>I need to go down then push the box down to the target</reasoning></think>"
                "<answer>Down{action_sep}Down</answer>"
            ),
            additional_info="Inside the `<observation>` tags, " + _SOKOBAN_ADDITIONAL_INFO,
        ),
        "worldmodeling": VagenFormat(
            format="<think><reasoning>...</reasoning><prediction>...</prediction></think><answer>...</answer>",
            description="You should first give your reasoning, then predict the next state, and finally your answer.",
            example=(
                "<think><reasoning>I need to go right then push the box down to the target.</reasoning>"
                "<prediction>The player will be above the box, the target and box will be at the same place."
                "</prediction></think><answer>Right{action_sep}Down</answer>"
            ),
            additional_info="Inside the `<prediction>` tags, " + _SOKOBAN_ADDITIONAL_INFO,
        ),
        "grounding_worldmodeling": VagenFormat(
            format=(
                "<think><observation>...</observation><reasoning>...</reasoning><prediction>...</prediction></think>"
                "<answer>...</answer>"
            ),
            description=(
                "You should first give the description of your observation, then your reasoning, then predict the "
                "next state, and finally your answer."
            ),
            example=(
                "<think><observation>The box is below and to right of the player and the target is below and to the "
                "right of the player</observation><reasoning>I need to go right then go down to push the box down to "
                "the target</reasoning><prediction>The player will be above the box and target, the target and box "
                "will be at the same row.</prediction></think><answer>Right{action_sep}Down</answer>"
            ),
            additional_info=(
                "For the content you provide within the `<observation>` and `<prediction>` tags, you must strictly "
                "describe the relative position of the `target` and any visible `box` objects **relative to the "
                "player**. Your description/prediction must include **both** a vertical and a horizontal directional "
                "relationship for each object. Use ONLY the terms `above`, `below`, `left`, `right`, or `same` for "
                "describing these relationships."
            ),
        ),
    },
)

# --------------------------------------------------------------------------- FrozenLake: vagen/env/frozenlake/prompt.py

_FROZENLAKE_ADDITIONAL_INFO = (
    "describe the position of the target (gift box) and each hole (blue) relative to the player. For each object, "
    "you must specify both its vertical (above, below, same) and horizontal (left, right, same) direction."
)

FROZENLAKE = VagenEnvTexts(
    system_prompt=(
        "You are a FrozenLake solver.\n"
        "FrozenLake Quick Guide\n"
        "Goal: Reach the goal (G).\n"
        "Symbols (If image is provided there are no symbols):\n"
        "_ Frozen | O Hole | G Goal | P Player | X Player fell into hole | √ Player on goal\n"
        "Rules:\n"
        "1. Avoid falling into holes.\n"
        "2. Frozen tiles are slippery, you may move perpendicular to your intended direction.\n"
        "Actions you can take: Left, Down, Right, Up. \n"
    ),
    initial_template="[Initial Observation]:\n{observation}\nDecide your next action(s).\n",
    action_template=(
        "After your answer, the extracted valid action is {valid_action}.\n"
        "After that, the observation is:\n"
        "{observation}\n"
        "Decide your next action(s).\n"
    ),
    formats={
        "free_think": VagenFormat(
            format="<think>...</think><answer>...</answer>",
            description="You should first give your reasoning, and then your answer.",
            example=(
                "<think>I can see the target is on my down left, I should go down then left to reach the target"
                "</think><answer>Down{action_sep}Left</answer>"
            ),
        ),
        "no_think": VagenFormat(
            format="<answer>...</answer>",
            description="You should provide only your answer.",
            example="<answer>Down{action_sep}Left</answer>",
        ),
        "grounding": VagenFormat(
            format="<think><observation>...</observation><reasoning>...</reasoning></think>",
            description="You should first describe the observation, then your reasoning, and finally your answer.",
            example=(
                "<think><observation>The player is on the above the target</observation><reasoning>I should go down "
                "then left to reach the target</reasoning></think><answer>Down{action_sep}Left</answer>"
            ),
            additional_info="Inside the <observation> tags, " + _FROZENLAKE_ADDITIONAL_INFO,
        ),
        "worldmodeling": VagenFormat(
            format="<think><reasoning>...</reasoning><prediction>...</prediction></think><answer>...</answer>",
            description="You should first give your reasoning, then predict the next state, and finally your answer.",
            example=(
                "<think><reasoning>I can see the target is on my down left, I should go down then left</reasoning>"
                "<prediction>The player will reach the target</prediction></think>"
                "<answer>Down{action_sep}Left</answer>"
            ),
            additional_info="Inside the <prediction> tags, " + _FROZENLAKE_ADDITIONAL_INFO,
        ),
        "grounding_worldmodeling": VagenFormat(
            format=(
                "<think><observation>...</observation><reasoning>...</reasoning><prediction>...</prediction></think>"
                "<answer>...</answer>"
            ),
            description=(
                "You should first describe the observation, then your reasoning, then predict the next state, and "
                "finally your answer."
            ),
            example=(
                "<think><observation>The player is above and on the right side of target. There is a hole below and "
                "at the left of the player</observation><reasoning>I should go down twice first to reach th same row "
                "as the target</reasoning><prediction>The player will be in the same row and to the right of the "
                "target.</prediction></think><answer>Down{action_sep}Down</answer>"
            ),
            additional_info=(
                "For the content you provide within the `<observation>` and `<prediction>` tags, you must strictly "
                "describe the relative position of the `target` (the gift box) and any visible `hole` (blue circles) "
                "objects **relative to the player**. Your description/prediction must include **both** a vertical and "
                "a horizontal directional relationship for each object. Use ONLY the terms `above`, `below`, `left`, "
                "`right`, or `same` for describing these relationships."
            ),
        ),
    },
)

VAGEN_ENVS: dict[str, VagenEnvTexts] = {"Sokoban": SOKOBAN, "FrozenLake": FROZENLAKE}
"""VAGEN's texts by turnrl env id (:mod:`turnrl.envs.catalog`)."""


# --------------------------------------------------------------------------- rendering (each env's env.py)


def vagen_texts(env_id: str, format_name: str) -> tuple[VagenEnvTexts, VagenFormat]:
    """The env's texts and its format entry.

    Raises:
        ValueError: an env id or format name VAGEN's layout does not have here, naming those it has.
    """
    env = VAGEN_ENVS.get(env_id)
    if env is None:
        raise ValueError(f"VAGEN's prompt layout has no texts for env {env_id!r}; it has {sorted(VAGEN_ENVS)}")
    fmt = env.formats.get(format_name)
    if fmt is None:
        raise ValueError(f"VAGEN's prompt layout has no format {format_name!r} for {env_id}; it has "
                         f"{list(env.formats)}")
    return env, fmt


def vagen_format_prompt(fmt: VagenFormat, *, max_actions_per_turn: int, separator: str, add_example: bool) -> str:
    """VAGEN's ``format_prompt_generator`` text: the actions' limit and separator, the description, the additional
    info where the format has one, the response's shape and, with ``add_example``, ``e.g.`` and the example."""
    text = f"You can take up to {max_actions_per_turn} action(s) at a time, separated by {separator}."
    text += f"\n{fmt.description}"
    if fmt.additional_info is not None:
        text += f"\n{fmt.additional_info}"
    text += f"\nYour response should be in the format of:\n{fmt.format}"
    if add_example:
        text += f"\ne.g. {fmt.example.format(action_sep=separator)}"
    return text


def vagen_system_prompt(env_id: str, format_name: str, *, max_actions_per_turn: int, separator: str) -> str:
    """VAGEN's system message: the env's guide, a newline, then the format text with its example.

    Raises:
        ValueError: see :func:`vagen_texts`.
    """
    env, fmt = vagen_texts(env_id, format_name)
    format_text = vagen_format_prompt(fmt, max_actions_per_turn=max_actions_per_turn, separator=separator,
                                      add_example=True)
    return f"{env.system_prompt}\n{format_text}"


def vagen_valid_action_text(valid_actions: Sequence[str]) -> str:
    """The stepped actions as VAGEN's f-string writes its list: ``['Down', 'Left']``, and ``[]`` for none."""
    return str(list(valid_actions))


def vagen_observation_text(
    env_id: str,
    format_name: str,
    *,
    first: bool,
    valid_actions: Sequence[str],
    max_actions_per_turn: int,
    separator: str,
    image: bool,
    state_text: str = "",
) -> tuple[str, str]:
    """VAGEN's user message of one turn, as the text before the image and the text after it.

    Args:
        env_id: a key of :data:`VAGEN_ENVS`.
        format_name: one of that env's formats.
        first: the observation after reset (VAGEN's initial template), else after a step (its action template).
        valid_actions: the actions the previous turn stepped, in order, up to the first one the env did not know
            (VAGEN's ``self.valid_actions``); unused when ``first``.
        max_actions_per_turn: VAGEN's ``max_actions_per_step``.
        separator: VAGEN's ``action_sep``.
        image: the image goes where VAGEN writes its placeholder: between the two texts.
        state_text: the text observation, used without ``image``; VAGEN's own is its grid (cells such as
            ``" _ \\t"``, rows joined by newlines).

    Returns:
        ``(before, after)``; without ``image`` the whole message is ``before`` and ``after`` is ``""``.

    Raises:
        ValueError: see :func:`vagen_texts`.
    """
    env, fmt = vagen_texts(env_id, format_name)
    template = env.initial_template if first else env.action_template
    head, _, tail = template.partition("{observation}")
    head = head.format(valid_action=vagen_valid_action_text(valid_actions))
    tail += "\n" + vagen_format_prompt(fmt, max_actions_per_turn=max_actions_per_turn, separator=separator,
                                       add_example=False)
    if image:
        return head, tail
    return head + state_text + tail, ""

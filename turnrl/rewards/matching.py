"""Matching a description of a state against the true state: the rule behind the state rewards.

The comparison is a *matcher* (:class:`Matcher`): text + true facts -> a
score in [0, 1]. :class:`RuleMatcher` parses the text
(:func:`parse_description`: natural language such as "the box is above and to
the left of the player", or JSON objects with relations or positions) into
claims, and scores them against
:meth:`~turnrl.envs.contract.AgentEnv.state_facts` with a weighted F1 over object
kinds, matching claims to true objects with the Hungarian algorithm
(:func:`weighted_f1`). The weights and other names of each env's kinds are its
class's ``state_reward_profile`` (:class:`~turnrl.envs.contract.StateRewardProfile`).
The LLM judge (:mod:`turnrl.rewards.judge`) scores its parses with the same rule;
the reward functions are :mod:`turnrl.rewards.state`.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
from scipy.optimize import linear_sum_assignment

from turnrl.envs.catalog import ENVS, builtin_name, env_class
from turnrl.envs.contract import ObjectFact, StateFacts, StateRewardProfile
from turnrl.registry import is_module_attr

logger = logging.getLogger(__name__)

# --------------------------------------------------------------------------- vocabulary
VERTICAL_WORDS: dict[str, str] = {
    "above": "above", "up": "above", "upper": "above", "top": "above", "north": "above", "over": "above",
    "higher": "above",
    "below": "below", "down": "below", "lower": "below", "bottom": "below", "south": "below", "under": "below",
    "beneath": "below", "underneath": "below",
    "ahead": "ahead", "forward": "ahead", "front": "ahead", "behind": "behind",
}
"""Words for the vertical relation to the player, by synonym ("up" and "above" mean the same). A first-person
env (Navigation) has ahead/behind of the agent's facing on this axis instead of above/below."""
HORIZONTAL_WORDS: dict[str, str] = {
    "left": "left", "west": "left", "right": "right", "east": "right",
}
"""Words for the horizontal relation to the player."""
COMPOUND_WORDS: dict[str, tuple[str, ...]] = {
    "northeast": ("north", "east"), "northwest": ("north", "west"), "southeast": ("south", "east"),
    "southwest": ("south", "west"), "upward": ("up",), "upwards": ("up",), "downward": ("down",),
    "downwards": ("down",), "leftward": ("left",), "leftwards": ("left",), "rightward": ("right",),
    "rightwards": ("right",),
}
"""Single words that state one or both axes ("northeast" is north and east), read as the words they join."""
NUMBER_WORDS: dict[str, int] = {
    "a": 1, "an": 1, "one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8,
    "nine": 9, "ten": 10, "no": 0, "zero": 0,
}
"""Counts before an object's name; "no holes" claims none (a count of 0), not one hole."""
MAX_NAME_WORDS = 3
"""Longest object name, in words, that prose can name ("air conditioner", a custom env's "red key")."""
MAX_COPIES = 10
"""A claim of "n holes" stands for at most this many objects (a count is never trusted beyond it)."""
MAX_TEXT_CHARS = 4000
"""Descriptions are cut to this length before parsing: a runaway response costs no more than a long one."""


def profile_for(env_id: str, facts: StateFacts) -> StateRewardProfile:
    """The profile the env's class declares (``state_reward_profile``), or equal weights over the kinds in
    ``facts`` for an env that declares none."""
    profile = declared_profile(env_id)
    if profile is not None:
        return profile
    return StateRewardProfile({fact.name.lower(): 1.0 for fact in facts.objects})


def declared_profile(env_id: str) -> StateRewardProfile | None:
    """The ``state_reward_profile`` of a registered env's class, or of the class a ``module:Class`` id names: a
    user's env is scored with the weights and other names it declares, as a built-in one is. None for an env
    that declares none."""
    name = builtin_name(env_id)
    if name is not None:
        return env_class(name).state_reward_profile
    return _imported_profile(env_id) if is_module_attr(env_id) else None


@functools.lru_cache(maxsize=256)
def _imported_profile(env_id: str) -> StateRewardProfile | None:
    """What ``module:attr`` declares, looked up once per id (scoring asks for every turn); None where the id names
    nothing importable here (e.g. a Gymnasium ``module:id``): the facts' kinds are then weighed alike."""
    try:
        factory = ENVS.get(env_id)
    except Exception:
        return None
    profile = getattr(factory, "state_reward_profile", None)
    return profile if isinstance(profile, StateRewardProfile) else None


# --------------------------------------------------------------------------- parsing
@dataclass(frozen=True)
class Claim:
    """One object as a description states it."""

    name: str
    """Canonical object kind (after aliases and plurals), e.g. ``"hole"``."""
    vertical: str | None = None
    """``above``/``below``/``same``, or None when the text does not say."""
    horizontal: str | None = None
    """``left``/``right``/``same``, or None when the text does not say."""
    position: tuple[int, int] | None = None
    """``(row, col)`` when the text gives the object's cell."""


def canonical_name(word: str, kinds: Sequence[str], aliases: Mapping[str, str]) -> str | None:
    """``"Holes"`` -> ``"hole"`` (plural and alias aware); None if ``word`` names no kind."""
    word = word.lower().strip()
    for candidate in (word, word[:-2] if word.endswith("es") else word, word[:-1] if word.endswith("s") else word):
        if candidate in kinds:
            return candidate
        if candidate in aliases:
            return aliases[candidate]
    return None


def parse_relation(text: str) -> tuple[str | None, str | None]:
    """The vertical and horizontal relation a phrase states.

    ``"above and to the left of"`` -> ``("above", "left")``; ``"directly above"``
    -> ``("above", "same")``; ``"at the player's position"`` -> ``("same", "same")``;
    ``"in the same row, to the right"`` -> ``("same", "right")``.
    """
    words = [part for word in re.findall(r"[a-z]+", text.lower()) for part in COMPOUND_WORDS.get(word, (word,))]
    vertical = next((VERTICAL_WORDS[w] for w in words if w in VERTICAL_WORDS), None)
    horizontal = next((HORIZONTAL_WORDS[w] for w in words if w in HORIZONTAL_WORDS), None)
    lowered = " ".join(words)
    if "same row" in lowered:
        vertical = "same"
    if "same column" in lowered:
        horizontal = "same"
    if re.search(r"\b(same (position|cell|place|square|spot)|player s (position|cell|square))\b", lowered) or (
        re.search(r"\b(on|at) the player\b", lowered) and vertical is None and horizontal is None
    ):
        return "same", "same"
    if "directly" in words or "straight" in words or "exactly" in words:
        # "directly above" names one axis and means the other is shared.
        if vertical is not None and horizontal is None:
            horizontal = "same"
        elif horizontal is not None and vertical is None:
            vertical = "same"
    return vertical, horizontal


_POSITION = re.compile(r"row\s*(-?\d+)\s*,?\s*(?:and\s*)?(?:col(?:umn)?)\s*(-?\d+)|\(\s*(-?\d+)\s*,\s*(-?\d+)\s*\)")
# "... and the hole ..." and "... and there is a hole ..." start a new object's clause; "and a bit to the left" does
# not (it goes on describing the same object).
_CLAUSE_SPLIT = re.compile(
    r"[.;\n]+|,\s*(?=(?:and\s+)?(?:the|there|a|an|one|two|three|four|five|\d+)\s)|\band\s+(?=(?:the|there)\b)")


def _position(text: str) -> tuple[int, int] | None:
    match = _POSITION.search(text)
    if match is None:
        return None
    row, col = (match.group(1), match.group(2)) if match.group(1) is not None else (match.group(3), match.group(4))
    try:
        return int(row), int(col)
    except ValueError:  # pragma: no cover - the pattern only matches digits
        return None


def _count_before(words: list[str], index: int) -> int:
    """``"two holes"`` -> 2: the number word or digits just before the object's name, else 1."""
    if index == 0:
        return 1
    previous = words[index - 1]
    if previous.isdigit():
        return min(int(previous[:3]), MAX_COPIES)
    return NUMBER_WORDS.get(previous, 1)


def _named_kinds(words: list[str], kinds: Sequence[str], aliases: Mapping[str, str]) -> list[tuple[int, str]]:
    """``(index of its first word, kind)`` of each object name in ``words``, the longest name first: in "the red
    key" the name is "red key" (a kind of its own where the env has one), not "key"."""
    named, i = [], 0
    while i < len(words):
        for length in range(min(MAX_NAME_WORDS, len(words) - i), 0, -1):
            kind = canonical_name(" ".join(words[i:i + length]), kinds, aliases)
            if kind is not None:
                named.append((i, kind))
                i += length
                break
        else:
            i += 1
    return named


def parse_natural_language(text: str, kinds: Sequence[str], aliases: Mapping[str, str]) -> list[Claim]:
    """Claims from sentences like "The box is directly to the left of the player." (any string in).

    The text is cut into clauses (sentences, semicolons, and "and the ..."); each
    clause that names a kind gives a claim with the relation or cell it states.
    The player's own cell is a claim named ``player`` when the text gives one.
    """
    claims: list[Claim] = []
    for clause in _CLAUSE_SPLIT.split(text[:MAX_TEXT_CHARS]):
        words = re.findall(r"[a-z]+|\d+", clause.lower())
        named = [(i, name) for i, name in _named_kinds(words, kinds, aliases) if name != "player"]
        position = _position(clause.lower())
        if not named:
            if "player" in words and position is not None:
                claims.append(Claim("player", position=position))
            continue
        # The first kind named is the subject ("the box is left of the target" is about the box).
        index, name = named[0]
        vertical, horizontal = parse_relation(clause)
        claim = Claim(name, vertical, horizontal, position)
        claims.extend([claim] * _count_before(words, index))
    return claims


def _json_values(text: str) -> list[Any]:
    """Every JSON object or array that can be decoded starting at a ``{`` or ``[`` of ``text`` (outermost only)."""
    decoder = json.JSONDecoder()
    values: list[Any] = []
    position = 0
    while True:
        starts = [i for i in (text.find("{", position), text.find("[", position)) if i >= 0]
        if not starts:
            return values
        start = min(starts)
        try:
            value, end = decoder.raw_decode(text, start)
        except (ValueError, RecursionError):
            position = start + 1
            continue
        values.append(value)
        position = end


def _claim_from_json(
    name: str, value: Any, kinds: Sequence[str], aliases: Mapping[str, str], nested: bool = False
) -> list[Claim]:
    """The claims of one ``name: value`` entry. ``nested``: ``value`` is an item of a list of objects, which is one
    object or cell (a list in it is not opened again: lists nested hundreds deep would exhaust the stack)."""
    kind = canonical_name(str(name), kinds, aliases)
    if kind is None:
        if str(name).lower() == "player" and isinstance(value, (list, tuple)) and len(value) == 2:
            position = _int_pair(value)
            return [Claim("player", position=position)] if position else []
        return []
    if not nested and isinstance(value, list) and value and all(
        isinstance(item, (dict, list, str)) for item in value
    ) and not (len(value) == 2 and all(isinstance(item, (int, float)) for item in value)):
        # {"hole": [{...}, {...}]} or {"hole": [[1, 2], [3, 0]]}: several objects of one kind.
        return [claim for item in value[:MAX_COPIES] for claim in _claim_from_json(kind, item, kinds, aliases, True)]
    if isinstance(value, str):
        return [Claim(kind, *parse_relation(value), position=_position(value))]
    if isinstance(value, (list, tuple)):
        position = _int_pair(value)
        return [Claim(kind, position=position)] if position else []
    if isinstance(value, dict):
        lowered = {str(k).lower(): v for k, v in value.items()}
        vertical, horizontal = parse_relation(" ".join(
            str(lowered.get(key, "")) for key in ("relation", "direction", "vertical", "horizontal")
        ))
        if "vertical" in lowered and str(lowered["vertical"]).lower() in ("same", "none", "level", "0"):
            vertical = "same"
        if "horizontal" in lowered and str(lowered["horizontal"]).lower() in ("same", "none", "level", "0"):
            horizontal = "same"
        position = _int_pair(lowered.get("position")) if "position" in lowered else _int_pair(
            [lowered.get("row"), lowered.get("col", lowered.get("column"))]
        )
        return [Claim(kind, vertical, horizontal, position)]
    return []


def _int_pair(value: Any) -> tuple[int, int] | None:
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        return None
    try:
        row, col = (int(v) for v in value)
    except (TypeError, ValueError, OverflowError):
        return None
    return row, col


def parse_json(text: str, kinds: Sequence[str], aliases: Mapping[str, str]) -> list[Claim] | None:
    """Claims from the JSON in ``text``; None when it holds no JSON object or array.

    Accepted shapes: a list of ``{"name", "vertical", "horizontal"}`` (or
    ``"position": [row, col]``, or ``"relation": "above-left"``) objects; a
    mapping of names to such objects, to relation strings, to cells or to
    lists of them; either wrapped in ``{"objects": ...}``.
    """
    values = _json_values(text[:MAX_TEXT_CHARS])
    if not values:
        return None
    claims: list[Claim] = []
    for value in values:
        if isinstance(value, dict) and isinstance(value.get("objects"), (list, dict)):
            value = value["objects"]
        if isinstance(value, dict):
            for name, item in value.items():
                claims.extend(_claim_from_json(str(name), item, kinds, aliases))
        elif isinstance(value, list):
            for item in value[: MAX_COPIES * 8]:
                if isinstance(item, dict):
                    name = next((item[k] for k in ("name", "object", "type", "kind") if k in item), None)
                    if name is not None:
                        claims.extend(_claim_from_json(str(name), item, kinds, aliases))
    return claims


def parse_description(text: str, kinds: Sequence[str], aliases: Mapping[str, str] | None = None) -> list[Claim]:
    """Claims that a description makes about objects of the given kinds: JSON if it holds any, else prose.

    Never raises: any string in, a (possibly empty) list of claims out.
    """
    aliases = aliases or {}
    from_json = parse_json(text, kinds, aliases)
    return from_json if from_json is not None else parse_natural_language(text, kinds, aliases)


# --------------------------------------------------------------------------- scoring
def claim_similarity(claim: Claim, fact: ObjectFact, player: tuple[int, int] | None) -> float:
    """How right a claim is about one true object, in [0, 1].

    A claimed cell scores 1 if it is the object's cell, else 0. A claimed
    relation scores half a point per axis that matches (an axis the text does
    not state is wrong).
    """
    if claim.position is not None:
        return float(claim.position == tuple(fact.position))
    if player is None:  # an env without a player: relations cannot be checked, the kind alone is right
        return 1.0
    return 0.5 * (claim.vertical == fact.vertical) + 0.5 * (claim.horizontal == fact.horizontal)


@dataclass(frozen=True)
class MatchScore:
    """How a description matches the truth."""

    score: float
    """Weighted F1 over object kinds, in [0, 1]."""
    f1: dict[str, float]
    """F1 of each kind that was scored."""


def weighted_f1(claims: Sequence[Claim], facts: StateFacts, weights: Mapping[str, float]) -> MatchScore:
    """Weighted F1 of ``claims`` against ``facts``, one Hungarian matching per object kind.

    For a kind ``k`` with claims ``C_k`` and true objects ``T_k``, the matching
    maximizes the summed similarity ``S_k`` (:func:`claim_similarity`);
    ``precision_k = S_k / |C_k|``, ``recall_k = S_k / |T_k|``, ``F1_k`` their
    harmonic mean (0 when either set is empty and the other is not). The
    score is ``sum_k w_k F1_k / sum_k w_k`` over the weighted kinds that
    appear in the claims or the truth. Where that sum of weights is 0, VAGEN's
    rule holds: 1 when nothing at all is claimed or true (nothing to see,
    nothing claimed) and ``weights`` names a kind, else 0, so zero weights
    or a truth of unweighted kinds never pay a free 1. A claimed player cell
    is scored as a kind of its own when ``weights`` has ``player`` (an
    unweighted one is not a claim about an object).
    """
    truth: dict[str, list[ObjectFact]] = {}
    for fact in facts.objects:
        truth.setdefault(fact.name.lower(), []).append(fact)
    if facts.player is not None:
        truth.setdefault("player", []).append(ObjectFact("player", facts.player, "same", "same"))
    by_kind: dict[str, list[Claim]] = {}
    for claim in claims:
        by_kind.setdefault(claim.name, []).append(claim)
    f1: dict[str, float] = {}
    for kind in weights:
        claimed, true = by_kind.get(kind, []), truth.get(kind, [])
        if kind == "player" and not claimed:
            continue  # the player is scored only when the description places it
        if not claimed and not true:
            continue
        if not claimed or not true:
            f1[kind] = 0.0
            continue
        similarity = np.array([[claim_similarity(c, t, facts.player) for t in true] for c in claimed])
        rows, cols = linear_sum_assignment(similarity, maximize=True)
        matched = float(similarity[rows, cols].sum())
        precision, recall = matched / len(claimed), matched / len(true)
        f1[kind] = 0.0 if matched == 0 else 2 * precision * recall / (precision + recall)
    total_weight = sum(weights[kind] for kind in f1)
    if total_weight <= 0:
        nothing_claimed = all(claim.name == "player" and "player" not in weights for claim in claims)
        empty = nothing_claimed and not facts.objects and bool(weights)
        return MatchScore(1.0 if empty else 0.0, f1)
    return MatchScore(sum(weights[kind] * value for kind, value in f1.items()) / total_weight, f1)


def rule_can_score(facts: StateFacts) -> bool:
    """Whether ``facts`` give the rule anything to check: objects, or a player whose cell a text may claim.

    Facts whose state lives only in ``extra`` (PrimitiveSkill's positions, an SVG icon's shapes, a Sudoku grid)
    would score every text 1 (nothing to see, nothing claimed): a free reward, not a judgement.
    """
    return bool(facts.objects) or facts.player is not None


# --------------------------------------------------------------------------- matchers
@dataclass(frozen=True)
class MatchItem:
    """One description to score against the truth."""

    text: str
    facts: StateFacts
    env_id: str
    field: str
    """``observation`` (the state before the turn) or ``prediction`` (after it)."""


class Matcher(Protocol):
    """Scores descriptions against true facts, in [0, 1]; a failed item scores None (the caller decides)."""

    def score(self, items: Sequence[MatchItem]) -> list[float | None]: ...

    def metrics(self) -> dict[str, float]: ...


class RuleMatcher:
    """Parse the text (:func:`parse_description`) and score it with :func:`weighted_f1`.

    Args:
        profiles: per-env weights and aliases that replace the built-in ones (keyed by env id).
    """

    def __init__(self, profiles: Mapping[str, StateRewardProfile] | None = None) -> None:
        self.profiles = dict(profiles or {})
        self._warned: set[str] = set()

    def profile(self, env_id: str, facts: StateFacts) -> StateRewardProfile:
        return self.profiles.get(profile_key(env_id)) or profile_for(env_id, facts)

    def score_one(self, item: MatchItem) -> float | None:
        """The item's weighted F1; None where its facts hold nothing the rule can check (:func:`rule_can_score`)."""
        if not rule_can_score(item.facts):
            if item.env_id not in self._warned:
                self._warned.add(item.env_id)
                logger.warning(
                    "the rule matcher cannot score %s: its state_facts() name no objects and no player (the state is "
                    "in extra), so its descriptions are unscored; use matcher: judge with mode: yes_no", item.env_id)
            return None
        profile = self.profile(item.env_id, item.facts)
        kinds = list(profile.weights) + [fact.name.lower() for fact in item.facts.objects]
        claims = parse_description(item.text, kinds, profile.aliases)
        return weighted_f1(claims, item.facts, profile.weights).score

    def score(self, items: Sequence[MatchItem]) -> list[float | None]:
        return [self.score_one(item) for item in items]

    def metrics(self) -> dict[str, float]:
        return {}


def profile_key(env_id: str) -> str:
    """Where configured weights for ``env_id`` are kept: a built-in env under its name however it is spelt
    (``frozenlake``, ``turnrl/FrozenLake-v0``: the spellings ``env.id`` takes), any other env under its id."""
    return builtin_name(env_id) or env_id


def profiles_from_settings(settings: Mapping[str, Any] | None) -> dict[str, StateRewardProfile]:
    """``{FrozenLake: {weights: {goal: 0.7, hole: 0.3}, aliases: {gift: goal}}}`` -> profiles (config form).

    Raises:
        ValueError: a weight that is no finite number >= 0, or weights none of which is positive (every
            description would score 0, :func:`weighted_f1`), naming the env and the key; a 0 beside a positive
            weight leaves that kind out and is allowed.
    """
    profiles: dict[str, StateRewardProfile] = {}
    for env_id, spec in (settings or {}).items():
        if not isinstance(spec, Mapping) or not isinstance(spec.get("weights"), Mapping):
            raise ValueError(f"object_weights[{env_id!r}] needs a 'weights' mapping of object kind to weight")
        weights = {str(k).lower(): _setting_weight(env_id, k, v) for k, v in spec["weights"].items()}
        if len(weights) < len(spec["weights"]):  # kinds are matched in lower case: "Goal" and "goal" are one
            raise ValueError(f"object_weights[{env_id!r}].weights={dict(spec['weights'])} names a kind twice "
                             "(kinds are read in lower case): give each kind one weight")
        if not any(w > 0 for w in weights.values()):
            raise ValueError(f"object_weights[{env_id!r}].weights={dict(spec['weights'])} gives no kind a positive "
                             "weight, so every description would score 0: give the kinds the reward checks weights "
                             "> 0 (a 0 leaves a kind out)")
        aliases = spec.get("aliases") or {}
        if not isinstance(aliases, Mapping):
            raise ValueError(f"object_weights[{env_id!r}].aliases must map another name to an object kind "
                             f"({{gift: goal}}), got {aliases!r:.100}")
        if profile_key(str(env_id)) in profiles:
            raise ValueError(f"object_weights names {profile_key(str(env_id))!r} twice (as {env_id!r} and another "
                             "spelling): give each env one entry")
        profiles[profile_key(str(env_id))] = StateRewardProfile(weights, {str(k).lower(): str(v).lower()
                                                                          for k, v in aliases.items()})
    return profiles


def _setting_weight(env_id: str, kind: Any, value: Any) -> float:
    """One configured weight as a float; ValueError naming the env and the kind unless it is a finite number >= 0."""
    try:
        weight = math.nan if isinstance(value, bool) else float(value)
    except (TypeError, ValueError, OverflowError):
        weight = math.nan
    if not (math.isfinite(weight) and weight >= 0):
        raise ValueError(f"object_weights[{env_id!r}].weights[{kind!r}]={value!r:.100}: a weight must be a finite "
                         "number >= 0 (the share of the reward that kind's F1 carries)")
    return weight

"""State rewards (VAGEN's visual reasoning rewards): does the agent see and predict the state it is in?

A *grounding* reward compares a turn's ``<observation>`` with the state before
the turn's first action; a *world-model* reward compares its ``<prediction>``
with the state after its last action. Only well-formed turns are judged (a
turn whose response breaks the format scores 0, as in VAGEN); with
``require_valid_actions`` only turns that earn the format reward are, as in
VAGEN (well formed, and every action written valid and kept).

The comparison is a *matcher* (:class:`~turnrl.rewards.matching.Matcher`):
text + true facts -> a score in [0, 1]. Two come with turnrl:

- :class:`turnrl.rewards.matching.RuleMatcher`: parses the text into claims
  and scores them against :meth:`~turnrl.envs.contract.AgentEnv.state_facts` with
  a weighted F1 over object kinds (the env class's ``state_reward_profile``). A state with no objects and no
  player (PrimitiveSkill, SVG, the puzzles: their state is in ``extra``) leaves it nothing to check, so such a
  turn is unscored (``on_error``, counted); the ``yes_no`` judge scores those.
- :class:`turnrl.rewards.judge.JudgeMatcher`: an LLM behind any
  OpenAI-compatible endpoint, either as a YES/NO judge or as a parser to JSON
  whose output is scored by the rule.

Reward hacking: a model can learn to write one generic description that is
often partly right. :class:`RepetitionPenalty` (VAGEN's) adds a penalty when
the text is among the ``top_k`` most frequent of the last ``window`` answers
and its score is below ``threshold``.

Use in a recipe (VAGEN's weights)::

    rewards:
      extra:
        - {name: grounding, fn: grounding, weight: 0.5}
        - {name: worldmodel, fn: worldmodel, weight: 0.5}

Every function reports ``metrics()`` (judged turns, mean match score,
repetition penalties, and the judge's calls, errors and latency), which the
trainer logs under ``rewards/<name>/``.
"""

from __future__ import annotations

import inspect
import math
from collections import Counter, deque
from collections.abc import Mapping, Sequence
from typing import Any

from turnrl.agent.formats import ResponseFormat
from turnrl.config import ConfigError
from turnrl.rewards.judge import JudgeMatcher, JudgeSettings
from turnrl.rewards.matching import Matcher, MatchItem, RuleMatcher, profiles_from_settings
from turnrl.rewards.turn_rewards import FinishedTurn


# --------------------------------------------------------------------------- anti-hacking
class RepetitionPenalty:
    """VAGEN's guard against one generic answer: penalize frequent texts that score low.

    A text that is among the ``top_k`` most frequent of the last ``window``
    texts seen (before it) and scores below ``threshold`` gets ``penalty``
    added to its score. Every text then joins the window.
    """

    def __init__(self, window: int = 1000, top_k: int = 5, threshold: float = 0.7, penalty: float = -0.1) -> None:
        if window < 1 or top_k < 1:
            raise ValueError(f"repetition penalty: window and top_k must be >= 1, got {window} and {top_k}")
        if not (math.isfinite(threshold) and math.isfinite(penalty)):
            # a NaN score fails the reward for every turn it is computed with, not just the penalized one
            raise ValueError(f"repetition penalty: threshold and penalty must be finite, got {threshold} and {penalty}")
        self.window, self.top_k, self.threshold, self.penalty = window, top_k, threshold, penalty
        self.recent: deque[str] = deque()
        self.counts: Counter[str] = Counter()
        self.applied = 0

    def __call__(self, text: str, score: float) -> float:
        """The penalty for ``text`` (0 or ``penalty``); records ``text``."""
        frequent = {t for t, _ in self.counts.most_common(self.top_k)}
        hit = text in frequent and score < self.threshold
        self.recent.append(text)
        self.counts[text] += 1
        if len(self.recent) > self.window:
            old = self.recent.popleft()
            self.counts[old] -= 1
            if self.counts[old] == 0:
                del self.counts[old]
        self.applied += hit
        return self.penalty if hit else 0.0


# --------------------------------------------------------------------------- the reward functions
class StateReward:
    """Score one reasoning field of each well-formed turn against the true state (a :class:`RewardFn`).

    Args:
        field: ``observation`` (scored against the state before the turn) or
            ``prediction`` (against the state after it).
        matcher: ``rule`` or ``judge``.
        judge: settings of :class:`turnrl.rewards.judge.JudgeSettings` (``base_url``, ``model``, ``mode``, ...)
            when ``matcher`` is ``judge``.
        object_weights: per-env weights and aliases, replacing the built-in ones, e.g.
            ``{FrozenLake: {weights: {goal: 0.7, hole: 0.3}}}``.
        repetition: true for :class:`RepetitionPenalty` with VAGEN's values (window 1000, top_k 5,
            threshold 0.7, penalty -0.1), a mapping of those settings, or false for no penalty.
        on_error: the score of a turn the matcher could not score (a judge that failed); counted in metrics.
        require_valid_actions: judge only turns whose actions were all valid and kept, as VAGEN's state reward
            judges only turns it paid the format reward; false judges every well-formed turn.
    """

    needs_state_facts = True

    def __init__(
        self,
        field: str = "observation",
        matcher: str = "rule",
        judge: Mapping[str, Any] | None = None,
        object_weights: Mapping[str, Any] | None = None,
        repetition: Mapping[str, Any] | bool = True,
        on_error: float = 0.0,
        require_valid_actions: bool = False,
    ) -> None:
        if field not in ("observation", "prediction"):
            raise ValueError(f"field={field!r}: choose observation (grounding) or prediction (world model)")
        if matcher not in ("rule", "judge"):
            raise ValueError(f"matcher={matcher!r}: choose rule or judge")
        if not math.isfinite(on_error):
            raise ValueError(f"on_error={on_error}: the score of an unscored turn must be a finite number, e.g. 0")
        profiles = profiles_from_settings(object_weights)
        self.field = field
        self.on_error = on_error
        self.require_valid_actions = require_valid_actions
        self.matcher: Matcher
        if matcher == "judge":
            if not judge:
                raise ValueError("matcher=judge needs judge settings, at least {base_url: ..., model: ...}")
            self.matcher = JudgeMatcher(JudgeSettings(**judge), RuleMatcher(profiles))
        else:
            self.matcher = RuleMatcher(profiles)
        if isinstance(repetition, Mapping):
            self.repetition: RepetitionPenalty | None = RepetitionPenalty(**repetition)
        else:
            self.repetition = RepetitionPenalty() if repetition else None
        self._reset_counters()

    def _reset_counters(self) -> None:
        self._turns = 0
        self._judged = 0
        self._failed = 0
        self._score_sum = 0.0
        self._penalties_at_reset = self.repetition.applied if self.repetition else 0

    def __call__(self, turns: Sequence[FinishedTurn]) -> list[float]:
        scores = [0.0] * len(turns)
        items, where = [], []
        for i, turn in enumerate(turns):
            facts = turn.facts_before if self.field == "observation" else turn.facts_after
            text = turn.parsed.fields.get(self.field)
            if not turn.parsed.format_ok or text is None or facts is None:
                continue  # only well-formed turns are judged
            if self.require_valid_actions and not self._format_rewarded(turn):
                continue
            items.append(MatchItem(text, facts, turn.env_id, self.field))
            where.append(i)
        results = self.matcher.score(items) if items else []
        for i, item, result in zip(where, items, results):
            if result is None:
                self._failed += 1
                scores[i] = self.on_error
                continue
            self._judged += 1
            self._score_sum += result
            penalty = self.repetition(item.text, result) if self.repetition else 0.0
            scores[i] = result + penalty
        self._turns += len(turns)
        return scores

    @staticmethod
    def _format_rewarded(turn: FinishedTurn) -> bool:
        """The format reward's gate (VAGEN's for state rewards): at least one action, none dropped (unknown,
        malformed or past the turn's limit) and each one the env took."""
        return bool(turn.parsed.actions) and not turn.parsed.dropped_actions and all(turn.actions_valid)

    def metrics(self) -> dict[str, float]:
        """Counters since the last call, then reset: judged turns, mean match, penalties, the matcher's own."""
        out = {"judged_share": self._judged / self._turns if self._turns else 0.0, "unscored": float(self._failed)}
        if self._judged:  # no mean of nothing: a step without judged turns leaves a gap in the curve
            out["match_mean"] = self._score_sum / self._judged
        if self.repetition is not None:
            out["repetition_penalties"] = float(self.repetition.applied - self._penalties_at_reset)
        out.update(self.matcher.metrics())
        self._reset_counters()
        return out


def _settings_but_field(reward: type[StateReward]) -> type[StateReward]:
    """``reward`` declaring :class:`StateReward`'s settings but ``field``, which it fixes: a recipe's misspelt
    setting is then named with the settings it takes, where ``**settings`` hid them until Python's TypeError."""
    parameters = inspect.signature(StateReward).parameters
    reward.__signature__ = inspect.Signature([p for name, p in parameters.items() if name != "field"])  # type: ignore[attr-defined]
    return reward


@_settings_but_field
class GroundingReward(StateReward):
    """``<observation>`` against the state before the turn (``fn: grounding``)."""

    def __init__(self, **settings: Any) -> None:
        super().__init__(field="observation", **settings)


@_settings_but_field
class WorldModelReward(StateReward):
    """``<prediction>`` against the state after the turn (``fn: worldmodel``)."""

    def __init__(self, **settings: Any) -> None:
        super().__init__(field="prediction", **settings)


def check_fields_written(functions: Mapping[str, Any], fmt: ResponseFormat) -> None:
    """Refuse a state reward of ``functions`` (by name) that reads a tag the response format does not write: each
    of its turns would score 0, so it would train nothing while its metrics read as a model that never sees.

    Raises:
        ConfigError: naming the reward, the format's tags and the formats that write the tag.
    """
    for name, fn in functions.items():
        if isinstance(fn, StateReward) and fn.field not in fmt.tag_names:
            writers = "grounding or grounding_worldmodeling" if fn.field == "observation" else \
                "worldmodeling or grounding_worldmodeling"
            raise ConfigError(f"rewards.extra {name!r} scores each turn's <{fn.field}>, which agent.format={fmt.name} "
                              f"does not write (its tags: {', '.join(fmt.tag_names)}): choose a format that does "
                              f"({writers}), or drop the reward")

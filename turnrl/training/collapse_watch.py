"""Collapse diagnostics on a step's rollouts, and the early stops of a run (``collapse:`` in the config).

    CollapseDiagnostics.measure(step, trajectories, score)
      reasoning pairs        every answered turn whose response holds reasoning: its prompt x (with the
                             response up to and including ``<think>``) and its reasoning z (the tokens inside)
      draw                   first turns (one column per group's prompt) and turns drawn trajectory-uniformly
                             (each pair its own column), ``collapse.samples`` of each
      cross log-probs        every z scored after every x with the trainer's forward pass: (n, c) matrices
                             of the per-token mean and the per-sequence sum of log p(z_i | x_j)
      metrics                the pure functions of :mod:`turnrl.algorithms.collapse`

    EarlyStops.observe(metrics)    after each step: reward-spread collapse, low validation success, empty steps

The pairs are token-exact: z is the ids the policy sampled, x the prompt it sampled them from (what its
context window held), never a re-rendered text. A response is cut at token boundaries: the tokens that
end at or before the reasoning's first character go to x, the tokens that lie inside it form z (a token
straddling the end is left out).
"""

from __future__ import annotations

import bisect
import hashlib
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from turnrl.agent.formats import ResponseFormat
from turnrl.algorithms.collapse import (
    SpreadCollapse,
    Streak,
    information_metrics,
    retrieval_metrics,
    zscore_metrics,
)
from turnrl.rollout.trajectory import Trajectory
from turnrl.training.batch import Batch, Sample, collate
from turnrl.training.seeding import step_seed
from turnrl.training.train_config import CollapseConfig
from turnrl.viz.records import read_metrics

Scorer = Callable[[Batch], torch.Tensor]
"""Log-probs of a batch's scored tokens (its ``loss_mask``), Shape (b, s): the trainer's forward pass."""

FIRST_TURN = "first_turn"
"""Metrics of first-turn pairs: ``collapse/first_turn/...``."""
MULTI_TURN = "multi_turn"
"""Metrics of pairs drawn over all turns: ``collapse/multi_turn/...``."""
ROWS_PER_CALL = 256
"""Cross pairs handed to the scorer at once (whole columns; it cuts them into its own micro-batches)."""


# --------------------------------------------------------------------------- pairs
@dataclass(frozen=True)
class ReasoningPair:
    """One turn's prompt x and the reasoning z sampled after it."""

    prompt_ids: list[int]
    """x: the turn's prompt and its response up to the reasoning (``<think>`` included: in the prompt where the
    format ends it with it, RAGEN's). (P,)."""
    reasoning_ids: list[int]
    """z: the sampled tokens of the reasoning, tags left out. (R,), never empty."""
    episode: int
    """Index of the trajectory in the rollout."""
    turn: int
    group: int
    model_inputs: dict[str, torch.Tensor] = field(default_factory=dict)
    """The prompt's extra model inputs (a VLM's images)."""

    def prompt_key(self) -> tuple[Any, ...]:
        """Equal for equal prompts: the ids and the bytes of the images (a VLM's image tokens are all alike)."""
        images = tuple((name, hashlib.sha1(value.detach().cpu().contiguous().numpy().tobytes()).hexdigest())
                       for name, value in sorted(self.model_inputs.items()))
        return tuple(self.prompt_ids), images


def reasoning_tokens(ids: Sequence[int], fmt: ResponseFormat, decode: Callable[[list[int]], str]
                     ) -> tuple[int, int] | None:
    """The sampled tokens of a response's reasoning: ``ids[a:b]``, or None when it has none.

    ``a`` is the first position whose prefix ``ids[:a]`` covers the text before the reasoning (the prompt
    side keeps ``<think>`` and a token that runs into the reasoning); ``b`` the last whose prefix ends
    inside it. Prefix texts grow with the prefix, so both are binary searches over ``decode``. The reasoning
    is found in the assistant message, its start that the prompt held (RAGEN's ``<think>``, a thinking
    template's opening) then the response.
    """
    skipped = len(fmt.message_start)
    span = fmt.reasoning_span(fmt.assistant_text(decode(list(ids))))
    if span is None:
        return None
    start, end = max(span[0] - skipped, 0), span[1] - skipped
    length = lambda k: len(decode(list(ids[:k])))  # noqa: E731
    a = bisect.bisect_left(range(len(ids) + 1), start, key=length)
    b = bisect.bisect_right(range(len(ids) + 1), end, key=length) - 1
    return (a, b) if a < b else None


def episode_pairs(trajectory: Trajectory, episode: int, fmt: ResponseFormat, decode: Callable[[list[int]], str]
                  ) -> tuple[list[ReasoningPair], int]:
    """The reasoning pairs of an episode's answered turns, in turn order, and the number of answered turns."""
    tokens = trajectory.tokens
    if tokens is None:
        return [], 0
    pairs, answered = [], 0
    for turn, record in enumerate(tokens.turns):
        if record.response_ids is None:
            continue
        answered += 1
        cut = reasoning_tokens(record.response_ids, fmt, decode)
        if cut is None:
            continue
        a, b = cut
        pairs.append(ReasoningPair(tokens.prompt_ids(turn) + record.response_ids[:a], record.response_ids[a:b],
                                   episode, turn, trajectory.group, tokens.prompt_model_inputs(turn)))
    return pairs, answered


def draw_first_turns(pairs: list[list[ReasoningPair]], samples: int, generator: torch.Generator
                     ) -> list[ReasoningPair]:
    """Up to ``samples`` first-turn pairs, drawn uniformly without replacement (0: all of them)."""
    first = [episode[0] for episode in pairs if episode and episode[0].turn == 0]
    if samples == 0 or samples >= len(first):
        return first
    return [first[i] for i in torch.randperm(len(first), generator=generator)[:samples].tolist()]


def draw_turns(pairs: list[list[ReasoningPair]], samples: int, generator: torch.Generator) -> list[ReasoningPair]:
    """Trajectory-uniform draws (RAGEN's): ``min(samples, total)`` times an episode uniformly, with
    replacement, then one of its pairs uniformly; a draw of an episode without pairs is dropped.
    ``samples`` 0 draws as many times as there are pairs."""
    total = sum(len(episode) for episode in pairs)
    draws = total if samples == 0 else min(samples, total)
    drawn = []
    for _ in range(draws):
        episode = pairs[int(torch.randint(len(pairs), (1,), generator=generator))]
        if episode:
            drawn.append(episode[int(torch.randint(len(episode), (1,), generator=generator))])
    return drawn


@dataclass(frozen=True)
class Columns:
    """The prompts a cross log-prob matrix scores against."""

    prompts: list[ReasoningPair]
    """The pair whose prompt stands for each column. (c,)."""
    of_pair: torch.Tensor
    """Shape (n,), long: each pair's own column."""
    classes: torch.Tensor
    """Shape (c,), long: equal for columns of identical prompts."""


def columns_by_group(pairs: list[ReasoningPair]) -> Columns:
    """One column per group's prompt (first turns, RAGEN's), in order of first appearance. A group whose
    prompts differ (a response that wrote something before ``<think>``) gets a column for each."""
    index: dict[Any, int] = {}
    prompts: list[ReasoningPair] = []
    of_pair = []
    for pair in pairs:
        key = (pair.group, pair.prompt_key())
        if key not in index:
            index[key] = len(prompts)
            prompts.append(pair)
        of_pair.append(index[key])
    return Columns(prompts, torch.tensor(of_pair, dtype=torch.long), _classes(prompts))


def columns_per_pair(pairs: list[ReasoningPair]) -> Columns:
    """Each pair its own column (turns drawn over trajectories, RAGEN's)."""
    return Columns(list(pairs), torch.arange(len(pairs)), _classes(pairs))


def _classes(prompts: list[ReasoningPair]) -> torch.Tensor:
    ids: dict[Any, int] = {}
    return torch.tensor([ids.setdefault(prompt.prompt_key(), len(ids)) for prompt in prompts])


def cross_logprobs(pairs: Sequence[ReasoningPair], prompts: Sequence[ReasoningPair], score: Scorer, pad_id: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Every reasoning scored after every prompt: ``log p(z_i | x_j)`` by teacher forcing.

    Rows ``[x_j | z_i]`` go to ``score`` a few whole columns at a time (about :data:`ROWS_PER_CALL` rows),
    with x_j's extra model inputs.

    Returns:
        ``token`` Shape (n, c): the mean log-prob of z_i's tokens after x_j; ``sequence`` Shape (n, c): their sum.
    """
    n, c = len(pairs), len(prompts)
    total = torch.zeros(n, c, dtype=torch.float64)
    per_call = max(1, ROWS_PER_CALL // max(n, 1))
    for first in range(0, c, per_call):
        block = range(first, min(first + per_call, c))
        samples = [Sample(input_ids=prompts[j].prompt_ids + pair.reasoning_ids,
                          loss_mask=[0] * len(prompts[j].prompt_ids) + [1] * len(pair.reasoning_ids),
                          sampler_logprobs=[0.0] * (len(prompts[j].prompt_ids) + len(pair.reasoning_ids)),
                          turn_ends=[], turn_rewards=[], episode=pair.episode, group=pair.group,
                          model_inputs=prompts[j].model_inputs)
                   for j in block for pair in pairs]
        batch = collate(samples, pad_id)
        logprobs = score(batch).to(torch.float64).cpu()
        sums = (logprobs * batch.loss_mask.to(torch.float64)).sum(1)
        total[:, first : first + len(block)] = sums.view(len(block), n).T
    lengths = torch.tensor([len(pair.reasoning_ids) for pair in pairs], dtype=torch.float64)
    return total / lengths[:, None], total


def pair_metrics(token: torch.Tensor, sequence: torch.Tensor, columns: Columns, eps: float,
                 ema_std: tuple[float | None, float | None], ema_decay: float) -> dict[str, float]:
    """The metrics of one sample of pairs (unprefixed): information and z-scores per token and per sequence
    (``_seq``), retrieval (the same per token and per sequence: a row's length divides all its entries).
    ``ema_std``: the moving averages of the marginal std (per token, per sequence) before this sample."""
    metrics = information_metrics(token, columns.of_pair)
    metrics.update(retrieval_metrics(token, columns.of_pair, columns.classes))
    metrics.update(zscore_metrics(token, columns.of_pair, eps, ema_std[0], ema_decay))
    metrics.update({f"{key}_seq": value for key, value in information_metrics(sequence, columns.of_pair).items()
                    if key != "mi_upper_bound"})
    metrics.update({f"{key}_seq": value for key, value in
                    zscore_metrics(sequence, columns.of_pair, eps, ema_std[1], ema_decay).items()})
    metrics["pairs"], metrics["prompts"] = float(len(columns.of_pair)), float(len(columns.prompts))
    return metrics


class CollapseDiagnostics:
    """RAGEN's collapse detection over a step's rollouts, every ``collapse.every`` steps.

    Args:
        config: the ``collapse`` section.
        fmt: the response format (where the reasoning lies).
        decode: token ids to text, special tokens kept.
        pad_id: the tokenizer's padding id.
        seed: the run's seed (the pairs drawn are a function of it and the step).
    """

    def __init__(self, config: CollapseConfig, fmt: ResponseFormat, decode: Callable[[list[int]], str], pad_id: int,
                 seed: int) -> None:
        self.config = config
        self.fmt = fmt
        self.decode = decode
        self.pad_id = pad_id
        self.seed = seed
        self.ema_std: dict[str, float] = {}
        """Moving averages of ``<kind>/marginal_std`` and ``<kind>/marginal_std_seq``."""

    def due(self, step: int) -> bool:
        """Measured at the first step and every ``every`` steps (RAGEN's steps 1, 5, 10, ... counted from 1)."""
        every = self.config.every
        return every > 0 and (step == 0 or (step + 1) % every == 0)

    def measure(self, step: int, trajectories: list[Trajectory], score: Scorer) -> dict[str, float]:
        """``collapse/...`` metrics of the step's trajectories (all of them, before any filter), scored by ``score``
        (the actor before this step's update); a kind with fewer than 2 prompts is left out."""
        start = time.time()
        config = self.config
        found = [episode_pairs(t, i, self.fmt, self.decode) for i, t in enumerate(trajectories)]
        pairs = [episode for episode, _ in found]
        answered = sum(count for _, count in found)
        metrics = {"collapse/valid_thinking_rate": sum(map(len, pairs)) / answered} if answered else {}
        generator = torch.Generator().manual_seed(step_seed(self.seed, step))
        kinds: list[tuple[str, list[ReasoningPair], Callable[[list[ReasoningPair]], Columns]]] = []
        if config.first_turn:
            answered_first = sum(1 for t in trajectories
                                 if t.tokens is not None and t.tokens.turns and t.tokens.turns[0].response_ids)
            valid_first = sum(1 for episode in pairs if episode and episode[0].turn == 0)
            metrics["collapse/first_turn_pairs_total"] = float(answered_first)
            metrics["collapse/first_turn_pairs_valid"] = float(valid_first)
            metrics["collapse/first_turn_valid_rate"] = valid_first / answered_first if answered_first else 0.0
            kinds.append((FIRST_TURN, draw_first_turns(pairs, config.samples, generator), columns_by_group))
        if config.multi_turn:
            kinds.append((MULTI_TURN, draw_turns(pairs, config.samples, generator), columns_per_pair))
        for kind, drawn, layout in kinds:
            columns = layout(drawn)
            if len(columns.prompts) < 2:  # one prompt: nothing to tell apart
                continue
            token, sequence = cross_logprobs(drawn, columns.prompts, score, self.pad_id)
            ema_std = (self.ema_std.get(f"{kind}/marginal_std"), self.ema_std.get(f"{kind}/marginal_std_seq"))
            found_metrics = pair_metrics(token, sequence, columns, config.std_eps, ema_std, config.ema_decay)
            for name in ("marginal_std", "marginal_std_seq"):
                self.ema_std[f"{kind}/{name}"] = found_metrics[_ema_name(name)]
            metrics.update({f"collapse/{kind}/{name}": value for name, value in found_metrics.items()})
        metrics["timing/collapse_s"] = time.time() - start
        return metrics

    def resume(self, records: list[dict[str, float]]) -> None:
        """Take the moving averages back from the step records logged before a resume."""
        for record in records:
            for kind in (FIRST_TURN, MULTI_TURN):
                for name in ("marginal_std", "marginal_std_seq"):
                    logged = record.get(f"collapse/{kind}/{_ema_name(name)}")
                    if logged is not None:
                        self.ema_std[f"{kind}/{name}"] = float(logged)


def _ema_name(name: str) -> str:
    """``marginal_std`` -> ``marginal_std_ema``, ``marginal_std_seq`` -> ``marginal_std_ema_seq`` (RAGEN's names)."""
    return name.replace("marginal_std", "marginal_std_ema")


# --------------------------------------------------------------------------- early stops
@dataclass(frozen=True)
class EarlyStop:
    """Why a run stopped before its last step."""

    rule: str
    """``reward_spread_collapse``, ``low_validation_success`` or ``empty_filter_steps``."""
    reason: str
    """One sentence for people."""


class EarlyStops:
    """The early-stop rules a run has turned on, fed each step's metrics (RAGEN's order: empty steps, reward
    spread, validation success).

    Args:
        config: the ``collapse`` section.
        history: the step records logged before a resume (:func:`logged_steps`), replayed so that a resumed
            run stops where an uninterrupted one would.
    """

    def __init__(self, config: CollapseConfig, history: Sequence[Mapping[str, float]] = ()) -> None:
        self.config = config
        self.spread = SpreadCollapse(config.spread_baseline_steps, config.spread_window, config.spread_ratio)
        self.low_success = Streak(config.low_success_validations)
        self.empty = Streak(config.stop_after_empty_steps)
        self.active = config.every > 0 or config.stop_on_reward_spread or config.stop_on_low_success or bool(
            config.stop_after_empty_steps)
        """Whether to report the rules' state (``collapse/...``): with collapse diagnostics or a stop on."""
        self.fired: EarlyStop | None = None
        """The rule that stopped this session of the run (a resumed run's history does not count)."""
        stops = [self.observe(dict(record)) for record in history]
        self.fired = None
        self.stopped_before: EarlyStop | None = stops[-1] if stops else None
        """The rule that fires at the history's last step: a run resumed from there had ended there (its checkpoint
        is the one an early stop saves, and a process killed before the summary leaves it so)."""

    def observe(self, metrics: dict[str, float]) -> EarlyStop | None:
        """Feed one step's metrics (those of the rollout, the filter and a validation run with it); adds the
        rules' state to ``metrics`` and ``early_stop/<rule>: 1`` when one fires."""
        if not self.active:
            return None
        config, stop = self.config, None
        empty = bool(metrics.get("filter/skipped_step", 0.0))
        if self.empty.observe(empty) and stop is None:
            stop = EarlyStop("empty_filter_steps", f"the group filter kept nothing to train on for {self.empty.count} "
                                                   "steps in a row")
        metrics["collapse/empty_filter_steps"] = float(self.empty.count)
        spread = metrics.get("rollout/in_group_reward_std")
        if not empty and spread is not None:
            fired = self.spread.observe(spread)
            if fired and config.stop_on_reward_spread and stop is None:
                stop = EarlyStop("reward_spread_collapse",
                                 f"the in-group reward std stayed below {config.spread_ratio:g} x its baseline "
                                 f"{self.spread.baseline:.4g} (the mean of the first {config.spread_baseline_steps} "
                                 f"training steps) for {config.spread_window} training steps in a row")
        if self.spread.baseline is not None:
            metrics["collapse/reward_spread_baseline"] = self.spread.baseline
            metrics["collapse/reward_spread_threshold"] = float(self.spread.threshold or 0.0)
        success = metrics.get("val/success")
        if success is not None:
            fired = self.low_success.observe(success < config.low_success)
            if fired and config.stop_on_low_success and stop is None:
                stop = EarlyStop("low_validation_success",
                                 f"validation success stayed below {config.low_success:g} for "
                                 f"{self.low_success.count} validations in a row")
            metrics["collapse/low_success_validations"] = float(self.low_success.count)
        if stop is not None:
            metrics[f"early_stop/{stop.rule}"] = 1.0
            self.fired = stop
        return stop

    def summary(self, step: int) -> dict[str, Any]:
        """For the run's summary once a rule fired (the run stopped after ``step``): ``stopped_by: early_stop``
        and ``early_stop: {rule, reason, step}``; else nothing."""
        if self.fired is None:
            return {}
        return {"stopped_by": "early_stop",
                "early_stop": {"rule": self.fired.rule, "reason": self.fired.reason, "step": step}}


def logged_steps(run_dir: Path, last_step: int) -> list[dict[str, float]]:
    """The step records of ``run_dir/metrics.jsonl`` up to ``last_step`` (a resumed run's history), in order:
    those of RL steps (they have ``filter/skipped_step``), not of validations alone."""
    records = read_metrics(run_dir / "metrics.jsonl")
    steps = [r for r in records if "filter/skipped_step" in r and 1 <= int(r["step"]) <= last_step]
    by_step = {int(r["step"]): r for r in steps}  # a step logged twice keeps its last record
    return [by_step[s] for s in sorted(by_step)]

"""The update half of an RL step: forward passes without gradient, then PPO epochs.

Notation: b samples, s sequence length.

Everything here wires the pure functions of :mod:`turnrl.algorithms` to a
:class:`~turnrl.training.batch.Batch`; no formula is written twice. Advantages
come from :mod:`turnrl.training.batch_advantages`.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from turnrl.algorithms import (
    aggregate,
    entropy_bonus,
    kl_penalty,
    truncated_importance_weights,
    value_loss,
)
from turnrl.algorithms.losses import PolicyLoss, PolicyLossInputs
from turnrl.models.devices import to_device
from turnrl.training.algorithm_config import AlgorithmConfig
from turnrl.training.batch import Batch
from turnrl.training.model_passes import ValueModel, token_logprobs
from turnrl.training.ranks import whole
from turnrl.training.train_config import OptimConfig


# --------------------------------------------------------------------------- micro-batches
@dataclass(frozen=True)
class MicroBatching:
    """How rows are cut into forward/backward passes: ``rows`` at a time, padded, or (``tokens`` above 0) as
    many as fit in ``tokens`` tokens, packed end to end (:mod:`turnrl.training.packing`)."""

    rows: int
    """Samples per pass when ``tokens`` is 0."""
    tokens: int = 0
    """Token budget of a packed pass; 0: passes of ``rows`` samples."""

    @classmethod
    def of(cls, config: AlgorithmConfig) -> MicroBatching:
        """The update's passes."""
        return cls(config.micro_batch_size, config.micro_batch_tokens)

    @classmethod
    def scoring(cls, config: AlgorithmConfig) -> MicroBatching:
        """The passes that score without a backward (``algorithm.score_micro_batch_tokens``, else the update's)."""
        return cls(config.micro_batch_size, config.score_micro_batch_tokens or config.micro_batch_tokens)

    @property
    def packed(self) -> bool:
        return self.tokens > 0

    def split(self, index: torch.Tensor, lengths: torch.Tensor) -> list[torch.Tensor]:
        """The passes over the batch rows ``index``; ``lengths`` Shape (b,) counts every batch row's tokens.

        By tokens: :func:`best_fit_passes`.
        """
        if not self.packed:
            return list(_chunks(index, self.rows))
        return [torch.tensor(part, dtype=torch.long) for part in best_fit_passes(index.tolist(), lengths, self.tokens)]


def best_fit_passes(rows: list[int], lengths: torch.Tensor, budget: int) -> list[list[int]]:
    """``rows`` packed into passes of at most ``budget`` tokens (a row longer than it gets a pass alone).

    Best-fit decreasing: rows longest first, each into the open pass it leaves the least room in, else a new one.
    Closing a pass as soon as the next row overflows it (next fit) leaves the room a short row could take: 64
    rows of 300-4,200 tokens in 8,704-token passes take 21 passes so, 18 by best fit (docs/benchmarks.md, "Packed
    passes by best fit"). By hand: none of the libraries the trainer uses packs bins, and the rule is a dozen
    lines. ``lengths`` Shape (b,) counts every batch row's tokens.

    Returns:
        The passes in the order they were opened, each its rows longest first.
    """
    sizes = lengths.tolist()
    order = sorted(rows, key=lambda row: -sizes[row])  # stable: equal lengths keep their order
    passes: list[list[int]] = []
    room: list[tuple[int, int]] = []  # (free tokens, pass) of the passes still open, sorted
    for row in order:
        n = int(sizes[row])
        at = bisect.bisect_left(room, (n, -1))
        if at < len(room):
            free, place = room.pop(at)
            passes[place].append(row)
            if free > n:
                bisect.insort(room, (free - n, place))
        else:
            passes.append([row])
            if budget > n:
                bisect.insort(room, (budget - n, len(passes) - 1))
    return passes


def _chunks(index: torch.Tensor, size: int) -> Iterator[torch.Tensor]:
    for start in range(0, len(index), size):
        yield index[start : start + size]


# --------------------------------------------------------------------------- forward passes without grad
@torch.no_grad()
def batched_logprobs(
    model: torch.nn.Module, batch: Batch, batching: MicroBatching, temperature: float,
    passes: Callable[[int], int] = lambda n: n,
) -> torch.Tensor:
    """Shape (b, s): log-probs of the sampled tokens under ``model``, one micro-batch at a time.

    ``passes`` turns this process's number of passes into the number to run (data parallel: the most of any
    process, since FSDP's collectives need every process in every pass); extra passes score row 0 and are
    dropped.
    """
    out = torch.zeros_like(batch.loss_mask)
    parts = batching.split(torch.arange(len(batch)), batch.attention_mask.sum(1).cpu())
    for rows in _padded_passes(parts, passes):
        part = batch.select(rows if rows is not None else [0])
        lp, _ = token_logprobs(model, part.input_ids, part.attention_mask, part.loss_mask, temperature,
                               model_inputs=part.model_inputs, packed=batching.packed,
                               image_features=part.image_features)
        if rows is not None:
            out[to_device(rows, out.device), : lp.shape[1]] = lp
    return out


@torch.no_grad()
def batched_values(
    critic: ValueModel, batch: Batch, batching: MicroBatching, passes: Callable[[int], int] = lambda n: n
) -> torch.Tensor:
    """Shape (b, s): the critic's values, zero outside the loss mask (``passes`` as :func:`batched_logprobs`)."""
    out = torch.zeros_like(batch.loss_mask)
    parts = batching.split(torch.arange(len(batch)), batch.attention_mask.sum(1).cpu())
    for rows in _padded_passes(parts, passes):
        part = batch.select(rows if rows is not None else [0])
        values = critic(part.input_ids, part.attention_mask, part.model_inputs, packed=batching.packed,
                        image_features=part.image_features)
        if rows is not None:
            out[to_device(rows, out.device)] = values * part.loss_mask
    return out


def _padded_passes(parts: list[torch.Tensor], passes: Callable[[int], int]) -> list[torch.Tensor | None]:
    return [*parts, *[None] * (passes(len(parts)) - len(parts))]


# --------------------------------------------------------------------------- the PPO epochs
@dataclass
class UpdateInputs:
    """What the PPO epochs read, all Shape (b, s)."""

    batch: Batch
    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    returns: torch.Tensor
    old_values: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    sample_weights: torch.Tensor | None = None
    """Shape (b,): each sample's weight in the policy loss (None: all 1)."""


TOKEN_MEANS = frozenset({
    "actor/clip_frac", "actor/approx_kl", "actor/dual_clip_frac", "actor/tis_weight_mean", "actor/tis_capped",
    "critic/clip_frac", "critic/error",
})
"""Metrics that are token means over the loss mask whatever the loss's aggregation (:class:`PolicyLossStats`,
:class:`ValueLossStats`): a mini-batch's is its micro-batches' weighted by their share of its tokens. Weighted by
their share of a sequence-mean loss instead, they would depend on how the mini-batch is cut (and so would the
target-KL and rollback decisions that read ``actor/approx_kl``)."""


def micro_weight(micro: torch.Tensor, mini: torch.Tensor, row_tokens: torch.Tensor, aggregation: str) -> float:
    """Share of a micro-batch (rows ``micro``) in its mini-batch's (rows ``mini``) loss, so accumulated gradients
    equal the mini-batch loss. ``row_tokens`` Shape (b,): each row's trained tokens, on the host (reading them
    from the device for each micro-batch would wait for the passes in flight)."""
    if aggregation == "token-mean":
        return float(row_tokens[micro].sum()) / max(float(row_tokens[mini].sum()), 1.0)
    has_tokens = lambda rows: float((row_tokens[rows] > 0).sum())  # noqa: E731
    return has_tokens(micro) / max(has_tokens(mini), 1.0)


def _step_optimizer(
    optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], optim: OptimConfig
) -> tuple[float, bool]:
    """Clip, then step unless the gradient is non-finite or above the skip threshold. Returns (norm, skipped)."""
    total = torch.nn.utils.clip_grad_norm_(params, optim.grad_clip)
    # Sharded (FSDP) parameters give the norm over every process as a DTensor.
    norm = float(whole(total))
    too_big = optim.skip_grad_norm_above is not None and norm > optim.skip_grad_norm_above
    if not math.isfinite(norm) or too_big:
        optimizer.zero_grad(set_to_none=True)
        return norm, True
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm, False


@dataclass(frozen=True)
class ActorState:
    """The actor's trained weights and its optimizer's state for each, as they were before an optimizer step."""

    weights: list[torch.Tensor]
    optimizer_state: list[dict[str, Any] | None]
    """Per weight, a copy of ``optimizer.state[weight]`` (Adam's moments and step count); None before its first
    step."""


def save_actor_state(params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer) -> ActorState:
    """A copy of ``params`` and of their optimizer state (sharded weights copy their local shards)."""
    return ActorState([p.detach().clone() for p in params],
                      [_copied(optimizer.state[p]) if p in optimizer.state else None for p in params])


def _copied(state: dict[str, Any]) -> dict[str, Any]:
    return {key: value.clone() if isinstance(value, torch.Tensor) else value for key, value in state.items()}


@torch.no_grad()
def restore_actor_state(saved: ActorState, params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer
                        ) -> None:
    """Put back what :func:`save_actor_state` copied: the optimizer steps since then never happened."""
    for param, weights, state in zip(params, saved.weights, saved.optimizer_state, strict=True):
        param.copy_(weights)
        if state is None:
            optimizer.state.pop(param, None)
        else:
            optimizer.state[param] = state


@dataclass(frozen=True)
class Shard:
    """This process's share of each mini-batch in data-parallel training (see :func:`shard_rows`).

    ``reduce`` sums a dict of floats over all processes (the per-micro-batch metric sums and weights), so
    every process reports the metrics of the whole mini-batches; ``most`` is the largest of a number over
    all processes.
    """

    rank: int
    world: int
    reduce: Callable[[dict[str, float]], dict[str, float]]
    most: Callable[[int], int] = lambda n: n


def shard_rows(mini: torch.Tensor, lengths: torch.Tensor, shard: Shard, by_tokens: bool) -> torch.Tensor:
    """This process's rows of a mini-batch: ``rank::world``, or (``by_tokens``) rows dealt longest first to
    the process with the fewest tokens so far, so that no process waits for one with twice its tokens."""
    if not by_tokens:
        return mini[shard.rank :: shard.world]
    order = mini[torch.argsort(lengths[mini], descending=True, stable=True)].tolist()
    load = [0] * shard.world
    mine = []
    for row in order:
        owner = min(range(shard.world), key=lambda r: (load[r], r))
        load[owner] += int(lengths[row])
        if owner == shard.rank:
            mine.append(row)
    return torch.tensor(mine, dtype=torch.long)


def shard_micro_batches(
    mini: torch.Tensor, lengths: torch.Tensor, batching: MicroBatching, shard: Shard | None
) -> list[torch.Tensor | None]:
    """This process's micro-batches of a mini-batch (rows of the whole batch; ``lengths`` Shape (b,)).

    With a ``shard`` each process gets its rows (:func:`shard_rows`), and as many micro-batches as the
    process with the most: a None is a turn with nothing to train on, in which the process still runs a
    forward and backward (weighted 0) because FSDP's collectives need every process in every pass.
    """
    if shard is None:
        return list(batching.split(mini, lengths))
    mine = shard_rows(mini, lengths, shard, batching.packed)
    parts: list[torch.Tensor | None] = list(batching.split(mine, lengths)) if len(mine) else []
    if batching.packed:
        count = shard.most(len(parts))
    else:
        count = math.ceil(math.ceil(len(mini) / shard.world) / batching.rows)
    return parts + [None] * (count - len(parts))


def ppo_epochs(
    actor: torch.nn.Module,
    critic: ValueModel | None,
    inputs: UpdateInputs,
    config: AlgorithmConfig,
    optim: OptimConfig,
    actor_optimizer: torch.optim.Optimizer | None,
    critic_optimizer: torch.optim.Optimizer | None,
    temperature: float,
    generator: torch.Generator,
    shard: Shard | None = None,
) -> dict[str, float]:
    """Mini-batch PPO epochs over one rollout batch; returns mean metrics.

    ``actor_optimizer`` None trains only the critic (critic warm-up). Loss-side metrics (losses, clip
    fractions, entropy...) are each mini-batch's, i.e. the micro-batches' values weighted by their share of
    the mini-batch loss (of its tokens for the :data:`TOKEN_MEANS`), averaged over mini-batches. With a
    ``shard`` (data parallel) this process trains on its rows of each mini-batch; its losses are weighted by
    their share of the whole mini-batch times the number of processes, since FSDP averages the gradients of
    the processes.
    """
    batch = inputs.batch
    actor_params = [p for p in actor.parameters() if p.requires_grad]
    critic_params = [p for p in critic.parameters() if p.requires_grad] if critic is not None else []
    world = shard.world if shard is not None else 1
    policy_loss = config.policy_loss_fn  # resolved once per update, not in every micro-batch
    # metric -> sum of weight * value over micro-batches, on the device until the epochs end: a read of the
    # device in every pass would make the host wait for each pass before queuing the next one.
    weighted: dict[str, torch.Tensor] = {}
    weights: dict[str, float] = {}  # metric -> sum of weights
    sums: dict[str, float] = {}  # optimizer-step metrics (the same on every process)
    counts: dict[str, int] = {}

    def record(key: str, value: float) -> None:
        sums[key] = sums.get(key, 0.0) + value
        counts[key] = counts.get(key, 0) + 1

    def record_weighted(values: dict[str, torch.Tensor], weight: float, token_weight: float | None = None) -> None:
        for key, value in values.items():
            w = token_weight if token_weight is not None and key in TOKEN_MEANS else weight
            weighted[key] = weighted[key] + w * value if key in weighted else w * value
            weights[key] = weights.get(key, 0.0) + w

    batching = MicroBatching.of(config)
    lengths = batch.attention_mask.sum(1).cpu()
    row_tokens = batch.loss_mask.sum(1).cpu()
    stepping = actor_optimizer  # None once the target KL (or a rollback) stops the actor for this step
    kl_stopped = rolled_back = False
    # With a rollback bound: the actor before its latest optimizer step, until a mini-batch's passes after that step
    # read its KL (the last step's is read by a pass of its own after the epochs).
    guard = config.rollback_kl if actor_optimizer is not None else None
    before_step: ActorState | None = None
    last_mini: torch.Tensor | None = None
    # With the sampler's log-probs as the old ones, the first mini-batch's passes (before any optimizer step, so
    # under the weights that sampled) also measure how far training's forward drifts from the sampler's.
    watch_drift = config.old_logprobs == "sampler"
    filled = passes = 0.0  # packed passes: the share of each one's token budget its rows fill, summed, and a count
    for _ in range(config.ppo_epochs):
        order = torch.randperm(len(batch), generator=generator)
        for mini in _chunks(order, config.mini_batch_size):
            if stepping is None and (critic is None or critic_optimizer is None):
                break
            mini_kl: torch.Tensor | float = 0.0  # on the device until the optimizer step reads it
            for micro in shard_micro_batches(mini, lengths, batching, shard):
                # A process without rows left still joins the pass, on one row weighted 0.
                part = batch.select(micro if micro is not None else mini[:1])
                weight = micro_weight(micro, mini, row_tokens, config.loss_aggregation) if micro is not None else 0.0
                token_weight = micro_weight(micro, mini, row_tokens, "token-mean") if micro is not None else 0.0
                rows = micro if micro is not None else mini[:1]
                if batching.packed:
                    filled += float(lengths[micro].sum()) / batching.tokens if micro is not None else 0.0
                    passes += 1
                if stepping is not None:
                    drift = watch_drift and micro is not None
                    values = _actor_backward(actor, part, inputs, rows, config, policy_loss, temperature,
                                             weight * world, batching.packed, sampler_drift=drift)
                    if drift:
                        record_weighted({DRIFT: values.pop(DRIFT)}, float(row_tokens[micro].sum()))
                    record_weighted(values, weight, token_weight)
                    if config.target_kl is not None or guard is not None:
                        mini_kl = mini_kl + token_weight * values["actor/approx_kl"]
                if critic is not None and critic_optimizer is not None:
                    record_weighted(_critic_backward(critic, part, inputs, rows, config, weight * world,
                                                     batching.packed), weight, token_weight)
            kl = _mini_batch_kl(float(mini_kl), shard) if stepping is not None and \
                (config.target_kl is not None or guard is not None) else 0.0
            if stepping is not None and guard is not None and before_step is not None and kl > guard:
                # The optimizer step before these passes moved the policy this far: undo it, and step no more.
                stepping.zero_grad(set_to_none=True)
                restore_actor_state(before_step, actor_params, stepping)
                stepping, rolled_back = None, True
            elif stepping is not None and config.target_kl is not None and kl > 1.5 * config.target_kl:
                stepping.zero_grad(set_to_none=True)  # this mini-batch's gradient is not applied
                stepping, kl_stopped = None, True
            watch_drift = False  # the first mini-batch's passes were under the sampling weights; later ones are not
            if stepping is not None:
                if guard is not None:
                    before_step = None  # freed before the next copy: two copies are never held at once
                    before_step, last_mini = save_actor_state(actor_params, stepping), mini
                norm, skipped = _step_optimizer(stepping, actor_params, optim)
                record("actor/grad_norm", norm)
                record("actor/skipped_steps", float(skipped))
            if critic is not None and critic_optimizer is not None:
                norm, skipped = _step_optimizer(critic_optimizer, critic_params, optim)
                record("critic/grad_norm", norm)
                record("critic/skipped_steps", float(skipped))
    if stepping is not None and guard is not None and before_step is not None and last_mini is not None and \
            _approx_kl_after(actor, inputs, last_mini, lengths, row_tokens, batching, config, policy_loss,
                             temperature, shard) > guard:
        restore_actor_state(before_step, actor_params, stepping)
        rolled_back = True
    totals = dict(zip(weighted, torch.stack(list(weighted.values())).tolist(), strict=True)) if weighted else {}
    if passes:
        totals[PASS_FILL], weights[PASS_FILL] = filled, passes
    if shard is not None:
        # Keys seen by any process (one may have had only weight-0 passes): sums over processes.
        both = shard.reduce({**{f"v:{k}": v for k, v in totals.items()}, **{f"w:{k}": v for k, v in weights.items()}})
        totals = {k[2:]: v for k, v in both.items() if k.startswith("v:")}
        weights = {k[2:]: v for k, v in both.items() if k.startswith("w:")}
    metrics = {key: totals[key] / weights[key] for key in totals if weights[key] > 0}
    metrics.update({key: sums[key] / counts[key] for key in sums})
    for key in ("actor/skipped_steps", "critic/skipped_steps"):
        if key in metrics:
            metrics[key] = sums[key]  # a count, not a mean
    if actor_optimizer is not None:
        metrics["actor/optimizer_steps"] = float(counts.get("actor/grad_norm", 0))
        if config.target_kl is not None:
            metrics["actor/kl_stopped"] = float(kl_stopped)
        if guard is not None:
            metrics["actor/rolled_back"] = float(rolled_back)
    return metrics


@torch.no_grad()
def _approx_kl_after(
    actor: torch.nn.Module, inputs: UpdateInputs, mini: torch.Tensor, lengths: torch.Tensor,
    row_tokens: torch.Tensor, batching: MicroBatching, config: AlgorithmConfig, policy_loss_fn: PolicyLoss,
    temperature: float, shard: Shard | None,
) -> float:
    """The approximate KL to the sampling policy (``actor/approx_kl``) of mini-batch ``mini``, the last one trained
    on, under the actor's weights now: passes without a backward that read the update's last optimizer step as
    the next mini-batch's passes read each earlier one."""
    batch = inputs.batch
    kl: torch.Tensor | float = 0.0
    for micro in shard_micro_batches(mini, lengths, batching, shard):
        rows = micro if micro is not None else mini[:1]
        part = batch.select(rows)
        weight = micro_weight(micro, mini, row_tokens, "token-mean") if micro is not None else 0.0  # a token mean
        index = to_device(rows, inputs.old_logprobs.device)
        logprobs, _ = token_logprobs(actor, part.input_ids, part.attention_mask, part.loss_mask, temperature,
                                     model_inputs=part.model_inputs, packed=batching.packed,
                                     image_features=part.image_features)
        _, stats = policy_loss_fn(
            PolicyLossInputs(logprobs, inputs.old_logprobs[index], inputs.advantages[index], part.loss_mask),
            config.policy_loss_settings,
        )
        kl = kl + weight * stats.approx_kl
    return _mini_batch_kl(float(kl), shard)


def _mini_batch_kl(local: float, shard: Shard | None) -> float:
    """A mini-batch's approximate KL from this process's weighted share of it: the same number on every
    process, which all stop together (FSDP's passes need every process)."""
    return local if shard is None else shard.reduce({"kl": local})["kl"]


PASS_FILL = "actor/pass_fill"
"""With packed passes (``algorithm.micro_batch_tokens``): the share of the passes' token budget the update's rows
filled, over every pass of the step (and every process). Rows a little over half the budget fill barely half of
each pass, since no two fit: 0.5 says two rows would share a pass at a budget twice their length
(docs/metrics.md)."""

DRIFT = "actor/logprob_mismatch"
"""The mean absolute difference of the training forward's log-probs from the sampler's, over the tokens of the
first mini-batch of a step's update (with ``algorithm.old_logprobs=sampler``) or of the whole batch (``recompute``,
from the recomputed old log-probs)."""


def _actor_backward(
    actor: torch.nn.Module, part: Batch, inputs: UpdateInputs, rows: torch.Tensor, config: AlgorithmConfig,
    policy_loss_fn: PolicyLoss, temperature: float, weight: float, packed: bool, sampler_drift: bool = False,
) -> dict[str, torch.Tensor]:
    """One micro-batch's actor loss and its backward; its metrics as 0-dim tensors, not read from the device.
    ``sampler_drift``: also :data:`DRIFT`, the token mean of its log-probs' distance from the sampler's."""
    index = to_device(rows, inputs.old_logprobs.device)
    mask = part.loss_mask
    # Entropy is watched even without a bonus: its fall is the first sign of collapse.
    logprobs, entropy = token_logprobs(
        actor, part.input_ids, part.attention_mask, mask, temperature, with_entropy=True,
        model_inputs=part.model_inputs, packed=packed, image_features=part.image_features,
    )
    weights = inputs.sample_weights[index] if inputs.sample_weights is not None else None
    token_weights, cap = None, config.tis_cap
    if cap is not None:
        token_weights = truncated_importance_weights(
            inputs.old_logprobs[index], part.sampler_logprobs.to(logprobs.device), mask, cap)
    policy_loss, stats = policy_loss_fn(
        PolicyLossInputs(logprobs, inputs.old_logprobs[index], inputs.advantages[index], mask, weights, token_weights),
        config.policy_loss_settings,
    )
    loss = policy_loss
    metrics = {"losses/policy": policy_loss, "actor/clip_frac": stats.clip_frac, "actor/approx_kl": stats.approx_kl,
               "actor/dual_clip_frac": stats.dual_clip_frac}
    if token_weights is not None and cap is not None:
        metrics["actor/tis_weight_mean"] = aggregate(token_weights, mask, "token-mean")
        metrics["actor/tis_capped"] = aggregate((token_weights >= cap).float(), mask, "token-mean")
    assert entropy is not None  # asked for with_entropy
    bonus = entropy_bonus(entropy, mask, config.loss_aggregation)
    if config.entropy_coef != 0:
        loss = loss - config.entropy_coef * bonus
    metrics["actor/entropy"] = bonus
    if inputs.ref_logprobs is not None and config.kl_coef > 0:
        kl = kl_penalty(logprobs, inputs.ref_logprobs[index], kind=config.kl_kind, mask=mask)
        kl_term = aggregate(kl, mask, config.loss_aggregation)
        if not config.kl_in_reward:
            loss = loss + config.kl_coef * kl_term
        metrics["actor/kl_ref"] = kl_term
    if sampler_drift:
        metrics[DRIFT] = aggregate((logprobs - part.sampler_logprobs.to(logprobs.device)).abs(), mask, "token-mean")
    (loss * weight).backward()
    metrics["losses/actor_total"] = loss
    return {key: value.detach().float() for key, value in metrics.items()}


def _critic_backward(
    critic: ValueModel, part: Batch, inputs: UpdateInputs, rows: torch.Tensor, config: AlgorithmConfig,
    weight: float, packed: bool,
) -> dict[str, torch.Tensor]:
    """One micro-batch's value loss and its backward; its metrics as 0-dim tensors, not read from the device."""
    assert inputs.old_values is not None
    index = to_device(rows, inputs.returns.device)
    values = critic(part.input_ids, part.attention_mask, part.model_inputs, packed=packed,
                    image_features=part.image_features)
    loss, stats = value_loss(
        values, inputs.old_values[index], inputs.returns[index], part.loss_mask,
        clip=config.value_clip, aggregation=config.loss_aggregation,
    )
    (loss * weight).backward()
    return {key: value.detach().float() for key, value in
            {"losses/value": loss, "critic/clip_frac": stats.clip_frac, "critic/error": stats.error}.items()}

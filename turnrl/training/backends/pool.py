"""Disaggregated pools: the last ``distributed.rollout_processes`` of the processes ``torchrun`` started roll out,
the others train (docs/distributed.md, "Disaggregated pools").

    trainer ranks 0 .. n-k-1     the trainer (FSDP2 over their own default group; one: on its own), validation
    rollout ranks n-k .. n-1     each a RolloutHost (policy + envs of its own, on its GPU) serving trainer 0

Trainer 0 drives the rollout processes over groups of their own (:mod:`~turnrl.training.backends.pool_protocol`:
the messages, a rollout process's loop, trainer 0's :class:`~turnrl.training.backends.pool_protocol.ProcessPool`);
the trainer's weights reach them as :mod:`~turnrl.training.backends.pool_weights` says. A failure of a rollout
process is named in the :class:`RolloutWorkerError` trainer 0 raises, as for a Ray worker. The other trainer
ranks get each step's played batch (or that error) from trainer 0 (:func:`share_from_main`): the FSDP update
sees the batch it sees without a pool.

Synchronous (:class:`PoolRollout`): after each step the trainer's weights are streamed to the pool
(``pool/publish_s``) and checked; the next step is played with them. Asynchronous (``distributed.async_rollout``):
:class:`~turnrl.training.backends.asynchronous.AsyncRollout` on trainer 0 with the pool as its runner and
:class:`~turnrl.training.backends.pool_weights.PoolCopy` as where its copy lives: the weights are staged on
trainer 0's device by every trainer's main thread (the gather is a collective) and sent by the rollout thread
between batches; with partial rollouts also to one process at a time, at its turn boundaries.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Generic, NoReturn

import torch
import torch.distributed as dist

from turnrl.chat.template_deltas import ChatTemplateDeltas
from turnrl.config import SamplingConfig
from turnrl.models.devices import resolve_dtype
from turnrl.rollout.ray_workers import (
    EnvSpec,
    RolloutWorkerError,
    WeightsTransferError,
    WorkerRewardMetrics,
    WorkerSpec,
    model_files,
)
from turnrl.rollout.runner import EpisodeSlot, RolloutTimings
from turnrl.rollout.trajectory import Trajectory
from turnrl.training import ranks, wire
from turnrl.training.backends.asynchronous import AsyncRollout, RolloutThreadError
from turnrl.training.backends.backend import (
    Played,
    PlayStep,
    RewardMetrics,
    RolloutBackend,
    RolloutParts,
    Rollouts,
    StepRollout,
    WeightsVersion,
)
from turnrl.training.backends.local import LocalRollout
from turnrl.training.backends.pool_protocol import ProcessPool, pool_groups
from turnrl.training.backends.pool_weights import PoolCopy, PoolWeights
from turnrl.training.backends.sharded import ShardedRollout
from turnrl.training.backends.weights_check import WeightsSyncError


# --------------------------------------------------------------------------- the backends
class PoolRollout:
    """The synchronous :class:`~turnrl.training.backends.backend.RolloutBackend` on rollout processes (on every
    trainer rank; trainer 0's drives the pool). :meth:`set_weights` streams the trainer's weights to the pool when
    the actor's updates moved (``pool/publish_s``) and checks what each process computes with."""

    runs_ahead = False
    plays_on_trainer_policy = False

    def __init__(self, pool: ProcessPool | None, copy: PoolCopy, checked: PoolWeights,
                 precision: Callable[[], AbstractContextManager]) -> None:
        self.pool = pool
        self.copy = copy
        self.checked = checked
        self.precision = precision
        self.updates: int | None = None

    @property
    def timings(self) -> RolloutTimings:
        assert self.pool is not None, "trainer 0 plays"
        return self.pool.timings

    @property
    def rewards(self) -> RewardMetrics:
        assert self.pool is not None, "trainer 0 plays"
        return self.pool.rewards

    def run(self, slots: Sequence[EpisodeSlot], sampling: SamplingConfig) -> list[Trajectory]:
        assert self.pool is not None, "trainer 0 plays"
        return self.pool.run(slots, sampling)

    def roll_out(self, step: int, play: PlayStep[Played]) -> StepRollout[Played]:
        return StepRollout(play(self, step, self.precision()))

    def set_weights(self, model: torch.nn.Module, version: WeightsVersion) -> dict[str, float]:
        self.checked.expect(model, version)
        start = time.perf_counter()
        if self.updates is None or version.updates != self.updates:
            self.copy.send(model, version, every=self.updates is None)
        publish_s = time.perf_counter() - start
        first = self.updates is None
        self.updates = version.updates
        self.checked.take(version.steps)
        return {} if first else {"pool/publish_s": publish_s, **self.checked.metrics()}

    def exclusive(self) -> AbstractContextManager[Any]:
        return nullcontext()

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()


class PoolFollower:
    """The asynchronous pool's backend on a trainer rank other than 0: no rollout thread; it takes part in the
    weights' collectives in the order trainer 0's :class:`AsyncRollout` runs them (the checksum, then the first
    transfer or the staging)."""

    runs_ahead = True
    plays_on_trainer_policy = False

    def __init__(self, copy: PoolCopy, checked: PoolWeights) -> None:
        self.copy = copy
        self.checked = checked
        self.updates: int | None = None

    timings = RolloutTimings()
    rewards: RewardMetrics = WorkerRewardMetrics()

    def run(self, slots: Sequence[EpisodeSlot], sampling: SamplingConfig) -> list[Trajectory]:
        raise RuntimeError("trainer 0 plays the rollout processes' episodes")

    def roll_out(self, step: int, play: PlayStep[Played]) -> StepRollout[Played]:
        raise RuntimeError("trainer 0 plays the rollout processes' episodes")

    def set_weights(self, model: torch.nn.Module, version: WeightsVersion) -> dict[str, float]:
        self.checked.expect(model, version)
        if self.updates is None:
            self.copy.start(model, version)
        elif version.updates != self.updates:
            self.copy.stage(model, version)
        self.updates = version.updates
        return {}

    def exclusive(self) -> AbstractContextManager[Any]:
        return nullcontext()

    def close(self) -> None:
        pass


@dataclass(frozen=True)
class SharedError:
    """An exception of trainer 0, as the other trainer ranks get it (:func:`share_from_main`): its type's name and
    message, which pickle whatever the exception holds."""

    kind: str
    message: str
    worker: int | None = None

    @classmethod
    def of(cls, error: Exception) -> SharedError:
        """``error`` to share; an error of the rollout thread caused by a lost rollout process as that (the stop
        path saves the last finished step for it, as in the synchronous pool)."""
        if isinstance(error, RolloutThreadError) and isinstance(error.__cause__, RolloutWorkerError):
            error = error.__cause__
        worker = error.worker if isinstance(error, RolloutWorkerError) else None
        return cls(type(error).__name__, str(error), worker)

    def error(self) -> Exception:
        """The exception every trainer rank raises: of the type trainer 0 raised where it is one the run's stop path
        tells apart, else a ``RuntimeError`` naming it."""
        if self.kind in (RolloutWorkerError.__name__, WeightsTransferError.__name__):
            return RolloutWorkerError(self.message, worker=self.worker)
        if self.kind == WeightsSyncError.__name__:
            return WeightsSyncError(self.message)
        return RuntimeError(f"trainer 0 stopped on {self.kind}: {self.message}")


@dataclass
class Shared(Generic[Played]):
    """What trainer 0 hands the other trainer ranks for a step: its rollout, or the error that stopped it."""

    rollout: StepRollout[Played] | None
    error: SharedError | None = None


class TrainerGroup:
    """A rollout backend as every trainer rank sees it: trainer 0's ``inner`` plays each step, and the other trainer
    ranks get the step's rollout from it (:func:`share_from_main`), or the error that stopped it, which every
    rank then raises (they stop together, at the same point). :meth:`set_weights` runs ``inner``'s on every rank
    (its gathers are collectives) and shares trainer 0's failure to send or check the weights the same way."""

    def __init__(self, inner: RolloutBackend, deltas: Callable[[], ChatTemplateDeltas],
                 pool: ProcessPool | None) -> None:
        self.inner = inner
        self.deltas = deltas
        self.pool = pool
        self.runs_ahead = inner.runs_ahead
        self.plays_on_trainer_policy = inner.plays_on_trainer_policy

    @property
    def timings(self) -> RolloutTimings:
        return self.inner.timings

    @property
    def rewards(self) -> RewardMetrics:
        return self.inner.rewards

    def run(self, slots: Sequence[EpisodeSlot], sampling: SamplingConfig) -> list[Trajectory]:
        return self.inner.run(slots, sampling)

    def roll_out(self, step: int, play: PlayStep[Played]) -> StepRollout[Played]:
        """The step's rollout on every trainer rank.

        Raises:
            RolloutWorkerError: a rollout process was lost (on every rank; in the rollout thread too).
            RuntimeError: any other failure of trainer 0's rollout (there, the exception itself).
        """
        shared: Shared[Played] | None = None
        failure: Exception | None = None
        if ranks.is_main():
            try:
                shared = Shared(self.inner.roll_out(step, play))
            except Exception as error:  # noqa: BLE001 - every rank raises it, after the broadcast
                failure, shared = error, Shared(None, SharedError.of(error))
        shared = share_from_main(shared, self.deltas)
        assert shared is not None
        if shared.error is not None:
            raise_shared(shared.error, failure)
        assert shared.rollout is not None
        return shared.rollout

    def set_weights(self, model: torch.nn.Module, version: WeightsVersion) -> dict[str, float]:
        """``inner``'s on every rank; a failure of trainer 0's (a rollout process that failed to take the weights, or
        took other ones) raised on every rank, a lost rollout process as :class:`WeightsTransferError`: the update
        is done, and no checkpoint records it."""
        metrics: dict[str, float] = {}
        error: SharedError | None = None
        failure: Exception | None = None
        try:
            metrics = self.inner.set_weights(model, version)
        except (RolloutWorkerError, WeightsSyncError) as raised:
            if not ranks.is_main():
                raise  # not from the pool: trainer 0 alone talks to it
            failure, error = raised, SharedError.of(raised)
        error = share_from_main(error, self.deltas)
        if error is None:
            return metrics
        if error.kind == RolloutWorkerError.__name__:
            error = dataclasses.replace(error, kind=WeightsTransferError.__name__)
        raise_shared(error, failure)

    def exclusive(self) -> AbstractContextManager[Any]:
        return self.inner.exclusive()

    def close(self) -> None:
        self.inner.close()  # the rollout thread first: it may be talking to the pool
        if self.pool is not None:
            self.pool.close()


def raise_shared(error: SharedError, raised: Exception | None) -> NoReturn:
    """Raise trainer 0's ``error`` on this rank; on trainer 0 from ``raised``, the exception itself (its traceback
    is the one to read)."""
    if error.kind == WeightsTransferError.__name__:
        raise WeightsTransferError(error.message, worker=error.worker) from raised
    rebuilt = error.error()
    if raised is not None and (type(rebuilt) is RuntimeError or rebuilt.__class__ is raised.__class__):
        raise raised
    raise rebuilt from raised


OBJECT_CHUNK_BYTES = 64 * 2**20


def share_from_main(value: Any, deltas: Callable[[], ChatTemplateDeltas]) -> Any:
    """Trainer 0's ``value`` on every trainer rank (a broadcast over their group). The chat template objects the
    trajectories' token contexts refer to (they hold the tokenizer) do not travel: each rank attaches its own.
    Written here because torch's ``broadcast_object_list`` puts the whole pickle on the GPU at once (see
    :func:`ranks.all_gather_objects`)."""
    if ranks.world_size() == 1:
        return value
    device = ranks.process_device() or torch.device("cpu")
    payload = torch.empty(0, dtype=torch.uint8)
    if ranks.is_main():
        payload = wire.dumps(value, persistent_id=lambda obj: "deltas" if isinstance(obj, ChatTemplateDeltas) else None)
    size = torch.tensor([len(payload)], dtype=torch.long, device=device)
    dist.broadcast(size, 0)
    total = int(size)
    received = payload if ranks.is_main() else torch.empty(total, dtype=torch.uint8)
    width = min(OBJECT_CHUNK_BYTES, max(total, 1))
    chunk = torch.zeros(width, dtype=torch.uint8, device=device)
    for start in range(0, total, width):
        count = min(width, total - start)
        if ranks.is_main():
            chunk[:count].copy_(payload[start:start + count])
        dist.broadcast(chunk, 0)
        if not ranks.is_main():
            received[start:start + count].copy_(chunk[:count])
    if ranks.is_main():
        return value
    here = deltas()
    return wire.loads(received, persistent_load=lambda _: here)


# --------------------------------------------------------------------------- the run's parts
def pool_rollouts(parts: RolloutParts) -> Rollouts:
    """``distributed.rollout_processes``: the steps' backend on the rollout processes (synchronous, or ahead in a
    thread of trainer 0 with ``async_rollout``) and validation on the trainer ranks (as without a pool)."""
    config = parts.config
    dist_config = config.distributed
    trainers = ranks.launched_trainers(dist_config.rollout_processes)
    main = ranks.is_main()
    dtype = resolve_dtype(config.model.dtype, parts.device)  # the rollout processes' devices are of the same kind
    pool: ProcessPool | None = None
    if main:
        groups = pool_groups(trainers, dist_config.rollout_processes, parts.device, dist_config.timeout_s)
        batch_size = max(64, config.groups.n_groups * config.groups.group_size)
        spec = WorkerSpec(
            model_files(parts.start_path),
            dataclasses.replace(config.model, device="cuda" if parts.device.type == "cuda" else "cpu"),
            config.agent,
            EnvSpec(config.env.id, dict(config.env.settings), tuple(config.env.remote),
                    timeout_s=dist_config.timeout_s),
            rewards=config.rewards, max_batch_size=batch_size, env_threads=config.groups.env_workers,
            torch_threads=config.run.threads)
        pool = ProcessPool(groups, spec, parts.tokenizer, parts.train.fmt.response_prefix, trainers)
        dtype = pool.dtype
    deltas = lambda: ChatTemplateDeltas.for_tokenizer(  # noqa: E731
        parts.tokenizer, response_prefix=parts.train.fmt.response_prefix)
    # Every trainer rank gathers and checks the weights in the rollout processes' dtype (the checksum is a
    # collective of theirs), which trainer 0 learns from them.
    dtype = share_from_main(dtype, deltas)
    copy = PoolCopy(pool, dtype, parts.device)
    checked = PoolWeights(pool, dtype)
    inner: RolloutBackend
    if not dist_config.async_rollout:
        inner = PoolRollout(pool, copy, checked, parts.precision)
    elif pool is None:
        inner = PoolFollower(copy, checked)
    else:
        inner = AsyncRollout(pool, None, parts.device, parts.dtype, dist_config.max_staleness, config.run.steps,
                             dist_config.partial_rollouts, where=copy, checked=checked)
    validation: RolloutBackend = LocalRollout(parts.validation, parts.precision) if trainers == 1 else \
        ShardedRollout(parts.validation, parts.tokenizer, parts.precision)
    return Rollouts(TrainerGroup(inner, deltas, pool), validation)


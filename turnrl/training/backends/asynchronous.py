"""The asynchronous backend: the next batches are played with the previous weights while the trainer updates.

One process, two pools of the same policy:

    trainer thread   actor, critic, reference on ``model.device``: update(s), publish weights s+1, ...
    rollout thread   a copy of the actor on ``distributed.rollout_device``: roll out s+1, s+2, ... in order

    rollout(s)  may start once the weights it samples with are at most ``max_staleness`` updates old,
                i.e. once update s-1-max_staleness has been published
    publish     after each step the trainer's :meth:`AsyncRollout.set_weights` copies the actor's trainable
                parameters into a staging copy; the rollout thread copies them into its model between batches
                (with partial rollouts also between rounds of turns), never mid-generation
    update(s)   PPO on batch s; with recomputed old log-probs and ``algorithm.tis_cap`` the truncated
                importance weights ``min(pi_old / pi_sampler, cap)`` correct for the lag

Partial rollouts (``distributed.partial_rollouts``): the rollout thread also takes weights published while it
plays a batch, at the next turn boundary (before a round's generation, when no sequence is generating: the
engine's cached keys and values of the old weights are dropped then, and the episodes' prompts are prefilled
again with the new ones). The episodes in flight go on with them from their next turn; their earlier turns keep
their own version and sampler log-probs, so the truncated importance weights stay exact per token. A batch of
step ``s`` still starts only with weights at most ``max_staleness`` updates behind, and its turns only move to
newer ones: the bound holds for its oldest turn. ``async/weight_switches`` counts the switches of a step's batch,
``async/turns_behind_mean`` is the mean staleness of its turns (``async/staleness`` is its oldest turn's) and
``async/turns_newer_weights_frac`` the share of its turns sampled after a switch.

``max_staleness=0`` is the synchronous algorithm: rollout s+1 waits for update s, the rollout thread plays each
step with the trainer's own ``play`` function (the same random draws), and the run is the same run. With a
larger bound, the trainer and the rollout share no state but the staged weights and the queue of batches;
validation (on the trainer's actor) and a rollout batch never run at the same time (:meth:`AsyncRollout.exclusive`),
since both reseed torch's global generator and score with the same reward functions (state rewards keep a
history).

What a stop or a kill loses, and what a resume plays again: a checkpoint is the trainer's state alone (steps
done, weights, optimizers); the batches the rollout thread played ahead (finished in the queue, or in flight) are
dropped by :meth:`AsyncRollout.close`, which says which steps they were, or with the process by a SIGKILL. The
resumed run's rollout thread starts at the first step the checkpoint has not trained, and the levels of a step come
from the step alone (``seeds``, :mod:`turnrl.training.seeding`; a resume that would lay them out otherwise is
refused). So every step from the first to ``run.steps`` is trained once, on the groups and seeds an uninterrupted
run plays at that step, whatever the moment of the stop. What may differ is the samples: the first resumed step is
played with the checkpoint's weights (staleness 0) where the uninterrupted run would have played it with weights
up to ``max_staleness`` updates older (and which version plays a step there depends on timing anyway). With
``max_staleness=0`` a resume continues the run exactly, as a synchronous one does. Replaying is exact about the
episodes and costs at most ``max_staleness + 1`` batches of rollout per resume; keeping the buffer in the
checkpoint instead would make each save wait for the batch in flight, and still not give an uninterrupted run's
samples, whose weights depend on timing.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import Counter
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Generic, Protocol

import torch

from turnrl.config import SamplingConfig
from turnrl.models.devices import indexed, resolve_device
from turnrl.models.loading import cast_copy
from turnrl.policy.factory import model_policy
from turnrl.rollout.runner import EpisodeSlot, Rollout, RolloutTimings, TurnBoundary
from turnrl.rollout.trajectory import Trajectory
from turnrl.training.backends.backend import (
    EpisodeRunner,
    Played,
    PlayStep,
    RewardMetrics,
    RolloutParts,
    StepRollout,
    WeightsVersion,
)
from turnrl.training.backends.weights_check import PolicyWeights
from turnrl.training.logger import RunConsole
from turnrl.training.precision import autocast

console = RunConsole()


def let_compiled_code_run_beside_traces() -> None:
    """Let a compiled function called in one thread run while another thread traces a graph to compile.

    In torch 2.11 the flag that says "an FX trace is under way" is process-wide: while the trainer's thread
    compiles its layer parts (the first update, the first scoring pass), every compiled function the rollout
    thread called raised "Detected that you are using FX to symbolically trace a dynamo-optimized function", and
    the engine, taking it for a compiler failure, decoded without its compiled kernels for the rest of the run
    (the VisGym ``vlm-3b`` run one update ahead on one H200, torch 2.11). With this off, such a call runs its
    function uncompiled, that once. torch 2.14 keeps the flag per thread, and the setting there changes nothing.
    """
    torch._dynamo.config.error_on_nested_fx_trace = False


class RolloutCopy(Protocol):
    """Where the rollout side's copy of the actor lives, and how the trainer's weights reach it: this process
    (:class:`LocalCopy`) or rollout processes (:class:`~turnrl.training.backends.pool.PoolCopy`)."""

    parts: Sequence[int]
    """The parts of the copy that take weights apart, each at its own turn boundaries (partial rollouts): one, 0,
    in this process; each rollout process of a pool."""

    def start(self, source: torch.nn.Module, version: WeightsVersion) -> None:
        """The first weights (no rollout thread yet): from now on the copy holds ``source``'s."""
        ...

    def stage(self, source: torch.nn.Module, version: WeightsVersion) -> None:
        """On the trainer's thread: ``source``'s trainable weights into the staging buffers (on every trainer
        process where they are gathered from shards: a collective)."""
        ...

    def apply(self, version: WeightsVersion, parts: Sequence[int]) -> None:
        """On the rollout thread: the staged weights (``version``) into the copy's ``parts``."""
        ...


class CopyCheck(Protocol):
    """The check of the copy's weights after each apply, and their version on its turns
    (:class:`~turnrl.training.backends.weights_check.PolicyWeights` for a copy in this process)."""

    def expect(self, model: torch.nn.Module, version: WeightsVersion) -> None: ...

    def take(self, steps: int | None = None, parts: Sequence[int] | None = None) -> None:
        """The copy's ``parts`` (None: all of it) hold the weights of ``steps`` now: check them."""
        ...

    def metrics(self) -> dict[str, float]: ...


class LocalCopy:
    """A :class:`RolloutCopy` in this process: ``target``, a copy of the actor (same architecture, its parameters
    in the compute dtype, or float32 under LoRA: :func:`async_rollouts`; they are overwritten in place, so that
    the engine, which reads them where they live, notices the change through their version counters). The
    staging copy is on the trainer's device, in the target's dtype: publishing is a cast and a copy on one
    device; the rollout thread does the device-to-device copy (peer to peer between two GPUs) when it is ready
    for new weights."""

    parts: Sequence[int] = (0,)

    def __init__(self, target: torch.nn.Module) -> None:
        self.target = target
        self._sources: list[torch.nn.Parameter] = []
        self._targets: list[torch.nn.Parameter] = []
        self._staged: list[torch.Tensor] = []
        self._staged_at: torch.cuda.Event | None = None
        """Recorded on the trainer's stream after the last staging: the rollout thread's stream waits for it."""

    def start(self, source: torch.nn.Module, version: WeightsVersion) -> None:
        targets = dict(self.target.named_parameters())
        names = [name for name, p in source.named_parameters() if p.requires_grad]
        if not names:
            raise ValueError("the actor has no trainable parameter to publish")
        self._sources = [p for name, p in source.named_parameters() if p.requires_grad]
        self._targets = [targets[name] for name in names]
        # In the copy's dtype: what the copy takes is cast once, on the trainer's device, when it is staged.
        self._staged = [p.detach().to(dtype=target.dtype, copy=True) for p, target in zip(self._sources, self._targets)]

    @torch.no_grad()
    def stage(self, source: torch.nn.Module, version: WeightsVersion) -> None:
        for staged, parameter in zip(self._staged, self._sources):
            staged.copy_(parameter)
        if self._staged[0].device.type == "cuda":
            self._staged_at = torch.cuda.Event()
            self._staged_at.record()

    @torch.no_grad()
    def apply(self, version: WeightsVersion, parts: Sequence[int]) -> None:
        device = self._targets[0].device
        if device.type == "cuda" and self._staged_at is not None:
            torch.cuda.current_stream(device).wait_event(self._staged_at)  # the rollout thread's own stream
        for target, staged in zip(self._targets, self._staged):
            target.copy_(staged)
        if device.type == "cuda":
            # The staging copy may be rewritten as soon as the staged weights' lock is released. This stream
            # alone: the trainer's (on the same GPU, another stream) goes on with its update meanwhile.
            torch.cuda.current_stream(device).synchronize()


class StagedWeights:
    """The trainer's latest actor weights, staged for the rollout copy, with their version.

    The version of the weights after the update of step ``s`` is ``s + 1`` (a skipped update publishes the
    version with the same weights), so a batch of step ``s`` rolled out with version ``v`` is ``s - v``
    updates behind. Only trainable parameters are staged: frozen ones (a LoRA base, a frozen vision tower)
    never change.

    Args:
        source: the trainer's actor.
        copy: where the rollout copy lives (:class:`RolloutCopy`); it takes ``source``'s weights now.
        version: the version both hold now.
    """

    def __init__(self, source: torch.nn.Module, copy: RolloutCopy, version: WeightsVersion) -> None:
        copy.start(source, version)
        self.source = source
        self.copy = copy
        self._changed = threading.Condition()
        self.version = version.steps
        """The latest published version."""
        self._staged = version
        """The version whose weights are staged."""
        self._applied = {part: version.steps for part in copy.parts}
        """The version each part of the rollout copy holds."""

    def publish(self, version: WeightsVersion, changed: bool) -> float:
        """Stage the trainer's weights as ``version`` (``changed`` False: the update was skipped, only the
        version moves). Returns the seconds it took (waiting for a copy to the rollout model included)."""
        start = time.time()
        with self._changed:
            if changed:
                self.copy.stage(self.source, version)
                self._staged = version
            self.version = version.steps
            self._changed.notify_all()
        return time.time() - start

    def wait_for(self, version: int, stop: threading.Event) -> float:
        """Block until ``version`` (or a later one) is published or ``stop`` is set; returns the seconds waited."""
        start = time.time()
        with self._changed:
            while self.version < version and not stop.is_set():
                self._changed.wait(timeout=0.5)
        return time.time() - start

    def apply(self, part: int | None = None) -> int:
        """Copy the staged weights into the rollout copy's ``part`` (None: every part) when they are newer than
        what it holds (every part, when one of them is behind: a pool then broadcasts once, where sending to each
        part behind in turn would cost a transfer each); returns the version it holds now (the latest published)."""
        with self._changed:
            parts = list(self._applied) if part is None else [part]
            if any(self._applied[p] < self._staged.steps for p in parts):
                self.copy.apply(self._staged, parts)
            for p in parts:
                self._applied[p] = self.version
            return self.version

    def held(self, part: int) -> int:
        """The version the rollout copy's ``part`` holds."""
        with self._changed:
            return self._applied[part]

    def newer(self, part: int) -> bool:
        """Whether a version later than the one the rollout copy's ``part`` holds was published (its weights
        changed or not)."""
        with self._changed:
            return self.version > self._applied[part]

    def wake(self) -> None:
        """Wake a waiting :meth:`wait_for` (to see its stop event)."""
        with self._changed:
            self._changed.notify_all()


class AheadRunner(EpisodeRunner, Protocol):
    """The runner the rollout thread plays its batches on: a :class:`~turnrl.rollout.runner.Rollout` or the rollout
    processes' pool; each calls ``turn_boundary`` before each round of turns of each of its parts (a rollout
    process's rounds are its own: the pool calls it when the process reports one)."""

    turn_boundary: TurnBoundary | None


@dataclass
class RolloutBatch(Generic[Played]):
    """One step's rollout as the rollout thread hands it to the trainer."""

    step: int
    played: Played
    """What the trainer's ``play`` returned for the step."""
    weights_version: int
    """The version of the weights it was sampled with (see :class:`StagedWeights`)."""
    wait_weights_s: float
    """How long the rollout thread waited for these weights (the staleness bound)."""
    turns_by_version: dict[int, int]
    """The turns sampled with each version (``agent.wait_for_turns``: counted at the turn boundaries)."""
    switches: int
    """How many newer versions the rollout copy's parts took while they played the batch (partial rollouts)."""


@dataclass
class RolloutFailure:
    """The rollout thread stopped on an exception."""

    step: int
    error: BaseException


class RolloutThreadError(RuntimeError):
    """An exception in the rollout thread, raised again in the trainer's ``step`` (the original is its cause)."""


class AsyncRollout:
    """A :class:`~turnrl.training.backends.backend.RolloutBackend` whose steps are played in a background
    thread on a copy of the actor, up to ``max_staleness`` updates ahead of the trainer (see the module's docs).

    The thread starts at the first :meth:`roll_out` and plays the steps from there to ``end_step`` in order;
    :meth:`close` stops it (call it at the end of a run, and on Ctrl-C).

    Args:
        runner: a runner on a policy that samples from ``copy``.
        copy: the rollout thread's copy of the actor (on ``device``; its parameters are overwritten in place);
            None where ``where`` says where it lives.
        device: where the copy lives (``distributed.rollout_device``), or the device the rollout thread drives it
            from (trainer 0's, for rollout processes).
        dtype: the compute dtype the episodes play under.
        max_staleness: how many updates behind the weights a batch samples with may be.
        end_step: the steps before it are rolled out (``run.steps``).
        partial_rollouts: take weights published mid-batch at the next turn boundary (see the module).
        where: where the copy lives (None: ``copy``, in this process: :class:`LocalCopy`).
        checked: the check of the copy's weights (None: of ``runner``'s policy, in this process).
    """

    runs_ahead = True
    plays_on_trainer_policy = False

    def __init__(self, runner: AheadRunner, copy: torch.nn.Module | None, device: torch.device, dtype: torch.dtype,
                 max_staleness: int, end_step: int, partial_rollouts: bool = False, *,
                 where: RolloutCopy | None = None, checked: CopyCheck | None = None) -> None:
        self.runner = runner
        self.copy = copy
        if where is None:
            assert copy is not None, "a rollout copy in this process, or where it lives"
            where = LocalCopy(copy)
        self.where = where
        self.device = device
        self.dtype = dtype
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" and copy is not None else None
        """The copy's CUDA stream: every episode played on the copy queues its kernels there, whichever thread plays
        it (see :meth:`_produce_steps`), so that what the engine allocates and frees stays on one stream (the
        caching allocator hands a freed block to other work on the stream it was allocated on at once)."""
        self.max_staleness = max_staleness
        self.end_step = end_step
        self.partial_rollouts = partial_rollouts
        self._turns: Counter[int] = Counter()
        """The batch in play's turns by the version that samples them."""
        self._switches = 0
        """The batch in play's switches to newer weights."""
        self.weights: StagedWeights | None = None
        """The staged weights, from the first :meth:`set_weights` (the trainer's, once built or restored)."""
        self.updates = 0
        """The actor's updates of the weights last published."""
        self._batches: queue.Queue[RolloutBatch[Any] | RolloutFailure] = queue.Queue()
        self._stop = threading.Event()
        # Held for a whole rollout batch and for a whole validation: both seed torch's global generator and
        # score with the same (possibly stateful) reward functions. Re-entrant: run() within exclusive().
        self._sampling = threading.RLock()
        self.thread: threading.Thread | None = None
        self._failure: RolloutFailure | None = None
        self._playing: int | None = None
        """The step the rollout thread is playing now, if any."""
        self._producing = 0
        """The step the rollout thread is at (waiting for its weights or playing it)."""
        if checked is None:
            assert isinstance(runner, Rollout), "a runner of this process, or the check of where the copy lives"
            checked = PolicyWeights(runner.policy, "asynchronous")
        self.checked: CopyCheck = checked
        """The check of the copy's weights after each apply, and their version on its turns."""

    def precision(self) -> AbstractContextManager:
        return autocast(self.device, self.dtype)

    # ------------------------------------------------------------------ the runner's side of the protocol
    @property
    def timings(self) -> RolloutTimings:
        return self.runner.timings

    @property
    def rewards(self) -> RewardMetrics:
        return self.runner.rewards

    def run(self, slots: Sequence[EpisodeSlot], sampling: SamplingConfig) -> list[Trajectory]:
        """The slots' episodes on the rollout copy, between two batches of the rollout thread."""
        with self._sampling, self._on_stream(), self.precision():
            played = self.runner.run(slots, sampling)
            if self.device.type == "cuda":  # done on the device before a rollout batch takes the engine
                torch.cuda.current_stream(self.device).synchronize()
            return played

    def _on_stream(self) -> AbstractContextManager[Any]:
        return torch.cuda.stream(self.stream) if self.stream is not None else nullcontext()

    def exclusive(self) -> AbstractContextManager[Any]:
        return self._sampling

    # ------------------------------------------------------------------ the rollout thread
    def _produce(self, play: PlayStep[Any], first_step: int) -> None:
        """Roll out steps ``first_step .. end_step - 1`` in order, each within the staleness bound."""
        self._producing = first_step
        try:
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)  # the current device is per thread
            with self._on_stream():
                self._produce_steps(play, first_step)
        except BaseException as error:  # noqa: BLE001 - every failure goes to the trainer, which raises it
            self._batches.put(RolloutFailure(self._producing, error))

    def _produce_steps(self, play: PlayStep[Any], first_step: int) -> None:
        """The rollout thread's steps. A copy in this process plays them on a CUDA stream of its own: where it
        shares the trainer's GPU (``distributed.rollout_device`` unset) its kernels then run beside the update's
        instead of queuing behind them on the one default stream (decode reads memory while the update's matrix
        products compute). A batch's device work is done when it is handed over, so that a validation on the
        trainer's stream (the same engine) starts after it."""
        assert self.weights is not None
        for step in range(first_step, self.end_step):
            self._producing = step
            wait_s = self.weights.wait_for(step - self.max_staleness, self._stop)
            if self._stop.is_set():
                return
            version = self.weights.apply()
            self._playing = step
            self.checked.take(version)
            self._turns, self._switches = Counter(), 0
            with self._sampling:
                # Set for the batch alone: a validation's episodes on this runner take no weights.
                self.runner.turn_boundary = self._turn_boundary
                try:
                    played = play(self.runner, step, self.precision())
                finally:
                    self.runner.turn_boundary = None
                if self.device.type == "cuda":
                    torch.cuda.current_stream(self.device).synchronize()
            self._batches.put(RolloutBatch(step, played, version, wait_s, dict(self._turns), self._switches))
            self._playing = None

    def _turn_boundary(self, turns: int, part: int) -> None:
        """Before a round of ``turns`` turns of the batch in play on the copy's ``part`` (none of its sequences
        generating): with partial rollouts, that part takes the newest published weights (checked as between
        batches; the engine drops its cached keys and values of the old ones); count the turns under the version
        that samples them."""
        assert self.weights is not None
        if self.partial_rollouts and self.weights.newer(part):
            self.checked.take(self.weights.apply(part), parts=[part])
            self._switches += 1
        self._turns[self.weights.held(part)] += turns

    def _next_batch(self, step: int) -> RolloutBatch[Any]:
        """The rollout of ``step`` (waiting for it); a failure of the rollout thread is raised here."""
        while self._failure is None:
            try:
                item = self._batches.get(timeout=1.0)
            except queue.Empty:
                if self.thread is not None and not self.thread.is_alive() and self._batches.empty():
                    raise RolloutThreadError(
                        f"no rollout for step {step}: the rollout thread has stopped (it rolls out the steps "
                        f"before run.steps={self.end_step}, and close() stops it)") from None
                continue
            if isinstance(item, RolloutFailure):
                self._failure = item
                break
            if item.step != step:
                raise RolloutThreadError(f"step {step} was asked for, but the rollout thread rolled out step "
                                         f"{item.step}: an asynchronous trainer runs its steps in order")
            return item
        failure = self._failure
        raise RolloutThreadError(f"the rollout of step {failure.step} failed in the rollout thread: "
                                 f"{type(failure.error).__name__}: {failure.error}") from failure.error

    # ------------------------------------------------------------------ the trainer's side
    def roll_out(self, step: int, play: PlayStep[Played]) -> StepRollout[Played]:
        """The rollout of ``step`` from the rollout thread (started by the first call, at ``step``)."""
        if self.weights is None:
            raise RuntimeError("AsyncRollout.roll_out before set_weights: the trainer publishes its weights first")
        start = time.time()
        if self.thread is None:
            let_compiled_code_run_beside_traces()
            self.thread = threading.Thread(target=self._produce, args=(play, step), name="turnrl-rollout",
                                           daemon=True)
            self.thread.start()
        queued = self._batches.qsize()
        batch = self._next_batch(step)
        return StepRollout(batch.played, {
            "async/staleness": float(step - batch.weights_version),
            "async/weights_version": float(batch.weights_version),
            "async/weight_switches": float(batch.switches),
            **turn_staleness(step, batch.weights_version, batch.turns_by_version),
            "async/wait_rollout_s": time.time() - start,
            "async/wait_weights_s": batch.wait_weights_s,
            "async/queue_size": float(queued),
        })

    def set_weights(self, model: torch.nn.Module, version: WeightsVersion) -> dict[str, float]:
        """Publish ``model``'s weights as version ``version.steps`` (copied only when its updates moved); the
        first call stages them (the copy holds them already)."""
        # Noted before it is published: the rollout thread checks the copy against it once it applies it.
        self.checked.expect(model, version)
        if self.weights is None:
            self.weights = StagedWeights(model, self.where, version)
            self.updates = version.updates
            self.checked.take(version.steps)  # the copy holds the actor's weights; no rollout thread yet
            return {}
        publish_s = self.weights.publish(version, changed=version.updates != self.updates)
        self.updates = version.updates
        return {"async/publish_s": publish_s, **self.checked.metrics()}

    def close(self, timeout_s: float = 60.0) -> None:
        """Stop the rollout thread: it ends after the batch in progress, which is dropped with the queued ones;
        the steps dropped are said: a resume plays them again (see the module).

        Safe to call twice, and before any step.
        """
        self._stop.set()
        if self.weights is not None:
            self.weights.wake()
        if self.thread is not None and self.thread.is_alive():
            self.thread.join(timeout_s)
            if self.thread.is_alive():
                console.print(f"the rollout thread is still finishing its batch after {timeout_s:.0f} s; "
                              "it is left to end with the process")
        dropped = [] if self._playing is None or not self.thread or not self.thread.is_alive() else [self._playing]
        while not self._batches.empty():
            item = self._batches.get_nowait()
            if isinstance(item, RolloutBatch):
                dropped.append(item.step)
        if dropped:
            steps = sorted(set(dropped))  # a batch put just as the thread's join timed out counts once
            named = ", ".join(str(step + 1) for step in steps)
            console.print(f"rollouts played ahead and not trained, dropped: step{'s' if len(steps) > 1 else ''} "
                          f"{named} (a resume from the last checkpoint plays them again, on the same seeds)",
                          soft_wrap=True)


def turn_staleness(step: int, first_version: int, turns_by_version: dict[int, int]) -> dict[str, float]:
    """``async/turns_behind_mean``: the mean over a batch's turns of how many updates behind step ``step`` their
    weights are; ``async/turns_newer_weights_frac``: the share of them sampled with weights newer than
    ``first_version`` (the batch's first). Empty when no turn was counted (no rounds to count at:
    ``agent.wait_for_turns=false``)."""
    turns = sum(turns_by_version.values())
    if not turns:
        return {}
    behind = sum((step - version) * count for version, count in turns_by_version.items())
    newer = sum(count for version, count in turns_by_version.items() if version > first_version)
    return {"async/turns_behind_mean": behind / turns, "async/turns_newer_weights_frac": newer / turns}


def async_rollouts(parts: RolloutParts) -> tuple[AsyncRollout, Rollout]:
    """``distributed.async_rollout``: the steps' backend on a copy of the actor (on ``distributed.rollout_device``,
    with its own policy and engine cache) and a runner on ``parts``' own policy for validation."""
    config = parts.config
    dist = config.distributed
    # With an index: the rollout thread makes it its current device.
    device = indexed(resolve_device(dist.rollout_device) if dist.rollout_device else parts.device)
    # The copy samples; the trainer's actor trains and validates. It holds its weights in the compute dtype, in
    # which the engine computes anyway: beside the trainer on one GPU a float32 copy and its float32 staging
    # buffers are 15 GB more at 3B (the VisGym vlm-3b run ran out of memory with them). A LoRA copy keeps the
    # actor's precision: the engine merges the base weight and the adapters before its cast, and a merge from
    # bf16 ones rounds otherwise than the synchronous run's (its staging holds only the adapters).
    actor_copy = cast_copy(parts.actor, None if config.lora.enabled else parts.dtype, device).eval()
    batch_size = max(64, config.groups.n_groups * config.groups.group_size)
    policy = model_policy(actor_copy, parts.tokenizer, config.model, max_batch_size=batch_size,
                          processor=parts.processor, dtype=parts.dtype)
    train = parts.train
    runner = Rollout(policy, train.fmt, config.agent, env_id=config.env.id, executor=train.executor,
                     rewards=train.rewards)
    return AsyncRollout(runner, actor_copy, device, parts.dtype, dist.max_staleness, config.run.steps,
                        partial_rollouts=dist.partial_rollouts), parts.validation

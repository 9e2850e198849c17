"""Asynchronous rollout: the next batches are played with the previous weights while the trainer updates.

One process, two pools of the same policy:

    trainer thread   actor, critic, reference on ``model.device``: update(s), publish weights s+1, ...
    rollout thread   a copy of the actor on ``distributed.rollout_device``: roll out s+1, s+2, ... in order

    rollout(s)  may start once the weights it samples with are at most ``max_staleness`` updates old,
                i.e. once update s-1-max_staleness has been published
    publish     after each update the trainer copies the actor's trainable parameters into a staging copy;
                the rollout thread copies them into its model between batches, never mid-generation
    update(s)   PPO on batch s; with recomputed old log-probs and ``algorithm.tis_cap`` the truncated
                importance weights ``min(pi_old / pi_sampler, cap)`` correct for the lag

``max_staleness=0`` is the synchronous algorithm: rollout s+1 waits for update s, every phase draws the same
random numbers as in :class:`~turnrl.training.trainer.Trainer`, and the run is the same run. With a larger
bound, the trainer and the rollout share no state but the staged weights and the queue of batches; validation
(on the trainer's actor) and a rollout batch never run at the same time, since both reseed torch's global
generator and score with the same reward functions (state rewards keep a history).

Batches in flight when a run stops are dropped: a resumed run rolls them out again.
"""

from __future__ import annotations

import copy
import queue
import threading
import time
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path

import torch

from turnrl.models.devices import resolve_device
from turnrl.policy.factory import model_policy
from turnrl.rewards import Rewards
from turnrl.rollout.groups import EnvGroups
from turnrl.rollout.runner import Rollout
from turnrl.training.config import TrainConfig
from turnrl.training.logger import RunConsole
from turnrl.training.precision import autocast
from turnrl.training.seeding import step_seed
from turnrl.training.trainer import StepOutput, Trainer, collect, dynamic_sample, select_trajectories

console = RunConsole()


def roll_out_batch(
    rollout: Rollout, groups: EnvGroups, step: int, config: TrainConfig, precision: AbstractContextManager
) -> tuple[StepOutput, list[int]]:
    """The episodes of ``step`` and the indices of those to train on, as :meth:`Trainer.roll_out` makes them
    (dynamic sampling, or one round and the StarPO-S filter), seeded the same way."""
    torch.manual_seed(step_seed(config.seeds.seed, step))
    algo = config.algorithm
    if algo.dynamic_sampling:
        return dynamic_sample(rollout, groups, step, config, precision)
    output = collect(rollout, groups.train_slots(step), config.sampling, precision)
    keep, filter_metrics = select_trajectories(output.trajectories, algo.filter)
    output.metrics.update(filter_metrics)
    return output, keep


class StagedWeights:
    """The trainer's latest actor weights, staged for the rollout copy, with their version.

    The version of the weights after the update of step ``s`` is ``s + 1`` (a skipped update publishes the
    version with the same weights), so a batch of step ``s`` rolled out with version ``v`` is ``s - v``
    updates behind. Only trainable parameters are staged: frozen ones (a LoRA base, a frozen vision tower)
    never change.

    Args:
        source: the trainer's actor.
        target: the rollout copy (same architecture; its parameters are overwritten in place, so that the
            engine, which reads them where they live, notices the change through their version counters).
        version: the version both hold now.
    """

    def __init__(self, source: torch.nn.Module, target: torch.nn.Module, version: int) -> None:
        targets = dict(target.named_parameters())
        names = [name for name, p in source.named_parameters() if p.requires_grad]
        if not names:
            raise ValueError("the actor has no trainable parameter to publish")
        self._sources = [p for name, p in source.named_parameters() if p.requires_grad]
        self._targets = [targets[name] for name in names]
        # On the trainer's device: publishing is a copy on one device; the rollout thread does the
        # device-to-device copy (peer to peer between two GPUs) when it is ready for new weights.
        self._staged = [p.detach().clone() for p in self._sources]
        self._changed = threading.Condition()
        self.version = version
        """The latest published version."""
        self._staged_version = version
        """The version whose weights are in the staging copy."""
        self.applied_version = version
        """The version the rollout copy holds."""

    @torch.no_grad()
    def publish(self, version: int, changed: bool) -> float:
        """Stage the trainer's weights as ``version`` (``changed`` False: the update was skipped, only the
        version moves). Returns the seconds it took (waiting for a copy to the rollout model included)."""
        start = time.time()
        with self._changed:
            if changed:
                for staged, source in zip(self._staged, self._sources):
                    staged.copy_(source)
                self._staged_version = version
            self.version = version
            self._changed.notify_all()
        return time.time() - start

    def wait_for(self, version: int, stop: threading.Event) -> float:
        """Block until ``version`` (or a later one) is published or ``stop`` is set; returns the seconds waited."""
        start = time.time()
        with self._changed:
            while self.version < version and not stop.is_set():
                self._changed.wait(timeout=0.5)
        return time.time() - start

    @torch.no_grad()
    def apply(self) -> int:
        """Copy the staged weights into the rollout copy when they are newer; returns its version now."""
        with self._changed:
            if self._staged_version > self.applied_version:
                for target, staged in zip(self._targets, self._staged):
                    target.copy_(staged)
                device = self._targets[0].device
                if device.type == "cuda":
                    # The staging copy may be rewritten as soon as the lock is released.
                    torch.cuda.synchronize(device)
            self.applied_version = self.version
            return self.applied_version

    def wake(self) -> None:
        """Wake a waiting :meth:`wait_for` (to see its stop event)."""
        with self._changed:
            self._changed.notify_all()


@dataclass
class RolloutBatch:
    """One step's rollout as the rollout thread hands it to the trainer."""

    step: int
    output: StepOutput
    keep: list[int]
    """Indices of the trajectories to train on (empty: skip the update)."""
    weights_version: int
    """The version of the weights it was sampled with (see :class:`StagedWeights`)."""
    wait_weights_s: float
    """How long the rollout thread waited for these weights (the staleness bound)."""


@dataclass
class RolloutFailure:
    """The rollout thread stopped on an exception."""

    step: int
    error: BaseException


class RolloutThreadError(RuntimeError):
    """An exception in the rollout thread, raised again in the trainer's ``step`` (the original is its cause)."""


class AsyncTrainer(Trainer):
    """:class:`~turnrl.training.trainer.Trainer` with rollouts in a background thread on a copy of the actor.

    Args: as :class:`~turnrl.training.trainer.Trainer`; ``config.distributed`` gives ``max_staleness`` and
    ``rollout_device``. Call :meth:`close` at the end of a run (and on Ctrl-C) to stop the thread.

    """

    retries_out_of_memory = False  # its own step runs the update; the rollout thread shares the random state

    def __init__(
        self, config: TrainConfig, start_model: Path | str | None = None, rewards: Rewards | None = None
    ) -> None:
        super().__init__(config, start_model=start_model, rewards=rewards)
        dist = config.distributed
        self.max_staleness = dist.max_staleness
        self.rollout_device = resolve_device(dist.rollout_device) if dist.rollout_device else self.device
        # The copy samples; the trainer's actor trains and validates. Its own policy (and engine cache),
        # its own Rollout; the envs of train_groups are only ever used by the rollout thread.
        self.rollout_copy = copy.deepcopy(self.actor).to(self.rollout_device).eval().requires_grad_(False)
        batch_size = max(64, config.groups.n_groups * config.groups.group_size)
        policy = model_policy(self.rollout_copy, self.tokenizer, config.model, max_batch_size=batch_size,
                              processor=self.processor, dtype=self.dtype)
        assert isinstance(self.rollout, Rollout)  # Ray rollouts are refused with async_rollout (the config says)
        self.rollout = self.copy_rollout = Rollout(policy, self.rollout.fmt, config.agent, env_id=config.env.id,
                                                   executor=self.executor, rewards=self.rollout.rewards)
        self.weights = StagedWeights(self.actor, self.rollout_copy, version=self.first_step)
        self._batches: queue.Queue[RolloutBatch | RolloutFailure] = queue.Queue()
        self._stop = threading.Event()
        # Held for a whole rollout batch and for a whole validation: both seed torch's global generator and
        # score with the same (possibly stateful) reward functions.
        self._sampling = threading.Lock()
        self._thread: threading.Thread | None = None
        self._failure: RolloutFailure | None = None

    def rollout_precision(self) -> AbstractContextManager:
        return autocast(self.rollout_device, self.dtype)

    # ------------------------------------------------------------------ the rollout thread
    def _start(self, first_step: int) -> None:
        self._thread = threading.Thread(target=self._produce, args=(first_step, self.config.run.steps),
                                        name="turnrl-rollout", daemon=True)
        self._thread.start()

    def _produce(self, first_step: int, end_step: int) -> None:
        """Roll out steps ``first_step .. end_step - 1`` in order, each within the staleness bound."""
        step = first_step
        try:
            if self.rollout_device.type == "cuda":
                torch.cuda.set_device(self.rollout_device)  # the current device is per thread
            for step in range(first_step, end_step):
                wait_s = self.weights.wait_for(step - self.max_staleness, self._stop)
                if self._stop.is_set():
                    return
                version = self.weights.apply()
                with self._sampling:
                    output, keep = roll_out_batch(self.copy_rollout, self.train_groups, step, self.config,
                                                  self.rollout_precision())
                self._batches.put(RolloutBatch(step, output, keep, version, wait_s))
        except BaseException as error:  # noqa: BLE001 - every failure goes to the trainer, which raises it
            self._batches.put(RolloutFailure(step, error))

    def _next_batch(self, step: int) -> RolloutBatch:
        """The rollout of ``step`` (waiting for it); a failure of the rollout thread is raised here."""
        while self._failure is None:
            try:
                item = self._batches.get(timeout=1.0)
            except queue.Empty:
                if self._thread is not None and not self._thread.is_alive() and self._batches.empty():
                    raise RolloutThreadError(
                        f"no rollout for step {step}: the rollout thread has stopped (it rolls out the steps "
                        f"before run.steps={self.config.run.steps}, and close() stops it)") from None
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
    def step(self, step: int) -> StepOutput:
        """Take the rollout of ``step`` from the rollout thread, update on it, publish the new weights."""
        step_start = time.time()
        if self._thread is None:
            self._start(step)
        queued = self._batches.qsize()
        batch = self._next_batch(step)
        wait_rollout_s = time.time() - step_start
        self._timed("rollout_s", batch.output.metrics["timing/rollout_s"])
        self.measure_collapse(step, batch.output)
        output = self.update(step, batch.output, batch.keep) if batch.keep else batch.output
        publish_s = self.weights.publish(step + 1, changed=bool(batch.keep))
        output.metrics.update({
            "async/staleness": float(step - batch.weights_version),
            "async/weights_version": float(batch.weights_version),
            "async/wait_rollout_s": wait_rollout_s,
            "async/wait_weights_s": batch.wait_weights_s,
            "async/queue_size": float(queued),
            "async/publish_s": publish_s,
            "timing/step_s": time.time() - step_start,
        })
        return output

    def validate(self) -> StepOutput:
        """Validation on the trainer's actor, between two rollout batches (see the module's docstring)."""
        with self._sampling:
            return super().validate()

    def close(self, timeout_s: float = 60.0) -> None:
        """Stop the rollout thread: it ends after the batch in progress, which is dropped with the queued ones.

        Safe to call twice, and before any step.
        """
        self._stop.set()
        self.weights.wake()
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                console.print(f"the rollout thread is still finishing its batch after {timeout_s:.0f} s; "
                              "it is left to end with the process")
        while not self._batches.empty():
            self._batches.get_nowait()
        super().close()  # Ray env workers, when the envs live in them

"""The check after each weights sync: the rollout computes with the weights the trainer just made.

A rollout that silently keeps sampling with old weights trains on its own stale samples and nothing looks
wrong (LoRA adapters that never reached a peer's rollout engine went unnoticed for two months). So after a
backend hands its rollout side new weights, it compares a checksum of a few of the weights the rollout
computes with (the engine's merged, cast or fused buffers; a Ray worker's model) against the same weights of
the trainer's actor, computed the same way (:func:`turnrl.engine.weights.model_checksum`), and stops the run
with :class:`WeightsSyncError` when:

- they disagree beyond rounding: the rollout holds other weights than the trainer's, or
- the trainer's checksum moved since the last check (an optimizer step changed the probed weights) and the
  rollout's did not: the sync was skipped or did not reach what the rollout computes with.

A check reads five or so tensors (the first and last layers' attention and MLP projections, the LM head; LoRA
adapters merged as the engine merges them), summed on their device in float64; its seconds are reported as
``timing/weights_check_s``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch

from turnrl.engine.weights import WeightsChecksum, model_checksum
from turnrl.policy.interface import Policy
from turnrl.training.backends.backend import WeightsVersion

Trainer = TypeVar("Trainer")
"""What a check needs of the trainer's side of a version (its checksum, or its model)."""


class WeightsSyncError(RuntimeError):
    """The rollout's weights are not the trainer's after a sync: the run stops (see the module's docstring)."""


@dataclass(frozen=True)
class CheckedWeights:
    """Both sides' checksums at one check."""

    version: WeightsVersion
    trainer: WeightsChecksum
    rollout: WeightsChecksum


class WeightsCheck:
    """Compares each sync's rollout checksum with the trainer's, and with the previous sync's.

    Args:
        backend: names the rollout side in the error (``local``, ``sharded``, ``asynchronous``, ``ray worker 0``).
    """

    def __init__(self, backend: str) -> None:
        self.backend = backend
        self.last: CheckedWeights | None = None
        """The last check that passed."""

    def verify(self, version: WeightsVersion, trainer: WeightsChecksum, rollout: WeightsChecksum) -> None:
        """Raise :class:`WeightsSyncError` if the rollout does not hold ``version``'s weights (see the module)."""
        where = f"after the weights sync of version {version.updates} (step {version.steps}) on the {self.backend} " \
                "rollout backend"
        last = self.last
        if last is not None and trainer.total != last.trainer.total and rollout.total == last.rollout.total:
            raise WeightsSyncError(
                f"the rollout's weights did not change {where}: the trainer's actor changed since version "
                f"{last.version.updates} (checksum {last.trainer.total:.9g} -> {trainer.total:.9g}) but the rollout "
                f"still computes with checksum {rollout.total:.9g}, so it would sample with stale weights (LoRA "
                "adapters included). The transfer of the weights to the rollout side is broken: stop and fix it")
        if not rollout.agrees(trainer):
            raise WeightsSyncError(
                f"the rollout's weights differ from the trainer's actor {where}: checksum {rollout.total:.9g} against "
                f"{trainer.total:.9g} (norm {trainer.norm:.6g}, computed in {trainer.dtype}), so it would "
                "sample with other weights than the ones trained. The transfer of the weights to the rollout side "
                "is broken: stop and fix it")
        self.last = CheckedWeights(version, trainer, rollout)


class CheckSeconds:
    """The seconds the checksums and checks of a rollout side took, reported once each (``timing/weights_check_s``).
    Thread-safe: the asynchronous backends compute the trainer's checksum on its thread and check on their rollout
    thread."""

    def __init__(self) -> None:
        self._seconds = 0.0
        self._lock = threading.Lock()

    def add(self, seconds: float) -> None:
        with self._lock:
            self._seconds += seconds

    def metrics(self) -> dict[str, float]:
        """``timing/weights_check_s``: the seconds since the last call (empty if none were added)."""
        with self._lock:
            seconds, self._seconds = self._seconds, 0.0
        return {"timing/weights_check_s": seconds} if seconds else {}


class ExpectedWeights(Generic[Trainer]):
    """The trainer's weight versions noted for a rollout side and not taken yet, by ``steps``, each with what its
    check needs of the trainer (its checksum, or its model until the rollout's dtype is known). Thread-safe: the
    asynchronous backends note on the trainer's thread and take on their rollout thread."""

    def __init__(self) -> None:
        self._expected: dict[int, tuple[WeightsVersion, Trainer]] = {}
        self._lock = threading.Lock()

    def note(self, version: WeightsVersion, trainer: Trainer) -> None:
        """``version`` is the trainer's now."""
        with self._lock:
            self._expected[version.steps] = (version, trainer)

    def take(self, steps: int | None) -> tuple[WeightsVersion, Trainer] | None:
        """The version the rollout holds once it took the weights of ``steps`` (None: the latest noted), and
        every noted version up to it forgotten; None when none was noted since the last take."""
        with self._lock:
            newer = [s for s in self._expected if steps is None or s <= steps]
            if not newer:
                return None
            taken = self._expected[steps if steps in self._expected else max(newer)]
            for s in newer:
                del self._expected[s]
            return taken


class PolicyWeights:
    """The rollout side of a backend whose rollout is a :class:`~turnrl.policy.interface.Policy` of this process:
    it notes the trainer's weights (:meth:`expect`), and once the policy has them (:meth:`take`), stamps their
    version on the policy (every turn records it) and checks them (:class:`WeightsCheck`).

    :meth:`expect` computes the trainer's checksum when it is called (the asynchronous backend's trainer goes on
    training while the rollout takes the weights), except the first time: the rollout's dtype is not known yet,
    and the trainer's side is computed at the first :meth:`take`, before which the actor does not change.
    Thread-safe: the asynchronous backend expects on the trainer's thread and takes on its rollout thread.

    Args:
        policy: the rollout's policy.
        backend: names it in the error.
    """

    def __init__(self, policy: Policy, backend: str) -> None:
        self.policy = policy
        self.check = WeightsCheck(backend)
        self.dtype: torch.dtype | None = None
        """The rollout's compute dtype, from its first checksum: the trainer's side is cast to it."""
        self.expected: ExpectedWeights[WeightsChecksum | torch.nn.Module] = ExpectedWeights()
        """The versions noted and not taken yet, with the trainer's checksum (or its model, before the first
        take)."""
        self.seconds = CheckSeconds()

    def expect(self, model: torch.nn.Module, version: WeightsVersion) -> None:
        """The trainer holds ``version`` in ``model``: the rollout takes it next (its checksum computed now)."""
        start = time.perf_counter()
        trainer: WeightsChecksum | torch.nn.Module = model if self.dtype is None else model_checksum(model, self.dtype)
        self.expected.note(version, trainer)
        self.seconds.add(time.perf_counter() - start)

    def take(self, steps: int | None = None, parts: Sequence[int] | None = None) -> None:
        """The policy holds the weights of ``steps`` now (None: the latest noted); stamp and check them. The policy
        is one part, whatever ``parts`` says.

        Nothing to do when no newer version was noted. Call it between generations (the engine's buffers are
        brought up to date here).

        Raises:
            WeightsSyncError: the policy's weights are not the trainer's.
        """
        taken = self.expected.take(steps)
        if taken is None:
            return
        version, trainer = taken
        start = time.perf_counter()
        self.policy.weights_version = version.updates
        rollout = self.policy.weights_checksum()
        if rollout is not None:
            self.dtype = rollout.dtype
            if isinstance(trainer, torch.nn.Module):
                trainer = model_checksum(trainer, rollout.dtype)
            self.check.verify(version, trainer, rollout)
        self.seconds.add(time.perf_counter() - start)

    def metrics(self) -> dict[str, float]:
        """``timing/weights_check_s``: the checks' seconds since the last call (empty if none ran)."""
        return self.seconds.metrics()

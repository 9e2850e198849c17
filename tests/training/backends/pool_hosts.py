"""Rollout hosts for the rollout processes' tests (``distributed.rollout_host``): a real RolloutHost with one
behaviour changed, as a user's subclass would be named."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from turnrl.config import SamplingConfig
from turnrl.engine.weights import WeightsChecksum
from turnrl.rollout.ray_workers import RolloutHost, SlotSpec, WorkerResult

STOP_FILE_VARIABLE = "POOL_TEST_STOP_FILE"


def keep_own_weights(host: RolloutHost, version: int, weights: Iterable[tuple[str, torch.Tensor]]
                     ) -> WeightsChecksum | None:
    """Read a transfer whole, load none of it, and answer as if it had: a sync that never reaches the policy."""
    for _ in weights:
        pass
    host.version = version
    host.rollout.policy.weights_version = version
    return host.rollout.policy.weights_checksum()


class SkipsWeights(RolloutHost):
    """Takes the first weights, then reads every later transfer and keeps its own: a sync that never reaches the
    policy (the LoRA adapters a peer never sent)."""

    def load_weights(self, version: int, weights: Iterable[tuple[str, torch.Tensor]]) -> WeightsChecksum | None:
        if self.version is None:
            return super().load_weights(version, weights)
        return keep_own_weights(self, version, weights)


class FailsInStepTwo(RolloutHost):
    """Raises at its second batch (``fails_at``), as an env that breaks does."""

    fails_at = 2
    plays = 0

    def run(self, slots: Sequence[SlotSpec], sampling: SamplingConfig, seed: int) -> WorkerResult:
        self.plays += 1
        if self.plays == self.fails_at:
            raise RuntimeError("the env server went away")
        return super().run(slots, sampling, seed)


class FailsInStepFour(FailsInStepTwo):
    """Raises at its fourth batch."""

    fails_at = 4


class SkipsUpdateThreeOnRankTwo(RolloutHost):
    """Takes the weights of updates 1 and 2; in the second rollout process (launched rank 2 under one trainer) reads
    those of update 3 and keeps its own: a sync that never reaches the policy (the LoRA adapters a peer never
    sent)."""

    def load_weights(self, version: int, weights: Iterable[tuple[str, torch.Tensor]]) -> WeightsChecksum | None:
        if version == 3 and os.environ.get("RANK") == "2":
            return keep_own_weights(self, version, weights)
        return super().load_weights(version, weights)


class StopsTheRunInStepThree(RolloutHost):
    """Touches the run's stop file (its path in ``POOL_TEST_STOP_FILE``) as it starts playing step 3, which an
    asynchronous run plays ahead while step 2 updates: the run stops after step 2, step 3 played and not trained."""

    plays = 0

    def run(self, slots: Sequence[SlotSpec], sampling: SamplingConfig, seed: int) -> WorkerResult:
        self.plays += 1
        if self.plays == 3 and STOP_FILE_VARIABLE in os.environ:
            Path(os.environ[STOP_FILE_VARIABLE]).touch()
        return super().run(slots, sampling, seed)


class FailsTakingWeightsTwo(RolloutHost):
    """Raises amid the weights of update 2 (its third transfer, after step 2), having taken one tensor of them: the
    rest of the broadcast is still on its way."""

    transfers = 0

    def load_weights(self, version: int, weights: Iterable[tuple[str, torch.Tensor]]) -> WeightsChecksum | None:
        self.transfers += 1
        if self.transfers < 3:
            return super().load_weights(version, weights)
        next(iter(weights))
        raise RuntimeError("the GPU fell off the bus")


RUN_DIR_VARIABLE = "POOL_TEST_RUN_DIR"


def wait_for_step_record(step: int, timeout_s: float = 300.0) -> None:
    """Until the run's metrics (its directory in ``POOL_TEST_RUN_DIR``) hold step ``step``'s record: the trainer
    logs it after the step's update published its weights."""
    metrics = Path(os.environ[RUN_DIR_VARIABLE]) / "metrics.jsonl"
    deadline = time.monotonic() + timeout_s
    while not (metrics.is_file() and
               any(json.loads(line).get("step") == step and "rollout/success" in line
                   for line in metrics.read_text().splitlines())):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no record of step {step} in {metrics} after {timeout_s:g} s")
        time.sleep(0.05)


class NewWeightsMidStepTwo(RolloutHost):
    """Plays step 2 (played ahead with the weights of step 1, one update behind) up to its second round, then waits
    for the update of step 1 to be published before reporting that round's turn boundary: with partial rollouts
    the episodes in flight take those weights from their second turn on."""

    plays = 0

    def run(self, slots: Sequence[SlotSpec], sampling: SamplingConfig, seed: int) -> WorkerResult:
        self.plays += 1
        report = self.rollout.turn_boundary
        if self.plays == 2 and report is not None:
            rounds = 0

            def at_boundary(turns: int, part: int) -> None:
                nonlocal rounds
                rounds += 1
                if rounds == 2:
                    wait_for_step_record(1)
                report(turns, part)

            self.rollout.turn_boundary = at_boundary
        return super().run(slots, sampling, seed)


class SkipsWeightsMidStepTwo(NewWeightsMidStepTwo):
    """As :class:`NewWeightsMidStepTwo`, and reads the weights it is sent mid-batch but keeps its own: a partial
    rollout whose episodes would go on with stale weights."""

    def load_weights(self, version: int, weights: Iterable[tuple[str, torch.Tensor]]) -> WeightsChecksum | None:
        if self.plays != 2:
            return super().load_weights(version, weights)
        return keep_own_weights(self, version, weights)


class DiesInStepTwo(RolloutHost):
    """Exits at its second batch without a word, as a process the kernel kills does: the first rollout process
    alone (launched rank 1 under one trainer); the others play on."""

    plays = 0

    def run(self, slots: Sequence[SlotSpec], sampling: SamplingConfig, seed: int) -> WorkerResult:
        self.plays += 1
        if self.plays == 2 and os.environ.get("RANK") == "1":
            os._exit(3)
        return super().run(slots, sampling, seed)

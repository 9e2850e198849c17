"""Weight versions and the check after each weights sync, in the trainer on the tiny model: every turn records
the version of the weights that sampled it, a normal run (full weights and LoRA, the engine's buffers) passes the
check, and a sync that does not reach the rollout (skipped, or LoRA adapters left behind) stops the run naming
the backend and the version."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tests.training.backends.test_asynchronous import TIS, async_config, run_steps
from tests.training.trainer_runs import config, step_records, trajectories
from turnrl.engine.llm_engine import Engine
from turnrl.engine.weights import WeightRef, WeightsChecksum
from turnrl.training.backends.asynchronous import RolloutThreadError, StagedWeights
from turnrl.training.backends.backend import WeightsVersion
from turnrl.training.backends.weights_check import WeightsCheck, WeightsSyncError
from turnrl.training.commands import train
from turnrl.training.trainer import Trainer

ENGINE = ["model.backend=engine"]
LORA = ["lora.enabled=true", "lora.r=4", "lora.alpha=8", "algorithm.advantage=grpo"]


def turn_versions(records: list[dict]) -> set[int | None]:
    return {turn["weights_version"] for record in records for turn in record["turns"]}


# --------------------------------------------------------------------------- versions on turns
@pytest.mark.parametrize("backend", [[], ENGINE], ids=["hf", "engine"])
def test_turns_carry_the_version_of_the_weights_that_sampled_them(tiny_model_dir, tmp_path, backend):
    train(config(tiny_model_dir, tmp_path, *backend))
    run_dir = tmp_path / "run"
    assert turn_versions(trajectories(run_dir, 1)) == {0}  # step 1 sampled with the starting weights
    assert turn_versions(trajectories(run_dir, 2)) == {1}  # step 2 with those of the first update
    validations = {path.name: turn_versions([json.loads(line) for line in path.read_text().splitlines()])
                   for path in (run_dir / "trajectories").glob("val_*.jsonl")}
    assert validations == {"val_before_rl.jsonl": {0}, "val_after_rl.jsonl": {2}}
    steps = step_records(run_dir)
    assert steps[2]["timing/weights_check_s"] >= 0  # the sync before step 2 was checked, and timed


def test_an_asynchronous_run_s_turns_carry_the_version_they_were_sampled_with(tiny_model_dir, tmp_path):
    trainer = Trainer(async_config(tiny_model_dir, tmp_path, 1, *TIS))
    outputs = run_steps(trainer, 3)
    for step, output in enumerate(outputs):
        sampled_with = output.metrics["async/weights_version"]  # the steps' version; one update a step here
        assert {turn.weights_version for t in output.trajectories for turn in t.turns} == {sampled_with}, step
        assert sampled_with <= step


# --------------------------------------------------------------------------- the check passes on normal runs
ASYNC = ["distributed.async_rollout=true", *TIS]


@pytest.mark.parametrize("settings", [ENGINE, [*ENGINE, *LORA], LORA, [*ASYNC, *ENGINE, *LORA]],
                         ids=["engine", "engine-lora", "hf-lora", "async-engine-lora"])
def test_the_check_passes_when_the_rollout_follows_the_trainer(tiny_model_dir, tmp_path, settings):
    train(config(tiny_model_dir, tmp_path, *settings, "run.steps=3"))
    steps = step_records(tmp_path / "run")
    assert sorted(steps) == [1, 2, 3]
    assert any("timing/weights_check_s" in record for record in steps.values())


# --------------------------------------------------------------------------- a sync that does not arrive
def test_a_skipped_engine_sync_stops_the_run_naming_the_backend_and_the_version(tiny_model_dir, tmp_path,
                                                                                 monkeypatch):
    monkeypatch.setattr(Engine, "sync_weights", lambda self: None)  # the engine keeps the buffers it built
    with pytest.raises(WeightsSyncError, match=r"version 1 \(step 1\) on the local rollout backend"):
        train(config(tiny_model_dir, tmp_path, *ENGINE))


def keep_the_copy(self: StagedWeights, part: int | None = None) -> int:
    """:meth:`StagedWeights.apply` that moves the version and copies nothing: a transfer that is lost."""
    self._applied = dict.fromkeys(self._applied, self.version)
    return self.version


@pytest.mark.parametrize("lora", [[], LORA], ids=["full", "lora"])
def test_a_lost_asynchronous_transfer_stops_the_run(tiny_model_dir, tmp_path, monkeypatch, lora):
    # With LoRA only the adapters are staged: their loss is the rollout engine that never gets them.
    monkeypatch.setattr(StagedWeights, "apply", keep_the_copy)
    trainer = Trainer(async_config(tiny_model_dir, tmp_path, 0, *ENGINE, *lora))
    with pytest.raises(RolloutThreadError, match=r"WeightsSyncError: the rollout's weights did not change after the "
                                                 r"weights sync of version 1 \(step 1\) on the asynchronous"):
        run_steps(trainer, 2)


def test_lora_adapters_the_engine_never_merges_are_caught(tiny_model_dir, tmp_path, monkeypatch):
    """The engine's merged buffers left as they were built: the base weights without the trained adapters."""
    monkeypatch.setattr(WeightRef, "refresh", lambda self: False)
    with pytest.raises(WeightsSyncError, match="did not change after the weights sync of version 1"):
        train(config(tiny_model_dir, tmp_path, *ENGINE, *LORA))


# --------------------------------------------------------------------------- the comparison itself
def sums(total: float, norm: float = 100.0) -> WeightsChecksum:
    return WeightsChecksum(total, norm, torch.float32)


def test_the_check_compares_with_the_trainer_and_with_the_last_sync():
    check = WeightsCheck("local")
    check.verify(WeightsVersion(0, 0), sums(1.0), sums(1.0))
    check.verify(WeightsVersion(1, 0), sums(1.0), sums(1.0))  # nothing trained: nothing to change
    check.verify(WeightsVersion(2, 1), sums(2.0), sums(2.0 + 1e-6))  # rounding of another computation
    with pytest.raises(WeightsSyncError, match=r"did not change .* version 2 \(step 3\) on the local"):
        check.verify(WeightsVersion(3, 2), sums(3.0), sums(2.0 + 1e-6))
    with pytest.raises(WeightsSyncError, match=r"differ from the trainer's actor .* version 2 \(step 3\)"):
        check.verify(WeightsVersion(3, 2), sums(3.0), sums(3.5))
    with pytest.raises(WeightsSyncError, match="differ"):  # a released buffer has no weights
        check.verify(WeightsVersion(3, 2), sums(3.0), sums(math.nan, math.nan))



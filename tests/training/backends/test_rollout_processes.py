"""Disaggregated pools (``distributed.rollout_processes``): the last processes torchrun starts roll out, the others
train; gloo processes on the CPU, the tiny model, the reference run's settings (greedy: one process and several play
the same episodes)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.training import test_kill_points as kill_points
from tests.training.reference_run import (
    assert_same_metrics,
    run_config,
    run_train,
    step_records,
    train_in_process,
)
from tests.training.test_commands import overrides
from tests.training.test_kill_points import output, start
from turnrl.config import ConfigError
from turnrl.training.backends.pool_protocol import leave_stops_to_the_trainers
from turnrl.training.checkpoint import latest_checkpoint
from turnrl.training.commands import train

POOL = "tests.training.backends.pool_hosts"
ASYNC = ["distributed.async_rollout=true", "algorithm.old_logprobs=recompute", "algorithm.tis_cap=2.0"]


def pool(trainers: int, rollouts: int, *extra: str) -> list[str]:
    return [f"distributed.nproc_per_node={trainers + rollouts}", f"distributed.rollout_processes={rollouts}",
            "distributed.timeout_s=120", *extra]


def trajectories(run: Path, step: int) -> list[dict]:
    return [json.loads(line) for line in (run / "trajectories" / f"step_{step:06d}.jsonl").read_text().splitlines()]


def episodes(run: Path, step: int) -> list[tuple]:
    """Each episode's seed, group, reward and the tokens of its turns (what the policy said)."""
    return [(t["seed"], t["group"], t["sample"], t["total_reward"], [turn.get("response") for turn in t["turns"]])
            for t in trajectories(run, step)]


def played_as_one(single: Path, pool_run: Path) -> tuple[dict[int, dict], dict[int, dict]]:
    """The pool's run and the one-process run: the same steps, each with the same metrics and episodes; their
    step records."""
    one, two = step_records(single), step_records(pool_run)
    assert sorted(one) == sorted(two) and one
    for step in one:
        assert_same_metrics(one[step], two[step])
        assert episodes(single, step) == episodes(pool_run, step)
    return one, two


def ran(result) -> str:
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return " ".join(result.stdout.split())


STALENESS_0 = ["distributed.async_rollout=true", "distributed.max_staleness=0"]


def test_a_rollout_process_ignores_ctrl_c_and_sigterm_and_so_do_the_processes_it_starts():
    """The trainers decide when a pool stops; a job-wide SIGTERM also reaches the processes a rollout process starts
    (inductor's compile workers), which keep the signal ignored and live on."""
    previous = {number: signal.getsignal(number) for number in (signal.SIGINT, signal.SIGTERM)}
    try:
        leave_stops_to_the_trainers()
        signal.raise_signal(signal.SIGINT)
        signal.raise_signal(signal.SIGTERM)  # this process goes on
        ignored = "import signal; print(signal.getsignal(signal.SIGTERM) == signal.SIG_IGN)"
        child = subprocess.run([sys.executable, "-c", ignored], capture_output=True, text=True, timeout=60)
        assert child.stdout.strip() == "True", child.stdout + child.stderr
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def test_one_trainer_and_two_rollout_processes_train_as_one_process_until_one_skips_the_weights(tiny_model_dir,
                                                                                                tmp_path, single):
    """Two steps: the episodes, rewards and every step's metrics of the one-process run; the turns record the weights
    version they were played with. Then the second rollout process keeps its weights through the sync after step 3:
    the check of its checksum stops the run naming it, not the first. One launch for both: starting the three
    processes is most of its time."""
    result = run_train(tiny_model_dir, tmp_path, "pool", "run.steps=3",
                       *pool(1, 2, f"distributed.rollout_host={POOL}:SkipsUpdateThreeOnRankTwo"))
    said = " ".join((result.stdout + result.stderr).split())
    assert result.returncode != 0, said[-3000:]
    assert "1 trainer process and 2 rollout processes" in said
    one, two = played_as_one(single, tmp_path / "pool")
    assert sorted(one) == [1, 2]
    assert two[2]["timing/weights_check_s"] >= 0 and "pool/publish_s" in two[2]
    versions = {turn["weights_version"] for t in trajectories(tmp_path / "pool", 2) for turn in t["turns"]}
    assert versions == {1}  # step 2 played with the weights of the first update
    assert "WeightsSyncError: the rollout's weights did not change after the weights sync of version 3" in said, \
        said[-3000:]
    assert "pool (rollout process 2 (rank 2" in said and "rollout process 1 (rank 1" not in said, said[-3000:]


# 20 s; by default the processes play as one synchronously (train_as_one_process_until_one_skips_the_weights),
# the pool's asynchronous protocol runs one update behind (asynchronous_pool_one_update_behind_...), and partial
# rollouts equal full ones in process (test_partial_rollouts.py).
@pytest.mark.slow
def test_one_trainer_and_two_rollout_processes_asynchronous_with_no_staleness_train_as_one_process(
        tiny_model_dir, tmp_path, single):
    """Asynchronous with no staleness, with partial rollouts (no weights are published while a batch plays; without
    them the rollout processes report the same turn boundaries and take nothing there either): the episodes,
    rewards and every step's metrics of the one-process run; the turns record the weights version they were played
    with."""
    said = ran(run_train(tiny_model_dir, tmp_path, "pool", "run.steps=2",
                         *pool(1, 2, *STALENESS_0, "distributed.partial_rollouts=true")))
    assert "1 trainer process and 2 rollout processes" in said
    one, two = played_as_one(single, tmp_path / "pool")
    assert sorted(one) == [1, 2]
    assert two[2]["timing/weights_check_s"] >= 0
    assert "async/publish_s" in two[2]
    versions = {turn["weights_version"] for t in trajectories(tmp_path / "pool", 2) for turn in t["turns"]}
    assert versions == {1}  # step 2 played with the weights of the first update
    # The processes reported their rounds' turn boundaries; none took other weights there.
    assert two[2]["async/turns_behind_mean"] == 0 and two[2]["async/weight_switches"] == 0


# A rollout process waits at a boundary until the trainer logs step 1: a long wait on a busy machine.
PARTIAL = [*ASYNC, "distributed.max_staleness=1", "distributed.partial_rollouts=true", "run.steps=2",
           "distributed.timeout_s=600"]


# 31 s of four processes; by default the pool plays one update behind across processes
# (asynchronous_pool_one_update_behind) and partial rollouts equal full ones in process.
@pytest.mark.slow
def test_two_rollout_processes_take_weights_published_mid_batch_at_their_next_turn(tiny_model_dir, tmp_path,
                                                                                   monkeypatch):
    """Two FSDP trainers, two rollout processes, one update behind with partial rollouts: step 2 starts on the
    weights before update 1, and each process waits at its second round until update 1 is published: trainer 0
    sends it to that process alone, which plays the round with it (checked against the trainers' weights)."""
    monkeypatch.setenv("POOL_TEST_RUN_DIR", str(tmp_path / "pool"))
    ran(run_train(tiny_model_dir, tmp_path, "pool", *pool(2, 2, *PARTIAL),
                  f"distributed.rollout_host={POOL}:NewWeightsMidStepTwo"))
    record = step_records(tmp_path / "pool")[2]
    versions = [[turn["weights_version"] for turn in t["turns"]] for t in trajectories(tmp_path / "pool", 2)]
    assert all(v == [0, 1][:len(v)] for v in versions), versions  # each turn records the weights that sampled it
    halves = versions[:len(versions) // 2], versions[len(versions) // 2:]  # each process's groups
    assert all(any(len(v) == 2 for v in half) for half in halves), f"each process plays a second round: {versions}"
    turns = [version for v in versions for version in v]
    assert record["async/weight_switches"] == 2  # each process once
    assert record["async/staleness"] == 1 and record["async/weights_version"] == 0  # the oldest turn's
    assert record["async/turns_newer_weights_frac"] == pytest.approx(turns.count(1) / len(turns))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_rollout_processes_on_gpus_take_weights_mid_batch_over_nccl(tiny_model_dir, tmp_path, monkeypatch):
    """The test above on GPUs, one process a GPU: the weights go over the pool's NCCL group, broadcast to a lone
    rollout process (two GPUs) or sent point to point to each (three or more: two rollout processes)."""
    rollouts = min(2, torch.cuda.device_count() - 1)
    monkeypatch.setenv("POOL_TEST_RUN_DIR", str(tmp_path / "pool"))
    ran(run_train(tiny_model_dir, tmp_path, "pool", *pool(1, rollouts, *PARTIAL), "model.device=cuda",
                  f"distributed.rollout_host={POOL}:NewWeightsMidStepTwo"))
    record = step_records(tmp_path / "pool")[2]
    versions = [[turn["weights_version"] for turn in t["turns"]] for t in trajectories(tmp_path / "pool", 2)]
    assert all(v == [0, 1][:len(v)] for v in versions) and any(len(v) == 2 for v in versions), versions
    assert record["async/weight_switches"] == rollouts


@pytest.mark.slow  # 14 s; a skipped transfer between batches is caught in the default run (until_one_skips_the_weights)
def test_a_mid_batch_transfer_a_rollout_process_skips_stops_the_run(tiny_model_dir, tmp_path, monkeypatch):
    """A rollout process that reads the weights sent at its turn boundary and keeps its own is caught by the check
    of that process; the other one, still playing, does not hold the stop up (a stop sent to it would wait for
    distributed.timeout_s, an hour here, past this test's limit)."""
    monkeypatch.setenv("POOL_TEST_RUN_DIR", str(tmp_path / "pool"))
    result = run_train(tiny_model_dir, tmp_path, "pool", *pool(1, 2, *PARTIAL), "distributed.timeout_s=3600",
                       f"distributed.rollout_host={POOL}:SkipsWeightsMidStepTwo", timeout=300)
    said = " ".join(result.stdout.split()) + " ".join(result.stderr.split())
    assert result.returncode == 1, said[-3000:]
    assert "the rollout's weights did not change after the weights sync of version 1 (step 1) on the pool " \
           "(rollout process " in said, said[-3000:]


@pytest.mark.slow  # 20 s; by default each half: one trainer and two rollout processes, two FSDP trainers
def test_two_fsdp_trainers_and_one_rollout_process_train_as_one_process(tiny_model_dir, tmp_path, single):
    said = ran(run_train(tiny_model_dir, tmp_path, "pool", "run.steps=2", *pool(2, 1)))
    assert "2 trainer processes (FSDP) and 1 rollout process" in said
    played_as_one(single, tmp_path / "pool")
    assert (tmp_path / "pool" / "checkpoints" / "step_000002" / "optimizer" / ".metadata").is_file()  # DCP shards


@pytest.mark.slow  # 19 s; a VLM on images over two processes by default (tests/training/parallel/test_fsdp2.py)
def test_a_vlm_on_image_observations_rolls_out_in_a_rollout_process_as_in_one_process(tiny_vlm_dir, tmp_path):
    """The tiny VLM on image observations with a reference: the rollout process builds the model with its image
    processor, its episodes (images in every prompt) and every step's metrics are those of one process."""
    settings = ("run.steps=2", "env.settings.mode=image", "algorithm.kl_coef=0.05")
    single = train_in_process(tiny_vlm_dir, tmp_path, "single", *settings)
    said = ran(run_train(tiny_vlm_dir, tmp_path, "pool", *settings, *pool(1, 1)))
    assert "1 trainer process and 1 rollout process" in said
    one, _ = played_as_one(single, tmp_path / "pool")
    assert sorted(one) == [1, 2] and one[2]["vision/images_encoded"] > 0


@pytest.mark.slow  # two runs, one of three processes
def test_lora_adapters_reach_the_rollout_processes_merged(tiny_model_dir, tmp_path):
    """Two FSDP2 trainers of a LoRA actor and one rollout process: the adapted weights go merged from the shards
    (the checksum after each sync merges them as the engine does), and the run is the one-process run."""
    lora = ("lora.enabled=true", "lora.r=4", "lora.alpha=8", "algorithm.kl_coef=0.05", "algorithm.advantage=grpo",
            "run.steps=2")
    single = train_in_process(tiny_model_dir, tmp_path, "single", *lora)
    ran(run_train(tiny_model_dir, tmp_path, "pool", *lora, *pool(2, 1)))
    one, two = step_records(single), step_records(tmp_path / "pool")
    for step in one:
        assert_same_metrics(one[step], two[step])
        assert episodes(single, step) == episodes(tmp_path / "pool", step)
    assert one[2]["actor/grad_norm"] > 0


def test_asynchronous_pool_one_update_behind_corrects_with_importance_weights_until_its_process_fails(
        tiny_model_dir, tmp_path):
    """Three steps one update behind; then the rollout process raises in step 4 (played ahead while step 3 updates,
    its failure taken with that batch): the run stops naming it, with step 3 saved to resume from. One launch for
    both: starting the processes is most of its time."""
    result = run_train(tiny_model_dir, tmp_path, "pool", "run.steps=4", "run.save_every=1",
                       *pool(1, 1, *ASYNC, "distributed.max_staleness=1",
                             f"distributed.rollout_host={POOL}:FailsInStepFour"))
    said = " ".join(result.stdout.split())
    assert result.returncode != 0, said[-3000:] + result.stderr[-3000:]
    records = step_records(tmp_path / "pool")
    assert sorted(records) == [1, 2, 3]
    assert records[1]["async/staleness"] == 0
    assert records[2]["async/staleness"] == 1  # step 2 plays while update 1 runs
    for record in records.values():
        assert 0 < record["actor/tis_weight_mean"] <= 2.0 and "actor/tis_capped" in record
    assert records[3]["async/weights_version"] >= 1 and "async/publish_s" in records[3]
    # The rollout process took the published weights (each take checked against the trainer's checksum).
    versions = [{turn["weights_version"] for t in trajectories(tmp_path / "pool", step) for turn in t["turns"]}
                for step in (1, 2, 3)]
    assert versions[0] == {0} and versions[2] <= {1, 2} and versions[2] != {0}
    assert "rollout process 1 (rank 1, pid" in said, said[-3000:]
    assert "failed during play: RuntimeError: the env server went away" in said, said[-3000:]
    assert "stopped by the error above after step 3 of 4" in said, said[-3000:]  # a checkpoint to resume from
    assert (tmp_path / "pool" / "checkpoints" / "step_000003").is_dir()


@pytest.mark.slow  # 19 s; by default a rollout process that skips the weights stops the run (the second of two, in
# the launch of train_as_one_process_until_one_skips_the_weights)
def test_a_rollout_process_that_skips_the_weights_stops_the_run(tiny_model_dir, tmp_path):
    result = run_train(tiny_model_dir, tmp_path, "pool", "run.steps=2",
                       *pool(1, 1, f"distributed.rollout_host={POOL}:SkipsWeights"))
    assert result.returncode != 0
    said = " ".join((result.stdout + result.stderr).split())
    assert "WeightsSyncError: the rollout's weights did not change after the weights sync of version 1" in said
    assert "pool (rollout process 1 (rank 1" in said


@pytest.mark.slow  # 21 s; by default a rollout process that fails is named in an asynchronous run
# (asynchronous_pool_one_update_behind_..._until_its_process_fails), and a synchronous run stops on a lost rollout
# worker with its checkpoint (tests/training/test_trainer_resume.py, a_run_stopped_by_a_lost_rollout_worker_...)
def test_a_rollout_process_that_fails_stops_the_run_naming_it(tiny_model_dir, tmp_path):
    result = run_train(tiny_model_dir, tmp_path, "pool", "run.steps=3", "run.save_every=1",
                       *pool(1, 1, f"distributed.rollout_host={POOL}:FailsInStepTwo"))
    assert result.returncode != 0
    said = " ".join(result.stdout.split())
    assert "rollout process 1 (rank 1, pid" in said
    assert "failed during play: RuntimeError: the env server went away" in said
    assert "stopped by the error above after step 1 of 3" in said  # a checkpoint to resume from
    assert (tmp_path / "pool" / "checkpoints" / "step_000001").is_dir()


@pytest.mark.slow  # 21 s; a rollout process that fails is named by default (until_its_process_fails)
def test_a_rollout_process_that_dies_in_an_asynchronous_batch_is_named_at_once(tiny_model_dir, tmp_path):
    """Its channel closes: the receive from it fails at once (not after distributed.timeout_s, an hour here, past
    this test's limit), and the run stops naming it, with the last finished step saved."""
    result = run_train(tiny_model_dir, tmp_path, "pool", "run.steps=3", "run.save_every=1",
                       *pool(1, 2, *ASYNC, "distributed.max_staleness=0", "distributed.timeout_s=3600",
                             f"distributed.rollout_host={POOL}:DiesInStepTwo"), timeout=300)
    said = " ".join(result.stdout.split())
    assert result.returncode != 0, said[-3000:]
    assert "rollout process 1 (rank 1, pid" in said and "died during play, or stopped answering" in said, \
        said[-3000:] + result.stderr[-3000:]
    assert (tmp_path / "pool" / "checkpoints" / "step_000001").is_dir()


@pytest.mark.slow  # 39 s; by default a skipped transfer stops the run (until_one_skips_the_weights) and an asynchronous
# run killed mid-step resumes each episode once (test_asynchronous_resume.py)
def test_a_failed_weights_transfer_stops_every_trainer_and_the_resume_trains_each_step_once(tiny_model_dir,
                                                                                           tmp_path):
    """Two trainers; the rollout process raises amid the weights after step 2 (the update done, the broadcast
    half received): both trainers stop on it (none waits in a collective of its own), no checkpoint holds the
    updated weights under step 1, and the resume trains steps 2 and 3 once each."""
    settings = ["run.steps=3", "run.save_every=1", *pool(2, 1)]
    result = run_train(tiny_model_dir, tmp_path, "pool", *settings,
                       f"distributed.rollout_host={POOL}:FailsTakingWeightsTwo")
    said = " ".join(result.stdout.split())
    assert result.returncode == 1, said[-3000:] + result.stderr[-3000:]
    assert "rollout process 1 (rank 2, pid" in said and \
        "failed during take weights: RuntimeError: the GPU fell off the bus" in said, said[-3000:]
    assert "after step 1 of 3; no checkpoint after it: the last is step_000001" in said, said[-3000:]
    assert sorted(p.name for p in (tmp_path / "pool" / "checkpoints").glob("step_*")) == ["step_000001"]
    ran(run_train(tiny_model_dir, tmp_path, "pool", *settings, f"resume={tmp_path / 'pool'}",
                  "distributed.rollout_host=turnrl.rollout.ray_workers:RolloutHost"))
    records = [json.loads(line) for line in (tmp_path / "pool" / "metrics.jsonl").read_text().splitlines()]
    assert sorted(r["step"] for r in records if "rollout/success" in r) == [1, 2, 3]  # each step trained once


@pytest.mark.slow  # 24 s; by default a SIGTERM to torchrun is tested with FSDP trainers
# (test_fsdp2.py, a_sigterm_to_the_command) and a rollout process's ignoring it here (ignores_ctrl_c_and_sigterm)
def test_a_sigterm_to_torchrun_stops_a_pool_after_the_step_in_progress_with_its_checkpoint(tiny_model_dir, tmp_path,
                                                                                            capsys):
    """torchrun forwards SIGTERM (a batch scheduler's) to every process it started: the rollout process leaves the
    stop to the trainer, which finishes the step in progress, saves it and stops the pool; the resume continues
    from that checkpoint with every record once."""
    run = tmp_path / "run"
    process = start(tmp_path, *overrides(tiny_model_dir, tmp_path, "run.steps=6", "run.save_every=1", *pool(1, 1)))
    launcher = Path(f"/proc/{process.pid}/task/{process.pid}/children")
    deadline = time.monotonic() + 300
    while kill_points.step_records(run) < 1 or not launcher.read_text().split():
        assert process.poll() is None and time.monotonic() < deadline, output(tmp_path)[-3000:]
        time.sleep(0.05)
    recorded = kill_points.step_records(run)
    os.kill(int(launcher.read_text().split()[0]), signal.SIGTERM)  # torchrun's, as a scheduler's would land
    process.wait(timeout=300)
    said = " ".join(output(tmp_path).split())
    assert "SIGTERM: stopping after this step" in said, said[-3000:]
    done = latest_checkpoint(run)
    # The signal lands in step 1's tail (its record written, its checkpoint not yet) or in step 2: either way the
    # step in progress finishes, is saved, and nothing is recorded after it.
    assert done is not None and int(done.name[5:]) >= recorded, said[-3000:]
    assert kill_points.step_records(run) == int(done.name[5:]) < 6, said[-3000:]
    assert f"interrupted after step {int(done.name[5:])} of 6" in said, said[-3000:]
    assert "rollout process" not in said.split("SIGTERM", 1)[1], said[-3000:]  # none failed or was lost
    status, text = kill_points.resume(run, 6, capsys)
    assert status == 0, text
    kill_points.assert_whole(run, 6)


def worker_of_rank(launcher_pid: int, rank: int) -> int | None:
    """The pid of torchrun's worker process of ``rank`` (from its environment), if it has started."""
    for pid in Path(f"/proc/{launcher_pid}/task/{launcher_pid}/children").read_text().split():
        try:
            environment = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except (FileNotFoundError, ProcessLookupError):  # a short-lived child, gone
            continue
        if f"RANK={rank}".encode() in environment:
            return int(pid)
    return None


@pytest.mark.slow  # two runs of four processes, about two minutes on two cores
def test_a_pool_whose_trainer_0_is_killed_mid_step_resumes_to_every_planned_step_once(tiny_model_dir, tmp_path,
                                                                                      capsys):
    """Two FSDP2 trainers and two rollout processes, one update behind with partial rollouts: trainer 0 SIGKILLed
    after step 2's record (step 3 updating, step 4 in play, weights in flight to a rollout process maybe); torchrun
    stops the others. The resume trains every planned step once, each step's episodes once."""
    run = tmp_path / "run"
    settings = pool(2, 2, *ASYNC, "distributed.max_staleness=1", "distributed.partial_rollouts=true")
    process = start(tmp_path, *overrides(tiny_model_dir, tmp_path, "run.steps=5", "run.save_every=1", *settings))
    launcher = Path(f"/proc/{process.pid}/task/{process.pid}/children")
    deadline = time.monotonic() + 300
    trainer = None
    while kill_points.step_records(run) < 2 or trainer is None:
        assert process.poll() is None and time.monotonic() < deadline, output(tmp_path)[-3000:]
        torchrun = launcher.read_text().split()
        trainer = worker_of_rank(int(torchrun[0]), 0) if torchrun else None
        time.sleep(0.02)
    os.kill(trainer, signal.SIGKILL)
    process.wait(timeout=300)
    assert process.returncode != 0, output(tmp_path)[-3000:]
    assert kill_points.step_records(run) < 5, "the run ended before the kill"
    status, text = kill_points.resume(run, 5, capsys)
    assert status == 0, text
    kill_points.assert_whole(run, 5)


@pytest.mark.slow  # three runs of two (or four) processes, one (or three) minutes on two cores
@pytest.mark.parametrize("processes", [(1, 1, []), (2, 2, ["distributed.partial_rollouts=true"])],
                         ids=["one-and-one", "two-and-two-partial"])
def test_an_asynchronous_pool_stopped_and_resumed_trains_each_planned_step_once(tiny_model_dir, tmp_path,
                                                                              monkeypatch, processes):
    """The stop file touched as a rollout process starts step 3 (played ahead while step 2 updates): the run stops
    after step 2 and drops step 3; the resumed run plays steps 3 and 4 on the seeds and groups the uninterrupted run
    plays."""
    trainers, rollouts, extra = processes
    settings = [*pool(trainers, rollouts, *ASYNC, "distributed.max_staleness=1", *extra), "run.steps=4",
                "run.save_every=1"]
    ran(run_train(tiny_model_dir, tmp_path, "whole", *settings))
    monkeypatch.setenv("POOL_TEST_STOP_FILE", str(tmp_path / "run" / "stop"))
    stopped = run_train(tiny_model_dir, tmp_path, "run", *settings,
                        f"distributed.rollout_host={POOL}:StopsTheRunInStepThree")
    said = " ".join(stopped.stdout.split())
    assert "interrupted after step 2 of 4" in said, said[-3000:]
    # Step 4 too, where step 3 finished during the save.
    assert "rollouts played ahead and not trained, dropped: step 3 " in said or \
        "rollouts played ahead and not trained, dropped: steps 3, 4 " in said
    monkeypatch.delenv("POOL_TEST_STOP_FILE")
    ran(run_train(tiny_model_dir, tmp_path, "run", *settings, f"resume={tmp_path / 'run'}"))
    whole, resumed = step_records(tmp_path / "whole"), step_records(tmp_path / "run")
    assert sorted(whole) == sorted(resumed) == [1, 2, 3, 4]  # every step logged once
    for step in whole:
        played = sorted((t["group"], t["seed"], t["sample"]) for t in trajectories(tmp_path / "run", step))
        assert played == sorted((t["group"], t["seed"], t["sample"]) for t in trajectories(tmp_path / "whole", step))
        assert resumed[step]["batch/samples"] == len(played)
    config = run_config(tiny_model_dir, tmp_path, "run", *settings)
    assert config.groups.n_groups * config.groups.group_size == len(played)


def test_settings_a_pool_cannot_run_are_refused_in_one_line(tiny_model_dir, tmp_path):
    with pytest.raises(ConfigError, match="leaves no process to train: set distributed.nproc_per_node=3"):
        run_config(tiny_model_dir, tmp_path, "pool", "distributed.nproc_per_node=2", "distributed.rollout_processes=2")
    with pytest.raises(ConfigError, match="are processes of torchrun: set distributed.nproc_per_node=2"):
        train(run_config(tiny_model_dir, tmp_path, "pool", "distributed.rollout_processes=1",
                         "distributed.nproc_per_node=2"))

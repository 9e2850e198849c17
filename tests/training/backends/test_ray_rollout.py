"""The Ray backend: the trainer's weights reach the workers with the next rollout (none after a run's last step),
the step that sent them reports the transfer and its check (a transfer that does not arrive stops the run), and
``turnrl train distributed.backend=ray`` is the one-process run, and stops with a checkpoint that resumes when a
worker dies."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

import pytest
import torch

from tests.training.reference_run import ARGS, assert_same_metrics, run_config, run_train, step_records
from turnrl.envs import make
from turnrl.envs.seeds import SeedSplits
from turnrl.models.loading import load_model
from turnrl.rollout import ray_workers as ray_workers_module
from turnrl.rollout.groups import EnvGroups
from turnrl.rollout.ray_workers import policy_weights
from turnrl.rollout.trajectory import Trajectory
from turnrl.training.backends.backend import EpisodeRunner, WeightsVersion
from turnrl.training.backends.ray_rollout import RayBackend, ray_workers
from turnrl.training.backends.weights_check import WeightsSyncError
from turnrl.training.checkpoint import latest_checkpoint


# Every test here on one pytest-xdist worker (the Makefile's --dist loadgroup): a run joins its cluster with
# address `auto`, the cluster started last on the machine, which a second worker's module fixture would be.
pytestmark = pytest.mark.xdist_group("ray_cluster")


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray cluster of two CPUs, started as a user would (``ray start --head``); a run joins it with
    ``distributed.ray_address=auto``, as on the head machine of a cluster.

    Its folder is a short one of its own under /tmp, not pytest's: Ray puts Unix sockets in
    ``<temp>/session_<date>_<time>_<micros>_<pid>/sockets/``, and a socket's path may not pass 107 bytes, which
    pytest's numbered folders (``/tmp/pytest-of-<user>/pytest-<n>/popen-gw0/ray0``) did once ``n`` had five
    digits."""
    pytest.importorskip("ray")
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    temp = tempfile.mkdtemp(prefix="ray-", dir="/tmp" if Path("/tmp").is_dir() else None)
    ray_bin = str(Path(sys.executable).parent / "ray")
    started = subprocess.run([ray_bin, "start", "--head", f"--port={port}", "--num-cpus=2", "--include-dashboard=false",
                              f"--temp-dir={temp}", "--disable-usage-stats"], capture_output=True, text=True)
    assert started.returncode == 0, started.stderr[-2000:]
    yield "auto"
    stop_cluster(temp, port)
    shutil.rmtree(temp, ignore_errors=True)


def stop_cluster(temp_dir: str, port: int) -> None:
    """Stop the cluster that ``ray start --temp-dir=temp_dir --port=port`` started, and only it: its head's
    processes name the temp dir or the port on their command lines, and its agents and workers are their
    children (renamed ``ray::...``). ``ray stop --force`` would stop every Ray process on the machine, such as
    the local clusters of tests running beside this one."""
    import psutil

    this_port = re.compile(rf":{port}(?!\d)")
    ours = {os.getpid(), *(process.pid for process in psutil.Process().parents())}
    heads = [process for process in psutil.process_iter(["cmdline"]) if process.pid not in ours
             and any(temp_dir in part or this_port.search(part) for part in process.info["cmdline"] or [])]
    processes = list(heads)
    for head in heads:
        with contextlib.suppress(psutil.Error):
            processes.extend(head.children(recursive=True))
    for process in processes:
        with contextlib.suppress(psutil.Error):
            process.terminate()
    # The head's GCS server and monitor do not end on a SIGTERM (not within 15 s), and the processes they have not
    # reaped stay listed with them: a longer wait than a second only puts the kill off.
    _, alive = psutil.wait_procs(processes, timeout=1)
    for process in alive:
        with contextlib.suppress(psutil.Error):
            process.kill()



@pytest.mark.slow  # about 40 s; the kept handler is checked in the default run (test_ray.py, ray.init's handler)
def test_a_sigterm_to_a_run_on_ray_workers_stops_after_the_step_with_a_checkpoint(tiny_model_dir, tmp_path,
                                                                                   ray_cluster):
    """ray.init puts a SIGTERM handler of its own in (it ends the process at once); the run keeps its own, and a
    scheduler's SIGTERM saves the step in progress as without Ray."""
    from tests.training.test_commands import kinds, turnrl_train, wait_for

    run = tmp_path / "run"
    process = turnrl_train(f"model.path={tiny_model_dir}", f"run.output_dir={tmp_path}", "run.name=run", *ARGS,
                           "run.steps=200", "distributed.backend=ray", "distributed.rollout_workers=1",
                           f"distributed.ray_address={ray_cluster}")
    try:
        wait_for(lambda: (run / "metrics.jsonl").is_file() and any(kind == "step" for _, kind in kinds(run)),
                 "first step", process)
        process.send_signal(signal.SIGTERM)
        out, err = process.communicate(timeout=240)
    finally:
        process.kill()
    text = " ".join((out + err).split())
    assert process.returncode == 128 + signal.SIGTERM, text[-3000:]
    assert "SIGTERM: stopping after this step" in text, text[-3000:]
    assert latest_checkpoint(run) is not None and f"continue with: turnrl train resume={run}" in text

def test_weights_reach_the_workers_with_the_next_rollout_whose_metrics_report_the_transfer_and_its_check(
        tiny_model_dir, tiny_tokenizer, tmp_path, ray_cluster, monkeypatch):
    import ray

    config = run_config(tiny_model_dir, tmp_path, "ray", "distributed.backend=ray", "distributed.rollout_workers=1",
                        f"distributed.ray_address={ray_cluster}")
    workers = ray_workers(config, tiny_model_dir, tiny_tokenizer, batch_size=8)
    backend = RayBackend(workers, nullcontext)
    actor = load_model(tiny_model_dir).eval()
    slots = EnvGroups(lambda: make("FrozenLake"), 1, 1, SeedSplits()).train_slots(0)

    def play(runner: EpisodeRunner, step: int, precision: AbstractContextManager) -> list[Trajectory]:
        with precision:
            return runner.run(slots, config.sampling)

    try:
        assert backend.set_weights(actor, WeightsVersion(0, 0)) == {}
        assert workers.version is None  # noted, not sent: no rollout has asked for them yet
        first = backend.roll_out(0, play)
        assert workers.version == 0 and first.metrics["ray/weights_sync_s"] > 0 and len(first.played) == 1
        assert first.metrics["timing/weights_check_s"] > 0  # the worker's checksum checked against the actor's
        assert {turn.weights_version for turn in first.played[0].turns} == {0}
        backend.set_weights(actor, WeightsVersion(1, 0))  # a step that left the weights as they were
        assert backend.roll_out(1, play).metrics == {}
        backend.set_weights(actor, WeightsVersion(2, 1))  # the last step of a run, or one before a stop
        assert workers.version == 0
        backend.run(slots, config.sampling)  # episodes played outside a step get them too
        assert workers.version == 1

        # A transfer that does not reach the workers (the weights sent never change, as with LoRA adapters left out
        # of them): the worker's checksum stays, the actor's moved, and the rollout stops naming the worker.
        sent = policy_weights(actor)
        monkeypatch.setattr(ray_workers_module, "policy_weights", lambda model, dtype=None: sent)
        with torch.no_grad():
            for parameter in actor.parameters():
                parameter.add_(0.01)
        backend.set_weights(actor, WeightsVersion(3, 2))
        with pytest.raises(WeightsSyncError, match=r"did not change .* version 2 \(step 3\) on the ray \(worker 0\)"):
            backend.roll_out(3, play)
    finally:
        backend.close()
        ray.shutdown()


def test_ray_rollout_workers_train_as_one_process(tiny_model_dir, tmp_path, ray_cluster, single):
    """``distributed.backend=ray`` on a running cluster: two rollout actors play the groups and get the new
    weights before each rollout; the run is the single-process run."""
    ray_run = run_train(tiny_model_dir, tmp_path, "ray", "run.steps=2", "distributed.backend=ray",
                        "distributed.rollout_workers=2", f"distributed.ray_address={ray_cluster}")
    assert ray_run.returncode == 0, ray_run.stdout[-2000:] + ray_run.stderr[-3000:]
    one, two = step_records(single), step_records(tmp_path / "ray")
    for step in one:
        assert_same_metrics(one[step], two[step])
        assert two[step]["ray/weights_sync_s"] > 0  # the first weights, then those of update 1


@pytest.mark.slow
def test_a_dead_rollout_worker_stops_the_run_with_a_checkpoint_that_resumes(tiny_model_dir, tmp_path, ray_cluster):
    """Kill a Ray rollout worker after the first checkpoint: the run saves the last finished step, says how to
    resume and exits; resuming finishes the run."""
    command = [sys.executable, "-m", "turnrl.cli", "train", f"model.path={tiny_model_dir}",
               f"run.output_dir={tmp_path}", "run.name=ray", *ARGS, "run.steps=6", "run.save_every=1",
               "distributed.backend=ray", "distributed.rollout_workers=2", f"distributed.ray_address={ray_cluster}",
               "distributed.timeout_s=300"]
    run = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})
    first = tmp_path / "ray" / "checkpoints" / "step_000001"
    deadline = time.time() + 300
    while not first.is_dir() and time.time() < deadline and run.poll() is None:
        time.sleep(0.5)
    if not first.is_dir():
        run.kill()
        pytest.fail(f"no checkpoint after the first step: {run.communicate()[0][-3000:]}")
    # Ray names an actor's process after its class.
    workers = subprocess.run(["pgrep", "-f", "ray::RolloutHost"], capture_output=True, text=True).stdout.split()
    assert len(workers) == 2, workers
    os.kill(int(workers[1]), signal.SIGKILL)
    output, _ = run.communicate(timeout=240)
    text = " ".join(output.split())
    assert run.returncode == 1, output[-3000:]  # a fault, with a checkpoint and how to resume
    assert "rollout stopped" in text and "stopped by the error above" in text and "turnrl train resume=" in text
    resumed = run_train(tiny_model_dir, tmp_path, "ray", "run.steps=6", "distributed.backend=ray",
                        "distributed.rollout_workers=2", f"distributed.ray_address={ray_cluster}",
                        f"resume={tmp_path / 'ray'}")
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    assert sorted(step_records(tmp_path / "ray"))[-1] == 6

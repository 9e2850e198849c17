"""Stopping and resuming an RL run: time limits, Ctrl-C, SIGTERM, lost workers, out of memory, damaged checkpoints."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
import torch._inductor.config as inductor_config
from safetensors.torch import load_file

from tests.training.trainer_runs import (
    COMMON,
    base_weights,
    comparable,
    config,
    records,
    step_records,
)
from turnrl.cli import main
from turnrl.config import ConfigError, load_config
from turnrl.rollout.ray_workers import RolloutWorkerError
from turnrl.training.commands import GracefulStop, train
from turnrl.training.schedules import kl_adaptive_scale
from turnrl.training.train_config import TrainConfig
from turnrl.training.trainer import Trainer


# --------------------------------------------------------------------------- a time limit
def test_a_time_limit_ends_the_run_as_a_finished_one_and_a_resume_goes_on(tiny_model_dir, tmp_path, capsys):
    run = tmp_path / "run"
    summary = train(config(tiny_model_dir, tmp_path, "run.steps=4", "run.time_limit_minutes=1e-6"))
    assert summary["steps"] == 1 and summary["stopped_by"] == "time_limit"
    assert summary["time_limit"] == {"minutes": 1e-6, "step": 1}
    assert "time limit of 1e-06 minutes reached after step 1" in " ".join(capsys.readouterr().out.split())
    assert (run / "checkpoints" / "latest").read_text() == "step_000001"
    logged = records(run)
    assert max(r["step"] for r in logged) == 1 and "val/success" in logged[-1]  # validated after its last step
    assert json.loads((run / "summary.json").read_text())["time_limit"]["step"] == 1
    assert "after step 1: 1e-06 minutes" in (run / "report.html").read_text()
    summary = train(config(tiny_model_dir, tmp_path, "run.steps=4", f"resume={run}"))  # no limit this time
    assert summary["steps"] == 4 and "stopped_by" not in summary and "time_limit" not in summary
    assert sorted(step_records(run)) == [1, 2, 3, 4]


def test_a_run_stopped_right_after_a_validation_ends_with_it_and_logs_the_step_once(tiny_model_dir, tmp_path):
    """The step's validation saw the final weights: validating again would cost its time and log a second
    record of the step (which a mean over the last validations would count twice)."""
    run = tmp_path / "run"
    summary = train(config(tiny_model_dir, tmp_path, "run.steps=4", "run.time_limit_minutes=1e-6",
                           "validation.every=1"))
    assert summary["steps"] == 1
    at_step_1 = [r for r in records(run) if r["step"] == 1]
    assert len(at_step_1) == 1 and "rollout/success" in at_step_1[0]
    assert summary["val_success_after_rl"] == at_step_1[0]["val/success"]
    assert summary["val_after_rl"]["val/episodes"] == at_step_1[0]["val/episodes"]
    assert (run / "trajectories" / "val_after_rl.jsonl").read_text().strip()


# --------------------------------------------------------------------------- Ctrl-C
def test_graceful_stop_asks_first_and_interrupts_on_the_second_ctrl_c():
    with GracefulStop() as stop:
        signal.raise_signal(signal.SIGINT)
        assert stop.requested
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_sigterm_delivered_twice_at_once_is_one_request_and_a_later_one_interrupts(monkeypatch):
    """A scheduler signals every process and torchrun forwards it too: SIGTERMs milliseconds apart ask once; one
    after the window interrupts, and a Ctrl-C after a SIGTERM interrupts at once."""
    monkeypatch.setattr(GracefulStop, "SAME_SIGTERM_S", 0.5)
    with GracefulStop() as stop:
        signal.raise_signal(signal.SIGTERM)
        signal.raise_signal(signal.SIGTERM)
        assert stop.requested and stop.signal is signal.SIGTERM
        time.sleep(0.6)
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGTERM)
    with GracefulStop() as stop:
        signal.raise_signal(signal.SIGTERM)
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)


def test_a_sigterm_makes_the_process_compile_in_itself_and_ctrl_c_leaves_the_compile_workers():
    """A job-wide SIGTERM kills inductor's compile workers, and a compile handed to them then waits forever: from the
    first SIGTERM on the process compiles in itself. Ctrl-C, which the workers ignore, leaves them their work."""
    with inductor_config.patch(compile_threads=8):
        with GracefulStop():
            signal.raise_signal(signal.SIGINT)
        assert inductor_config.compile_threads == 8
        with GracefulStop(phase="end"):
            signal.raise_signal(signal.SIGTERM)
        assert inductor_config.compile_threads == 1


def test_ctrl_c_saves_a_checkpoint_and_the_resumed_run_logs_every_step_once(tiny_model_dir, tmp_path, monkeypatch,
                                                                             capsys):
    extra = ["algorithm.advantage=grpo", "run.steps=3", "run.save_every=0", "run.keep_checkpoints=1"]
    step = Trainer.step

    def step_then_ctrl_c(self, index):
        output = step(self, index)
        if index == 0:
            signal.raise_signal(signal.SIGINT)  # arrives during the first step
        return output

    monkeypatch.setattr(Trainer, "step", step_then_ctrl_c)
    summary = train(config(tiny_model_dir, tmp_path, *extra))
    monkeypatch.setattr(Trainer, "step", step)
    run = tmp_path / "run"
    assert summary["interrupted_at_step"] == 1
    assert (run / "checkpoints" / "latest").read_text() == "step_000001"
    out = capsys.readouterr().out
    # One numbering: the step in the message is the checkpoint's and the last one in metrics.jsonl.
    assert f"interrupted after step 1 of 3; checkpoint {run / 'checkpoints' / 'step_000001'}" in out
    assert [r["step"] for r in records(run)] == [0, 1]
    assert sorted((run / "trajectories").glob("step_*[0-9].jsonl")) == [run / "trajectories" / "step_000001.jsonl"]
    assert f"turnrl train resume={run}" in out
    assert not (run / "summary.json").exists()
    # The stopped run had logged step 1; a record past the checkpoint (as a crash leaves) is dropped too.
    with (run / "metrics.jsonl").open("a") as file:
        file.write(json.dumps({"step": 2, "rollout/success": 0.0}) + "\n")
    summary = train(config(tiny_model_dir, tmp_path, *extra, f"resume={run}"))
    steps = [r["step"] for r in records(run) if "rollout/success" in r]
    assert steps == [1, 2, 3]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step_000003"]  # keep last 1
    total = json.loads((run / "summary.json").read_text())["total_s"]
    # Resuming a finished run changes nothing.
    again = train(config(tiny_model_dir, tmp_path, *extra, f"resume={run}"))
    assert json.loads((run / "summary.json").read_text())["total_s"] == total == again["total_s"]
    assert [r["step"] for r in records(run) if "rollout/success" in r] == [1, 2, 3]


def test_a_second_ctrl_c_stops_at_once_and_says_where_to_resume(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """The step in progress is lost; the last complete checkpoint is named (it said only "interrupted")."""
    extra = ["algorithm.advantage=grpo", "run.steps=3", "run.save_every=1"]
    step = Trainer.step

    def two_ctrl_c_in_the_second_step(self, index):
        if index == 1:
            signal.raise_signal(signal.SIGINT)  # stop after this step...
            signal.raise_signal(signal.SIGINT)  # ...no: at once
        return step(self, index)

    monkeypatch.setattr(Trainer, "step", two_ctrl_c_in_the_second_step)
    with pytest.raises(KeyboardInterrupt):
        train(config(tiny_model_dir, tmp_path, *extra))
    run = tmp_path / "run"
    words = " ".join(capsys.readouterr().out.split())
    assert (f"stopped at once, the step in progress unsaved; then continue from step_000001 (intact) with "
            f"`turnrl train resume={run}`") in words
    assert [r["step"] for r in records(run) if "rollout/success" in r] == [1]


def test_an_rl_step_out_of_gpu_memory_stops_the_run_with_what_to_set_and_where_to_resume(tiny_model_dir, tmp_path,
                                                                                        monkeypatch):
    """Nothing is saved after it (the update may have stopped halfway); the message names the last checkpoint."""
    extra = ["algorithm.advantage=grpo", "run.steps=3", "run.save_every=1", "algorithm.micro_batch_tokens=512",
             "run.gpu_share=0.5"]
    step = Trainer.step

    def out_of_memory_at_the_second_step(self, index):
        if index == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. If reserved but "
                                         "unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF")
        return step(self, index)

    monkeypatch.setattr(Trainer, "step", out_of_memory_at_the_second_step)
    with pytest.raises(ConfigError) as error:
        train(config(tiny_model_dir, tmp_path, *extra))
    run = tmp_path / "run"
    assert str(error.value) == (
        "RL step 2 ran out of GPU memory: set algorithm.micro_batch_tokens=256; or model.gradient_checkpointing=true; "
        "or model.engine.free_during_update=true; or run.gpu_share above 0.5; then continue from step_000001 with "
        f"`turnrl train resume={run}` and the change. `turnrl memory` estimates each GPU's peak by part. "
        "torch: CUDA out of memory. Tried to allocate 2.00 GiB.")
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step_000001"]
    assert [r["step"] for r in records(run) if "rollout/success" in r] == [1]
    monkeypatch.setattr(Trainer, "step", lambda self, index: (_ for _ in ()).throw(torch.OutOfMemoryError("")))
    with pytest.raises(ConfigError, match="no checkpoint was saved before it .* torch: OutOfMemoryError$"):
        train(config(tiny_model_dir, tmp_path, *extra, "run.name=second"))


def test_ctrl_c_saves_the_checkpoint_after_the_reader_of_the_output_is_gone(tiny_model_dir, tmp_path):
    """``turnrl train ... | tee log``, then Ctrl-C, which ends ``tee`` too: the run still stops with its checkpoint,
    and what it says after that goes to stderr."""
    command = [sys.executable, "-m", "turnrl.cli", "train", *COMMON, f"model.path={tiny_model_dir}",
               f"run.output_dir={tmp_path}", "run.name=run", "algorithm.advantage=grpo", "run.steps=50",
               "run.threads=1", "validation.episodes=1"]
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
    try:
        for line in process.stdout:  # the run prints "rl 0/50 ..." as its first step starts
            if line.startswith("rl "):
                break
        process.stdout.close()  # the reader is gone: printing to stdout is now a broken pipe
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=300)
    finally:
        process.kill()
    run = tmp_path / "run"
    assert process.returncode == 130, err
    assert "Traceback" not in err and "continue with: turnrl train resume=" in err
    latest = (run / "checkpoints" / "latest").read_text()
    assert f"checkpoint {run / 'checkpoints' / latest}" in err
    assert (run / "checkpoints" / latest / "trainer_state.pt").is_file()


# --------------------------------------------------------------------------- resume
def test_resume_from_a_directory_without_checkpoint_names_the_key(tiny_model_dir, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="resume="):
        train(config(tiny_model_dir, tmp_path, f"resume={tmp_path / 'empty'}"))


def test_resume_continues_exactly_as_an_uninterrupted_run(tiny_model_dir, tmp_path):
    extra = ["algorithm.kl_coef=0.01", "algorithm.micro_batch_size=1", "algorithm.mini_batch_size=2"]
    train(config(tiny_model_dir, tmp_path, *extra, "run.steps=4", name="straight"))
    train(config(tiny_model_dir, tmp_path, *extra, "run.steps=2", name="split"))
    split = tmp_path / "split"
    summary = train(config(tiny_model_dir, tmp_path, *extra, "run.steps=4", f"resume={split}", name="split"))
    straight = tmp_path / "straight"
    final = "checkpoints/step_000004"
    a = load_file(straight / final / "actor" / "model.safetensors")
    b = load_file(split / final / "actor" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    a_critic = load_file(straight / final / "critic" / "model.safetensors")
    b_critic = load_file(split / final / "critic" / "model.safetensors")
    assert all(torch.equal(a_critic[k], b_critic[k]) for k in a_critic)
    assert torch.equal(torch.load(straight / final / "critic" / "value_head.pt")["weight"],
                       torch.load(split / final / "critic" / "value_head.pt")["weight"])
    one, two = step_records(straight), step_records(split)
    assert sorted(two) == [1, 2, 3, 4]
    for step in (3, 4):
        assert comparable(one[step]) == comparable(two[step]), step
    assert any(not torch.equal(a[k], base_weights(tiny_model_dir)[k]) for k in a)  # it trained
    assert "val_success_before_rl" in summary and summary["steps"] == 4


def test_resume_with_the_engine_continues_exactly(tiny_model_dir, tmp_path):
    extra = ["model.backend=engine", "algorithm.micro_batch_size=2", "algorithm.mini_batch_size=4"]
    train(config(tiny_model_dir, tmp_path, *extra, "run.steps=3", name="straight"))
    train(config(tiny_model_dir, tmp_path, *extra, "run.steps=2", name="split"))
    train(config(tiny_model_dir, tmp_path, *extra, "run.steps=3", f"resume={tmp_path / 'split'}", name="split"))
    one, two = step_records(tmp_path / "straight"), step_records(tmp_path / "split")
    assert comparable(one[3]) == comparable(two[3])


def test_a_run_stopped_by_a_lost_rollout_worker_resumes_exactly(tiny_model_dir, tmp_path, monkeypatch):
    """The failed step drew from the random generators before the worker was lost (a Ray rollout draws its workers'
    seeds from torch's), and the checkpoint of the step before holds the generators as they were left: the resumed
    step still plays and trains what the uninterrupted run did, since each step seeds itself from its number."""
    extra = ["algorithm.advantage=grpo", "algorithm.micro_batch_size=1", "algorithm.mini_batch_size=2"]
    train(config(tiny_model_dir, tmp_path, *extra, "run.steps=4", name="straight"))
    roll_out = Trainer.roll_out

    def worker_lost_in_step_3(self, index):
        if index == 2:
            torch.randint(0, 2**31, (1,)), random.random(), np.random.random()
            raise RolloutWorkerError("rollout worker 0 died", worker=0)
        return roll_out(self, index)

    monkeypatch.setattr(Trainer, "roll_out", worker_lost_in_step_3)
    summary = train(config(tiny_model_dir, tmp_path, *extra, "run.steps=4", name="split"))
    assert summary["interrupted_at_step"] == 2 and summary["stopped_by"] == "error"
    monkeypatch.setattr(Trainer, "roll_out", roll_out)
    split = tmp_path / "split"
    train(config(tiny_model_dir, tmp_path, *extra, "run.steps=4", f"resume={split}", name="split"))
    one, two = step_records(tmp_path / "straight"), step_records(split)
    assert sorted(two) == [1, 2, 3, 4]
    for step in (3, 4):
        assert comparable(one[step]) == comparable(two[step]), step
    final = "checkpoints/step_000004/actor/model.safetensors"
    a, b = load_file(tmp_path / "straight" / final), load_file(split / final)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_rollout_worker_lost_in_the_first_step_is_one_line_saying_how_to_start_again(tiny_model_dir, tmp_path,
                                                                                       monkeypatch):
    def worker_lost(self, index):
        raise RolloutWorkerError("rollout worker 0 died", worker=0)

    monkeypatch.setattr(Trainer, "roll_out", worker_lost)
    with pytest.raises(ConfigError, match="stopped in the run's first step, before any update .rollout worker 0 "
                                          "died.; nothing was saved: run the command again, with run.overwrite=true"):
        train(config(tiny_model_dir, tmp_path, "algorithm.advantage=grpo", "run.steps=2"))


def test_the_kl_adaptive_rate_follows_each_update_and_a_resume_keeps_it(tiny_model_dir, tmp_path):
    """``optim.kl_adaptive_target``: each update's scale is the rule applied to the update before's KL, the rate
    is the scale times the schedule, and a run resumed at step 2 goes on as the uninterrupted one."""
    extra = ["optim.kl_adaptive_target=0.0005", "optim.kl_adaptive_min=0.3", "optim.kl_adaptive_max=2",
             "optim.actor_lr=1e-3", "algorithm.micro_batch_size=1", "algorithm.mini_batch_size=2"]
    train(config(tiny_model_dir, tmp_path, *extra, "run.steps=4", name="straight"))
    train(config(tiny_model_dir, tmp_path, *extra, "run.steps=2", name="split"))
    train(config(tiny_model_dir, tmp_path, *extra, "run.steps=4", f"resume={tmp_path / 'split'}", name="split"))
    one, two = step_records(tmp_path / "straight"), step_records(tmp_path / "split")
    scale = 1.0
    for step in (1, 2, 3, 4):
        scale = kl_adaptive_scale(scale, one[step]["actor/approx_kl"], 0.0005, 0.3, 2.0)
        assert one[step]["actor/lr_scale"] == pytest.approx(scale)
        assert one[step]["actor/lr"] == pytest.approx(1e-3 * scale)  # the rate the next update takes
        assert comparable(one[step]) == comparable(two[step]), step
    assert len({round(one[step]["actor/lr_scale"], 9) for step in one}) > 1  # the scale moved
    final = "checkpoints/step_000004/actor/model.safetensors"
    a, b = load_file(tmp_path / "straight" / final), load_file(tmp_path / "split" / final)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_resume_after_sft_with_lora_continues_exactly(tiny_model_dir, tmp_path):
    extra = ["lora.enabled=true", "lora.r=4", "sft.enabled=true", "sft.episodes=8", "sft.epochs=1",
             "sft.batch_size=8", "sft.micro_batch_size=8", "sft.warmup_steps=0", "algorithm.advantage=grpo"]
    train(config(tiny_model_dir, tmp_path, *extra, "run.steps=3", name="straight"))
    train(config(tiny_model_dir, tmp_path, *extra, "run.steps=2", name="split"))
    train(config(tiny_model_dir, tmp_path, *extra, "run.steps=3", f"resume={tmp_path / 'split'}", name="split"))
    one, two = step_records(tmp_path / "straight"), step_records(tmp_path / "split")
    assert comparable(one[3]) == comparable(two[3])


def test_a_resume_trains_with_the_optimizer_settings_it_is_given(tiny_model_dir, tmp_path, capsys):
    """Loading the optimizers' states brings back the settings they were saved with; the resume's own win."""
    train(config(tiny_model_dir, tmp_path, "optim.actor_lr=1e-3", "optim.critic_lr=1e-3", "run.steps=2"))
    run = tmp_path / "run"
    train(config(tiny_model_dir, tmp_path, "run.steps=3", f"resume={run}", "optim.actor_lr=1e-5",
                 "optim.critic_lr=2e-5", "optim.weight_decay=0.5", "optim.adam_eps=1e-6"))
    assert "optim.actor_lr: 0.001 -> 1e-05" in capsys.readouterr().out
    records = step_records(run)
    assert records[2]["actor/lr"] == 1e-3 and records[3]["actor/lr"] == 1e-5
    state = torch.load(run / "checkpoints" / "step_000003" / "trainer_state.pt", weights_only=False)
    actor, critic = state["actor_optimizer"]["param_groups"][0], state["critic_optimizer"]["param_groups"][0]
    assert (actor["lr"], actor["initial_lr"], actor["weight_decay"], actor["eps"]) == (1e-5, 1e-5, 0.5, 1e-6)
    assert (critic["lr"], critic["weight_decay"], critic["eps"]) == (2e-5, 0.5, 1e-6)
    assert state["actor_scheduler"]["base_lrs"] == [1e-5]


def test_a_resume_that_changes_the_lora_settings_is_refused(tiny_model_dir, tmp_path):
    train(config(tiny_model_dir, tmp_path, "lora.enabled=true", "lora.r=4", "algorithm.advantage=grpo",
                 "run.steps=1"))
    message = resume_error(tmp_path / "run", "run.steps=2", "lora.r=8", "lora.target_modules=q_proj")
    assert "lora.r: 4 -> 8; lora.target_modules: 'all-linear' -> 'q_proj'" in message
    assert "model.path=" in message and "step_000001" in message


def test_a_resume_that_changes_the_built_in_model_is_refused_and_its_config_says_where_the_run_lives(tmp_path,
                                                                                                   monkeypatch):
    """The weights load from the checkpoint whatever the preset says: the run went on with the tiny model while its
    config.yaml said small; and an output_dir given was written there, sending a later ``--config RUN/config.yaml``
    run elsewhere."""
    run = tmp_path / "run"
    train(config(None, tmp_path, "model.builtin_preset=tiny", "algorithm.advantage=grpo", "run.steps=1"))
    before = (run / "config.yaml").read_text()
    message = resume_error(run, "run.steps=2", "model.builtin_preset=small")
    assert "changes model.builtin_preset: 'tiny' -> 'small': step_000001 holds the model the run was built as" in \
        message and f"model.path={run / 'checkpoints' / 'step_000001' / 'actor'}" in message
    assert (run / "config.yaml").read_text() == before
    assert main(["train", f"resume={run}", "run.steps=2", "run.output_dir=elsewhere", "run.name=other"]) == 0
    written = load_config(TrainConfig, run / "config.yaml").run
    assert (written.output_dir, written.name, written.steps) == (str(tmp_path), "run", 2)
    monkeypatch.chdir(run)  # resumed from inside the run's folder: `resume=.` names no folder by itself
    assert main(["train", "resume=.", "run.steps=3"]) == 0
    written = load_config(TrainConfig, run / "config.yaml").run
    assert (written.output_dir, written.name, written.steps) == (str(tmp_path.resolve()), "run", 3)


def resume_error(run: Path, *overrides: str) -> str:
    """The one-line error of ``turnrl train resume=RUN ...``, which must stop cleanly."""
    with pytest.raises(SystemExit) as info:
        main(["train", f"resume={run}", *overrides])
    message = str(info.value.code)
    assert message.startswith("error: ") and "\n" not in message, message
    return message


def test_a_resume_check_of_the_optimizers_own_is_said_as_it_is(tiny_model_dir, tmp_path, monkeypatch):
    """A ConfigError is a ValueError: read as a trainer state's fault, its own words were lost to "is not this run's
    trainer state"."""
    from turnrl.training.parallel.single import SingleProcess

    train(config(tiny_model_dir, tmp_path, "run.steps=1"))

    def refuse(*args, **kwargs):
        raise ConfigError("the optimizers' own check failed: do this")

    monkeypatch.setattr(SingleProcess, "restore_optimizers", refuse)
    assert resume_error(tmp_path / "run", "run.steps=2") == "error: the optimizers' own check failed: do this"


def test_a_resume_over_damaged_checkpoints_goes_on_from_a_complete_one_or_changes_nothing(tiny_model_dir, tmp_path,
                                                                                          capsys):
    extra = ["algorithm.advantage=grpo", "run.save_every=1"]
    train(config(tiny_model_dir, tmp_path, *extra))
    run, checkpoints = tmp_path / "run", tmp_path / "run" / "checkpoints"
    recorded = (run / "config.yaml").read_text()
    first_weights = (checkpoints / "step_000001" / "actor" / "model.safetensors").read_bytes()
    # Nothing complete to resume from: one line says what is broken, and the run is left as it was.
    (checkpoints / "step_000002" / "trainer_state.pt").unlink()
    os.truncate(checkpoints / "step_000001" / "actor" / "model.safetensors", 1000)
    message = resume_error(run, "run.steps=4")
    assert ("holds no complete checkpoint (step_000002, the checkpoint checkpoints/latest names, is incomplete "
            "(no trainer_state.pt); step_000001 is incomplete (actor/model.safetensors is damaged: ") in message
    assert f"turnrl train --config {run / 'config.yaml'} run.overwrite=true" in message
    assert (run / "config.yaml").read_text() == recorded
    # With step 1 whole again, the resume goes on from it and says so.
    (checkpoints / "step_000001" / "actor" / "model.safetensors").write_bytes(first_weights)
    capsys.readouterr()
    assert main(["train", f"resume={run}", "run.steps=3"]) == 0
    assert ("step_000002, the checkpoint checkpoints/latest names, is incomplete (no trainer_state.pt); resuming "
            "from step_000001, the newest complete checkpoint") in capsys.readouterr().out
    assert [r["step"] for r in records(run)] == [0, 1, 2, 3, 3]
    assert sorted(p.name for p in checkpoints.iterdir()) == ["latest", "step_000001", "step_000002", "step_000003"]
    assert load_config(TrainConfig, run / "config.yaml").run.steps == 3
    # Fewer steps than the run has done would label a later state as an earlier step: refused, nothing changed.
    recorded = (run / "config.yaml").read_text()
    assert "goes on after step 3, past run.steps=2: give run.steps=4 or more to train further" in \
        resume_error(run, "run.steps=2")
    # A recipe laid over the run's own settings (its validation, its sampling, its model) changed them silently.
    assert resume_error(run, "--config", "configs/quickstart.yaml") == (
        f"error: resume={str(run)!r} goes on with the run's own settings ({run}/config.yaml), which --config "
        "configs/quickstart.yaml would replace; leave --config out and give key=value for what to change")
    assert (run / "config.yaml").read_text() == recorded
    # A failure found only when the checkpoint loads (saved by two processes) leaves config.yaml as it was too.
    state = torch.load(checkpoints / "step_000003" / "trainer_state.pt", weights_only=False)
    torch.save({**state, "world_size": 2}, checkpoints / "step_000003" / "trainer_state.pt")
    recorded = (run / "config.yaml").read_text()
    assert "was saved by 2 process(es)" in resume_error(run, "run.steps=5")
    assert (run / "config.yaml").read_text() == recorded
    # So does a trainer state whose archive is whole but whose contents are not.
    with zipfile.ZipFile(checkpoints / "step_000003" / "trainer_state.pt") as archive:
        entries = {info.filename: archive.read(info) for info in archive.infolist()}
    with zipfile.ZipFile(checkpoints / "step_000003" / "trainer_state.pt", "w") as archive:
        for name, data in entries.items():
            archive.writestr(name, b"not a pickle" if name.endswith("data.pkl") else data)
    message = resume_error(run, "run.steps=5")
    assert f"{checkpoints / 'step_000003' / 'trainer_state.pt'} cannot be read (" in message
    assert "move step_000003 away to resume from an earlier checkpoint" in message
    assert (run / "config.yaml").read_text() == recorded

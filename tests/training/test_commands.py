"""A run's directory under crashes and a second writer: real processes killed at chosen moments, two ``turnrl
train`` at once, SIGTERM; a file-size limit on this process; and the commands the messages print."""

from __future__ import annotations

import errno
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from turnrl.algorithms.estimators import get_estimator
from turnrl.cli import main
from turnrl.config import ConfigError, load_config, turnrl_command
from turnrl.training.checkpoint import checkpoint_problem, latest_checkpoint
from turnrl.training.commands import sft_only, train
from turnrl.training.preflight import preflight
from turnrl.training.run_dir import OWNER_FILE, RunLock, write_config
from turnrl.training.seeding import level_plan_change
from turnrl.training.train_config import TrainConfig

ROOT = Path(__file__).resolve().parents[2]
# A short GRPO run of the tiny model (no critic: the cheapest step), one thread.
FAST = [
    "model.device=cpu", "model.dtype=float32", "run.tensorboard=false", "run.trajectories_every=1", "run.threads=1",
    "env.id=FrozenLake", "agent.format=no_think", "agent.env_instructions=false", "agent.format_instructions=false",
    "agent.max_turns=2", "sampling.max_new_tokens=8", "groups.n_groups=2", "groups.group_size=2",
    "validation.episodes=2", "algorithm.advantage=grpo", "algorithm.mini_batch_size=4", "algorithm.micro_batch_size=2",
]


def overrides(model_dir: Path, out: Path, *extra: str, name: str = "run") -> list[str]:
    return [f"model.path={model_dir}", f"run.output_dir={out}", f"run.name={name}", *FAST, *extra]


def config(model_dir: Path, out: Path, *extra: str, name: str = "run") -> TrainConfig:
    """The run's config, recording turnrl's own estimators only: another test module registers one of its own
    in this process, and the resumes below run in fresh processes that do not know it."""
    loaded = load_config(TrainConfig, None, overrides(model_dir, out, *extra, name=name))
    loaded.algorithm.estimator_params = {name: params for name, params in loaded.algorithm.estimator_params.items()
                                         if (get_estimator(name).fn.__module__ or "").startswith("turnrl.")}
    return loaded


def records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def kinds(run: Path) -> list[tuple[int, str]]:
    """Each record of ``metrics.jsonl`` as (step, what): an RL step's, or a validation's alone."""
    return [(r["step"], "step" if "rollout/success" in r else "val") for r in records(run)]


def environment() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get(
        "PYTHONPATH", "")])}


def python(code: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """``code`` in a new interpreter (where a signal, a kill or a resource limit touches only it)."""
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout,
                          env=environment(), cwd=ROOT)


def turnrl_train(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "turnrl.cli", "train", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=environment(), cwd=ROOT)


def wait_for(condition, what: str, process: subprocess.Popen | None = None, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if process is not None and process.poll() is not None:
            raise AssertionError(f"the process ended before {what}: {process.communicate()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {timeout} s")
        time.sleep(0.1)


def error_line(*args: str) -> str:
    """The one-line error of ``turnrl ARGS`` run in this process."""
    with pytest.raises(SystemExit) as info:
        main(list(args))
    message = str(info.value.code)
    assert message.startswith("error: ") and "\n" not in message, message
    return message


def listing(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@contextmanager
def file_size_limit(limit: int) -> Iterator[None]:
    """This process may write files of at most ``limit`` bytes while it is open (``ulimit -f``): a disk that refuses
    a write, met by the command run in this process. Python ignores the SIGXFSZ that would end the process, so the
    write raises (EFBIG) as it does in a ``turnrl`` process under the limit; the tests that run under it capture
    their output in memory (``capsys``), where the limit does not stop it. A run in a process of its own under the
    limit, whose whole output and exit status are checked: test_kill_points.py's refused writes."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def stopped_run(model_dir: Path, once_per_run) -> Path:
    """A 3-step run stopped after its first step by ``RUN/stop`` (checkpoint 1, no summary); copied, never changed,
    by the tests (run once for all the pytest-xdist workers). The file is made during the step: one there before
    the run starts is an earlier run's, which the run's lock removes."""
    from turnrl.training.trainer import Trainer

    step = Trainer.step

    def step_then_stop(self, index):
        (self.run_dir / "stop").touch()
        return step(self, index)

    def run(out: Path) -> None:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(Trainer, "step", step_then_stop)
            summary = train(config(model_dir, out, "run.steps=3"))
        assert summary["interrupted_at_step"] == 1

    return once_per_run("kill_points_stopped", run) / "run"


def copy_of(run: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    return copy


@pytest.fixture(scope="module")
def finished(tiny_model_dir, tmp_path_factory) -> Path:
    """A finished 2-step run with a checkpoint after each step (read, never changed, by the tests)."""
    out = tmp_path_factory.mktemp("finished")
    train(config(tiny_model_dir, out, "run.steps=2", "run.save_every=1"))
    return out / "run"


# --------------------------------------------------------------------------- 1. config.yaml, whole or not at all
def test_a_config_write_that_fails_leaves_the_old_config_yaml_whole(tmp_path):
    """A resume rewrites config.yaml; under a file-size limit that write fails, and the old file must stay
    whole (it was cut to the limit before), with no temporary file left beside it."""
    run = tmp_path / "run"
    run.mkdir()
    write_config(load_config(TrainConfig, None, [f"run.output_dir={tmp_path}", "run.name=run", "run.steps=3"]))
    before = (run / "config.yaml").read_bytes()
    assert len(before) > 1024
    again = load_config(TrainConfig, None, [f"run.output_dir={tmp_path}", "run.name=run", "run.steps=7"])
    with file_size_limit(1024), pytest.raises(OSError) as failed:  # `ulimit -f 1`
        write_config(again)
    assert failed.value.errno == errno.EFBIG, failed.value
    assert (run / "config.yaml").read_bytes() == before
    assert [p.name for p in run.iterdir()] == ["config.yaml"]


# --------------------------------------------------------------------------- 2. a damaged config.yaml
@pytest.mark.parametrize("damage", [b"", b"\n  \n", b"\x9f\xd3\x00\xffrandom\xfe bytes", b"run: [unclosed",
                                    b"- a list\n", "a folder", "missing",
                                    pytest.param(b"run: " + b"[" * 100_000, id="nested too deep")])
def test_a_damaged_config_yaml_stops_a_resume_with_one_line_and_changes_nothing(finished, tmp_path, damage):
    run = tmp_path / "run"
    run.mkdir()
    for path, data in listing(finished).items():  # a copy of the finished run, summary.json left out
        if path != "summary.json":
            (run / path).parent.mkdir(parents=True, exist_ok=True)
            (run / path).write_bytes(data)
    recorded = (run / "config.yaml").read_bytes()
    if damage == "a folder":
        (run / "config.yaml").unlink()
        (run / "config.yaml").mkdir()
    elif damage == "missing":  # deleted: the checkpoints say it was a run
        (run / "config.yaml").unlink()
    else:
        (run / "config.yaml").write_bytes(damage)
    before = listing(run)
    message = error_line("train", f"resume={run}", "run.steps=3")
    copy = run / "checkpoints" / "step_000002" / "config.yaml"
    assert message.startswith(f"error: {run / 'config.yaml'} is damaged (")
    assert f"restore it from the copy checkpoint 2 keeps (`cp {copy} {run / 'config.yaml'}`)" in message
    assert "overwrite" not in message and message.endswith("Nothing was changed")
    assert (f"move the folder away (`mv {run / 'config.yaml'} " in message) == (damage == "a folder")
    assert listing(run) == before
    assert copy.read_bytes() == recorded  # the copy is the run's settings
    # Without a copy (checkpoints saved before they kept one): resume with the recipe, nothing deleted.
    for checkpoint in ("step_000001", "step_000002"):
        (run / "checkpoints" / checkpoint / "config.yaml").unlink()
    message = error_line("train", f"resume={run}")
    assert f"`turnrl train --config RECIPE resume={run}` writes it again" in message
    assert "overwrite" not in message


def test_a_config_yaml_cut_short_that_still_parses_stops_a_resume_and_changes_nothing(finished, tmp_path):
    """Cut at a line, config.yaml is still YAML: read as it stands, every setting it lost would take its default
    (a GRPO run would look for a critic and call its checkpoints incomplete). The checkpoint's copy says what a
    whole one holds."""
    run = tmp_path / "run"
    for path, data in listing(finished).items():
        (run / path).parent.mkdir(parents=True, exist_ok=True)
        (run / path).write_bytes(data)
    lines = (run / "config.yaml").read_text().splitlines(keepends=True)
    (run / "config.yaml").write_text("".join(lines[: len(lines) // 2]))
    before = listing(run)
    message = error_line("train", f"resume={run}", "run.steps=3")
    assert message.startswith(f"error: {run / 'config.yaml'} is damaged (cut short: it lacks ")
    assert "settings that the copy of checkpoint 2 holds" in message and "overwrite" not in message
    assert listing(run) == before


def test_a_resume_that_changes_the_runs_settings_says_which_once_they_are_written(finished, tmp_path, capsys):
    """The note comes once the checkpoint has loaded and config.yaml is rewritten with the resume's settings: a
    finished run, which a resume leaves as it is, gets none; the run's bookkeeping (run.steps) is no change."""
    run = tmp_path / "run"
    for path, data in listing(finished).items():
        (run / path).parent.mkdir(parents=True, exist_ok=True)
        (run / path).write_bytes(data)
    main(["train", f"resume={run}", "run.steps=2", "seeds.seed=7"])
    assert "settings changed" not in capsys.readouterr().out
    main(["train", f"resume={run}", "run.steps=3", "seeds.seed=7", "optim.actor_lr=0.5"])
    out = " ".join(capsys.readouterr().out.split())
    assert "note: resumed with settings changed from the run's: seeds.seed: 0 -> 7; optim.actor_lr:" in out
    assert "run.steps" not in out.split("note: resumed with settings changed")[1].split("(its config.yaml")[0]
    assert load_config(TrainConfig, run / "config.yaml").seeds.seed == 7


def test_a_checkpoint_that_keeps_its_runs_config_is_still_read_as_a_checkpoint(finished):
    from turnrl.training.run_dir import run_of_model

    checkpoint = finished / "checkpoints" / "step_000002"
    assert run_of_model(checkpoint) == (checkpoint / "actor", finished)
    assert run_of_model(finished) == (checkpoint / "actor", finished)


# --------------------------------------------------------------------------- 3. one writer per run directory
@pytest.mark.slow  # three commands, 31 s on two cores; the refusal itself, in process: the killed writer's test below
def test_a_second_train_or_resume_into_a_training_run_is_refused_with_its_owner(tiny_model_dir, tmp_path):
    run = tmp_path / "run"
    first = turnrl_train(*overrides(tiny_model_dir, tmp_path, "run.steps=200", "run.save_every=1"))
    seconds: list[subprocess.Popen] = []
    try:
        wait_for(lambda: (run / "checkpoints" / "latest").is_file(), "first checkpoint", first)
        # Both at once: a new run into the same name, and a resume of it.
        seconds += [turnrl_train(*args) for args in (overrides(tiny_model_dir, tmp_path, "run.steps=3"),
                                                     [f"resume={run}", "run.steps=300"])]
        for second in seconds:
            out, err = second.communicate(timeout=240)
            assert second.returncode == 1, out + err
            assert err.strip() == (f"error: run directory {run} is in use by pid {first.pid} on host "
                                   f"{os.uname().nodename} (since {err.split('(since ')[1].split(')')[0]}): one "
                                   "process writes into a run at a time; wait for it to end, stop it (`touch "
                                   f"{run / 'stop'}` stops it after its step, with a checkpoint), or pick another "
                                   "run.name")
        (run / "stop").touch()
        out, err = first.communicate(timeout=240)
    finally:
        for process in (first, *seconds):
            process.kill()
    assert first.returncode == 130, out + err
    steps = [step for step, kind in kinds(run) if kind == "step"]
    assert steps == list(range(1, len(steps) + 1))  # each step once, no torn line
    assert not (run / OWNER_FILE).exists()


HOLD_THE_LOCK = """
import sys, time
from pathlib import Path
from turnrl.training.run_dir import RunLock
with RunLock(Path(sys.argv[1])):
    print("locked", flush=True)
    time.sleep(600)
"""


def test_the_lock_of_a_killed_writer_is_taken_over_with_a_note(tmp_path, capsys):
    run = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", HOLD_THE_LOCK, str(run)], stdout=subprocess.PIPE, text=True,
                              env=environment(), cwd=ROOT)
    try:
        assert holder.stdout.readline() == "locked\n"
        with pytest.raises(ConfigError, match=f"is in use by pid {holder.pid} on host "):
            RunLock(run).__enter__()
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=60)
    finally:
        holder.kill()
    with RunLock(run):
        assert f"pid: {os.getpid()}\n" in (run / OWNER_FILE).read_text()
    note = " ".join(capsys.readouterr().err.split())
    assert f"note: {run} was last written by pid {holder.pid} on host" in note and "takes it over" in note
    assert sorted(p.name for p in run.iterdir()) == [".lock"]


def test_a_filesystem_without_flock_is_never_locked_by_a_file_a_killed_writer_left(tmp_path, capsys, monkeypatch):
    """filelock stands in a lock file's existence for flock where a filesystem has none (Lustre mounted without
    ``flock``): a run killed there would leave its file, refusing every later run of the directory until removed
    by hand. The run goes on unguarded and says so, and a writer that never released (killed) refuses nothing."""
    import errno
    import fcntl

    def missing(fd, operation):
        raise OSError(errno.ENOSYS, os.strerror(errno.ENOSYS))

    monkeypatch.setattr(fcntl, "flock", missing)
    RunLock(tmp_path / "run").__enter__()  # never left: a writer killed while it ran
    with RunLock(tmp_path / "run", create=False) as lock:
        assert lock.run_dir.is_dir()
    warnings = " ".join(capsys.readouterr().err.split())
    assert warnings.count(f"warning: {tmp_path / 'run'} cannot be locked on its filesystem (Function not "
                          "implemented)") == 2, warnings


def test_a_filesystem_without_locks_runs_unguarded_and_says_so(tmp_path, capsys, monkeypatch):
    import errno

    from filelock import FileLock

    def refused(self, *args, **kwargs):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(FileLock, "acquire", refused)
    with RunLock(tmp_path / "run") as lock:
        assert lock.run_dir.is_dir()
    warning = " ".join(capsys.readouterr().err.split())
    assert f"warning: {tmp_path / 'run'} cannot be locked on its filesystem (No locks available)" in warning
    monkeypatch.setattr(FileLock, "acquire", lambda self, *a, **k: (_ for _ in ()).throw(OSError(errno.EACCES, "")))
    with pytest.raises(PermissionError):  # another fault is not taken for a filesystem without locks
        RunLock(tmp_path / "other").__enter__()


def test_a_start_that_fails_its_checks_leaves_no_directory_behind(tiny_model_dir, tmp_path):
    with pytest.raises(ConfigError, match="Chess"):
        train(config(tiny_model_dir, tmp_path / "runs", "env.id=Chess"))
    assert not (tmp_path / "runs").exists()


# --------------------------------------------------------------------------- 4. every record once, whatever the kill
KILLED_AT = """
import os, signal, sys
from turnrl.config import load_config
from turnrl.training.commands import sft_only, train
from turnrl.training.train_config import TrainConfig
from turnrl.training.trainer import Trainer

point = sys.argv[1]
save, write_summary = Trainer.save, Trainer.write_summary

def save_then_maybe_die(self, step):
    if point == "before_final_checkpoint" and step == self.config.run.steps:
        os.kill(os.getpid(), signal.SIGKILL)
    return save(self, step)

def die(self):
    os.kill(os.getpid(), signal.SIGKILL)

Trainer.save = save_then_maybe_die
if point == "before_summary":
    Trainer.write_summary = die
train(load_config(TrainConfig, None, sys.argv[2:]))
"""


@pytest.mark.parametrize("point", ["before_summary",  # the case; the other, 11 s, runs with the slow tests
                                   pytest.param("before_final_checkpoint", marks=pytest.mark.slow)])
def test_a_run_killed_at_its_end_and_resumed_logs_every_record_once(tiny_model_dir, tmp_path, point):
    """SIGKILL after the final checkpoint and ``latest`` (before summary.json), or just before that checkpoint:
    the resumed run's metrics.jsonl holds each step and each validation once, as an uninterrupted run's."""
    run = tmp_path / "run"
    killed = python(KILLED_AT, point, *overrides(tiny_model_dir, tmp_path, "run.steps=2", "run.save_every=1"))
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert not (run / "summary.json").exists()
    assert latest_checkpoint(run).name == ("step_000002" if point == "before_summary" else "step_000001")
    summary = train(config(tiny_model_dir, tmp_path, "run.steps=2", "run.save_every=1", f"resume={run}"))
    assert kinds(run) == [(0, "val"), (1, "step"), (2, "step"), (2, "val")]
    assert json.loads((run / "summary.json").read_text())["val_success_after_rl"] == summary["val_success_after_rl"]
    assert sorted(p.name for p in (run / "trajectories").glob("*.jsonl") if ".advantages." not in p.name) == [
        "step_000001.jsonl", "step_000002.jsonl", "val_after_rl.jsonl", "val_before_rl.jsonl"]


def test_a_resume_with_fewer_steps_keeps_no_trajectories_of_steps_it_never_logged(tiny_model_dir, tmp_path):
    """Stopped at step 3 with checkpoint 1 (its own copy of the finished run), resumed to 2 steps: the files of
    step 3 go with its record."""
    run = tmp_path / "run"
    train(config(tiny_model_dir, tmp_path, "run.steps=3", "run.save_every=1", "run.keep_checkpoints=0"))
    for name in ("summary.json", "checkpoints/step_000002", "checkpoints/step_000003"):
        path = run / name
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()
    (run / "checkpoints" / "latest").write_text("step_000001")
    train(config(tiny_model_dir, tmp_path, "run.steps=2", f"resume={run}"))
    assert [step for step, kind in kinds(run) if kind == "step"] == [1, 2]
    assert not (run / "trajectories" / "step_000003.jsonl").exists()


# --------------------------------------------------------------------------- 5. a checkpoint the disk cannot hold
@pytest.fixture(scope="module")
def stopped(tiny_model_dir, once_per_run) -> Path:
    return stopped_run(tiny_model_dir, once_per_run)


def test_a_checkpoint_write_cut_by_a_file_size_limit_stops_with_the_cause_and_keeps_the_last_one(stopped, tmp_path,
                                                                                                 capsys):
    """The limit lets the actor's weights through and stops torch's zip writer in the optimizer states (its
    "unexpected pos"): one line naming the limit, the previous checkpoint whole and still ``latest``."""
    run = copy_of(stopped, tmp_path)
    first = run / "checkpoints" / "step_000001"
    weights = (first / "actor" / "model.safetensors").stat().st_size
    assert (first / "trainer_state.pt").stat().st_size > 1.5 * weights
    with file_size_limit(int(1.5 * weights)):
        last = error_line("train", f"resume={run}", "run.steps=2")
    assert last.startswith("error: checkpoint after step 2 could not be written: this process may write files of "
                           "at most ")
    assert "(its file-size limit, `ulimit -f`)" in last
    assert f"then continue from step_000001 (intact) with `turnrl train resume={run}`" in last
    assert latest_checkpoint(run) == first and checkpoint_problem(first) is None
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step_000001"]


# --------------------------------------------------------------------------- 11. SIGTERM, and no resume offered in vain
# 11 s; by default test_kill_points.py's SIGTERM in a step checks the same exit status, lines and resume (and every
# record once after it).
@pytest.mark.slow
def test_sigterm_stops_after_the_step_with_a_checkpoint_and_says_how_to_resume(tiny_model_dir, tmp_path):
    """What a batch scheduler sends before it kills: the run saves, as on Ctrl-C, and the resume it offers works."""
    run = tmp_path / "run"
    process = turnrl_train(*overrides(tiny_model_dir, tmp_path, "run.steps=200"))
    try:
        wait_for(lambda: any(kind == "step" for _, kind in kinds(run)) if (run / "metrics.jsonl").is_file()
                 else False, "first step", process)
        process.send_signal(signal.SIGTERM)
        out, err = process.communicate(timeout=240)
    finally:
        process.kill()
    text = " ".join((out + err).split())
    assert process.returncode == 128 + signal.SIGTERM, text[-3000:]  # 143, as a shell reports SIGTERM
    assert "SIGTERM: stopping after this step" in text and "Traceback" not in text
    latest = latest_checkpoint(run)
    assert latest is not None and f"checkpoint {latest}" in text
    assert f"continue with: turnrl train resume={run}" in text
    done = latest.name.removeprefix("step_").lstrip("0")
    train(config(tiny_model_dir, tmp_path, f"run.steps={int(done) + 1}", f"resume={run}"))
    assert json.loads((run / "summary.json").read_text())["steps"] == int(done) + 1


def test_a_start_into_a_run_without_a_checkpoint_offers_no_resume(tiny_model_dir, tmp_path, finished):
    """A run stopped before its first checkpoint (killed in step 1) holds metrics but nothing to resume."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 0, "val/success": 0.0}\n')
    with pytest.raises(ConfigError) as error:
        preflight(config(tiny_model_dir, tmp_path))
    assert "resume=" not in str(error.value)
    assert (f"run directory {run} already holds a run (metrics.jsonl); it holds no checkpoint to continue from; "
            "pick another run.name, or pass run.overwrite=true") in str(error.value)
    with pytest.raises(ConfigError, match=f"continue it with `turnrl train resume={finished}`"):
        preflight(config(tiny_model_dir, finished.parent))


# --------------------------------------------------------------------------- 12. a resume plays the run's levels
def test_a_resume_that_would_play_other_levels_is_refused_and_changes_nothing(finished):
    """Fewer groups a step after the checkpoint would play levels its steps trained on again (more: skip some):
    one line naming the key and the run's value, the run left as it was. The group size, which only sets how many
    samples a level gets, may change."""
    before = listing(finished)
    message = error_line("train", f"resume={finished}", "run.steps=3", "groups.n_groups=1")
    assert message == (f"error: resume={str(finished)!r}: groups.n_groups=1 would change which levels (env seeds) the "
                       "steps after step 2 play, so that some would be played twice and others never; resume with "
                       "the run's groups.n_groups=2, or start a new run")
    assert listing(finished) == before


@pytest.mark.parametrize(("override", "needed"), [
    ("algorithm.advantage=gae", "a critic, which the run has not saved"),
    ("lora.enabled=true", "LoRA adapters, which the run has not saved"),
    ("algorithm.kl_coef=0.1", "a KL reference model, which the run has not saved"),
])
def test_a_resume_that_needs_models_the_run_never_saved_is_refused_and_changes_nothing(finished, override, needed):
    """A critic, LoRA or a KL reference asked for on resume of a run trained without: one line naming it (where it
    was a traceback from the model loading, or, for a critic, every intact checkpoint called incomplete with
    advice to overwrite the run), the run left as it was."""
    before = listing(finished)
    message = error_line("train", f"resume={finished}", "run.steps=3", override)
    assert message.startswith(f"error: resume={str(finished)!r} would need {needed}: its checkpoints cannot be "
                              "resumed that way;"), message
    assert "overwrite" not in message
    assert listing(finished) == before


def test_what_a_resume_needs_is_read_from_the_runs_files_not_its_rewritten_config(tiny_model_dir, tmp_path):
    """A run trained with a KL reference, resumed once without (which rewrites its config.yaml with
    ``kl_coef=0``): the reference is still on disk, so a resume that turns the KL on again is not refused."""
    from turnrl.training.run_dir import saved_models_change

    train(config(tiny_model_dir, tmp_path, "run.steps=1", "algorithm.kl_coef=0.05"))
    run = tmp_path / "run"
    write_config(config(tiny_model_dir, tmp_path, "run.steps=1", "algorithm.kl_coef=0"))
    assert saved_models_change(run, config(tiny_model_dir, tmp_path, "algorithm.kl_coef=0.05", f"resume={run}")) \
        is None
    assert "a critic, which the run has not saved" in saved_models_change(
        run, config(tiny_model_dir, tmp_path, "algorithm.advantage=gae", f"resume={run}"))


def test_a_resume_with_a_critic_from_a_checkpoint_trained_without_one_is_refused(tiny_model_dir, tmp_path):
    """GAE, then resumed with GRPO, then with GAE again: the newest checkpoint has no critic because its steps had
    none, not because it is damaged; the resume says so instead of going back to the last checkpoint with one."""
    run = tmp_path / "run"
    train(config(tiny_model_dir, tmp_path, "run.steps=1", "run.save_every=1", "algorithm.advantage=gae"))
    train(config(tiny_model_dir, tmp_path, "run.steps=2", f"resume={run}"))
    before = listing(run)
    message = error_line("train", f"resume={run}", "run.steps=3", "algorithm.advantage=gae")
    assert message == (f"error: resume={str(run)!r} would go on with a critic from step_000002, which was trained "
                       "without one (algorithm.advantage=grpo): resume it with algorithm.advantage=grpo, or start a "
                       f"new run from its model (model.path={run / 'checkpoints' / 'step_000002' / 'actor'})")
    assert listing(run) == before


def test_the_level_plan_names_the_keys_that_move_the_levels(tmp_path):
    def settings(*extra: str) -> TrainConfig:
        return load_config(TrainConfig, None, [f"resume={tmp_path}", *extra])

    run = settings()
    assert level_plan_change(run, settings("groups.group_size=8", "seeds.seed=5", "run.steps=9"), 2) is None
    assert "seeds.train_start=20000 would change" in level_plan_change(run, settings("seeds.train_start=20000"), 2)
    followed = settings("seeds.levels_follow_seed=true")
    assert level_plan_change(followed, settings("seeds.levels_follow_seed=true", "seeds.seed=7"), 2).startswith(
        f"resume={str(tmp_path)!r}: seeds.seed=7 would change")
    dynamic = level_plan_change(run, settings("algorithm.dynamic_sampling=true"), 2)
    assert "algorithm.dynamic_sampling=True, algorithm.dynamic_sampling_rounds=3 would change" in dynamic
    assert dynamic.endswith("resume with the run's algorithm.dynamic_sampling=False, or start a new run")


# --------------------------------------------------------------------------- 14. commands as they can be run
def test_turnrl_is_printed_as_it_can_be_run(tmp_path, monkeypatch):
    script = tmp_path / ".venv" / "bin" / "turnrl"
    script.parent.mkdir(parents=True)
    script.write_text("#!/bin/sh\n")
    script.chmod(0o755)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    assert turnrl_command(str(script)) == ".venv/bin/turnrl"  # started as .venv/bin/turnrl, not activated
    assert turnrl_command(".venv/bin/turnrl") == ".venv/bin/turnrl"
    monkeypatch.chdir(tmp_path / ".venv" / "bin")
    assert turnrl_command(str(script)) == "./turnrl"  # a bare name would be looked up on the PATH
    monkeypatch.chdir(ROOT)
    assert turnrl_command(str(script)) == str(script)  # not below the current folder: the whole path
    monkeypatch.setenv("PATH", f"{script.parent}{os.pathsep}/usr/bin")
    assert turnrl_command(str(script)) == "turnrl"  # activated: the shell finds it
    assert turnrl_command(str(ROOT / "turnrl" / "cli.py")) == "turnrl"  # python -m turnrl.cli


def test_the_messages_print_the_command_the_run_was_started_with(tiny_model_dir, tmp_path, monkeypatch, finished):
    script = tmp_path / "venv" / "bin" / "turnrl"
    script.parent.mkdir(parents=True)
    script.write_text("#!/bin/sh\n")
    monkeypatch.setattr(sys, "argv", [str(script), "train"])
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    with pytest.raises(ConfigError, match=f"continue it with `{script} train resume={finished}`"):
        preflight(config(tiny_model_dir, finished.parent))


def test_the_steps_run_with_the_heap_settled_and_the_run_leaves_none_of_it_frozen(tiny_model_dir, tmp_path,
                                                                                    monkeypatch):
    import gc

    from turnrl.training import heap
    from turnrl.training.trainer import Trainer

    freezes, seen = [], []
    settle, step = heap.settle, Trainer.step

    def counted_settle():
        freezes.append(gc.get_freeze_count())
        settle()

    def counted_step(self, index):  # at each step: the freezes so far, and the objects the collector leaves out
        seen.append((len(freezes), gc.get_freeze_count()))
        return step(self, index)

    monkeypatch.setattr(heap, "settle", counted_settle)
    monkeypatch.setattr(Trainer, "step", counted_step)
    assert gc.get_freeze_count() == 0
    train(config(tiny_model_dir, tmp_path, "run.steps=3"))
    # settled before the first step, again before the second (what the first built to stay), not after
    assert [count for count, _ in seen] == [1, 2, 2]
    assert all(left_out > 10_000 for _, left_out in seen)  # the model, its modules, the run's objects
    assert gc.get_freeze_count() == 0  # the process goes on with everything collectable


def test_a_stop_before_the_first_step_that_cleanup_code_turns_into_another_error_still_stops(tiny_model_dir, tmp_path,
                                                                                           monkeypatch, capsys):
    from turnrl.training import commands

    def interrupted(config, start, distributed, stop):
        try:
            stop._handle(signal.SIGTERM, None)  # what SIGTERM does while the models are built
        finally:  # a library's cleanup that reads a local the interruption left unset (omegaconf's, as seen)
            raise UnboundLocalError("cannot access local variable 'old' where it is not associated with a value")

    monkeypatch.setattr(commands, "_train", interrupted)
    summary = train(config(tiny_model_dir, tmp_path, "run.steps=2"))
    assert summary["stopped_by"] == "request" and summary["stop_signal"] == "SIGTERM"
    assert "SIGTERM before the first step: stopped" in " ".join(capsys.readouterr().out.split())

    def failed(config, start, distributed, stop):  # an error with no stop behind it is raised as it is
        raise UnboundLocalError("a fault of its own")

    monkeypatch.setattr(commands, "_train", failed)
    with pytest.raises(UnboundLocalError, match="of its own"):
        train(config(tiny_model_dir, tmp_path, "run.steps=2", name="other"))


def test_cpu_offload_without_fsdp_is_refused_before_anything_is_written(tmp_path):
    # One process trains without FSDP2's shards: the option was ignored, and the run trained on the GPU anyway.
    with pytest.raises(ConfigError, match="set distributed.backend=fsdp"):
        train(config(tmp_path / "no-model", tmp_path / "runs", "distributed.cpu_offload=true"))
    assert not (tmp_path / "runs").exists()


def test_sft_data_given_apart_from_the_config_is_checked_with_it(tmp_path):
    # `turnrl sft --data chats.jsonl` set the chats after the load's checks: soft targets, which chats cannot
    # have, were then dropped without a word.
    with pytest.raises(ConfigError, match="sft.target_random_share"):
        sft_only(config(tmp_path / "no-model", tmp_path / "runs", "sft.target_random_share=0.1"),
                 data=str(tmp_path / "chats.jsonl"))
    assert not (tmp_path / "runs").exists()


# --------------------------------------------------------------------------- a run directory that cannot be made
@pytest.mark.parametrize("command", ["sft", "train"])
def test_a_run_directory_under_a_file_is_one_line_naming_the_file(tmp_path, command):
    """``run.output_dir`` naming a file: ``turnrl sft`` showed mkdir's traceback, and ``turnrl train`` said that the
    run directory (which does not exist) was a file."""
    (tmp_path / "out").write_text("")
    message = error_line(command, *FAST, f"run.output_dir={tmp_path / 'out'}", "run.name=run",
                         f"model.path={tmp_path / 'no-model'}")
    assert message.startswith(f"error: {tmp_path / 'out'} is a file, and the run directory {tmp_path / 'out' / 'run'} "
                              "goes inside it: move it away, or set run.output_dir to a folder"), message


def test_sft_into_a_folder_it_may_not_write_is_one_line(tmp_path, monkeypatch):
    """What a run directory under a folder of another user raises as the lock makes it (root writes anywhere, so
    the refusal is the lock's here): one line naming the folder, as ``turnrl train`` says it."""
    import errno

    from turnrl.training import commands

    def refused(self):
        raise PermissionError(errno.EACCES, "Permission denied", str(self.run_dir))

    monkeypatch.setattr(commands.RunLock, "__enter__", refused)
    for command in ("sft", "train"):
        message = error_line(command, *FAST, f"run.output_dir={tmp_path / 'shared'}", "run.name=run",
                             f"model.path={tmp_path / 'no-model'}")
        assert message.startswith(f"error: {tmp_path / 'shared'} may not be written into by this user: give it back "
                                  "its permissions (`chmod u+rwx`) (Permission denied); "), message


def test_a_resume_drops_the_images_of_the_steps_after_its_checkpoint(tmp_path):
    """The trajectory files of steps past the checkpoint went, and their PNGs stayed: beside the images a step written
    again makes (with fewer episodes or turns, some of another run), and for steps never reached, for good."""
    from turnrl.training.commands import _drop_trajectories_after

    folder = tmp_path / "trajectories"
    (folder / "images").mkdir(parents=True)
    names = ["step_000001.jsonl", "step_000003.jsonl", "step_000003.advantages.jsonl", "val_before_rl.jsonl",
             "images/step_000001_00000_000.png", "images/step_000003_00000_000.png",
             "images/step_000003_00001_final0.png", "images/step_000012_00000_001.png",
             "images/val_before_rl_00000_000.png", "images/val_after_rl_00000_000.png"]
    for name in names:
        (folder / name).write_text("")
    _drop_trajectories_after(folder, 2)
    assert sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()) == [
        "images/step_000001_00000_000.png", "images/val_after_rl_00000_000.png", "images/val_before_rl_00000_000.png",
        "step_000001.jsonl", "val_before_rl.jsonl"]


class Killed(BaseException):
    """A kill at a chosen line of the run, in this process."""


def test_a_longer_resume_killed_before_its_summary_ends_with_its_own_summary(tiny_model_dir, tmp_path, monkeypatch):
    """A finished run of 1 step, resumed to 2 and killed after its last checkpoint, before summary.json: the next
    resume said the run had already run its 2 steps and kept the summary of step 1 (its validation, its steps)."""
    from turnrl.training.trainer import Trainer

    run = tmp_path / "run"
    train(config(tiny_model_dir, tmp_path, "run.steps=1"))
    monkeypatch.setattr(Trainer, "write_summary", lambda self: (_ for _ in ()).throw(Killed()))
    with pytest.raises(Killed):
        train(config(tiny_model_dir, tmp_path, "run.steps=2", f"resume={run}"))
    monkeypatch.undo()
    summary = train(config(tiny_model_dir, tmp_path, "run.steps=2", f"resume={run}"))
    written = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == written["steps"] == 2
    after = [r for r in records(run) if r["step"] == 2 and "val/success" in r]
    assert written["val_success_after_rl"] == after[0]["val/success"]
    assert kinds(run) == [(0, "val"), (1, "step"), (1, "val"), (2, "step"), (2, "val")]


def test_sft_whose_model_the_disk_refuses_is_one_line_saying_how_to_run_it_again(tiny_model_dir, tmp_path, capsys):
    """safetensors' writer stopped by a file-size limit: ``turnrl sft`` showed its traceback (its error is no
    ``OSError``); the line says so, and that the model folder it left part-written needs run.overwrite."""
    run = tmp_path / "run"
    limit = (Path(tiny_model_dir) / "model.safetensors").stat().st_size // 2
    with file_size_limit(limit):
        last = error_line("sft", *overrides(tiny_model_dir, tmp_path, "sft.episodes=8", "sft.epochs=1",
                                            "sft.batch_size=8", "sft.micro_batch_size=8"))
    assert last.startswith(f"error: the run could not write into {run}: this process may write files of at most "), last
    assert last.endswith(f"then run it again with run.overwrite=true ({run / 'sft' / 'model'} was left part-written)")


def test_a_run_whose_engine_rows_are_shorter_than_its_episodes_may_grow_says_so_at_its_start(tiny_model_dir,
                                                                                              tmp_path, capsys):
    """Its episodes end at the row's length, short of the agent's budget: said on every run, not only where a
    GPU's memory check runs."""
    main(["train", *overrides(tiny_model_dir, tmp_path, "run.steps=0", "agent.max_context_tokens=8192",
                              "model.engine.max_seq_len=2048", "run.save_at_end=false")])
    out = " ".join(capsys.readouterr().out.split())
    assert ("note: episodes end at model.engine.max_seq_len=2048 tokens, short of agent.max_context_tokens=8192: "
            "set model.engine.max_seq_len=8192 to give them the agent's budget") in out

"""The ``turnrl train`` and ``turnrl sft`` commands: SFT, validation, the RL steps, checkpoints, the summary.

    train(config)
      preflight          what can be checked before anything is written or loaded
      sft_stage          the base model, fine-tuned on expert demos (rank 0, when enabled)
      the trainer        Trainer, with the parallel strategy and rollout backends compose.parts picks
                         (FSDP2 under torchrun, Ray workers, rollouts a batch ahead); each step is
                         trainer.step(step)
      loop               validation, metrics, trajectory files, checkpoints; Ctrl-C, SIGTERM (a batch
                         scheduler's) or ``RUN_DIR/stop`` stops after the step in progress with a checkpoint
                         (before the first step Ctrl-C and SIGTERM stop at once: there is nothing to save)

A run holds its directory's lock (:class:`~turnrl.training.run_dir.RunLock`) from its checks to its end, so a
second process writing into the same run is refused.

The trainer (:mod:`turnrl.training.trainer`) holds the models and runs a step; this module owns everything
around the steps.

Steps are numbered from 1 wherever a user sees them: step N is the run's N-th rollout and update, logged as
``step`` N in ``metrics.jsonl`` (0 is the validation before RL), with its trajectories in
``trajectories/step_N.jsonl``, and ``checkpoints/step_N`` holds the run after it. ``trainer.step`` takes the
step's index (N - 1), from which its seeds derive.
"""

from __future__ import annotations

import json
import re
import signal
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from types import FrameType
from typing import Any

import torch
from rich.markup import escape

from turnrl.agent.formats import get_format
from turnrl.config import ConfigError, turnrl_command
from turnrl.files import parse_json
from turnrl.models.loading import base_model_path, compile_in_this_process, start_compile_workers_ignoring_sigterm
from turnrl.rewards import Rewards
from turnrl.rewards.state import check_fields_written
from turnrl.rollout.metrics import error_kinds, errored_note
from turnrl.rollout.ray_workers import RolloutWorkerError, WeightsTransferError
from turnrl.rollout.trajectory import Trajectory, write_trajectories
from turnrl.training import compose, heap, ranks
from turnrl.training.allocator import cap_gpu_memory, set_allocator_settings
from turnrl.training.checkpoint import checkpoint_step, disk_error_cause, latest_checkpoint, resume_point
from turnrl.training.collapse_watch import EarlyStops, logged_steps
from turnrl.training.device_idle import profiled
from turnrl.training.logger import MetricsLogger, RunProgress
from turnrl.training.memory import (
    GIB,
    cache_full_note,
    check_memory,
    half_full_passes_note,
    rows_shorter_than_episodes,
)
from turnrl.training.memory_trace import recorded
from turnrl.training.out_of_memory import rl_out_of_memory
from turnrl.training.preflight import preflight
from turnrl.training.run_dir import STOP_FILE, RunLock, resumed_checkpoint, run_directory, run_lock, start_run
from turnrl.training.sft import SFTResult, sft_stage
from turnrl.training.stall_watch import StallWatch, stalls_path
from turnrl.training.step_episodes import StepOutput
from turnrl.training.train_config import TrainConfig
from turnrl.training.trainer import Trainer, console
from turnrl.viz.records import write_token_advantages
from turnrl.viz.report import REPORT_NAME, write_report

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
"""Ctrl-C, and what a batch scheduler (Slurm, Kubernetes) sends some time before it kills a job."""


class StopRequested(BaseException):
    """Ctrl-C or SIGTERM before the run's first step, which stops it at once: nothing of it is to be saved yet.
    A ``BaseException``, as ``KeyboardInterrupt`` is, so that no ``except Exception`` on the way swallows it."""

    def __init__(self, signum: signal.Signals) -> None:
        super().__init__(signum.name)
        self.signal = signum


class GracefulStop:
    """Ctrl-C (SIGINT) or SIGTERM as a request: the first asks the loop to stop after the step in progress
    (which then saves a checkpoint); a second one interrupts at once. Outside the main thread it changes
    nothing, and a signal the process was started ignoring (a background job of a script) stays ignored.

    A SIGTERM within :attr:`SAME_SIGTERM_S` of the first is the same request delivered twice, not a second one:
    a batch scheduler (or ``timeout``) signals every process of the job, and torchrun forwards the one it got
    to its processes as well (twice, when the second reaches it while it is stopping them), so each process of
    a distributed run gets it two or three times within milliseconds. Such a SIGTERM reaches inductor's compile
    workers too, which die of it unless they ignore it (``turnrl train`` starts them so on a GPU): from the first
    one on, the process compiles what it still compiles itself
    (:func:`~turnrl.models.loading.compile_in_this_process`).

    ``turnrl train`` holds it from its start: before the first step (the model build, SFT, the first validation)
    a request raises :class:`StopRequested` at once, since there is no step to finish and nothing new to save
    (:attr:`phase` ``start``); during the steps it waits for the step in progress (``steps``); once the steps
    are over it lets the run finish its last validation, checkpoint and summary (``end``).
    """

    SAME_SIGTERM_S = 2.0

    def __init__(self, phase: str = "steps") -> None:
        self.requested = False
        self._requested_at = 0.0
        self.signal: signal.Signals | None = None
        """The signal that asked first (the command's exit status is 128 + its number, as a shell reports)."""
        self.phase = phase
        """``start``, ``steps`` or ``end``: what a request does now (see the class)."""
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> GracefulStop:
        if threading.current_thread() is threading.main_thread():
            for number in STOP_SIGNALS:
                if signal.getsignal(number) != signal.SIG_IGN:
                    self._previous[number] = signal.signal(number, self._handle)
        return self

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested:
            repeated = signum == signal.SIGTERM == self.signal
            if repeated and time.monotonic() - self._requested_at < self.SAME_SIGTERM_S:
                return
            raise KeyboardInterrupt
        self.requested = True
        self._requested_at = time.monotonic()
        self.signal = signal.Signals(signum)
        if self.signal is signal.SIGTERM:  # it may have reached inductor's compile workers too
            compile_in_this_process()
        if self.phase == "start":
            raise StopRequested(self.signal)
        name = "Ctrl-C" if signum == signal.SIGINT else self.signal.name
        again = "Ctrl-C again" if signum == signal.SIGINT else f"{name} again"
        if self.phase == "end":
            console.print(f"\n[bold]{name}: the run is finishing[/bold] (its last validation, checkpoint and "
                          f"summary; {again} stops at once)")
        else:
            console.print(f"\n[bold]{name}: stopping after this step[/bold] to save a checkpoint ({again} stops "
                          "at once, without saving)")

    def __exit__(self, *exc: object) -> None:
        for number, previous in self._previous.items():
            signal.signal(number, previous)


def _watched_sft(config: TrainConfig, run_dir: Path) -> SFTResult:
    """The SFT stage under a stall watch (rank 0's, which runs it): a demo env that hangs writes the stacks."""
    with StallWatch(stalls_path(run_dir, ranks.rank()), 60 * config.run.stall_dump_minutes) as watch:
        return sft_stage(config, run_dir, watch.progressed)


def sft_only(config: TrainConfig, data: str | None = None) -> Path:
    """``turnrl sft``: warm up the configured model and save it under the run directory."""
    if data is not None:
        config.sft.data = data
        config.sft.validate()  # ``--data`` comes after the load's checks; the chats rule out some settings
    _set_allocator(config)
    model_before = _sft_model(config).exists()
    try:
        with RunLock(run_directory(config)):
            preflight(config, stage="sft")
            path = _watched_sft(config, start_run(config, stage="sft")).model_path
    except Exception as error:
        refused = _refused_write(error, config, _how_to_run_sft_again(config, model_before))
        if refused is None:
            raise
        raise refused from error
    console.print(f"SFT model written to {path}", markup=False, highlight=False, soft_wrap=True)
    return path


def _validate_and_write(trainer: Trainer, logger: MetricsLogger | None, step: int, name: str,
                        done: StepOutput | None = None) -> StepOutput:
    """Validate after ``step`` and write its record and trajectories; ``done``: a validation of these same
    weights that the log already holds (a run stopped right after it, or one that ran no step), so only its
    trajectories are written (validating again would cost the time and log the step twice)."""
    output = trainer.validate() if done is None else done
    if logger is not None:  # rank 0 of a distributed run
        if done is None:
            logger.log(step, output.metrics)
        write_trajectories(output.trajectories, trainer.run_dir / "trajectories", name=name)
    return output


def _drop_trajectories_after(folder: Path, step: int) -> None:
    """Delete the trajectory files of steps after ``step`` (a resumed run's checkpoint), which an interrupted
    session wrote and the resumed run either writes again or (with fewer steps) never reaches: the files, like
    ``metrics.jsonl``, hold every step the run has once. Their images go too (``images/step_N_*.png``): kept,
    they would sit beside the new ones of a step written again with fewer episodes or turns, and fill the disk
    with those of a step never reached."""
    if not folder.is_dir():
        return
    for path in [*folder.glob("step_*.jsonl"), *folder.glob("images/step_*.png")]:
        number = re.match(r"step_(\d+)[._]", path.name)
        if number is not None and int(number.group(1)) > step:
            path.unlink()


def _say_errors(what: str, trajectories: list[Trajectory], known: set[str] | None = None) -> None:
    """Say on the console that some of ``what``'s episodes errored, and the commonest error: they count as
    failures, so an env or env server that fails would read as a policy that solves nothing. ``known``: the
    kinds of error said already (training steps say each kind once, then count it in ``rollout/errors``)."""
    if known is not None:
        new = error_kinds(trajectories) - known
        if not new:
            return
        known |= new
    note = errored_note(trajectories, "counted as failures")
    if note is not None:
        later = "; further steps count them in rollout/errors" if known is not None else ""
        console.print(f"[bold red]{what}:[/bold red] {escape(note)}{later}", soft_wrap=True)


def _every(n: int) -> Callable[[int], bool]:
    return lambda count: n > 0 and count % n == 0


def finished_summary(config: TrainConfig) -> dict[str, Any] | None:
    """The summary of a resumed run that has already run its ``run.steps`` (None when steps are left, or when
    ``summary.json`` is an earlier session's: a run resumed with more steps and killed after its last checkpoint,
    before its summary, still has the summary of the steps it had before, which its end writes anew)."""
    checkpoint = resumed_checkpoint(config).checkpoint if config.resume else None
    summary_path = run_directory(config) / "summary.json"
    if checkpoint is None or checkpoint_step(checkpoint) < config.run.steps or not summary_path.is_file():
        return None
    try:
        summary = parse_json(summary_path.read_bytes())
    except ValueError:  # damaged (not JSON, not text): the checkpoint's own summary is written again
        return None
    if not isinstance(summary, dict) or "val_success_after_rl" not in summary:
        return None
    return summary if summary.get("steps") == checkpoint_step(checkpoint) else None


def train(config: TrainConfig) -> dict[str, Any]:
    """SFT (when enabled), validation, ``run.steps`` RL steps, validation, summary.

    Ctrl-C stops after the step in progress: a checkpoint is saved, the way to resume printed, and the
    summary returned has ``interrupted_at_step``; before the first step it stops at once (see
    :class:`GracefulStop`); a second Ctrl-C stops at once, naming the checkpoint to resume from, and raises
    ``KeyboardInterrupt``.

    Raises:
        ConfigError: before anything is written, for what :func:`preflight` checks; and for a write into the
            run directory that the disk refused (no space, a file-size limit), saying how to go on.
    """
    _set_allocator(config)  # before CUDA starts (the process group's device, the models)
    start = ranks.command_start()
    distributed = ranks.launched_by_torchrun()
    pool = config.distributed.rollout_processes
    one_process_only = config.distributed.backend == "ray" or (config.distributed.async_rollout and not pool)
    if distributed and one_process_only:
        raise ConfigError("several processes under torchrun train with FSDP; distributed.async_rollout (without "
                          "distributed.rollout_processes) and distributed.backend=ray run in one process: start "
                          "them without torchrun")
    if pool and not distributed:
        raise ConfigError(f"distributed.rollout_processes={pool} are processes of torchrun: set "
                          f"distributed.nproc_per_node={pool + 1} or more")
    if pool and ranks.launched_world() <= pool:
        raise ConfigError(f"distributed.rollout_processes={pool} of {ranks.launched_world()} processes leaves no "
                          f"process to train: start {pool + 1} or more")
    # A process that trains without FSDP2 has no shards for the option to move: it would train on the GPU regardless.
    offload_unused = config.distributed.cpu_offload and not compose.trains_with_fsdp(config)
    if offload_unused and distributed:
        raise ConfigError(f"distributed.cpu_offload keeps FSDP2's shards in host memory, and the one trainer beside "
                          f"distributed.rollout_processes={pool} trains without FSDP2: start two trainers or more, or "
                          "drop distributed.cpu_offload")
    if offload_unused and config.distributed.backend != "fsdp":  # fsdp without torchrun is refused below
        raise ConfigError("distributed.cpu_offload keeps FSDP2's shards in host memory, and this run trains in one "
                          "process without FSDP2: set distributed.backend=fsdp (FSDP2 runs on one GPU too), or drop "
                          "distributed.cpu_offload")
    if distributed:
        trainers = ranks.launched_trainers(pool)
        device = ranks.init_process_group(config.model.device, config.distributed.timeout_s, trainers)
        if config.run.threads == 0:
            torch.set_num_threads(ranks.threads_per_process())
        # config.yaml then says how many processes a resume needs (`turnrl train resume=RUN_DIR` starts them).
        config.distributed.nproc_per_node = ranks.launched_world()
        if ranks.launched_rank() >= trainers:
            from turnrl.training.backends.pool_protocol import serve_rollouts

            serve_rollouts(config, device)  # until trainer 0 says stop
            return {}
    elif config.distributed.backend == "fsdp":
        raise ConfigError("distributed.backend=fsdp runs one process per GPU: start them with "
                          "`torchrun --nproc-per-node N -m turnrl.cli train ...` or distributed.nproc_per_node=N")
    stop = GracefulStop(phase="start")
    try:
        with stop, run_lock(config):  # the lock before the checks: a run that starts in between would pass them too
            return _train(config, start, distributed, stop)
    except StopRequested as stopped:
        return _stopped_before_steps(config, stopped.signal)
    except KeyboardInterrupt:  # a second request: the step in progress is not saved
        if ranks.is_main():
            console.print(f"stopped at once, the step in progress unsaved; {_how_to_go_on(config)}",
                          markup=False, highlight=False, soft_wrap=True)
        raise
    except Exception as error:
        behind = _stop_behind(error)
        if behind is not None:
            return _stopped_before_steps(config, behind.signal)
        refused = _refused_write(error, config, _how_to_go_on(config))
        if refused is None:
            raise
        raise refused from error
    finally:
        if distributed:
            ranks.close_process_group()


_IN_THE_WAY = (IsADirectoryError, NotADirectoryError, FileExistsError, PermissionError)
"""What a file of the run that is not what the run made of it raises: a folder where the run writes a file
(``metrics.jsonl``, ``summary.json``, ``stop``), a file where it makes a folder (``trajectories``), a file it
may not write (changed by hand, or by another user)."""


def _refused_write(error: Exception, config: TrainConfig, go_on: str) -> ConfigError | None:
    """The one-line error for a write into the run directory that the disk refused (no space, a file-size limit:
    said by an ``OSError`` or by the error of a writer that wraps one, safetensors' saving a model) or that a file
    of the run stands in the way of (:func:`_run_file_in_the_way`), ending with ``go_on``, what continues the
    command; None for another fault, whose traceback should be seen."""
    cause = disk_error_cause(error)
    if cause is not None:
        return ConfigError(f"the run could not write into {run_directory(config)}: {cause}. Free some space, raise "
                           f"the limit or put run.output_dir on a larger disk; {go_on}")
    damaged = _run_file_in_the_way(error, run_directory(config)) if isinstance(error, OSError) else None
    return None if damaged is None else ConfigError(f"{damaged}; {go_on}")


def _run_file_in_the_way(error: OSError, run_dir: Path) -> str | None:
    """One line naming the run's own file that ``error`` is about and what to do with it, when it is one of the
    run directory's and of a kind in :data:`_IN_THE_WAY`; None otherwise (a fault whose traceback should be
    seen)."""
    if not isinstance(error, _IN_THE_WAY):
        return None
    names = [Path(name) for name in (error.filename, error.filename2) if isinstance(name, str)]
    inside = [path for path in names if path.resolve().is_relative_to(run_dir.resolve())]
    if not inside:
        return None
    path = inside[-1]  # of a rename, the target: the run's file; its temporary source is the run's own
    if isinstance(error, PermissionError) and not path.exists():  # a file to be made: its folder refused it
        path = path.parent
        what = "may not be written into by this user: give it back its permissions (`chmod u+rwx`)"
    elif isinstance(error, PermissionError):
        what = "may not be read or written by this user: give it back its permissions (`chmod u+rw`)"
    elif not path.exists():  # a folder to be made: a file stands where one of the folders above it goes
        path = next(folder for folder in path.parents if folder.exists())
        what = "is a file where the run keeps a folder: move it away" if path.resolve().is_relative_to(
            run_dir.resolve()) else (f"is a file, and the run directory {run_dir} goes inside it: move it away, "
                                     "or set run.output_dir to a folder")
    elif path.is_dir():
        what = "is a folder where the run keeps a file: move it away"
    else:
        what = "is a file where the run keeps a folder: move it away"
    return f"{path} {what} ({error.strerror})"


def _how_to_run_sft_again(config: TrainConfig, model_before: bool) -> str:
    """What runs ``turnrl sft`` again after a write it was refused: the same command, unless it left part of its
    model behind (there was none before it, ``model_before``), which the command's check then takes for an earlier
    run's."""
    if _sft_model(config).exists() and not model_before:
        return f"then run it again with run.overwrite=true ({_sft_model(config)} was left part-written)"
    return "then run it again with the same command"


def _how_to_go_on(config: TrainConfig) -> str:
    """What continues a run that stopped, as it stands on disk: its resume where it holds a complete checkpoint,
    else a fresh start (a resume would only say that there is no checkpoint)."""
    run_dir = run_directory(config)
    checkpoint = resume_point(run_dir, critic=config.algorithm.uses_critic).checkpoint
    command = turnrl_command()
    if checkpoint is not None:
        return f"then continue from {checkpoint.name} (intact) with `{command} train resume={run_dir}`"
    if (run_dir / "config.yaml").is_file():
        return (f"there is nothing to resume (no checkpoint was saved): start it again with `{command} train "
                f"--config {run_dir / 'config.yaml'} run.overwrite=true`")
    return "nothing of it was saved: start it again with the same command"


def _stop_behind(error: BaseException) -> StopRequested | None:
    """The stop request that ``error`` was raised in the wake of, if any. A request before the first step
    interrupts whatever the process is doing, and cleanup code on the way may raise an error of its own, which
    then carries the request as its context (omegaconf's ``finally`` blocks read a local the interruption left
    unset: an ``UnboundLocalError`` in place of the request, seen when SIGTERM came while a resume read its
    config)."""
    seen: set[int] = set()
    pending: list[BaseException | None] = [error]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        if isinstance(current, StopRequested):
            return current
        seen.add(id(current))
        pending += [current.__cause__, current.__context__]
    return None


def _stopped_before_steps(config: TrainConfig, by_signal: signal.Signals) -> dict[str, Any]:
    """Ctrl-C or SIGTERM before the first step (of the run, or of a resumed run's session): nothing new was saved;
    one line says so and how to go on. The summary returned says where the run stopped (the exit status)."""
    name = "Ctrl-C" if by_signal == signal.SIGINT else by_signal.name
    if ranks.is_main():
        console.print(f"{name} before the first step: stopped; {_how_to_go_on(config)}",
                      markup=False, highlight=False, soft_wrap=True)
    checkpoint = resume_point(run_directory(config), critic=config.algorithm.uses_critic).checkpoint
    done = checkpoint_step(checkpoint) if checkpoint is not None and config.resume else 0
    return {"interrupted_at_step": done, "stopped_by": "request", "stop_signal": by_signal.name}


def _train(config: TrainConfig, start: float, distributed: bool, stop: GracefulStop) -> dict[str, Any]:
    preflight(config)
    rewards = Rewards(config.rewards)  # a bad reward spec stops here, not after SFT
    check_fields_written(rewards.functions, get_format(config.agent.format))  # and one the format cannot feed
    done = finished_summary(config)
    if done is not None:
        console.print(f"run {config.resume} already ran its {config.run.steps} steps; nothing to do "
                      f"(raise run.steps to continue it). Summary: {run_directory(config) / 'summary.json'}",
                      markup=False, highlight=False)
        if ranks.is_main() and not (run_directory(config) / REPORT_NAME).is_file():  # killed before its report
            _report(run_directory(config))
        return done
    resumed = config.resume is not None
    if distributed and config.model.path is None:
        # transformers writes a model only on rank 0 of a process group, so rank 0 builds the built-in model
        # (or finds it cached) while the others wait: they all load a complete one.
        if ranks.is_main():
            base_model_path(config.model)
        ranks.wait_for_main()
    device = ranks.training_device(config.model.device)
    if device.type == "cuda":  # where the engine and model.compile compile: before anything has compiled
        start_compile_workers_ignoring_sigterm()
    if device.type == "cuda" and config.run.gpu_share < 1:  # before anything of this run is on the GPU
        cap_gpu_memory(config.run.gpu_share, device)
    checked = check_memory(config, base_model_path(config.model), device, ranks.world_size() if distributed else 1)
    memory = checked.estimate if checked is not None else None
    if memory is not None and config.model.engine.kv_cache_gb == 0:
        # The engine's default (30% of what is free when it starts) does not know the optimizer's states to come.
        config.model.engine.kv_cache_gb = round(memory.parts.get("key/value cache", 0.0) / GIB, 1) or 0.1
    sft = None
    if config.sft.enabled and not resumed:
        run_dir = start_run(config)
        if ranks.is_main():
            sft = _watched_sft(config, run_dir)
        ranks.wait_for_main()  # the other processes start RL from the SFT model rank 0 wrote
    # Every process starts from the SFT model rank 0 wrote.
    start_model = _sft_model(config) if distributed and config.sft.enabled and not resumed else \
        sft.model_path if sft is not None else None
    parts = compose.parts(config)
    trainer = Trainer(config, start_model=start_model, rewards=rewards, parallel=parts.parallel,
                      rollouts=parts.rollouts)
    if memory is not None:
        trainer.startup["memory_estimate_gib"] = memory.total / GIB
        console.print(f"memory per GPU, estimated: {memory.table()}", markup=False, highlight=False)
    if checked is not None and checked.faster is not None:
        console.print(f"faster, and estimated to fit: {checked.faster}", markup=False, highlight=False)
    try:
        with StallWatch(stalls_path(trainer.run_dir, ranks.rank()), 60 * config.run.stall_dump_minutes) as watch:
            return _run_steps(config, trainer, sft, resumed, start, stop, watch)
    finally:
        heap.release()
        trainer.close()


def _run_steps(config: TrainConfig, trainer: Trainer, sft: Any, resumed: bool, start: float,
               stop: GracefulStop, watch: StallWatch) -> dict[str, Any]:
    """Validation, the RL steps, validation, the last checkpoint and the summary (rank 0 writes); ``watch``'s clock
    starts again at each step and before the last validation."""
    distributed = ranks.launched_by_torchrun()
    trainer.session_start = start
    if sft is not None:
        trainer.summary.update(sft.metrics)
        trainer._timed("sft_s", sft.seconds)
    world = ranks.world_size()
    processes = f", {world} process{'es' if world > 1 else ''} (FSDP)" if distributed else ""
    if distributed and config.distributed.rollout_processes:
        pool = config.distributed.rollout_processes
        processes = f", {world} trainer process{'es' if world > 1 else ''}{' (FSDP)' if world > 1 else ''} and " \
                    f"{pool} rollout process{'es' if pool > 1 else ''}"
    compiled = f", {trainer.compiled_parts} layer parts compiled" if trainer.compiled_parts else ""
    remote = f" (envs served at {', '.join(config.env.remote)})" if config.env.remote else ""
    console.print(f"[bold]turnrl train[/bold] {escape(config.run.name)}: {escape(config.env.id)}{escape(remote)}, "
                  f"{config.algorithm.advantage}, run dir {escape(str(trainer.run_dir))}{processes}{compiled}",
                  soft_wrap=True)  # a path cut by the terminal's width cannot be copied whole
    short_rows = rows_shorter_than_episodes(config)
    if short_rows is not None:
        console.print(f"note: {short_rows}", markup=False, highlight=False, soft_wrap=True)
    logger = MetricsLogger(trainer.run_dir, config.run.tensorboard, config.run.wandb_project,
                           config=json.loads(json.dumps(vars(config), default=lambda o: vars(o))),
                           resume_step=trainer.first_step if resumed else None) if ranks.is_main() else None

    if resumed and logger is not None:
        _drop_trajectories_after(trainer.run_dir / "trajectories", trainer.first_step)
    validation: StepOutput | None = None  # the latest validation, while the weights are still the ones it saw
    if not resumed:
        validation = _validate_and_write(trainer, logger, 0, "val_before_rl.jsonl")
        success = validation.metrics["val/success"]
        trainer.summary["val_success_before_rl"] = success
        console.print(f"validation success before RL: [bold]{success:.3f}[/bold]")
        _say_errors("validation before RL", validation.trajectories)

    validate_now, save_now = _every(config.validation.every), _every(config.run.save_every)
    write_now = _every(config.run.trajectories_every)
    history = logged_steps(trainer.run_dir, trainer.first_step) if resumed else []
    early_stops, ran = EarlyStops(config.collapse, history), config.run.steps
    stopped: dict[str, Any] = {}  # why a run ended before run.steps, other than an early stop's rule
    trainer.collapse.resume(history)
    last_step = config.run.steps
    if early_stops.stopped_before is not None:  # the run had ended at its checkpoint: it ends so again
        ran = last_step = trainer.first_step
        early_stops.fired = early_stops.stopped_before
        console.print(f"[bold]early stop[/bold] after step {ran} (before this resume): "
                      f"{early_stops.stopped_before.reason}", soft_wrap=True)
    stop.phase = "steps"  # from here a request waits for the step in progress, which it then saves
    heap.settle()
    cache_noted = pass_noted = False
    error_kinds_said: set[str] = set()
    with RunProgress(console, "rl", config.run.steps, trainer.first_step) as progress:
        for step in range(trainer.first_step + 1, last_step + 1):
            watch.progressed()
            if step == trainer.first_step + 2:
                heap.settle()  # and what the first step built to stay (compiled graphs, CUDA graphs, caches)
            try:
                with _memory_recorded(config, trainer, step), _profiled(config, trainer, step):
                    output = trainer.step(step - 1)
            except RolloutWorkerError as error:
                # Escaped: an error's text is no markup (gloo's name their source file in brackets).
                console.print(f"[bold red]rollout stopped:[/bold red] {escape(str(error))}", soft_wrap=True)
                if step == 1:  # nothing trained, nothing to save: one line, and how to start again
                    raise ConfigError(f"the rollout stopped in the run's first step, before any update ({error}); "
                                      "nothing was saved: run the command again, with run.overwrite=true, once the "
                                      "rollout workers can run") from error
                # Saves the last finished step; not after a failed weights transfer, which comes after the step's
                # update: the weights are then a step ahead of the records, and the last checkpoint is the one.
                return _stop(trainer, logger, step - 1, error=True, save=not isinstance(error, WeightsTransferError))
            except torch.OutOfMemoryError as error:
                raise rl_out_of_memory(error, config, step, latest_checkpoint(trainer.run_dir),
                                       trainer.memory_retries.get(step), trainer.shortest_pair) from error
            metrics = output.metrics
            last = step == config.run.steps
            # A step whose filter kept nothing is not validated (RAGEN's trainer skips the rest of such a step), so
            # it adds nothing to the low-success early stop's count.
            skipped = metrics.get("filter/skipped_step") == 1.0
            _say_errors(f"step {step}", output.trajectories, error_kinds_said)
            validation = trainer.validate() if validate_now(step) and not last and not skipped else None
            if validation is not None:
                metrics.update(validation.metrics)
                _say_errors(f"validation after step {step}", validation.trajectories)
            early_stop = early_stops.observe(metrics)
            if logger is not None:
                logger.log(step, metrics)
            if write_now(step - 1) and logger is not None:  # steps 1, 1 + N, 1 + 2N, ...
                write_trajectories(output.trajectories, trainer.run_dir / "trajectories", name=f"step_{step:06d}.jsonl")
                if output.token_advantages:
                    write_token_advantages(trainer.run_dir / "trajectories" / f"step_{step:06d}.advantages.jsonl",
                                           output.token_advantages)
            errored = int(metrics.get("rollout/errors", 0))
            progress.update(1, f"success {metrics.get('rollout/success', 0):.2f} "
                               f"reward {metrics.get('rollout/reward_mean', 0):.2f}"
                               + (f" errors {errored}" if errored else ""))
            cache_note = None if cache_noted else cache_full_note(metrics, config.model.engine.kv_cache_gb)
            if cache_note is not None:
                console.print(f"step {step}: {cache_note}", markup=False, highlight=False, soft_wrap=True)
                cache_noted = True
            pass_note = None if pass_noted else half_full_passes_note(metrics, config.algorithm.micro_batch_tokens)
            if pass_note is not None:
                console.print(f"step {step}: {pass_note}", markup=False, highlight=False, soft_wrap=True)
                pass_noted = True
            # Ctrl-C, or the stop file (what stops every process of a torchrun run after the same step).
            requested = stop.requested or (trainer.run_dir / STOP_FILE).exists()
            stop_requested = ranks.any_rank(requested) if distributed else requested
            if stop_requested and not last:
                return _stop(trainer, logger, step, by_signal=stop.signal)
            if early_stop is not None:  # the run ends as a finished one: validation, checkpoint, summary
                ran = step
                console.print(f"[bold]early stop[/bold] after step {ran}: {early_stop.reason}", soft_wrap=True)
                break
            limit = config.run.time_limit_minutes  # the same on every process: no collective without one
            out_of_time = limit > 0 and time.time() - start > 60 * limit
            if limit > 0 and (ranks.any_rank(out_of_time) if distributed else out_of_time) and not last:
                ran = step
                stopped = {"stopped_by": "time_limit", "time_limit": {"minutes": limit, "step": step}}
                console.print(f"[bold]time limit[/bold] of {limit:g} minutes reached after step {ran}", soft_wrap=True)
                break
            if save_now(step) and not last:
                _save(trainer, step)

    stop.phase = "end"
    watch.progressed()
    if ran == trainer.first_step and resumed and trainer.summary.get("steps") == ran and \
            "val_after_rl" in trainer.summary:
        # Killed after its last checkpoint and before its summary: that checkpoint was saved after the final
        # validation was logged and its trajectories written, so neither is repeated, nor the checkpoint.
        after = trainer.summary["val_after_rl"]
    else:
        # A run that stopped early right after a validation, or ran no step, ends with that validation: the
        # weights are the ones it saw. (Every other way out of the loop leaves none: the last step skips its own.)
        final = _validate_and_write(trainer, logger, ran, "val_after_rl.jsonl", done=validation)
        if validation is None:  # a validation that ran in the loop was said there
            _say_errors("validation after RL", final.trajectories)
        after = final.metrics
        trainer.summary["val_success_after_rl"] = after["val/success"]
        trainer.summary["val_after_rl"] = after
        trainer.summary["steps"] = ran
        if ran > 0 and config.run.save_at_end:
            _save(trainer, ran)
    # Why the run stopped early (after the save: a resume forgets it).
    trainer.summary.update({**early_stops.summary(ran), **stopped})
    if logger is None:
        return trainer.summary
    (trainer.run_dir / STOP_FILE).unlink(missing_ok=True)  # asked for during the last step: the run has ended
    path = trainer.write_summary()
    logger.close()
    before_value = trainer.summary.get("val_success_before_rl")
    errored = int(after.get("val/errors", 0))
    errors = (f" ([bold red]{errored} of {int(after.get('val/episodes', 0))} episodes errored[/bold red], counted as "
              "failures: their errors are in trajectories/val_after_rl.jsonl)" if errored else "")
    success = after["val/success"]
    line = (f"validation success before RL: {before_value:.3f}, after RL: [bold]{success:.3f}[/bold]"
            if before_value is not None else f"validation success after RL: {success:.3f}")
    console.print(line + errors, soft_wrap=True)
    console.print(f"summary: {path}", markup=False, highlight=False, soft_wrap=True)
    _report(trainer.run_dir)
    return trainer.summary


def _set_allocator(config: TrainConfig) -> None:
    """Torch's CUDA allocator settings (``run.cuda_alloc_conf`` or the user's variable), said in one line."""
    line = set_allocator_settings(config)
    if line is not None and torch.cuda.is_available():
        console.print(line, markup=False, highlight=False, soft_wrap=True)


def _memory_recorded(config: TrainConfig, trainer: Trainer, step: int) -> AbstractContextManager[None]:
    """The allocator's history of ``step`` saved under ``memory/`` (``run.memory_snapshot_steps``), or nothing."""
    if step > config.run.memory_snapshot_steps:
        return nullcontext()
    return recorded(trainer.run_dir / "memory" / f"rank{ranks.rank()}_step{step}.pickle", trainer.device)


def _profiled(config: TrainConfig, trainer: Trainer, step: int) -> AbstractContextManager[None]:
    """A trace of ``step`` saved under ``profile/`` (``run.profile_steps``), or nothing."""
    if step not in config.run.profile_steps:
        return nullcontext()
    stem = trainer.run_dir / "profile" / f"rank{ranks.rank()}_step{step}"
    if ranks.is_main():
        console.print(f"tracing step {step} (slower: Python stacks) to {stem.parent}/")
    return profiled(stem, trainer.device)


def _save(trainer: Trainer, step: int) -> Path | None:
    """The checkpoint after ``step``, or None where it would not fit on its disk: then the run goes on (or
    ends with its summary) and the summary and the console say why no checkpoint was written."""
    problem = trainer.checkpoint_space_problem()
    if problem is None:
        return trainer.save(step)
    console.print(f"[bold red]checkpoint after step {step} not written:[/bold red] {escape(problem)}",
                  soft_wrap=True)
    trainer.summary["checkpoint_not_written"] = {"step": step, "why": problem}
    return None


def _sft_model(config: TrainConfig) -> Path:
    """Where the SFT stage (rank 0's) wrote the model RL starts from."""
    return run_directory(config) / "sft" / "model"


def _report(run_dir: Path) -> None:
    """The run's HTML report (``turnrl view``); a finished run never fails on it."""
    try:
        report = write_report(run_dir)
    except (OSError, ValueError) as error:
        console.print(f"no report: {error}", markup=False)
        return
    console.print(f"report: {report}  (turnrl view {run_dir} --serve to serve it)", markup=False, highlight=False,
                  soft_wrap=True)


def _stop(trainer: Trainer, logger: MetricsLogger | None, step: int, error: bool = False,
          by_signal: signal.Signals | None = None, save: bool = True) -> dict[str, Any]:
    """Ctrl-C or SIGTERM (``by_signal``), the stop file or a lost rollout worker (``error``): save the run after
    its last finished ``step`` (``save`` False: the trainer's state is no longer that step's; the last checkpoint
    is the one to continue from), say how to resume; the summary says where the run stopped and why."""
    checkpoint = _save(trainer, step) if save else latest_checkpoint(trainer.run_dir)
    if ranks.is_main():
        (trainer.run_dir / STOP_FILE).unlink(missing_ok=True)
    stopped: dict[str, Any] = {"interrupted_at_step": step, "stopped_by": "error" if error else "request"}
    if by_signal is not None:
        stopped["stop_signal"] = by_signal.name
    if logger is None:
        return {**trainer.summary, **stopped}
    logger.close()
    if save:
        saved = f"checkpoint {checkpoint or 'not written (above)'}"
    else:  # the steps after the last checkpoint are trained again by the resume (their records replaced)
        saved = f"no checkpoint after it: the last is {checkpoint.name if checkpoint else 'none'}, and a resume " \
                "trains the steps after it again"
    console.print(f"[bold]{'stopped by the error above' if error else 'interrupted'}[/bold] after step {step} "
                  f"of {trainer.config.run.steps}; {escape(saved)}", soft_wrap=True)
    if checkpoint is not None:  # one unwrapped line, to copy whole
        console.print(f"continue with: {turnrl_command()} train resume={trainer.run_dir}", markup=False,
                      highlight=False, soft_wrap=True)
    _report(trainer.run_dir)
    return {**trainer.summary, **stopped}

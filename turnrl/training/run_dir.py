"""A run's directory: where it lives, what a run writes there, and how a run starts in it.

A directory holds one run: a new run refuses one that holds another (:mod:`turnrl.training.preflight`
says so before anything is written), ``run.overwrite`` deletes the old outputs first, and ``resume``
continues the run it names, from the checkpoint :func:`resumed_checkpoint` picks. One process writes into
a directory at a time (:class:`RunLock`), and its ``config.yaml`` is replaced whole or not at all.
"""

from __future__ import annotations

import errno
import os
import shutil
import socket
import time
from contextlib import nullcontext
from dataclasses import fields, replace
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
import yaml
from filelock import FileLock, Timeout
from rich.console import Console

from turnrl.config import ConfigError, load_config, to_yaml, turnrl_command
from turnrl.files import atomic_write_text, parse_yaml, remove_unfinished_writes
from turnrl.training import ranks
from turnrl.training.checkpoint import (
    ResumePoint,
    checkpoint_step,
    checkpoint_steps,
    latest_checkpoint,
    latest_name,
    newest_whole_actor,
    reference_problem,
    remove_unfinished_saves,
    restore_replaced,
    resume_point,
)
from turnrl.training.seeding import level_plan_change, seed_everything
from turnrl.training.train_config import TrainConfig
from turnrl.viz.report import PLOTS_DIR, REPORT_NAME

RL_OUTPUTS = ("checkpoints", "metrics.jsonl", "tensorboard", "summary.json", "trajectories", "reference",
              REPORT_NAME, PLOTS_DIR)
"""What an RL run writes at the top of its directory: a directory holding any of them holds a run."""


def run_directory(config: TrainConfig) -> Path:
    """Where the run lives: the resumed directory, else ``run.output_dir/run.name``."""
    return Path(config.resume) if config.resume else Path(config.run.output_dir) / config.run.name


def resumed_checkpoint(config: TrainConfig) -> ResumePoint:
    """The checkpoint ``resume=RUN_DIR`` continues from (:func:`~turnrl.training.checkpoint.resume_point`).

    Raises:
        ConfigError: the directory holds no complete checkpoint; one line saying what is broken and what to do.
    """
    run_dir = run_directory(config)
    changed = saved_models_change(run_dir, config)
    if changed is not None:
        raise ConfigError(changed)
    reference = run_dir / "reference"
    if _needed_models(config)["a KL reference model"] and reference.is_dir():
        problem = reference_problem(reference)
        if problem is not None:
            raise ConfigError(f"{reference}, the frozen model the KL term compares the actor with, is damaged "
                              f"({problem}); it is a copy of the actor as this run's RL began (model.path, or the "
                              "SFT stage's model): put that model's save_pretrained folder there, or resume with "
                              "algorithm.kl_coef=0")
    point = resume_point(run_dir, critic=config.algorithm.uses_critic)
    if point.checkpoint is None:
        none = "no complete checkpoint" if checkpoint_steps(run_dir) else "no checkpoint"
        raise ConfigError(f"resume={config.resume!r} holds {none} ({point.note}); a run saves one every "
                          "run.save_every steps, at its end and on Ctrl-C; start it afresh with "
                          f"`{turnrl_command()} train --config {run_dir / 'config.yaml'} run.overwrite=true`")
    return point


def _needed_models(config: TrainConfig) -> dict[str, bool]:
    """Which models a resume with ``config`` loads besides the actor: a critic, LoRA adapters in place of the
    whole actor, the frozen reference of the KL term (LoRA's is the model under the adapters)."""
    return {"a critic": config.algorithm.uses_critic, "LoRA adapters": config.lora.enabled,
            "a KL reference model": config.algorithm.kl_coef > 0 and not config.lora.enabled}


def _saved_models(run_dir: Path) -> dict[str, bool] | None:
    """Which of those the run has on disk: a critic in some checkpoint (``critic/``), adapters as the newest
    checkpoint's actor (``actor/adapter_config.json``), the reference the run keeps (``RUN_DIR/reference``);
    None when no checkpoint holds an actor (what is wrong is said elsewhere). Read from the files, not from
    ``config.yaml``, which each resume rewrites with its own settings."""
    checkpoints = [run_dir / "checkpoints" / f"step_{step:06d}" for step in reversed(checkpoint_steps(run_dir))]
    actors = [checkpoint / "actor" for checkpoint in checkpoints if (checkpoint / "actor").is_dir()]
    if not actors:
        return None
    return {"a critic": any((checkpoint / "critic").is_dir() for checkpoint in checkpoints),
            "LoRA adapters": (actors[0] / "adapter_config.json").is_file(),
            "a KL reference model": (run_dir / "reference").is_dir()}


def saved_models_change(run_dir: Path, resumed: TrainConfig) -> str | None:
    """Why ``resumed`` (the run's ``config.yaml`` with a resume's overrides) needs models that the run does not
    hold, or holds as others (``algorithm.advantage=gae`` on a GRPO run: a critic it never trained;
    ``lora.enabled`` switched), and what to do; None when it has what the resume loads.

    Such a resume would otherwise stop deep in the model loading with a traceback, or (a critic asked for) call
    every intact checkpoint incomplete and advise ``run.overwrite=true``, which deletes them."""
    saved = _saved_models(run_dir)
    if saved is None:
        return None
    needed = _needed_models(resumed)
    missing = [name for name in needed if needed[name] and not saved[name]]
    switched = [name for name in ("LoRA adapters",) if saved[name] and not needed[name]]
    if not missing and not switched:
        return critic_dropped(run_dir, resumed)
    what = "; ".join([*(f"{name}, which the run has not saved" for name in missing),
                      *(f"no {name}, which the run was trained with" for name in switched)])
    return (f"resume={resumed.resume!r} would need {what}: its checkpoints cannot be resumed that way; resume it "
            f"with the run's own algorithm.advantage, algorithm.kl_coef and lora.enabled (leave them out), or start "
            f"a new run from one of its models (model.path={run_dir}/checkpoints/step_N/actor)")


def saved_config(checkpoint: Path) -> TrainConfig | None:
    """The run's settings as ``checkpoint``'s copy of ``config.yaml`` holds them; None where it keeps none, or its
    copy does not read (the copy is a spare: a resume goes on from the run's own ``config.yaml``)."""
    try:
        return load_config(TrainConfig, checkpoint / "config.yaml")
    except (OSError, ConfigError):
        return None


def moved_levels(saved: TrainConfig, checkpoint: Path, config: TrainConfig) -> str | None:
    """Why a resume of ``checkpoint`` (``saved``: the run's settings, :func:`saved_config`) with ``config`` would
    play other levels than the run planned for the steps after it
    (:func:`~turnrl.training.seeding.level_plan_change`), or None."""
    return level_plan_change(saved, config, checkpoint_step(checkpoint))


def lora_change(saved: TrainConfig, checkpoint: Path, config: TrainConfig) -> str | None:
    """Why ``config`` cannot resume ``checkpoint`` with other LoRA settings than the run's (``saved``,
    :func:`saved_config`), or None: its adapters (or its whole weights, without LoRA) keep the settings they were
    trained with, and loading them would ignore the new ones."""
    changed = [f"lora.{field.name}: {getattr(saved.lora, field.name)!r} -> {getattr(config.lora, field.name)!r}"
               for field in fields(config.lora) if getattr(saved.lora, field.name) != getattr(config.lora, field.name)]
    if not changed:
        return None
    return (f"resume={config.resume!r} changes {'; '.join(changed)}, which {checkpoint.name} was trained with and "
            f"keeps: resume with the run's LoRA settings, or start a new run from its model "
            f"(model.path={checkpoint / 'actor'})")


KEPT_ON_RESUME = ("builtin_preset", "builtin_template")
"""The model settings a resume of a built-in model's run cannot change: its checkpoints' weights have that
preset's shapes and load whatever the setting says, so the run's ``config.yaml`` would name a model it never
trained."""


def kept_setting_change(saved: TrainConfig, checkpoint: Path, config: TrainConfig) -> str | None:
    """Why ``config`` cannot resume ``checkpoint`` with other :data:`KEPT_ON_RESUME` settings than the run's
    (``saved``, :func:`saved_config`), or None (also for a run of a ``model.path``)."""
    if saved.model.path is not None:
        return None
    changed = [f"model.{name}: {getattr(saved.model, name)!r} -> {getattr(config.model, name)!r}"
               for name in KEPT_ON_RESUME if getattr(saved.model, name) != getattr(config.model, name)]
    if not changed:
        return None
    return (f"resume={config.resume!r} changes {'; '.join(changed)}: {checkpoint.name} holds the model the run "
            "was built as; resume with the run's own (leave them out), or start a new run from its model "
            f"(model.path={checkpoint / 'actor'})")


def critic_dropped(run_dir: Path, resumed: TrainConfig) -> str | None:
    """Why ``resumed`` cannot go on with a critic from the checkpoint ``checkpoints/latest`` names (else the
    newest), which its copy of ``config.yaml`` says was trained without one (a run resumed once with a GRPO
    estimator, then with GAE again), or None. The critic of an older checkpoint would throw away the steps after
    it, and the resume would take the newest checkpoint for a damaged one."""
    if not resumed.algorithm.uses_critic:
        return None
    steps = checkpoint_steps(run_dir)
    name = latest_name(run_dir) or (f"step_{steps[-1]:06d}" if steps else None)
    if name is None:
        return None
    saved = saved_config(run_dir / "checkpoints" / name)
    if saved is None or saved.algorithm.uses_critic:  # without a copy, the checkpoint's own checks say
        return None
    return (f"resume={resumed.resume!r} would go on with a critic from {name}, which was trained without one "
            f"(algorithm.advantage={saved.algorithm.advantage}): resume it with algorithm.advantage="
            f"{saved.algorithm.advantage}, or start a new run from its model "
            f"(model.path={run_dir / 'checkpoints' / name / 'actor'})")


def changed_settings(run: dict[str, Any], resumed: TrainConfig) -> list[str]:
    """The settings ``resumed`` changes from the run's own (``run``: its ``config.yaml`` as read), as
    ``env.id: 'FrozenLake' -> 'Bandit'``, in the order of the config: those of what is trained and played, not
    ``resume`` nor the run's bookkeeping (``run.steps``, which a resume raises to go on, the saving and the
    logging)."""
    before, after = flat_settings(run), flat_settings(yaml.safe_load(to_yaml(resumed)))
    return [f"{key}: {before[key]!r} -> {value!r}" for key, value in after.items()
            if key in before and key != "resume" and not key.startswith("run.") and before[key] != value]


def write_resumed_config(config: TrainConfig) -> list[str]:
    """The run's ``config.yaml`` rewritten with a resume's settings (once its checkpoint has loaded); returns the
    settings it changed (:func:`changed_settings`)."""
    run_dir = run_directory(config)
    path = run_dir / "config.yaml"
    located = run_dir if run_dir.name else run_dir.resolve()  # resume=. names no folder by itself
    try:
        run = parse_yaml(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, yaml.YAMLError):  # the resume's checks read it whole: damaged since, no note
        run = None
    # Where the run lives, whatever the resume was given (or the run's folder was moved): a later
    # `--config RUN/config.yaml` run then writes where this one is, not where another run.output_dir pointed.
    write_config(replace(config, run=replace(config.run, output_dir=str(located.parent), name=located.name)))
    return changed_settings(run, config) if isinstance(run, dict) else []


def write_config(config: TrainConfig) -> None:
    """The run's ``config.yaml``: what ``resume=RUN_DIR`` reads back (written by rank 0, whole or not at all:
    a resume reads it before anything else, so a file cut short would stop every later resume)."""
    if ranks.is_main():
        atomic_write_text(run_directory(config) / "config.yaml", to_yaml(config))


def _config_damage(path: Path) -> str | None:
    """What makes a run's ``config.yaml`` unreadable as its settings (``empty``, ``not UTF-8 text``), or None.

    An empty file would read as every default: a resume would then check the checkpoints against the wrong
    algorithm (a critic it never had) or go on with the wrong env, so it counts as damaged here.
    """
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as error:
        return f"cannot be read: {error.strerror or error}"
    except UnicodeDecodeError:
        return "not UTF-8 text"
    if not text.strip():
        return "empty"
    try:
        settings = parse_yaml(text)
    except yaml.YAMLError as error:
        return f"not valid YAML: {' '.join(str(error).split())}"
    if not isinstance(settings, dict) or not settings:
        return "no mapping of settings"
    return None


def flat_settings(settings: Any, prefix: str = "") -> dict[str, Any]:
    """A mapping of settings (a ``config.yaml`` read) by dotted key (``algorithm.kl_coef``); an empty mapping is
    one setting."""
    if not isinstance(settings, dict) or not settings:
        return {prefix.removesuffix("."): settings}
    return {key: value for name, inner in settings.items()
            for key, value in flat_settings(inner, f"{prefix}{name}.").items()}


def _setting_keys(path: Path) -> set[str]:
    """The dotted keys of a readable ``config.yaml``: every one the run was written with, as :func:`write_config`
    writes them all."""
    return set(flat_settings(parse_yaml(path.read_text(encoding="utf-8"))))


def settings_lost(before: set[str], now: set[str]) -> list[str]:
    """The keys of ``before`` that ``now`` holds neither as they are nor below them: a mapping empty before (an
    env's ``settings: {}``) that a resume has filled holds its key below it now, and is not lost."""
    return sorted(key for key in before if key not in now and not any(k.startswith(f"{key}.") for k in now))


def _config_copy(run_dir: Path) -> Path | None:
    """The copy of the run's settings that its latest checkpoint (else its newest one holding one) keeps."""
    latest = latest_checkpoint(run_dir)
    candidates = [latest] if latest is not None else []
    candidates += [run_dir / "checkpoints" / f"step_{step:06d}" for step in reversed(checkpoint_steps(run_dir))]
    return next((path / "config.yaml" for path in candidates if _config_damage(path / "config.yaml") is None),
                None)


def damaged_run_config(run_dir: Path) -> str | None:
    """One line, when ``RUN_DIR/config.yaml`` is damaged (empty, not text, not YAML), saying so and how to
    repair it, else None. Nothing is changed on disk: the checkpoints are intact, only the settings to resume
    them with are lost."""
    path = run_dir / "config.yaml"
    damage = _config_damage(path)
    copy = _config_copy(run_dir)
    if damage is None and copy is not None:
        missing = settings_lost(_setting_keys(copy), _setting_keys(path))
        if missing:
            # A file cut short can still parse; every key it lacks would then take its default silently.
            named = ", ".join(missing[:3]) + ("..." if len(missing) > 3 else "")
            damage = (f"cut short: it lacks {len(missing)} settings that the copy of checkpoint "
                      f"{checkpoint_step(copy.parent)} holds, {named}")
    if damage is None:
        return None
    command = turnrl_command()
    if copy is not None:
        away = f"move the folder away (`mv {path} {path}.damaged`), then " if path.is_dir() else ""
        repair = (f"{away}restore it from the copy checkpoint {checkpoint_step(copy.parent)} keeps "
                  f"(`cp {copy} {path}`) and resume again")
    else:
        repair = (f"resume with the recipe the run started from (`{command} train --config RECIPE resume={run_dir}` "
                  "writes it again), or start afresh under another run.name")
    return f"{path} is damaged ({damage}); {repair}. Nothing was changed"


LOCK_FILE = ".lock"
"""``RUN_DIR/.lock``: held (a kernel file lock) by the one process that writes into the run."""
OWNER_FILE = ".lock.owner"
"""``RUN_DIR/.lock.owner``: who holds the lock (``pid``, ``host``, ``since``), for the line refusing another."""
STOP_FILE = "stop"
"""``RUN_DIR/stop``: made by hand (``touch``), it asks the run that holds the lock to stop after its step."""


_NO_LOCKS = {errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP}
"""What a filesystem without file locks answers a lock with."""
_LOCK_TRIES = 8
"""How often a writer makes and locks a run's folder that other writers starting at the same moment remove."""


class RunLock:
    """One writer per run directory: ``turnrl train`` and ``turnrl sft`` hold ``RUN_DIR/.lock`` while they run.

    A second process (another ``turnrl train`` with the same run name, ``resume=RUN_DIR`` while the run trains)
    is refused with one line naming the owner, from ``RUN_DIR/.lock.owner``. The lock is filelock's (the
    operating system's file lock), which ends with the process holding it, however it ends: a killed owner
    leaves no lock to go stale, only its owner file, which the next writer replaces with a note, and perhaps a
    stop file it never saw, which the next writer removes with a note, as it does the unfinished folder of a
    checkpoint the owner was writing. A directory made only to be locked (a start that then failed its checks) is
    removed again.
    """

    def __init__(self, run_dir: Path, create: bool = True) -> None:
        self.run_dir = run_dir
        self.create = create
        """Make the directory when it is not there (a new run); else (a resume) lock only one that is."""
        self._lock: FileLock | None = None
        self._created: list[Path] = []
        """The folders made to hold the lock, deepest first (the run's, then those above it that were missing)."""

    def __enter__(self) -> RunLock:
        for tries_left in reversed(range(_LOCK_TRIES)):
            self._created = []
            if not self.run_dir.is_dir():
                if not self.create:
                    return self
                self._created = [folder for folder in (self.run_dir, *self.run_dir.parents) if not folder.exists()]
            # Not a soft lock (a file's existence) where the filesystem has no flock: a killed writer's file would
            # outlive it and refuse every later writer; the run goes on unguarded instead, and says so (below).
            lock = FileLock(str(self.run_dir / LOCK_FILE), timeout=0, fallback_to_soft=False)
            try:
                if self._created:
                    # Another writer starting at the same moment may make it first: the lock then says who has it.
                    self.run_dir.mkdir(parents=True, exist_ok=True)
                lock.acquire()
            except (FileNotFoundError, FileExistsError):
                # The folder went while this process made or locked it (``File exists`` is pathlib's word for one
                # made and removed meanwhile): a writer that started at the same moment made it, failed its checks
                # and removed it. Made again, it is this process's.
                if tries_left:
                    continue
                raise
            except Timeout:
                self._remove_if_created()
                owner = _read_owner(self.run_dir / OWNER_FILE) or "another process"
                raise ConfigError(f"run directory {self.run_dir} is in use by {owner}: one process writes into a "
                                  f"run at a time; wait for it to end, stop it (`touch {self.run_dir / STOP_FILE}` "
                                  "stops it after its step, with a checkpoint), or pick another run.name") from None
            except OSError as error:  # after Timeout, which is one
                if error.errno not in _NO_LOCKS:
                    raise
                # Some shared filesystems (Lustre or NFS mounted without locking) refuse file locks: the run goes
                # on unguarded rather than not at all, and says so.
                Console(stderr=True).print(f"warning: {self.run_dir} cannot be locked on its filesystem "
                                           f"({os.strerror(error.errno)}): nothing stops a second process writing "
                                           "into this run", markup=False, highlight=False, soft_wrap=True)
                return self
            break
        self._lock = lock
        remove_unfinished_writes(self.run_dir)  # of a writer killed mid-write: config.yaml's, summary.json's...
        remove_unfinished_writes(self.run_dir / "trajectories")  # a step's trajectories or token advantages
        restore_replaced(self.run_dir / "checkpoints")  # before a resume looks for its checkpoint
        for unfinished in remove_unfinished_saves(self.run_dir / "checkpoints"):
            Console(stderr=True).print(f"note: removed {unfinished.name}, a checkpoint an earlier run was killed "
                                       "while writing (never complete)", markup=False, highlight=False,
                                       soft_wrap=True)
        self._remove_stale_stop()
        left = _read_owner(self.run_dir / OWNER_FILE)
        if left is not None:
            Console(stderr=True).print(f"note: {self.run_dir} was last written by {left}, which ended without "
                                       "releasing it (killed); this process takes it over", markup=False,
                                       highlight=False, soft_wrap=True)
        record = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        atomic_write_text(self.run_dir / OWNER_FILE, "".join(f"{key}: {value}\n" for key, value in record.items()))
        return self

    def _remove_stale_stop(self) -> None:
        """Delete a stop file that no process holding the lock is left to see: a run removes its own when it
        stops, so one that is there asked an earlier writer that was killed or failed first. Kept, it would stop
        this run after its first step."""
        stop = self.run_dir / STOP_FILE
        if not stop.is_file():
            return
        stop.unlink()
        Console(stderr=True).print(f"note: {stop} asked an earlier run that ended without stopping on it; removed "
                                   "(touch it again to stop this one)", markup=False, highlight=False,
                                   soft_wrap=True)

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        if self._lock is None:
            return
        (self.run_dir / OWNER_FILE).unlink(missing_ok=True)
        if self._created and [p.name for p in self.run_dir.iterdir()] == [LOCK_FILE]:
            (self.run_dir / LOCK_FILE).unlink()  # while still held: no other process took it in between
        self._lock.release()
        self._lock = None
        self._remove_if_created()

    def _remove_if_created(self) -> None:
        for folder in self._created:
            try:
                folder.rmdir()  # only when empty
            except OSError:
                return


def _read_owner(path: Path) -> str | None:
    """``pid 123 on host node7 (since 2026-11-29 10:00:00)`` from an owner file, None when there is none."""
    try:
        fields = dict(line.split(": ", 1) for line in path.read_text().splitlines() if ": " in line)
    except (OSError, UnicodeDecodeError):
        return None
    if "pid" not in fields:
        return None
    return f"pid {fields['pid']} on host {fields.get('host', '?')} (since {fields.get('since', '?')})"


def run_lock(config: TrainConfig) -> RunLock | nullcontext[None]:
    """The lock of the run's directory, taken by rank 0 (the one process of a distributed run that writes
    its shared files); a resume locks the directory it names only when it is there (else its check says so)."""
    if not ranks.is_main():
        return nullcontext()
    return RunLock(run_directory(config), create=not config.resume)


def start_run(config: TrainConfig, *, stage: str = "train") -> Path:
    """Threads, seeds, the run directory and its ``config.yaml``: what every stage of a run starts from.

    With ``run.overwrite`` (and no resume) the outputs of the run that was there are deleted first, so old
    and new checkpoints, metrics, TensorBoard files, report and plots never mix: every output
    (``stage=train``), the SFT model (``sft``), or the RL outputs only (``rl``: after this run's own SFT stage).
    A resumed run's ``config.yaml`` is left as it is: the trainer rewrites it once the checkpoint has loaded
    (:func:`write_config`), so a resume that fails changes nothing.
    """
    if config.run.threads > 0:
        torch.set_num_threads(config.run.threads)
    seed_everything(config.seeds.seed)
    run_dir = run_directory(config)
    if ranks.is_main():  # the other processes of a distributed run wait for it
        if config.run.overwrite and not config.resume:
            for name in {"train": (*RL_OUTPUTS, "sft"), "sft": ("sft",), "rl": RL_OUTPUTS}[stage]:
                path = run_dir / name
                if path.is_dir():
                    shutil.rmtree(path)
                elif path.exists():
                    path.unlink()
        run_dir.mkdir(parents=True, exist_ok=True)
    if not config.resume:
        write_config(config)
    ranks.barrier()
    return run_dir


def training_run_inside(folder: Path) -> str | None:
    """What in ``folder`` makes it a training run's directory (``checkpoints``, ``metrics.jsonl``, ``sft``, its
    lock, ...), or None: an evaluation writing there would replace the run's ``config.yaml`` and ``summary.json``.
    Only what an evaluation never writes counts, so an evaluation's own folder is none."""
    kept = ("checkpoints", "metrics.jsonl", "tensorboard", "trajectories", "reference", "sft", LOCK_FILE)
    return next((name for name in kept if (folder / name).exists()), None)


def is_run_directory(path: Path) -> bool:
    """Whether ``path`` is a run's directory: its ``config.yaml``, and neither a model's ``config.json`` nor a
    checkpoint's ``trainer_state.pt`` (a checkpoint keeps a copy of its run's ``config.yaml``)."""
    return (path / "config.yaml").is_file() and not (path / "config.json").is_file() and \
        not (path / "trainer_state.pt").is_file()


def run_of_model(path: str | Path) -> tuple[Path, Path] | None:
    """The model a run saved at ``path`` and that run's directory, or None when ``path`` is no run's model.

    A run's models are ``RUN/checkpoints/step_N/actor`` (a checkpoint: ``RUN/checkpoints/step_N`` means its
    actor) and ``RUN/sft/model``; ``RUN`` itself means its latest checkpoint's actor (the newest whole one where
    the latest's is damaged), else its SFT model. The
    directory must hold the run's ``config.yaml``, whose agent and prompt settings the model was trained with.
    """
    given = Path(path)
    if not given.is_dir():
        return None
    if is_run_directory(given):
        # A latest checkpoint whose actor is damaged (a disk error, a copy cut short) is passed over.
        checkpoint = newest_whole_actor(given) or latest_checkpoint(given)
        model = checkpoint / "actor" if checkpoint is not None else given / "sft" / "model"
        return (model, given) if model.is_dir() else None
    if given.name == "actor" and given.parent.parent.name == "checkpoints":
        model, run = given, given.parents[2]
    elif given.parent.name == "checkpoints" and (given / "actor").is_dir():
        model, run = given / "actor", given.parents[1]
    elif given.name == "model" and given.parent.name == "sft":
        model, run = given, given.parents[1]
    else:
        return None
    return (model, run) if (run / "config.yaml").is_file() else None

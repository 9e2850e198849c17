"""A run's directory: where it lives, what a run writes there, and how a run starts in it.

A directory holds one run: a new run refuses one that holds another (:mod:`turnrl.training.preflight`
says so before anything is written), ``run.overwrite`` deletes the old outputs first, and ``resume``
continues the run it names, from the checkpoint :func:`resumed_checkpoint` picks.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from turnrl.config import ConfigError, to_yaml
from turnrl.training import ranks
from turnrl.training.checkpoint import ResumePoint, checkpoint_steps, resume_point
from turnrl.training.config import TrainConfig
from turnrl.training.seeding import seed_everything
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
    point = resume_point(run_dir, critic=config.algorithm.uses_critic)
    if point.checkpoint is None:
        none = "no complete checkpoint" if checkpoint_steps(run_dir) else "no checkpoint"
        raise ConfigError(f"resume={config.resume!r} holds {none} ({point.note}); a run saves one every "
                          "run.save_every steps, at its end and on Ctrl-C; start it afresh with "
                          f"`turnrl train --config {run_dir / 'config.yaml'} run.overwrite=true`")
    return point


def write_config(config: TrainConfig) -> None:
    """The run's ``config.yaml``: what ``resume=RUN_DIR`` reads back (written by rank 0)."""
    if ranks.is_main():
        (run_directory(config) / "config.yaml").write_text(to_yaml(config))


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


def run_of_model(path: str | Path) -> tuple[Path, Path] | None:
    """The model a run saved at ``path`` and that run's directory, or None when ``path`` is no run's model.

    A run's models are ``RUN/checkpoints/step_N/actor`` (a checkpoint: ``RUN/checkpoints/step_N`` means its
    actor) and ``RUN/sft/model``; ``RUN`` itself means its latest checkpoint's actor, else its SFT model. The
    directory must hold the run's ``config.yaml``, whose agent and prompt settings the model was trained with.
    """
    from turnrl.training.checkpoint import latest_checkpoint

    given = Path(path)
    if not given.is_dir():
        return None
    if (given / "config.yaml").is_file() and not (given / "config.json").is_file():  # a run, not a model
        checkpoint = latest_checkpoint(given)
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

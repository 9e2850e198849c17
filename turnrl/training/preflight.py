"""What ``turnrl train`` and ``turnrl sft`` check before anything is written or a model loads.

A run that would fail on a missing model, a bad env setting, unreadable SFT data, a checkpoint that is not
there or a directory that holds another run stops at once with a one-line error naming the key at fault.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from rich.console import Console

from turnrl.config import ConfigError, turnrl_command
from turnrl.envs.catalog import builtin_name, env_class
from turnrl.envs.contract import AgentEnv, max_text_length_of, reset_answer_problems
from turnrl.envservice.placement import env_factory
from turnrl.envservice.protocol import RemoteEnvError
from turnrl.models.builtin import check_builtin_preset
from turnrl.models.loading import ModelSource, is_vision_language, locate_model, model_line
from turnrl.models.vlm import is_vlm_preset
from turnrl.rollout.runner import check_observation, plays_blind, raised_where
from turnrl.training import ranks
from turnrl.training.checkpoint import checkpoint_step, resume_point
from turnrl.training.run_dir import RL_OUTPUTS, resumed_checkpoint, run_directory
from turnrl.training.sft import read_chat_jsonl
from turnrl.training.train_config import TrainConfig


def _check_envs(config: TrainConfig, needs_solver: bool) -> list[str]:
    """Build the env with its training and validation settings (here or on ``env.remote``, whose sessions are
    closed again) and reset it once with each, since some settings only a reset can judge (a 2048 target that the
    board's first tiles can never make: a board given at reset may reach further); with ``needs_solver``, that
    the env has a solver for expert demos.

    Returns:
        The settings keys (``env.settings``, ``env.val_settings``) under which the first observation holds an image.

    Raises:
        ConfigError: unknown env, a refused setting, no server, or no solver when one is needed.
    """
    with_images = []
    make_env = env_factory(config.env.id, dict(config.env.settings), config.env.remote)
    try:
        if config.env.val_settings is not None:
            make_val_env = env_factory(config.env.id, dict(config.env.val_settings), config.env.remote,
                                       where="env.val_settings")
            try:
                if _first_reset(make_val_env(), config.env.id, "env.val_settings", dict(config.env.val_settings)):
                    with_images.append("env.val_settings")
            finally:
                make_val_env.close()
        env = make_env()
        if _first_reset(env, config.env.id, "env.settings", dict(config.env.settings), seed=config.sft.seed_start):
            with_images.insert(0, "env.settings")
        if needs_solver and env.solve() is None:
            raise ConfigError(f"env.id={config.env.id!r} has no solver here (solve() is None), so it has no "
                              "expert demos; give SFT chats with sft.data=chats.jsonl, or set sft.enabled=false")
    finally:
        make_env.close()
    return with_images


def _first_reset(env: AgentEnv, env_id: str, where: str, settings: dict[str, Any], seed: int = 0) -> bool:
    """Reset ``env`` once; whether its observation holds an image. Its refusal of the settings (a ``ValueError``)
    is a one-line error naming them; any other error too, with the line that raised it (a user env's setting of
    the wrong type fails there, in the env's own arithmetic). An answer that every episode's reset would give,
    and the rollout refuse (not ``(observation, info)``, an observation it cannot read, or a text longer than the
    env's ``max_text_length()`` or that answer itself unusable), is the env's fault, whatever the settings: its
    one-line error says what the env returned and names ``turnrl check-env``, which lists all that the env
    breaks."""
    try:
        answer = env.reset(seed=seed)
    except (ValueError, RemoteEnvError) as error:
        raise ConfigError(f"env.id={env_id!r} with {where}={settings}: its first reset refused them: "
                          f"{' '.join(str(error).split())}") from error
    except Exception as error:
        raise ConfigError(f"env.id={env_id!r} with {where}={settings}: its first reset raised "
                          f"{type(error).__name__}: {' '.join(str(error).split())}{raised_where(error)}; check "
                          "the settings' types and values against the env's constructor") from error
    full_list = f"`{turnrl_command()} check-env {env_id}` lists all that the env breaks of the contract"
    problems = reset_answer_problems(answer)
    if problems:
        raise ConfigError(f"env.id={env_id!r}: {'; '.join(problems)}; {full_list}")
    obs, _ = answer
    try:
        max_text_length = max_text_length_of(env)
    except Exception as error:
        raise ConfigError(f"env.id={env_id!r}: its max_text_length() cannot be used: {type(error).__name__}: "
                          f"{' '.join(str(error).split())}{raised_where(error)}; {full_list}") from error
    try:
        check_observation(obs, max_text_length)
    except (TypeError, ValueError) as error:
        raise ConfigError(f"env.id={env_id!r}: its first observation cannot be played: {error}; {full_list}") from error
    return "image" in obs


def _check_model_sees(config: TrainConfig, source: ModelSource | None, with_images: list[str]) -> None:
    """An env whose observations hold images needs a model that takes them: a text-only one would stop at the
    first rollout, after it loaded and the run directory was written.

    Raises:
        ConfigError: naming the env's settings, the model and the ways on.
    """
    if not with_images:
        return
    if config.model.path is None:
        sees, model = is_vlm_preset(config.model.builtin_preset), f"model.builtin_preset={config.model.builtin_preset}"
    elif source == "local":
        sees, model = is_vision_language(config.model.path), f"model.path={config.model.path!r}"
    else:  # a hub id: its config is not read here (it may need the network); the rollout checks it
        return
    if sees:
        return
    name = builtin_name(config.env.id)  # a built-in env's modes are known; another's mode setting, if any, is not
    text_mode = name is not None and "text" in env_class(name).modes
    raise ConfigError(plays_blind(f"env.id={config.env.id!r} with {with_images[0]}", model, text_mode))


def _check_demo_seeds(config: TrainConfig) -> None:
    """The expert demos' env seeds miss the validation seeds: a model fine-tuned on the very levels it is then
    validated on would report their success as what it learned.

    Raises:
        ConfigError: naming both ranges and where the demos could start instead.
    """
    sft, seeds = config.sft, config.seeds
    demos_end, val_end = sft.seed_start + sft.episodes, seeds.val_start + seeds.val_size
    if sft.seed_start < val_end and seeds.val_start < demos_end:
        raise ConfigError(f"sft.seed_start={sft.seed_start}: the {sft.episodes} demos' seeds [{sft.seed_start}, "
                          f"{demos_end}) overlap the validation seeds [{seeds.val_start}, {val_end}), so validation "
                          f"would score levels the model was fine-tuned on; put sft.seed_start at or above {val_end}")


CHATS_FORMAT = 'a JSONL file of chats, one {"messages": [{"role": "user", ...}, {"role": "assistant", ...}]} a line'


def _check_chats(path: str) -> None:
    """``sft.data`` reads whole (each line and image), and each chat's roles are ones SFT can learn from
    (:func:`~turnrl.training.sft.read_chat_jsonl` checks them).

    Raises:
        ConfigError: naming the file, and the line of a chat at fault.
    """
    where = f"sft.data={path!r}"
    try:
        read_chat_jsonl(path)
    except FileNotFoundError as error:
        raise ConfigError(f"{where} does not exist; give {CHATS_FORMAT}") from error
    except IsADirectoryError as error:
        raise ConfigError(f"{where} is a folder; give {CHATS_FORMAT}") from error
    except UnicodeDecodeError as error:
        raise ConfigError(f"{where} is not UTF-8 text (byte {error.start}); give {CHATS_FORMAT}") from error
    except (OSError, ValueError) as error:
        raise ConfigError(f"{where}: {error}") from error


def preflight(config: TrainConfig, *, stage: str = "train") -> None:
    """Check what a run needs before anything is written or a model loads: one-line errors, no traceback.

    Checks: ``model.path`` is a model directory, or a hub id in the local cache or on a reachable hub
    (:func:`~turnrl.models.loading.locate_model`); the env id and its settings (one env is built and reset, for training
    and validation settings); SFT data (read whole, each line and image) or, for expert demos, a solver and seeds apart
    from the validation seeds; that the run to resume holds a complete checkpoint, not past ``run.steps``; optional
    packages (wandb); and that a new run does not write into another run's directory.

    Args:
        stage: ``train`` (``turnrl train``) or ``sft`` (``turnrl sft``, which writes only ``sft/``).

    Raises:
        ConfigError: naming the key at fault and what to do.
    """
    run_dir = run_directory(config)
    if config.resume:
        if not run_dir.is_dir():
            raise ConfigError(f"resume={config.resume!r}: no such run directory")
        checkpoint = resumed_checkpoint(config).checkpoint  # one there (else ConfigError)
        if checkpoint is not None and (done := checkpoint_step(checkpoint)) > config.run.steps:
            raise ConfigError(f"resume={config.resume!r} goes on after step {done}, past run.steps="
                              f"{config.run.steps}: give run.steps={done + 1} or more to train further, or leave "
                              "run.steps out")
    sft_runs = stage == "sft" or (config.sft.enabled and not config.resume)
    if sft_runs and not config.sft.data:
        _check_demo_seeds(config)
    with_images = _check_envs(config, needs_solver=sft_runs and not config.sft.data)
    if sft_runs and config.sft.data:
        _check_chats(config.sft.data)
    if config.run.wandb_project and importlib.util.find_spec("wandb") is None:
        raise ConfigError(f"run.wandb_project={config.run.wandb_project!r} needs wandb: pip install wandb "
                          "(or leave run.wandb_project unset)")
    # After the cheaper checks: it may ask the hub (a few seconds at most).
    source = locate_model(config.model.path, "model.path") if config.model.path is not None else None
    if config.model.path is None:
        check_builtin_preset(config.model.builtin_preset)  # before the line that names it
    _check_model_sees(config, source, with_images)
    if config.resume or config.run.overwrite:
        _say_model(config, source)
        return
    taken = [name for name in (RL_OUTPUTS if stage == "train" else ()) if (run_dir / name).exists()]
    if sft_runs and (run_dir / "sft" / "model").exists():  # an SFT stage that stopped before its model ran no run
        taken.append("sft")
    if taken:
        # Offered only where it can work: a run stopped before its first checkpoint has nothing to resume.
        resumable = stage == "train" and resume_point(run_dir).checkpoint is not None
        resume = (f"continue it with `{turnrl_command()} train resume={run_dir}`, " if resumable else
                  "it holds no checkpoint to continue from; " if stage == "train" else "")
        sft_model = run_dir / "sft" / "model"
        start_from = (f"; or start RL from its SFT model in a new run (model.path={sft_model} sft.enabled=false "
                      "run.name=ANOTHER)" if stage == "train" and not resumable and sft_model.is_dir() else "")
        raise ConfigError(
            f"run directory {run_dir} already holds a run ({', '.join(taken)}); {resume}pick another run.name, "
            f"or pass run.overwrite=true to delete it and start afresh{start_from}"
        )
    _say_model(config, source)


def _say_model(config: TrainConfig, source: ModelSource | None) -> None:
    """Once every check has passed, the line saying which model the run starts from (not for a resumed run,
    which continues from its checkpoint's); in yellow where the recipe expects a pretrained model and has none."""
    if config.resume or not ranks.is_main():
        return
    warn = source is None and config.model.expects_pretrained
    Console().print(model_line(config.model, source), markup=False, highlight=False, soft_wrap=True,
                    style="bold yellow" if warn else None)

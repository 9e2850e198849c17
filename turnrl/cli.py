"""The ``turnrl`` command.

    turnrl envs                                   list the environments
    turnrl play ENV [--seed N] [key=value ...]    play an env in the terminal
    turnrl render ENV --seed N -o out.png         draw an env's first frame
    turnrl check-env ENV [key=value ...]          check an env against the contract
    turnrl eval --env ENV --policy P --episodes N evaluate a policy
    turnrl eval --policy RUN --variants ragen     ... on RAGEN's generalization variants
    turnrl sft --config X.yaml [key=value ...]    supervised warm start
    turnrl train --config X.yaml [key=value ...]  RL training (SFT first when configured)
    turnrl serve-policy --model PATH --port N     OpenAI-compatible server
    turnrl serve-env [--port N] [--token T]       envs over HTTP (env.remote=[URL] uses them)
    turnrl view RUN_OR_EVAL_DIR [--serve]         HTML report of what the agent did, and training curves
    turnrl config show [--config X.yaml] [--eval] every config key, its value and its doc

Heavy libraries are imported inside the commands that need them, so listing
or playing an env starts at once.
"""

from __future__ import annotations

import argparse
import faulthandler
import math
import os
import re
import signal
import sys
import textwrap
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from rich.console import Console

console = Console()


def parse_settings(items: Sequence[str]) -> dict[str, Any]:
    """``["size=8", "is_slippery=true"]`` -> ``{"size": 8, "is_slippery": True}`` (YAML typing).

    Raises:
        SystemExit: a word that is not ``key=value``, a value that is not YAML (``size=[``), a key or value
            OmegaConf cannot read (``[=1``, ``a=${``), or settings that contradict each other (``a=[1] a.x=2``),
            naming them.
    """
    import yaml
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from turnrl.config import yaml_problem

    # OmegaConf raises IndexError on a key it cannot split (``[``), ValueError on a list index that is no number
    # (``a.x`` under a list) and RecursionError on a key thousands of names deep, besides its own errors.
    unreadable = (OmegaConfBaseException, IndexError, ValueError, RecursionError)

    def said(error: Exception) -> str:
        return (str(error).splitlines() or [type(error).__name__])[0]

    for item in items:
        if "=" not in item or not item.split("=", 1)[0].strip():
            raise SystemExit(f"error: setting {item!r} is not of the form key=value")
        try:  # one at a time, to name the one at fault
            OmegaConf.from_dotlist([item])
        except yaml.YAMLError as error:
            raise SystemExit(f"error: setting {item!r}: the value is not valid YAML: "
                             f"{yaml_problem(error, where=False)}") from error
        except unreadable as error:
            raise SystemExit(f"error: setting {item!r} cannot be read ({said(error)}): write it as "
                             "key=value, the key a name such as size, the value without '${'") from error
    try:
        return OmegaConf.to_container(OmegaConf.from_dotlist(list(items))) if items else {}  # type: ignore[return-value]
    except unreadable as error:
        raise SystemExit(f"error: settings {' '.join(items)!r} contradict each other ({said(error)}): "
                         "set each key once") from error


def _make_env(name: str, settings: dict[str, Any]):
    from turnrl.config import ConfigError
    from turnrl.envservice.placement import build_env

    try:
        return build_env(name, settings, where="setting")
    except ConfigError as error:
        raise SystemExit(f"error: {error}") from error


def seed_arg(text: str) -> int:
    """An env seed from the command line: an int from 0 (numpy's seeds cannot be negative)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative; seeds are whole numbers from 0")
    return value


# --------------------------------------------------------------------------- envs
def cmd_envs(args: argparse.Namespace) -> int:
    from turnrl.envs.catalog import env_class, env_names, gym_id

    width = max(40, console.width)
    for name in env_names():
        cls = env_class(name)
        lines = [f"{gym_id(name)}  modes: {', '.join(cls.modes)}"]
        lines += textwrap.wrap(cls.description, width - 2, initial_indent="  ", subsequent_indent="  ")
        lines += pack(setting_lines(name), width, first="  settings: ", rest=" " * 12)
        for line in [*lines, ""]:
            console.print(line, markup=False, highlight=False, no_wrap=True, overflow="ignore", crop=False)
    console.print("Settings are key=value with their defaults and (allowed values): "
                  "turnrl play Sokoban size=8 num_boxes=2; env.settings.size=8 in eval and train.",
                  markup=False, highlight=False)
    return 0


def pack(items: list[str], width: int, first: str, rest: str, gap: str = "  ") -> list[str]:
    """Lines of at most ``width`` characters holding ``items`` in order, never splitting one (an item longer
    than a line gets a line of its own): settings stay whole words a user can copy."""
    lines: list[str] = []
    line = first
    for item in items:
        start = line in (first, rest)
        if not start and len(line) + len(gap) + len(item) > width:
            lines.append(line)
            line = rest
            start = True
        line += item if start else gap + item
    if line not in (first, rest):
        lines.append(line)
    return lines


def setting_lines(name: str) -> list[str]:
    """One line per setting of a built-in env: ``name=default``, and the allowed values where there are few."""
    from turnrl.envs.catalog import env_parameters, env_setting_choices

    choices = env_setting_choices(name)
    lines = []
    for key, default in env_parameters(name).items():
        if key == "render_mode":  # Gymnasium's, for human viewers: not an agent setting
            continue
        allowed = f" ({'|'.join(str(c) for c in choices[key])})" if key in choices else ""
        lines.append(f"{key}={default!r}{allowed}")
    return lines


# --------------------------------------------------------------------------- play / render
def _save_png(image: Any, path: Path) -> None:
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(image).save(path)


def cmd_play(args: argparse.Namespace) -> int:
    from turnrl.play import play

    env = _make_env(args.env, parse_settings(args.settings))
    return play(env, args.env, args.seed, args.out, console)


def cmd_render(args: argparse.Namespace) -> int:
    from turnrl.config import turnrl_command
    from turnrl.envs.catalog import builtin_name, env_class
    from turnrl.envs.contract import reset_answer

    settings = parse_settings(args.settings)
    name = builtin_name(args.env)
    if name is not None and "mode" not in settings:  # a built-in env draws in its first image mode
        modes = env_class(name).modes
        image_modes = [m for m in modes if m != "text"]
        if not image_modes:
            raise SystemExit(f"error: {args.env} has no image mode (modes: {', '.join(modes)})")
        settings["mode"] = image_modes[0]
    env = _make_env(args.env, settings)
    try:
        obs, _ = reset_answer(env.reset(seed=args.seed))
    except TypeError as error:
        raise SystemExit(f"error: {args.env}: {error}; `{turnrl_command()} check-env {args.env}` lists all that "
                         "the env breaks of the contract") from error
    if not isinstance(obs, dict) or "image" not in obs:
        hint = f"; pick one of {[m for m in env_class(name).modes if m != 'text']}" if name else ""
        raise SystemExit(f"error: {args.env} with {settings} observes no image{hint}")
    output = image_path(args.output)
    try:
        _save_png(obs["image"], output)
    except OSError as error:  # a file where a folder of the path should be, a folder without the right to write
        raise SystemExit(f"error: -o {args.output}: cannot write the image there ({error.strerror}: "
                         f"{error.filename}); give a file path in a folder you can write to") from error
    # One unwrapped line: a path broken across lines cannot be copied.
    console.print(f"wrote {output} ({obs['image'].shape[1]}x{obs['image'].shape[0]})", markup=False, highlight=False,
                  soft_wrap=True)
    return 0


def image_path(output: str) -> Path:
    """Where ``render -o`` writes: the path as given when PIL knows its extension, with ``.png`` added when
    it has none; an extension PIL cannot write is an error naming the ones it can."""
    from PIL import Image

    path = Path(output)
    if not path.suffix:
        return path.with_name(path.name + ".png")
    Image.init()
    if path.suffix.lower() not in Image.EXTENSION:
        raise SystemExit(f"error: -o {output}: cannot write {path.suffix!r} images; use .png, .jpg, .webp, ...")
    return path


def cmd_check_env(args: argparse.Namespace) -> int:
    from turnrl.envs import EnvCheckError, check_env

    env = _make_env(args.env, parse_settings(args.settings))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            check_env(env, seed=args.seed, deterministic=not args.stochastic)
        except EnvCheckError as error:
            console.print(f"[bold red]{args.env} fails the turnrl env contract[/bold red]")
            console.print(str(error), markup=False)
            return 1
        finally:
            _say_checker_warnings(caught, args.env)
    console.print(f"[bold green]{args.env} passes[/bold green] Gymnasium's checker and turnrl's contract checks")
    return 0


def _say_checker_warnings(caught: list[warnings.WarningMessage], env_id: str) -> None:
    """Gymnasium's checker warnings as notes, once each, in plain text (they come in terminal colours, each with
    the checker's file and line); any other warning as Python would show it."""
    said = set()
    for warning in caught:
        if "gymnasium" not in Path(warning.filename).parts:
            warnings.showwarning(warning.message, warning.category, warning.filename, warning.lineno)
            continue
        text = re.sub(r"\x1b\[[0-9;]*m", "", str(warning.message)).removeprefix("WARN: ")
        if text not in said:
            said.add(text)
            wrapped = env_id.startswith("gym:")
            whose = " (of the wrapped env's own spaces: turnrl observes its frames)" if wrapped else ""
            console.print(f"note: Gymnasium's checker warns{whose}: {text}", markup=False, highlight=False,
                          soft_wrap=True)


# --------------------------------------------------------------------------- eval / sft / train / serve
def cmd_eval(args: argparse.Namespace) -> int:
    from turnrl.config import ConfigError, given_keys, load_config
    from turnrl.eval_config import EvalConfig
    from turnrl.eval_settings import BUDGET_KEYS, at_validation_temperature, config_env, training_sections, yaml_mapping
    from turnrl.evaluate import default_eval_dir, run_eval, variants_override
    from turnrl.training.run_dir import is_run_directory, run_of_model, training_run_inside

    policy, config_path = args.policy, args.config
    # A run's model plays as it was trained: with the run's env, agent, prompt and sampling settings.
    run = run_of_model(policy)
    if run is None and is_run_directory(Path(policy)):
        raise SystemExit(f"error: --policy {policy} is a run that holds no model: no checkpoint (it saved none: "
                         "run.save_at_end=false, run.save_every=0, or it stopped before the first) and no sft/model; "
                         "give a run that saved one, or a model directory")
    if run is not None:
        policy = str(run[0])
        if config_path is None:
            config_path = str(run[1] / "config.yaml")
            console.print(f"evaluating {policy} with the run's config {config_path} (the prompts, format, env "
                          "settings and sampling it trained with; --config FILE evaluates with others)",
                          markup=False, highlight=False, soft_wrap=True)
    overrides = [*args.overrides, f"policy={policy}"]
    if args.episodes is not None:  # else the config's episodes (an eval YAML's, an override's), 32 by default
        overrides.append(f"episodes={args.episodes}")
    if args.env:
        overrides.append(f"env.id={args.env}")
    if args.variants:
        try:
            overrides.append(variants_override(args.variants))
        except ConfigError as error:
            raise SystemExit(f"error: {error}") from error
    training_only = training_sections()
    overrides += at_validation_temperature(config_path, args.overrides)
    given = given_keys(config_path, overrides, skip_sections=training_only)
    if "env.id" not in given and "variants" not in given:
        if config_path is not None and not yaml_mapping(config_path):
            try:  # a file that cannot be read names no env: say what is wrong with the file instead
                load_config(EvalConfig, config_path, skip_sections=training_only)
            except ConfigError as error:
                raise SystemExit(f"error: {error}") from error
        raise SystemExit("error: no env to evaluate on: pass --env ENV, --variants ragen (or a YAML list of "
                         "variants), or --config with a recipe or a run's config.yaml")
    if args.out:
        overrides.append(f"out={args.out}")
    elif "out" not in given:
        label = args.env or (Path(args.variants).stem if args.variants else "eval")
        overrides.append(f"out={default_eval_dir(label, policy)}")
    try:
        config = load_config(EvalConfig, config_path, overrides, skip_sections=training_only)
        if config.out and Path(config.out).exists() and not Path(config.out).is_dir():  # before the episodes
            raise SystemExit(f"error: out={config.out!r} is a file; give the folder the evaluation writes to")
        out = Path(config.out) if config.out else None
        held = training_run_inside(out) if out is not None else None
        if out is not None and held is not None:
            raise SystemExit(f"error: out={config.out!r} is a training run's directory (it holds {held}), whose "
                             "config.yaml and summary.json the evaluation would replace; give another folder (such "
                             f"as {out / 'eval'})")
        if args.env and config_env(config_path) not in (None, args.env):
            # The file's env settings are its own env's: another env takes only those given here.
            given_env = load_config(EvalConfig, None, overrides).env
            config.env.settings, config.env.val_settings = given_env.settings, given_env.val_settings
        summary = run_eval(config, budget_from_env=not any(key in given for key in BUDGET_KEYS))
    except ConfigError as error:
        raise SystemExit(f"error: {error}") from error
    # Stopped by Ctrl-C or SIGTERM (what it played is written): 128 + the signal's number, as a shell reports.
    return 128 + signal.Signals[summary["stop_signal"]].value if "stop_signal" in summary else 0


def cmd_sft(args: argparse.Namespace) -> int:
    from turnrl.config import ConfigError, load_config
    from turnrl.training.commands import sft_only
    from turnrl.training.train_config import TrainConfig

    try:
        sft_only(load_config(TrainConfig, args.config, args.overrides), data=args.data)
    except ConfigError as error:
        raise SystemExit(f"error: {error}") from error
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from turnrl.config import ConfigError, load_config
    from turnrl.training.train_config import TrainConfig

    overrides = list(args.overrides)
    resumes = [o.split("=", 1)[1] for o in overrides if o.startswith("resume=")]
    if len(resumes) > 1:  # the config would be read from the first run and the checkpoint from the last
        raise SystemExit(f"error: resume= is given {len(resumes)} times ({', '.join(resumes)}); give one run")
    resume = resumes[0] if resumes else None
    config_path = args.config
    if resume is not None and (Path(resume) / "trainer_state.pt").is_file():  # it keeps a copy of config.yaml
        run = Path(resume).resolve().parent.parent
        raise SystemExit(f"error: resume={resume!r} is a checkpoint, not a run directory: resume the run "
                         f"(resume={run}) continues from its latest checkpoint; move later ones away to continue "
                         "from an earlier one")
    if resume is not None and config_path is not None and (Path(resume) / "config.yaml").is_file():
        from turnrl.training.run_dir import damaged_run_config

        if damaged_run_config(Path(resume)) is None:  # a recipe writes a damaged one again (its repair)
            raise SystemExit(f"error: resume={resume!r} goes on with the run's own settings ({resume}/config.yaml), "
                             f"which --config {config_path} would replace; leave --config out and give key=value for "
                             "what to change")
    if resume is not None and config_path is None:
        # A folder without config.yaml is no run, unless it holds checkpoints: then the file is lost (said below,
        # with the copy each checkpoint keeps); one of another kind (a folder) is damaged, said below too.
        if not (Path(resume) / "config.yaml").exists() and not (Path(resume) / "checkpoints").is_dir():
            raise SystemExit(f"error: {resume_problem(resume)}")
        from turnrl.training.run_dir import damaged_run_config

        damage = damaged_run_config(Path(resume))
        if damage is not None:
            raise SystemExit(f"error: {damage}")
        config_path = str(Path(resume) / "config.yaml")
    try:
        config = load_config(TrainConfig, config_path, overrides)
        # Several processes, or FSDP on one (its CPU offload lets a model too large for the GPU train there).
        dist = config.distributed
        if (dist.nproc_per_node > 1 or dist.backend == "fsdp") and "WORLD_SIZE" not in os.environ:
            return launch_processes(dist.nproc_per_node, args.config, overrides)
        # Imported once this process trains: the launcher above starts its processes without loading the models.
        from turnrl.training.commands import train

        summary = train(config)
    except ConfigError as error:  # also those found once the run starts (a reward function that cannot load)
        raise SystemExit(f"error: {error}") from error
    if summary.get("stopped_by") == "error":
        return 1  # a lost rollout worker: stopped with a checkpoint to resume from, but not by request
    if "WORLD_SIZE" in os.environ:
        from turnrl.training import ranks

        ranks.end_process(0)  # a stop asked for too: torchrun takes any other status for a failed process
    if "interrupted_at_step" not in summary:
        return 0
    # 128 + the signal's number, as a shell reports a process the signal ended (a stop file counts as Ctrl-C).
    return 128 + signal.Signals[summary.get("stop_signal", "SIGINT")].value


def resume_problem(resume: str) -> str:
    """Why ``resume=RESUME``, a path without ``config.yaml`` or ``checkpoints/``, is no run to continue, and which
    folder to give instead."""
    run = "give the folder `turnrl train` wrote (run.output_dir/run.name, e.g. runs/quickstart)"
    if not resume.strip() or not Path(resume).exists():
        return f"resume={resume!r} does not exist; {run}"
    if Path(resume).is_file():
        return f"resume={resume!r} is a file, not a run directory; {run}, the one that holds config.yaml"
    return f"resume={resume!r} is not a run directory (it has no config.yaml); {run}"


STOP_GRACE_S = 600
"""Seconds torchrun waits for its processes after a SIGTERM before it kills them (its own default is 30 s,
shorter than one VLM step and its checkpoint): ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``, unless it is set already."""


def launch_processes(nproc: int, config_path: str | None, overrides: list[str]) -> int:
    """``turnrl train ... distributed.nproc_per_node=N``: the same command in N processes under ``torchrun``
    (one per GPU), which stops them all when one fails; returns its exit status.

    The processes see ``WORLD_SIZE`` and do not launch again. On Ctrl-C, torchrun (which gets it too) stops
    the processes; this waits for it instead of leaving them behind. A SIGTERM sent to this process alone (a
    ``kill`` of the command) is passed on to torchrun, which passes it on to the processes: they finish the
    step in progress and save it; this then exits with 143 (128 + SIGTERM), as a shell reports a process the
    signal ended, whatever status torchrun gives a stop it was asked for.
    """
    import subprocess

    from turnrl.training.ranks import COMMAND_START

    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "-m", "turnrl.cli", "train"]
    command += ["--config", config_path] if config_path else []
    env = {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(STOP_GRACE_S), **os.environ, COMMAND_START: str(time.time())}
    launcher = subprocess.Popen([*command, *overrides], env=env)
    terminated = False

    def pass_on(signum: int, frame: Any) -> None:
        nonlocal terminated
        terminated = True
        launcher.send_signal(signal.SIGTERM)

    previous = signal.signal(signal.SIGTERM, pass_on)
    try:
        while True:
            try:
                status = launcher.wait()
                return 128 + signal.SIGTERM.value if terminated else status
            except KeyboardInterrupt:
                print("stopping the processes (a checkpoint is saved only by `touch RUN_DIR/stop`; the run "
                      "resumes from its last one)", file=sys.stderr)
    finally:
        signal.signal(signal.SIGTERM, previous)


H100_BYTES = int(79.2 * 2**30)
"""An H100 80GB's memory as torch reports it (``total_memory``): ``turnrl memory``'s GPU where there is none."""


def gpu_counts(text: str) -> list[int]:
    """``1,2,4`` as [1, 2, 4]: the GPU counts of ``turnrl memory --gpus``."""
    try:
        counts = [int(word) for word in text.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of GPU counts such as 1,2,4")
    return counts


def gib_arg(text: str) -> float:
    """A GPU's memory in GiB from the command line: a finite number above 0 (``turnrl memory --gpu-gib``)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of GiB such as 79.2") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a GPU memory; give its GiB as a number above 0, "
                                         "such as 79.2") from None
    return value


def parameters_text(count: int) -> str:
    """``7.62B`` or ``3.4M``."""
    return f"{count / 1e9:.2f}B" if count >= 1e9 else f"{count / 1e6:.1f}M"


def cmd_memory(args: argparse.Namespace) -> int:
    import torch

    from turnrl.config import ConfigError, load_config
    from turnrl.models.loading import locate_model
    from turnrl.training.allocator import run_margin
    from turnrl.training.memory import GIB, count_recipe_model, fit_report, rows_shorter_than_episodes
    from turnrl.training.train_config import TrainConfig

    try:
        config = load_config(TrainConfig, args.config, args.overrides)
        if config.model.path is not None:  # a missing path in train's words, not the hub client's about repo ids
            locate_model(config.model.path, "model.path")
        counts = count_recipe_model(config)
    except ConfigError as error:
        raise SystemExit(f"error: {error}") from error
    except (OSError, ValueError) as error:  # a model.path without a config transformers can read
        raise SystemExit(f"error: model.path={config.model.path!r} has no model config to count ({error})") \
            from error
    if args.gpu_gib is not None:
        device_bytes, gpu = args.gpu_gib * GIB, f"{args.gpu_gib:g} GiB (--gpu-gib)"
    elif torch.cuda.is_available():
        device_bytes = torch.cuda.get_device_properties(0).total_memory
        gpu = f"{device_bytes / GIB:.1f} GiB ({torch.cuda.get_device_name(0)})"
    else:
        device_bytes, gpu = H100_BYTES, f"{H100_BYTES / GIB:.1f} GiB (an H100 80GB; --gpu-gib sets another)"
    if config.run.gpu_share < 1:  # a run sharing the card: the start's check counts its share, so does this
        device_bytes *= config.run.gpu_share
        gpu += f", of which run.gpu_share={config.run.gpu_share:g} is {device_bytes / GIB:.1f} GiB"
    name = config.model.path or f"the built-in {config.model.builtin_preset!r}"
    print(f"{name}: {parameters_text(counts.total)} parameters, {parameters_text(counts.trained)} trained; "
          f"the estimated peak of each GPU, on GPUs of {gpu}:")
    margin = run_margin(config, device_bytes)  # this shell's allocator variables, as the run would have them
    verdicts = [fit_report(config, counts, processes, device_bytes, margin)
                for processes in args.gpus or [config.distributed.nproc_per_node]]
    for _, line in verdicts:
        print(f"  {line}")
    short_rows = rows_shorter_than_episodes(config)
    if short_rows is not None:
        print(f"  and {short_rows}")
    return 0 if all(fits for fits, _ in verdicts) else 1


def cmd_serve_policy(args: argparse.Namespace) -> int:
    import os

    from turnrl.config import ConfigError, ModelConfig, load_config
    from turnrl.serve.policy import TOKEN_ENV_VAR, serve

    overrides = [item.removeprefix("model.") for item in args.overrides]
    try:
        model_config = load_config(ModelConfig, None, [*overrides, f"device={args.device}"])
    except ConfigError as error:
        raise SystemExit(f"error: {error} (serve-policy takes model settings, e.g. dtype=bfloat16 backend=hf)") \
            from error
    try:
        serve(model_path=args.model, host=args.host, port=args.port, max_batch_size=args.max_batch_size,
              served_model_name=args.served_model_name, model_config=model_config,
              token=args.token if args.token is not None else os.environ.get(TOKEN_ENV_VAR) or None,
              prepare_threads=args.prepare_threads, max_image_pixels=args.max_image_pixels,
              max_request_mb=args.max_request_mb, body_timeout_s=args.body_timeout_s, body_stall_s=args.body_stall_s)
    except ConfigError as error:  # a busy port or a model that is not there: before the model loads
        raise SystemExit(f"error: {error}") from error
    return 0


def cmd_config_show(args: argparse.Namespace) -> int:
    from turnrl.config import ConfigError, config_keys, load_config
    from turnrl.eval_config import EvalConfig
    from turnrl.eval_settings import BUDGET_KEYS, at_validation_temperature, training_sections
    from turnrl.training.train_config import TrainConfig

    cls: type = EvalConfig if args.eval else TrainConfig
    # With --eval, a training recipe shows as `turnrl eval --config` reads it: its training sections skipped, its
    # sampling at its validation temperature.
    skipped = training_sections() if args.eval else set()
    overrides = [*args.overrides, *(at_validation_temperature(args.config, args.overrides) if args.eval else [])]
    try:
        config = load_config(cls, args.config, overrides, skip_sections=skipped) if args.config or overrides else cls()
    except ConfigError as error:
        raise SystemExit(f"error: {error}") from error
    title = "turnrl eval" if args.eval else "turnrl train / sft"
    source = f" from {args.config}" if args.config else ""
    console.print(f"# every key of {title}{source}: key: value  # doc", markup=False, highlight=False)
    if args.eval:
        console.print(f"# unless set, {' and '.join(BUDGET_KEYS)} come from the env (what a competent agent needs)",
                      markup=False, highlight=False, soft_wrap=True)
    section = None
    for item in config_keys(config):
        head = item.key.split(".", 1)[0] if "." in item.key else None
        if head != section and head is not None:
            console.print(f"\n# {head}", markup=False, highlight=False)
        section = head
        value = "null" if item.default is None else repr(item.default)
        console.print(f"{item.key}: {value}  # {item.doc}", markup=False, highlight=False, soft_wrap=True)
    return 0


def cmd_serve_env(args: argparse.Namespace) -> int:
    from turnrl.envservice.server import main as serve_env

    return serve_env(args)


def cmd_view(args: argparse.Namespace) -> int:
    from turnrl.viz.view_command import main as view

    return view(args)


# --------------------------------------------------------------------------- wiring
def build_parser() -> argparse.ArgumentParser:
    from turnrl import __version__

    # Both option modules are light: the server and the report load only when their command runs.
    from turnrl.envservice.options import add_arguments as add_serve_env_arguments
    from turnrl.envservice.options import count, port, seconds
    from turnrl.viz.view_command import add_arguments as add_view_arguments

    parser = argparse.ArgumentParser(
        prog="turnrl", description="Multi-turn RL for language and vision-language agents.",
        epilog="Run `turnrl COMMAND --help` for a command's options.",
    )
    parser.add_argument("--version", action="version", version=f"turnrl {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    env_help = "a built-in env (turnrl envs lists them), module:Class, or a registered Gymnasium id"
    settings_help = "env settings as key=value (e.g. size=8 mode=image); turnrl envs lists them"
    overrides_help = "config overrides as key=value (e.g. agent.max_turns=20); turnrl config show lists every key"

    p = sub.add_parser("envs", help="list environments with their modes and settings",
                       description="List the built-in environments, their modes and settings with defaults.")
    p.set_defaults(fn=cmd_envs)

    from turnrl.play import PLAY_COMMANDS  # light: the game's keys and commands

    p = sub.add_parser("play", help="play an environment in the terminal",
                       description="Play an env in the terminal: press a key (W/A/S/D or the arrow keys for "
                                   "directions, a letter for each other action) or type an action and Enter. "
                                   f"Commands: {PLAY_COMMANDS}.")
    p.add_argument("env", help=env_help)
    p.add_argument("--seed", type=seed_arg, default=0, help="episode seed, from 0 (default: 0)")
    p.add_argument("--out", help="folder for the PNG of each turn (image modes; default: a new temporary folder, "
                                 "named when the game starts)")
    p.add_argument("settings", nargs="*", help=settings_help)
    p.set_defaults(fn=cmd_play)

    p = sub.add_parser("render", help="write an env's first frame as an image",
                       description="Write the first frame of an env's episode as an image (PNG unless -o says).")
    p.add_argument("env", help=env_help)
    p.add_argument("--seed", type=seed_arg, default=0, help="episode seed, from 0 (default: 0)")
    p.add_argument("-o", "--output", required=True, help="image file; .png is added when it has no extension")
    p.add_argument("settings", nargs="*", help=settings_help)
    p.set_defaults(fn=cmd_render)

    p = sub.add_parser("check-env", help="check an env against turnrl's contract (and Gymnasium's checker)",
                       description="Build the env with the settings given and check it as a run would use it: "
                                   "Gymnasium's env checker, then turnrl's contract (the same seed gives the same "
                                   "episode, invalid actions never raise, observation and info types, the required "
                                   "methods, the solver's plan succeeds); every failure is listed with what to fix. "
                                   "See docs/extending.md.")
    p.add_argument("env", help=env_help)
    p.add_argument("--seed", type=seed_arg, default=0, help="seed of the episodes checked (default: 0)")
    p.add_argument("--stochastic", action="store_true", help="the env is random given its seed and actions "
                   "(e.g. slippery FrozenLake): do not require the solver's plan to succeed")
    p.add_argument("settings", nargs="*", help=settings_help)
    p.set_defaults(fn=cmd_check_env)

    p = sub.add_parser("eval", help="evaluate a policy on validation seeds",
                       description="Play validation seeds with a policy and report success, rewards, budget cuts "
                                   "and errors, on one env or (--variants) on each of a list of env variants with "
                                   "the same agent settings. Unless agent.max_turns or agent.max_actions_per_episode "
                                   "is set, the env says how many turns a competent agent needs.")
    p.add_argument("--env", help=env_help + "; gym:<id> for a Gymnasium env seen as images (default: the "
                                            "--config recipe's env)")
    p.add_argument("--policy", required=True,
                   help="expert, random, builtin, a model directory or hub id, or openai:<model> (with base_url=...); "
                        "a run's checkpoint (RUN/checkpoints/step_N/actor), SFT model or RUN itself (its latest "
                        "checkpoint) plays with the run's settings unless --config says otherwise")
    p.add_argument("--episodes", type=count, default=None,
                   help="validation seeds played (of each variant; default: the config's episodes, 32 unless set)")
    p.add_argument("--variants", help="evaluate on a list of env variants, one table: ragen (RAGEN's generalization "
                                      "set: Sokoban 6x6/1 box, 8x8/2 boxes, the alternative vocabulary, FrozenLake) "
                                      "or a YAML file listing {name, env, settings}")
    p.add_argument("--out", help="folder for summary.json and trajectories.jsonl "
                                 "(default: runs/eval/<env>-<policy>-<time>)")
    p.add_argument("--config", help="YAML with eval settings, or a training recipe (its training sections are "
                                    "skipped; it samples at its validation temperature)")
    p.add_argument("overrides", nargs="*", help=overrides_help)
    p.set_defaults(fn=cmd_eval)

    p = sub.add_parser("sft", help="supervised fine-tuning on expert demos or a JSONL of chats",
                       description="Fine-tune the recipe's model on its env's expert demos (or --data chats) and "
                                   "save it as RUN/sft/model; RL can start from it in a new run with "
                                   "model.path=RUN/sft/model sft.enabled=false.")
    p.add_argument("--config", help="recipe YAML (default: the built-in defaults)")
    p.add_argument("--data", help="JSONL of chat conversations instead of expert demos (same as sft.data=...)")
    p.add_argument("overrides", nargs="*", help=overrides_help)
    p.set_defaults(fn=cmd_sft)

    p = sub.add_parser("train", help="RL training from a recipe",
                       description="RL training (SFT first when sft.enabled). Ctrl-C stops after the current "
                                   "step and saves a checkpoint; resume=RUN_DIR continues a run.")
    p.add_argument("--config", help="recipe YAML (omit with resume=RUN_DIR)")
    p.add_argument("overrides", nargs="*", help=overrides_help + ", or resume=RUN_DIR")
    p.set_defaults(fn=cmd_train)

    p = sub.add_parser("memory", help="estimate a recipe's GPU memory on 1, 2, 4... GPUs (no GPU needed)",
                       description="Estimate each GPU's peak memory for a training recipe, by part (training "
                                   "states, reference, rollout weights, key/value cache, activations), on the "
                                   "GPU counts asked, and say what to turn on where it does not fit: the check "
                                   "`turnrl train` makes before loading, without a GPU or the model's weights. "
                                   "Exit status 1 when some count does not fit.")
    p.add_argument("--config", help="the recipe YAML")
    p.add_argument("--gpus", type=gpu_counts, help="GPU counts (processes) to estimate, as 1,2,4; default: the "
                                                    "recipe's distributed.nproc_per_node")
    p.add_argument("--gpu-gib", type=gib_arg, help="memory of one GPU in GiB; default: this machine's GPU, or an "
                                                 "H100 80GB's 79.2")
    p.add_argument("overrides", nargs="*", help="key=value overrides (model.builtin_preset=7b, lora.enabled=true)")
    p.set_defaults(fn=cmd_memory)

    p = sub.add_parser("serve-policy", help="serve a model over an OpenAI-compatible HTTP API",
                       description="Serve a model at http://HOST:PORT/v1 (chat completions, models, health).")
    p.add_argument("--model", required=True,
                   help="model directory, 'builtin', or 'builtin:PRESET' (e.g. builtin:vlm-tiny)")
    p.add_argument("--served-model-name", help="the name clients pass as `model` (default: the --model text), "
                                               "e.g. my-model for `turnrl eval --policy openai:my-model`")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1, this machine only)")
    p.add_argument("--port", type=port, default=8000, help="port to listen on; 0 picks a free one and says which "
                                                           "(default: 8000)")
    p.add_argument("--device", default="auto", help="auto (a GPU when there is one), cpu, cuda or cuda:N")
    p.add_argument("--max-batch-size", type=count, default=32,
                   help="prompts generated together at most (default: 32)")
    p.add_argument("--token", default=None,
                   help="API key clients must send as 'Authorization: Bearer KEY' (every path but /health; "
                        "default: $TURNRL_POLICY_TOKEN if set, else no key)")
    p.add_argument("--prepare-threads", type=count, default=2,
                   help="requests prepared at once (chat template, image decoding; default: 2)")
    p.add_argument("--max-image-pixels", type=count, default=4096 * 4096,
                   help="images with more pixels are refused undecoded (default: 16777216, 4096 x 4096)")
    p.add_argument("--max-request-mb", type=count, default=32,
                   help="request bodies over this many MiB are refused with a 413, unread (default: 32)")
    p.add_argument("--body-timeout-s", type=seconds, default=120.0,
                   help="a request body not whole this many seconds after its headers is a 408 (default: 120; "
                        "inf for none)")
    p.add_argument("--body-stall-s", type=seconds, default=15.0,
                   help="so is one whose next bytes do not come for this many seconds (default: 15; inf for none)")
    p.add_argument("overrides", nargs="*",
                   help="model settings as key=value (the model section: dtype=bfloat16, backend=hf, ...)")
    p.set_defaults(fn=cmd_serve_policy)

    p = sub.add_parser("serve-env", help="serve envs over HTTP (sessions, batched reset/step, images as PNG)",
                       description="Serve turnrl envs over HTTP for remote rollouts (env.remote=[URL] in a "
                                   "recipe or turnrl eval); see docs/env_service.md.")
    add_serve_env_arguments(p)
    p.set_defaults(fn=cmd_serve_env)

    p = sub.add_parser("view", help="write the HTML report of a run or eval folder, optionally serve it",
                       description="Write RUN_DIR_OR_EVAL_DIR/report.html (episodes, images, rewards, advantages, "
                                   "training curves) and plots/*.png; see docs/viewer.md.")
    add_view_arguments(p)
    p.set_defaults(fn=cmd_view)

    p = sub.add_parser("config", help="show every config key with its value and doc",
                       description="Print every config key, its value (the defaults, or a recipe's with --config) "
                                   "and its one-line doc.")
    config_sub = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    q = config_sub.add_parser("show", help="print every key, its value and its doc")
    q.add_argument("--config", help="a recipe YAML whose values to show")
    q.add_argument("--eval", action="store_true", help="the keys of turnrl eval instead of train")
    q.add_argument("overrides", nargs="*", help="key=value overrides applied before showing")
    q.set_defaults(fn=cmd_config_show)
    return parser


def _subparser(parser: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.ArgumentParser:
    """The (sub)parser of the command named in ``argv``, for usage errors that show that command's usage."""
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    for word in argv:
        if actions and word in actions[0].choices:
            return _subparser(actions[0].choices[word], argv[list(argv).index(word) + 1 :])
    return parser


def import_from_current_folder() -> None:
    """Put the current folder first on the import path, as ``python -m`` does, so that a ``module:Class`` env
    (or a ``module:function`` reward) of a package in the folder a command runs from imports; the ``turnrl``
    script alone would start with only its own folder there."""
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())


STACKS_SIGNAL = signal.SIGUSR1
"""``kill -USR1 PID``: the process prints every thread's Python stack to its stderr and goes on."""


def print_stacks_on_signal(file: TextIO) -> None:
    """Make :data:`STACKS_SIGNAL` print every thread's Python stack to ``file`` (the process goes on): where a run
    that seems stuck waits (on a lost worker's answer, a collective, a lock), without a debugger or a restart.
    Python's faulthandler writes the stacks from its own C handler, so it answers while the main thread is
    blocked in C (a wait on a future, a CUDA synchronize), where a Python signal handler would not run. It reads
    the other threads' frames without the GIL: meant for a stuck process; on a busy one it can, rarely, crash it
    (a training run also writes its stacks safely by itself when stuck: ``run.stall_dump_minutes``)."""
    faulthandler.register(STACKS_SIGNAL, file=file, all_threads=True)


def main(argv: Sequence[str] | None = None) -> int:
    # The run's own rich progress bars say what is happening; the per-file
    # bars of model loading and saving would only interleave with them.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    print_stacks_on_signal(sys.__stderr__ or sys.stderr)
    import_from_current_folder()
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    # argparse gives a trailing nargs="*" positional only the words before the
    # first option, so `play ENV --seed 3 mode=image` would stop at
    # "mode=image". Words of the form key=value left over after the options
    # belong to the command's settings / overrides, in command-line order.
    args, extra = parser.parse_known_args(argv)
    target = next((name for name in ("settings", "overrides") if hasattr(args, name)), None)
    if extra:
        if target is None or any(word.startswith("-") or "=" not in word for word in extra):
            _subparser(parser, argv).error(f"unrecognized arguments: {' '.join(extra)}")
        setattr(args, target, [*getattr(args, target), *extra])
    try:
        return int(args.fn(args) or 0)
    except KeyboardInterrupt:  # a second Ctrl-C, or one outside the steps that stop cleanly
        print("\ninterrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

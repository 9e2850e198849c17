"""The ``turnrl`` command.

    turnrl envs                                   list the environments
    turnrl play ENV [--seed N] [key=value ...]    play an env in the terminal
    turnrl render ENV --seed N -o out.png         draw an env's first frame
    turnrl check-env ENV [key=value ...]          check an env against the contract
    turnrl eval --env ENV --policy P --episodes N evaluate a policy
    turnrl sft --config X.yaml [key=value ...]    supervised warm start
    turnrl train --config X.yaml [key=value ...]  RL training (SFT first when configured)
    turnrl serve-policy --model PATH --port N     OpenAI-compatible server

Heavy libraries are imported inside the commands that need them, so listing
or playing an env starts at once.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

console = Console()


def parse_settings(items: Sequence[str]) -> dict[str, Any]:
    """``["size=8", "is_slippery=true"]`` -> ``{"size": 8, "is_slippery": True}`` (YAML typing)."""
    from omegaconf import OmegaConf

    for item in items:
        if "=" not in item:
            raise SystemExit(f"error: setting {item!r} is not of the form key=value")
    return OmegaConf.to_container(OmegaConf.from_dotlist(list(items))) if items else {}  # type: ignore[return-value]


def _make_env(name: str, settings: dict[str, Any]):
    from turnrl.envs import make

    try:
        return make(name, **settings)
    except (ValueError, TypeError) as error:
        raise SystemExit(f"error: {error}") from error


# --------------------------------------------------------------------------- envs
def cmd_envs(args: argparse.Namespace) -> int:
    from turnrl.envs.registry import env_class, env_names, env_parameters, gym_id

    table = Table(title="turnrl environments")
    # Ids and modes are what users type: never wrap or cut them, even in a narrow terminal.
    table.add_column("id", no_wrap=True)
    table.add_column("modes", no_wrap=True)
    table.add_column("description")
    table.add_column("settings (defaults)", overflow="fold")
    for name in env_names():
        cls = env_class(name)
        params = ", ".join(f"{k}={v!r}" for k, v in env_parameters(name).items() if k != "render_mode")
        table.add_row(gym_id(name), ", ".join(cls.modes), cls.description, params)
    console.print(table)
    return 0


# --------------------------------------------------------------------------- play / render
def _save_png(image: Any, path: Path) -> None:
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(image).save(path)


def cmd_play(args: argparse.Namespace) -> int:
    env = _make_env(args.env, parse_settings(args.settings))
    obs, info = env.reset(seed=args.seed)
    out_dir = Path(args.out or f"play_{args.env}_{args.seed}")
    console.print(f"[bold]{type(env).__name__}[/bold] seed={args.seed}\n")
    console.print(env.instructions(), markup=False)
    names = env.action_names()
    console.print(
        f"\nActions: {', '.join(names) if names else 'free-form text'}. "
        "Commands: :hint (solver's next actions), :reset, :quit\n",
        markup=False,
    )
    turn, total = 0, 0.0

    def show(obs: dict[str, Any]) -> None:
        console.print(obs["text"], markup=False, highlight=False)
        if "image" in obs:
            path = out_dir / f"turn_{turn:03d}.png"
            _save_png(obs["image"], path)
            console.print(f"[dim](image written to {path})[/dim]")

    show(obs)
    while True:
        try:
            line = input("action> ")
        except EOFError:
            break
        command = line.strip()
        if command in (":quit", ":q"):
            break
        if command == ":reset":
            obs, info = env.reset(seed=args.seed)
            turn, total = 0, 0.0
            show(obs)
            continue
        if command == ":hint":
            console.print(f"solver: {env.solve()}", markup=False)
            continue
        obs, reward, terminated, truncated, info = env.step(line)
        turn += 1
        total += reward
        valid = "" if info.get("action_is_valid", True) else " (invalid action)"
        console.print(f"reward {reward:g}{valid}, total {total:g}", markup=False)
        show(obs)
        if terminated or truncated:
            outcome = "solved" if info.get("success") else ("truncated" if truncated else "failed")
            console.print(f"[bold]Episode over: {outcome}[/bold] after {turn} steps, return {total:g}")
            break
    return 0


def cmd_render(args: argparse.Namespace) -> int:
    from turnrl.envs.registry import builtin_name, env_class

    settings = parse_settings(args.settings)
    name = builtin_name(args.env)
    if name is not None and "mode" not in settings:  # a built-in env draws in its first image mode
        modes = env_class(name).modes
        image_modes = [m for m in modes if m != "text"]
        if not image_modes:
            raise SystemExit(f"error: {args.env} has no image mode (modes: {', '.join(modes)})")
        settings["mode"] = image_modes[0]
    env = _make_env(args.env, settings)
    obs, _ = env.reset(seed=args.seed)
    if "image" not in obs:
        hint = f"; pick one of {[m for m in env_class(name).modes if m != 'text']}" if name else ""
        raise SystemExit(f"error: {args.env} with {settings} observes no image{hint}")
    _save_png(obs["image"], Path(args.output))
    console.print(f"wrote {args.output} ({obs['image'].shape[1]}x{obs['image'].shape[0]})")
    return 0


def cmd_check_env(args: argparse.Namespace) -> int:
    from turnrl.envs import EnvCheckError, check_env

    env = _make_env(args.env, parse_settings(args.settings))
    try:
        check_env(env, seed=args.seed, deterministic=not args.stochastic)
    except EnvCheckError as error:
        console.print(f"[bold red]{args.env} fails the turnrl env contract[/bold red]")
        console.print(str(error), markup=False)
        return 1
    console.print(f"[bold green]{args.env} passes[/bold green] Gymnasium's checker and turnrl's contract checks")
    return 0


# --------------------------------------------------------------------------- eval / sft / train / serve
def cmd_eval(args: argparse.Namespace) -> int:
    from dataclasses import fields

    from turnrl.config import ConfigError, EvalConfig, load_config
    from turnrl.evaluate import run_eval
    from turnrl.training.config import TrainConfig

    overrides = list(args.overrides)
    overrides += [f"env.id={args.env}", f"policy={args.policy}", f"episodes={args.episodes}"]
    if args.out:
        overrides.append(f"out={args.out}")
    try:
        # A training recipe evaluates with its own env, agent and sampling settings.
        training_only = {f.name for f in fields(TrainConfig)} - {f.name for f in fields(EvalConfig)}
        config = load_config(EvalConfig, args.config, overrides, skip_sections=training_only)
        run_eval(config)
    except ConfigError as error:
        raise SystemExit(f"error: {error}") from error
    return 0


def cmd_sft(args: argparse.Namespace) -> int:
    from turnrl.config import ConfigError, load_config
    from turnrl.training.config import TrainConfig
    from turnrl.training.trainer import sft_only

    try:
        sft_only(load_config(TrainConfig, args.config, args.overrides), data=args.data)
    except ConfigError as error:
        raise SystemExit(f"error: {error}") from error
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from turnrl.config import ConfigError, load_config
    from turnrl.training.config import TrainConfig
    from turnrl.training.trainer import train

    overrides = list(args.overrides)
    resume = next((o.split("=", 1)[1] for o in overrides if o.startswith("resume=")), None)
    config_path = args.config
    if resume is not None and config_path is None:
        config_path = str(Path(resume) / "config.yaml")
    try:
        train(load_config(TrainConfig, config_path, overrides))
    except ConfigError as error:  # also those found once the run starts (a reward function that cannot load)
        raise SystemExit(f"error: {error}") from error
    return 0


def cmd_serve_policy(args: argparse.Namespace) -> int:
    from turnrl.serve.policy import serve

    serve(model_path=args.model, host=args.host, port=args.port, device=args.device, max_batch_size=args.max_batch_size)
    return 0


# --------------------------------------------------------------------------- wiring
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="turnrl", description="Multi-turn RL for language and vision-language agents."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("envs", help="list environments with their modes and settings")
    p.set_defaults(fn=cmd_envs)

    p = sub.add_parser("play", help="play an environment in the terminal")
    p.add_argument("env")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="folder for the PNG of each turn (image modes)")
    p.add_argument("settings", nargs="*", help="env settings as key=value (e.g. size=8 mode=image)")
    p.set_defaults(fn=cmd_play)

    p = sub.add_parser("render", help="write an env's first frame as PNG")
    p.add_argument("env")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("-o", "--output", required=True)
    p.add_argument("settings", nargs="*", help="env settings as key=value")
    p.set_defaults(fn=cmd_render)

    p = sub.add_parser("check-env", help="check an env against turnrl's contract (and Gymnasium's checker)")
    p.add_argument("env", help="a built-in name, module:Class, or a registered Gymnasium id")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stochastic", action="store_true", help="the env is random given its seed and actions "
                   "(e.g. slippery FrozenLake): do not require the solver's plan to succeed")
    p.add_argument("settings", nargs="*", help="env settings as key=value")
    p.set_defaults(fn=cmd_check_env)

    p = sub.add_parser("eval", help="evaluate a policy on validation seeds")
    p.add_argument("--env", required=True)
    p.add_argument("--policy", required=True, help="expert, random, builtin, a model directory, or openai:<model>")
    p.add_argument("--episodes", type=int, default=32)
    p.add_argument("--out", help="folder for summary.json and trajectories.jsonl")
    p.add_argument("--config", help="YAML with eval settings, or a training recipe (its training sections are skipped)")
    p.add_argument("overrides", nargs="*", help="key=value overrides (e.g. env.settings.size=6 sampling.temperature=0)")
    p.set_defaults(fn=cmd_eval)

    p = sub.add_parser("sft", help="supervised fine-tuning on expert demos or a JSONL of chats")
    p.add_argument("--config", help="recipe YAML")
    p.add_argument("--data", help="JSONL of chat conversations instead of expert demos")
    p.add_argument("overrides", nargs="*", help="key=value overrides")
    p.set_defaults(fn=cmd_sft)

    p = sub.add_parser("train", help="RL training from a recipe")
    p.add_argument("--config", help="recipe YAML (omit with resume=RUN_DIR)")
    p.add_argument("overrides", nargs="*", help="key=value overrides, or resume=RUN_DIR")
    p.set_defaults(fn=cmd_train)

    p = sub.add_parser("serve-policy", help="serve a model over an OpenAI-compatible HTTP API")
    p.add_argument("--model", required=True,
                   help="model directory, 'builtin', or 'builtin:PRESET' (e.g. builtin:vlm-tiny)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--device", default="auto")
    p.add_argument("--max-batch-size", type=int, default=32)
    p.set_defaults(fn=cmd_serve_policy)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    # The run's own rich progress bars say what is happening; the per-file
    # bars of model loading and saving would only interleave with them.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    parser = build_parser()
    # argparse gives a trailing nargs="*" positional only the words before the
    # first option, so `play ENV --seed 3 mode=image` would stop at
    # "mode=image". Words of the form key=value left over after the options
    # belong to the command's settings / overrides, in command-line order.
    args, extra = parser.parse_known_args(argv)
    target = next((name for name in ("settings", "overrides") if hasattr(args, name)), None)
    if extra:
        if target is None or any(word.startswith("-") or "=" not in word for word in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        setattr(args, target, [*getattr(args, target), *extra])
    return int(args.fn(args) or 0)


if __name__ == "__main__":
    sys.exit(main())

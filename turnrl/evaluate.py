"""``turnrl eval``: play validation seeds with a policy and report how it did.

Writes ``summary.json`` (the figures printed) and ``trajectories.jsonl`` (every
turn: prompt, response, parsed fields, actions, rewards; images as PNG files in
``images/`` beside it).

The turn and action budgets are the agent section's, or, with
``budget_from_env``, what the env says a competent agent needs under its
settings (``env.action_budget()``): the expert finishes every built-in env with
them. The summary says where the budget came from (``env``, ``config``, or
``agent defaults`` for an env that names none), counts the episodes a budget
cut, and shows the first errors.

With ``variants`` (``turnrl eval --variants ragen``) one policy plays each
env variant in turn with the same agent, prompt and sampling settings, and
the run prints one table (variant, episodes, success, mean reward, format
validity, mean turns) that ``summary.json`` holds as ``variants``; each
variant's summary, config and trajectories go to ``variants/<name>/``.

Ctrl-C or SIGTERM keeps what was played: the batch in progress is dropped, the finished episodes are summarized
and written as a whole evaluation's are, with ``stop_signal`` and ``episodes_planned`` in the summary (a variant
cut short ends the table), and the command exits with 128 + the signal's number. An error that ends a batch (the
policy's engine failing, not an episode's own env or request, which ends that episode alone) keeps the batches
before it the same way, with ``failed`` in the summary, and is then raised.
"""

from __future__ import annotations

import json
import re
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch
import yaml
from rich.console import Console
from rich.table import Table

from turnrl.agent.formats import ResponseFormat, get_format
from turnrl.config import AgentConfig, ConfigError, EnvConfig, to_yaml
from turnrl.envs.contract import AgentEnv, optional_methods
from turnrl.envs.seeds import SeedSplits
from turnrl.envservice.placement import EnvFactory, env_factory
from turnrl.eval_config import VARIANT_SETS, EvalConfig, VariantConfig
from turnrl.files import parse_yaml
from turnrl.policy.factory import make_policy
from turnrl.policy.interface import Policy
from turnrl.registry import close_names
from turnrl.rewards import Rewards
from turnrl.rollout.groups import EnvGroups
from turnrl.rollout.metrics import first_errors, pass_at_k_by_seed, rollout_metrics
from turnrl.rollout.runner import Rollout
from turnrl.rollout.trajectory import TRUNCATED, Trajectory, write_trajectories
from turnrl.training.logger import RunProgress
from turnrl.training.seeding import step_seed
from turnrl.viz.records import VARIANT_COLUMNS, VARIANTS_DIR
from turnrl.viz.report import write_report

console = Console()

def summarize(trajectories: list[Trajectory]) -> dict[str, Any]:
    metrics = rollout_metrics(trajectories)
    cut = Counter(t.truncation_reason or "unknown" for t in trajectories if t.status == TRUNCATED)
    summary: dict[str, Any] = {
        "episodes": len(trajectories),
        "success_rate": metrics["success"],
        "pass_at_k": {str(k): v for k, v in pass_at_k_by_seed(trajectories).items()},
        "mean_turns": metrics["turns_mean"],
        "format_valid_rate": metrics["format_ok"],
        "action_validity": metrics["action_valid"],
        "action_effective": metrics["action_effective"],
        "env_metrics": {name.removeprefix("env_"): value for name, value in metrics.items() if name.startswith("env_")},
        "mean_reward": metrics["reward_mean"],
        "mean_env_reward": metrics["reward_env_mean"],
        # Each named reward before its weight (env, format, every rewards.extra: a state reward's is how well a
        # checkpoint sees), an episode's sum averaged over the episodes.
        "mean_rewards": {key.removeprefix("reward_").removesuffix("_mean"): value for key, value in metrics.items()
                         if key.startswith("reward_") and key.endswith("_mean") and key != "reward_mean"},
        "errors": int(metrics["errors"]),
        "truncated_rate": metrics["truncated"],
        "cut_by_budget": sum(cut.values()),
        "cut_by": dict(sorted(cut.items())),
        "first_errors": first_errors(trajectories),
    }
    return summary


def print_summary(summary: dict[str, Any], title: str) -> None:
    table = Table(title=title)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in summary.items():
        if key == "first_errors":
            continue
        if isinstance(value, dict):
            value = ", ".join(f"{k}: {v:.3f}" if isinstance(v, float) else f"{k}: {v}" for k, v in value.items()) or "-"
        elif isinstance(value, float):
            value = f"{value:.3f}"
        table.add_row(key, str(value))
    console.print(table)
    print_errors(summary)


def print_errors(summary: dict[str, Any], name: str = "") -> None:
    """How many episodes errored and the first errors (nothing when none did); ``name``: the variant's."""
    if summary.get("first_errors"):
        console.print(f"[bold red]{name}{': ' if name else ''}{summary['errors']} episode(s) errored[/bold red]; "
                      "first errors:")
        for message in summary["first_errors"]:
            console.print(f"  {message}", markup=False, highlight=False)


def env_budget(env: AgentEnv, agent: AgentConfig) -> AgentConfig | None:
    """``agent`` with the turn and action budgets the env asks for (``env.action_budget()``): one action a
    turn is enough to finish. None for an env that names no budget (no ``action_budget``, or one that
    answers None: a Gymnasium env without a step limit)."""
    wanted = optional_methods(env).action_budget()
    if wanted is None:
        return None
    actions = max(1, int(wanted))
    return replace(agent, max_turns=actions, max_actions_per_episode=actions)


@dataclass(frozen=True)
class EvalEnv:
    """One env a policy is evaluated on: a variant of a generalization table, or ``env`` alone."""

    name: str
    """The variant's name (its row and folder); empty for a single evaluation."""
    env_id: str
    settings: dict[str, Any]
    """Every setting the env is built with (the trained env's merged under a variant's own)."""
    own_settings: dict[str, Any]
    """What the variant itself sets (the table's settings column)."""
    where: str
    """The config key the settings come from, for error messages."""


def eval_envs(config: EvalConfig) -> list[EvalEnv]:
    """The envs of an evaluation: ``env`` alone, or one per variant. A variant of the trained env (``env.id``)
    takes its settings over the trained ones (``env.val_settings``, else ``env.settings``); another env takes
    its own alone."""
    trained = dict(config.env.val_settings if config.env.val_settings is not None else config.env.settings)
    where = "env.val_settings" if config.env.val_settings is not None else "env.settings"
    if not config.variants:
        return [EvalEnv("", config.env.id, trained, trained, where)]
    envs = []
    for index, variant in enumerate(config.variants):
        env_id = variant.env or config.env.id
        settings = {**trained, **variant.settings} if env_id == config.env.id else dict(variant.settings)
        envs.append(EvalEnv(variant.name, env_id, settings, dict(variant.settings), f"variants[{index}].settings"))
    return envs


@dataclass
class PreparedEnv:
    """An env checked and ready to play: how to make it and the agent settings it is played with."""

    target: EvalEnv
    make_env: EnvFactory
    """Builds one env (here or on ``env.remote``); closed when the evaluation ends."""
    agent: AgentConfig
    budget_source: str
    """``config``, ``env`` or ``agent defaults``: where the turn and action budgets come from."""


def prepare_env(config: EvalConfig, target: EvalEnv, budget_from_env: bool) -> PreparedEnv:
    """Build ``target``'s first env (so that a bad id or setting fails before a model loads) and its budget.
    The caller closes ``make_env`` (this closes it only when it raises).

    Raises:
        ConfigError: the env or its settings are refused (naming the variant, for a variant).
    """
    try:
        # Here or on the env servers of env.remote; an unknown env or a bad setting is a config error.
        make_env = env_factory(target.env_id, target.settings, config.env.remote, where=target.where)
    except ConfigError as error:
        if not target.name:
            raise
        raise ConfigError(f"variant {target.name!r} ({target.env_id} with {target.settings}): {error}") from error
    agent, budget_source = config.agent, "config"
    if budget_from_env:
        try:
            budgeted = env_budget(make_env(), config.agent)
        except BaseException:
            make_env.close()
            raise
        budget_source = "env" if budgeted is not None else "agent defaults"  # the env names none: say so
        agent = budgeted or config.agent
    return PreparedEnv(target, make_env, agent, budget_source)


@dataclass
class Played:
    """The episodes an evaluation of one env played: all it planned, or those before a stop or a failure."""

    trajectories: list[Trajectory]
    planned: int
    stop_signal: signal.Signals | None = None
    """Ctrl-C's or SIGTERM's, where one stopped the evaluation before its last episode."""
    failure: Exception | None = None
    """What failed a batch (the policy's engine, the rollout itself) after earlier batches ended: raised again
    once their episodes are written, so that hours of episodes are not lost with the batch."""


@dataclass
class StopSignal:
    """Which signal interrupted an evaluation (:func:`stops_as_interrupts` notes it)."""

    received: signal.Signals | None = None
    """Ctrl-C's or SIGTERM, as one arrived within :func:`stops_as_interrupts`; None before."""

    @property
    def signal(self) -> signal.Signals:
        """The signal that interrupted: the one noted, else Ctrl-C's (an interrupt raised otherwise)."""
        return self.received or signal.SIGINT


@contextmanager
def stops_as_interrupts() -> Iterator[StopSignal]:
    """Within it a SIGTERM (a batch scheduler's, before it kills the job) interrupts as Ctrl-C does, raising
    :class:`KeyboardInterrupt` where the process would otherwise end at once, and the signal is noted. Outside
    the main thread it changes nothing, and a signal the process was started ignoring stays ignored."""
    stop = StopSignal()

    def interrupt(signum: int, frame: Any) -> None:
        stop.received = signal.Signals(signum)
        raise KeyboardInterrupt

    previous: dict[signal.Signals, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for number in (signal.SIGINT, signal.SIGTERM):
            if signal.getsignal(number) != signal.SIG_IGN:
                previous[number] = signal.signal(number, interrupt)
    try:
        yield stop
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def play(config: EvalConfig, prepared: PreparedEnv, policy: Policy, fmt: ResponseFormat,
         stop: StopSignal) -> Played:
    """``config.episodes`` validation seeds (``samples_per_seed`` episodes each) of ``prepared``'s env, in batches;
    an interrupt (``stop`` says which signal) or an error drops the batch in progress and returns the episodes
    before it (none played: it is raised).

    A model's sampling noise is drawn from ``seeds.seed``, fixed anew for each env with the seed a training run's
    validation fixes: an evaluation repeats to the token, and a variant's figures do not hang on the variants
    played before it."""
    torch.manual_seed(step_seed(config.seeds.seed, -1))
    seeds = SeedSplits(config.seeds.train_start, config.seeds.val_start, config.seeds.val_size)
    slots = EnvGroups(prepared.make_env, 1, 1, seeds).val_slots(config.episodes, config.samples_per_seed,
                                                                 envs=config.batch_size)
    env_id = prepared.target.env_id
    rollout = Rollout(policy, fmt, prepared.agent, env_id=env_id, rewards=Rewards(config.rewards))
    label = f"{prepared.target.name} ({env_id})" if prepared.target.name else env_id
    trajectories: list[Trajectory] = []
    with RunProgress(console, "eval", len(slots)) as progress:
        try:
            for start in range(0, len(slots), config.batch_size):
                batch = slots[start : start + config.batch_size]
                trajectories.extend(rollout.run(batch, config.sampling))
                progress.update(len(batch), f"{label} / {config.policy}")
        except KeyboardInterrupt:
            if not trajectories:
                raise
            received = stop.signal
            console.print(f"\n[bold]{received.name}[/bold]: stopped after {len(trajectories)} of {len(slots)} "
                          f"episodes of {label} (the batch in progress dropped); the summary covers those")
            return Played(trajectories, len(slots), received)
        except Exception as error:  # an episode's own failure ends that episode; this one ended the batch
            if not trajectories:
                raise
            console.print(f"\n[bold red]{type(error).__name__}[/bold red]: the evaluation of {label} failed after "
                          f"{len(trajectories)} of {len(slots)} episodes (the batch in progress dropped); the summary "
                          "covers those, then the error is raised")
            return Played(trajectories, len(slots), failure=error)
    return Played(trajectories, len(slots))


def env_summary(config: EvalConfig, prepared: PreparedEnv, played: Played) -> dict[str, Any]:
    """:func:`summarize` with what was evaluated: env, policy, format and budget (and, where a signal or an error
    stopped it, which one and the episodes planned)."""
    summary = summarize(played.trajectories)
    summary.update(env=prepared.target.env_id, policy=config.policy, format=config.agent.format,
                   budget={"max_turns": prepared.agent.max_turns,
                           "max_actions_per_episode": prepared.agent.max_actions_per_episode,
                           "from": prepared.budget_source})
    if played.stop_signal is not None:
        summary.update(stop_signal=played.stop_signal.name, episodes_planned=played.planned)
    if played.failure is not None:
        summary.update(failed=failure_text(played.failure), episodes_planned=played.planned)
    return summary


def failure_text(error: Exception) -> str:
    """The error that ended an evaluation, as its summary says it: its type and first line."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


def single_config(config: EvalConfig, prepared: PreparedEnv) -> EvalConfig:
    """The config that evaluates ``prepared``'s env alone (a variant's folder holds it: its row again)."""
    env = EnvConfig(id=prepared.target.env_id, settings=dict(prepared.target.settings), remote=list(config.env.remote))
    return replace(config, env=env, agent=prepared.agent, variants=[])


def write_eval(out_dir: Path, summary: dict[str, Any], config: EvalConfig,
               trajectories: list[Trajectory] | None = None) -> None:
    """``summary.json``, ``config.yaml`` and (when given) ``trajectories.jsonl`` with its images."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    (out_dir / "config.yaml").write_text(to_yaml(config))
    if trajectories is not None:
        write_trajectories(trajectories, out_dir)


def write_page(out_dir: Path) -> None:
    try:
        report = write_report(out_dir)
        console.print(f"report: {report}  (turnrl view {out_dir} --serve to serve it)", markup=False,
                      highlight=False, soft_wrap=True)
    except (OSError, ValueError) as error:  # the evaluation itself succeeded
        console.print(f"no report: {error}", markup=False)


def run_eval(config: EvalConfig, budget_from_env: bool = False) -> dict[str, Any]:
    """Evaluate ``config.policy`` on ``config.episodes`` validation seeds of ``env``, or of each of ``variants``.

    Args:
        budget_from_env: take ``agent.max_turns`` and ``agent.max_actions_per_episode`` from the env's
            ``action_budget()`` (``turnrl eval`` does unless they are set), for each variant its own.

    Returns:
        The summary written to ``summary.json``: the figures of the env, or (with variants) the policy and
        the table, ``{"variants": [row, ...], ...}`` (see :func:`variant_row`).

    Raises:
        ConfigError: an env, its settings or the policy cannot be built (every env is checked before the model
            loads).
    """
    # However the evaluation ends (done, an error, Ctrl-C), its envs' sessions on env.remote are closed, not
    # left open on the servers until their idle timeout.
    with ExitStack() as closing:
        prepared = []
        for target in eval_envs(config):
            prepared.append(prepare_env(config, target, budget_from_env))
            closing.callback(prepared[-1].make_env.close)
        fmt = get_format(
            config.agent.format,
            action_separator=config.agent.action_separator,
            max_actions_per_turn=config.agent.max_actions_per_turn,
            strict=config.agent.strict_format,
        )
        policy = make_policy(config, fmt)  # one model for every variant
        with stops_as_interrupts() as stop:
            try:
                if not config.variants:
                    return evaluate_one(config, prepared[0], policy, fmt, stop)
                return evaluate_variants(config, prepared, policy, fmt, stop)
            except KeyboardInterrupt:  # before any batch ended (Ctrl-C's: the command says "interrupted")
                if stop.received is not signal.SIGTERM:
                    raise
                console.print("\n[bold]SIGTERM[/bold]: stopped before the first batch of episodes ended; nothing "
                              "written")
                raise SystemExit(128 + signal.SIGTERM.value) from None


def evaluate_one(config: EvalConfig, prepared: PreparedEnv, policy: Policy, fmt: ResponseFormat,
                 stop: StopSignal) -> dict[str, Any]:
    played = play(config, prepared, policy, fmt, stop)
    trajectories = played.trajectories
    summary = env_summary(config, prepared, played)
    print_summary(summary, f"{config.env.id}: {config.policy}")
    if not config.out:
        console.print("nothing written (out is unset); pass --out DIR to keep the summary and trajectories")
    else:
        out_dir = Path(config.out)
        write_eval(out_dir, summary, replace(config, agent=prepared.agent), trajectories)
        console.print(f"wrote {out_dir / 'summary.json'} and {out_dir / 'trajectories.jsonl'}", markup=False,
                      highlight=False, soft_wrap=True)  # whole paths, to copy
        write_page(out_dir)
    if played.failure is not None:
        raise played.failure
    return summary


def variant_row(prepared: PreparedEnv, summary: dict[str, Any]) -> dict[str, Any]:
    """One row of the generalization table: the variant, its env and settings, the figures of
    :data:`VARIANT_COLUMNS` and the budget it was played with."""
    target = prepared.target
    row: dict[str, Any] = {"variant": target.name, "env": target.env_id, "settings": target.own_settings}
    row.update({key: summary[key] for key, _ in VARIANT_COLUMNS})
    row.update(truncated_rate=summary["truncated_rate"], budget=summary["budget"],
               folder=f"{VARIANTS_DIR}/{target.name}")
    return row


def settings_text(settings: dict[str, Any]) -> str:
    """``{"size": 8, "num_boxes": 2}`` -> ``size=8 num_boxes=2`` (``-`` for none)."""
    return " ".join(f"{key}={value}" for key, value in settings.items()) or "-"


def print_variants(rows: list[dict[str, Any]], title: str) -> None:
    """The table, a line per variant: in a terminal as wide as it is, elsewhere (a log) up to 160 columns."""
    table = Table(title=title)
    for column in ("variant", "env", "settings"):
        table.add_column(column, no_wrap=column != "settings")
    for _, column in VARIANT_COLUMNS:
        table.add_column(column, justify="right")
    for row in rows:
        figures = [f"{row[key]:.3f}" if isinstance(row[key], float) else str(row[key]) for key, _ in VARIANT_COLUMNS]
        table.add_row(row["variant"], row["env"], settings_text(row["settings"]), *figures)
    wide = console if console.is_terminal else Console(file=console.file, width=max(console.width, 160))
    wide.print(table)


def evaluate_variants(
    config: EvalConfig, prepared: list[PreparedEnv], policy: Policy, fmt: ResponseFormat,
    stop: StopSignal,
) -> dict[str, Any]:
    """Play every variant with the one policy; write each variant's folder, then the table (the variants played
    before a stop or a failure, the one it cut short last); a failure is raised once the table is written."""
    out_dir = Path(config.out) if config.out else None
    rows: list[dict[str, Any]] = []
    stopped_by: signal.Signals | None = None
    failure: Exception | None = None
    for item in prepared:
        try:
            played = play(config, item, policy, fmt, stop)
        except KeyboardInterrupt:  # before the variant's first batch ended
            if not rows:
                raise
            stopped_by = stop.signal
            break
        except Exception as error:  # the same, failed: the variants played before it stay in the table
            if not rows:
                raise
            failure = error
            break
        summary = env_summary(config, item, played)
        rows.append(variant_row(item, summary))
        print_errors(summary, item.target.name)
        if out_dir is not None:
            write_eval(out_dir / VARIANTS_DIR / item.target.name, summary, single_config(config, item),
                       played.trajectories)
        if played.stop_signal is not None or played.failure is not None:
            stopped_by, failure = played.stop_signal, played.failure
            break
    result: dict[str, Any] = {
        "policy": config.policy, "format": config.agent.format, "temperature": config.sampling.temperature,
        "episodes": sum(row["episodes"] for row in rows), "variants": rows,
    }
    title = f"{config.policy} on {len(rows)} env variants"
    if stopped_by is not None:
        result.update(stop_signal=stopped_by.name, variants_planned=len(prepared))
        title += f" (stopped by {stopped_by.name}: {len(rows)} of {len(prepared)} played, the last maybe in part)"
    if failure is not None:
        result.update(failed=failure_text(failure), variants_planned=len(prepared))
        title += f" (failed: {len(rows)} of {len(prepared)} played, the last maybe in part)"
    print_variants(rows, title)
    if out_dir is None:
        console.print("nothing written (out is unset); pass --out DIR to keep the table and trajectories")
    else:
        write_eval(out_dir, result, config)
        console.print(f"wrote {out_dir / 'summary.json'} (the table) and {out_dir / VARIANTS_DIR}/<variant>/",
                      markup=False, highlight=False, soft_wrap=True)
        write_page(out_dir)
    if failure is not None:
        raise failure
    return result


# --------------------------------------------------------------------------- the command's folder and variants
# (what it reads of a recipe: turnrl/eval_settings.py)


def default_eval_dir(env: str, policy: str, now: float | None = None) -> Path:
    """``runs/eval/<env>-<policy>-<YYYYmmdd-HHMMSS>``: where ``turnrl eval`` writes without ``--out`` (a
    policy path keeps its last two parts, characters unsafe in a folder name become ``_``)."""
    policy_name = "_".join(Path(policy).parts[-2:]) if "/" in policy else policy
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", f"{env}-{policy_name}").strip("_")[:80]
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    return Path("runs") / "eval" / f"{name}-{stamp}"


def variants_override(value: str) -> str:
    """``--variants NAME|FILE``: a named list of env variants (``ragen``) or a YAML file holding a list of
    ``{name, env, settings}`` (or a ``variants:`` key holding one), as a ``variants=[...]`` override."""
    if value in VARIANT_SETS:
        return "variants=" + json.dumps([asdict(variant) for variant in VARIANT_SETS[value]])
    path = Path(value)
    if not path.is_file():
        raise ConfigError(f"--variants {value!r} is neither a named list ({', '.join(VARIANT_SETS)}) nor a "
                          "YAML file")
    try:
        data = parse_yaml(path.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as error:
        raise ConfigError(f"--variants {value}: not a YAML file ({' '.join(str(error).split())})") from error
    if isinstance(data, dict) and "variants" in data:
        data = data["variants"]
    if not isinstance(data, list) or not data:
        raise ConfigError(f"--variants {value} must hold a list of variants ({{name, env, settings}} each), "
                          "or a variants: key holding one")
    for number, variant in enumerate(data, start=1):
        problem = variant_problem(variant)
        if problem is not None:
            raise ConfigError(f"--variants {value}: variant {number} ({variant!r}) {problem}")
    return "variants=" + json.dumps(data)


def variant_problem(variant: Any) -> str | None:
    """What is wrong with one item of a ``--variants`` file, said the way to fix it; None when it is a mapping of
    :class:`~turnrl.config.VariantConfig`'s keys with mapping settings (the config then checks the values).
    Loaded as they are, such items fail with OmegaConf's words, one of them on another key than the one at fault."""
    keys = [f.name for f in fields(VariantConfig)]
    if not isinstance(variant, dict):
        return "is not a mapping; write each variant as {name: NAME, env: ENV, settings: {KEY: VALUE}}"
    for key in variant:
        if key not in keys:
            near = close_names(str(key), keys)
            hint = f"did you mean {' or '.join(near)}? " if near else ""
            return f"has no key {key!r}; {hint}a variant's keys are {', '.join(keys)}"
    if "name" not in variant:
        return "has no name; give it name: NAME (its row of the table and its folder under variants/)"
    if not isinstance(variant.get("settings", {}), dict):
        return "has settings that are not a mapping; write them as settings: {KEY: VALUE}, e.g. {size: 8}"
    return None

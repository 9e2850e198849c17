"""The RL recipe: setup, (SFT,) the loop of rollout + update, cleanup.

    train(config)
      sft_stage          the base model, fine-tuned on expert demos (when enabled)
      Recipe(config)     setup builds everything: models, optimizers, envs, rollout
      loop               recipe.step(step) -> StepOutput; the loop owns progress,
                         validation, trajectory files and checkpoints

One step reads top to bottom in :meth:`Recipe.step`:

    rollout -> filter groups -> batch -> old logprobs (sampler's; recomputed
    ones reported as a mismatch) -> reference logprobs -> values -> advantages
    -> PPO epochs for actor and critic -> metrics

Each phase is a function that takes values (:func:`collect`,
:func:`select_trajectories`, :func:`make_batch`, :func:`score_batch`, then
:func:`~turnrl.training.advantages.compute_advantages` and
:func:`~turnrl.training.ppo.ppo_epochs`), so another recipe (a distributed
one, say) wires the same components without branching this one.

Run it with ``turnrl train --config configs/X.yaml key=value ...``. Everything the
run needs that can be checked without a model (the env and its settings, SFT
data, the checkpoint to resume, optional packages, the run directory) is
checked by :func:`preflight` before anything is written or loaded. Ctrl-C
stops after the step in progress, saves a checkpoint and says how to resume.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import re
import shutil
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import torch
from rich.console import Console

from turnrl.agent.formats import get_format
from turnrl.algorithms import group_stats, kl_penalty, select_groups
from turnrl.config import ConfigError, SamplingConfig, env_factory, to_yaml
from turnrl.envs.seeds import SeedSplits
from turnrl.models.loading import freeze_vision_tower, load_model, load_processor, load_tokenizer, vision_tower
from turnrl.policy.factory import model_policy
from turnrl.policy.hf import HFPolicy, resolve_device, resolve_dtype
from turnrl.rewards import Rewards
from turnrl.rollout.groups import EnvGroups
from turnrl.rollout.metrics import rollout_metrics
from turnrl.rollout.ray_workers import RayRollout, RolloutWorkerError
from turnrl.rollout.runner import EpisodeSlot, Rollout
from turnrl.rollout.trajectory import Trajectory, write_trajectories
from turnrl.training import ranks
from turnrl.training.advantages import anchored_share, compute_advantages
from turnrl.training.batch import Batch, collate, trajectory_samples, turn_samples
from turnrl.training.checkpoint import (
    latest_checkpoint,
    load_trainer_state,
    prune_checkpoints,
    save_checkpoint,
    set_rng_state,
)
from turnrl.training.config import AlgorithmConfig, FilterConfig, TrainConfig
from turnrl.training.forward import ValueModel
from turnrl.training.logger import MetricsLogger, RunProgress
from turnrl.training.models import autocast, base_model_path, enable_checkpointing, seed_everything, step_seed
from turnrl.training.ppo import UpdateInputs, batched_logprobs, batched_values, ppo_epochs
from turnrl.training.sft import read_chat_jsonl, sft_stage
from turnrl.viz.records import token_advantage_records, write_token_advantages
from turnrl.viz.report import write_report

console = Console(quiet=not ranks.is_main())  # one process of a distributed run speaks


@dataclass
class StepOutput:
    """What one RL step (or one validation) produced."""

    metrics: dict[str, float]
    trajectories: list[Trajectory] = field(default_factory=list)
    token_advantages: list[dict[str, Any]] = field(default_factory=list)
    """Lines of ``trajectories/step_NNNNNN.advantages.jsonl`` (see :mod:`turnrl.viz.records`), on the steps
    whose trajectories are written."""


# --------------------------------------------------------------------------- the phases of a step
def collect(
    rollout: Rollout | RayRollout, slots: list[EpisodeSlot], sampling: SamplingConfig, precision: AbstractContextManager
) -> StepOutput:
    """Play the slots' episodes; metrics of the rollout, its timings and throughput."""
    start = time.time()
    with precision:
        trajectories = rollout.run(slots, sampling)
    metrics = {f"rollout/{k}": v for k, v in rollout_metrics(trajectories).items()}
    # What the reward functions report about this rollout (state rewards: match, judge calls and errors).
    metrics.update({f"rewards/{k}": v for k, v in rollout.rewards.metrics().items()})
    metrics["timing/rollout_s"] = time.time() - start
    metrics["timing/generate_s"] = rollout.timings.generate_s
    metrics["timing/env_s"] = rollout.timings.env_s
    generated = sum(len(turn.response_ids) for t in trajectories for turn in t.turns)
    metrics["throughput/generated_tokens_per_s"] = generated / max(rollout.timings.generate_s, 1e-9)
    return StepOutput(metrics, trajectories)


def select_trajectories(trajectories: list[Trajectory], config: FilterConfig) -> tuple[list[int], dict[str, float]]:
    """StarPO-S: the indices of the trajectories to train on (kept groups, no errors), and the filter's metrics.

    An empty list means: skip the update.
    """
    rewards = torch.tensor([t.total_reward for t in trajectories], dtype=torch.float64)
    groups = torch.tensor([t.group for t in trajectories])
    stats = group_stats(rewards, groups)
    metrics = {
        "rollout/in_group_reward_std": float(stats.std.mean()),
        "rollout/zero_variance_groups": float((stats.std == 0).float().mean()),
    }
    # FilterConfig.value above 1 is a count of groups, at most 1 a share.
    value: float | int = int(config.value) if config.method == "top_k" and config.value > 1 else config.value
    scores = None  # select_groups scores a group by its reward std unless given other scores
    if config.metric != "reward_std":
        per_sample = rewards if config.metric == "reward_mean" else torch.tensor(
            [float(sum(len(turn.response_ids) for turn in t.turns)) for t in trajectories])
        scores = group_stats(per_sample, groups).mean
    selection = select_groups(groups, rewards=rewards, scores=scores, strategy=config.method, value=value,
                              weighting=config.weighting, drop_zero_variance=config.drop_zero_variance,
                              on_empty=config.on_empty)
    metrics["filter/kept_ratio"] = selection.kept_ratio
    keep = [i for i, t in enumerate(trajectories) if bool(selection.keep_mask[i]) and t.trainable]
    if selection.skip_step:
        keep = []
    metrics["filter/skipped_step"] = float(not keep)
    return keep, metrics


def varied_groups(trajectories: list[Trajectory]) -> list[int]:
    """The groups, in order, whose rewards differ and whose episodes are all trainable (dynamic sampling)."""
    rewards = torch.tensor([t.total_reward for t in trajectories], dtype=torch.float64)
    groups = torch.tensor([t.group for t in trajectories])
    stats = group_stats(rewards, groups)
    broken = {t.group for t in trajectories if not t.trainable}
    return [int(g) for g, std in zip(stats.group_ids, stats.std) if std > 0 and int(g) not in broken]


def dynamic_sample(
    rollout: Rollout | RayRollout, groups: EnvGroups, step: int, config: TrainConfig, precision: AbstractContextManager
) -> tuple[StepOutput, list[int]]:
    """DAPO's dynamic sampling: roll out rounds of groups until ``n_groups`` of them have varied rewards,
    or the extra rounds run out; returns every trajectory played and the indices of those to train on
    (the first ``n_groups`` varied groups)."""
    algo, n_groups = config.algorithm, config.groups.n_groups
    rounds = 1 + algo.dynamic_sampling_rounds
    outputs = [collect(rollout, groups.train_slots(step, 0, rounds), config.sampling, precision)]
    trajectories = list(outputs[0].trajectories)
    while len(varied_groups(trajectories)) < n_groups and len(outputs) < rounds:
        slots = groups.train_slots(step, len(outputs), rounds, first_group=len(outputs) * n_groups)
        outputs.append(collect(rollout, slots, config.sampling, precision))
        trajectories += outputs[-1].trajectories
    chosen = set(varied_groups(trajectories)[:n_groups])
    keep = [i for i, t in enumerate(trajectories) if t.group in chosen]
    metrics = {f"rollout/{k}": v for k, v in rollout_metrics(trajectories).items()}
    for key in {key for output in outputs for key in output.metrics if key.startswith("rewards/")}:
        # Each round reported its own; their mean (counts too: per round) stands for the step.
        metrics[key] = sum(output.metrics.get(key, 0.0) for output in outputs) / len(outputs)
    for key in ("timing/rollout_s", "timing/generate_s", "timing/env_s"):
        metrics[key] = sum(output.metrics[key] for output in outputs)
    generated = sum(len(turn.response_ids) for t in trajectories for turn in t.turns)
    metrics["throughput/generated_tokens_per_s"] = generated / max(metrics["timing/generate_s"], 1e-9)
    metrics["rollout/dynamic_extra_rounds"] = float(len(outputs) - 1)
    metrics["rollout/dynamic_kept_groups"] = float(len(chosen))
    metrics["filter/skipped_step"] = float(not keep)
    return StepOutput(metrics, trajectories), keep


def make_batch(trajectories: list[Trajectory], keep: list[int], sample_mode: str, pad_id: int,
               device: torch.device) -> Batch:
    """The kept trajectories as padded training tensors (one sample per episode or per turn)."""
    make_samples = trajectory_samples if sample_mode == "trajectory" else turn_samples
    return collate(make_samples([trajectories[i] for i in keep], keep), pad_id).to(device)


@dataclass
class Scores:
    """Per-token scores of a batch from forward passes without gradient, all Shape (b, s)."""

    old_logprobs: torch.Tensor
    ref_logprobs: torch.Tensor | None
    values: torch.Tensor | None
    metrics: dict[str, float]


def score_batch(
    batch: Batch,
    actor: torch.nn.Module,
    reference: torch.nn.Module | None,
    critic: ValueModel | None,
    config: AlgorithmConfig,
    temperature: float,
    generator: torch.Generator,
    precision: AbstractContextManager,
) -> Scores:
    """PPO's old logprobs, the reference's logprobs (when there is a KL), the critic's values.

    ``reference`` None with a KL means LoRA: the reference is the actor with its adapters off.
    """
    metrics: dict[str, float] = {}
    start = time.time()
    micro = config.micro_batch_size
    with precision:
        if config.old_logprobs == "recompute":
            old_logprobs = batched_logprobs(actor, batch, micro, temperature)
            checked, recomputed = batch, old_logprobs
        else:
            # The sampler's logprobs are PPO's old logprobs; recomputing one micro-batch is enough to
            # watch how far training's forward pass drifts from the sampler's (bf16, kernels, padding).
            old_logprobs = batch.sampler_logprobs
            rows = torch.randperm(len(batch), generator=generator)[:micro].sort().values
            checked = batch.select(rows)
            recomputed = batched_logprobs(actor, checked, micro, temperature)
        checked_tokens = checked.loss_mask.sum().clamp(min=1)
        metrics["actor/logprob_mismatch"] = float(
            ((recomputed - checked.sampler_logprobs).abs() * checked.loss_mask).sum() / checked_tokens
        )
        metrics["timing/old_logprobs_s"] = time.time() - start
        ref_logprobs = None
        if config.kl_coef > 0:
            start = time.time()
            if reference is None:
                with actor.disable_adapter():  # type: ignore[operator]
                    ref_logprobs = batched_logprobs(actor, batch, micro, temperature)
            else:
                ref_logprobs = batched_logprobs(reference, batch, micro, temperature)
            metrics["timing/reference_s"] = time.time() - start
        values = None
        if critic is not None:
            start = time.time()
            values = batched_values(critic, batch, micro)
            metrics["timing/values_s"] = time.time() - start
    return Scores(old_logprobs, ref_logprobs, values, metrics)


# --------------------------------------------------------------------------- the recipe
def ray_rollout(config: TrainConfig, model_dir: Path, tokenizer: Any, batch_size: int) -> RayRollout:
    """``distributed.backend=ray``: rollout workers as Ray actors, each with a copy of the policy built from
    ``model_dir``'s config (its weights arrive before each rollout) and envs of its own."""
    import dataclasses

    from turnrl.rollout.ray_workers import EnvSpec, WorkerSpec, model_files

    dist = config.distributed
    spec = WorkerSpec(
        model_files(model_dir),
        dataclasses.replace(config.model, device="auto"),  # inside an actor: the GPU Ray gave it, if any
        config.agent,
        EnvSpec(config.env.id, dict(config.env.settings), tuple(config.env.remote),
                env_workers=-(-dist.env_workers // dist.rollout_workers),  # each rollout worker its share
                timeout_s=dist.timeout_s),
        rewards=config.rewards, max_batch_size=batch_size, env_threads=config.groups.env_workers,
        torch_threads=config.run.threads)
    return RayRollout(spec, dist.rollout_workers, tokenizer, worker_gpus=dist.worker_gpus,
                      timeout_s=dist.timeout_s, address=dist.ray_address)


def vision_module_pattern(model: torch.nn.Module) -> str | None:
    """A regex of the vision encoder's module names (for LoRA's ``exclude_modules``), None for text models."""
    tower = vision_tower(model)
    name = next((name for name, module in model.named_modules() if module is tower), None)
    return None if name is None else rf"{re.escape(name)}(\..*)?"


def run_directory(config: TrainConfig) -> Path:
    """Where the run lives: the resumed directory, else ``run.output_dir/run.name``."""
    return Path(config.resume) if config.resume else Path(config.run.output_dir) / config.run.name


STOP_FILE = "stop"
"""``touch RUN_DIR/stop``: the run stops after the step in progress and saves a checkpoint (as Ctrl-C does in one
process; under ``torchrun``, Ctrl-C ends the processes at once). The file is removed when the run stops."""

RL_OUTPUTS = ("checkpoints", "metrics.jsonl", "tensorboard", "summary.json", "trajectories", "reference")
"""What an RL run writes at the top of its directory: a directory holding any of them holds a run."""


def checkpoint_step(checkpoint: Path) -> int:
    """The step of a checkpoint directory ``step_000039`` (39)."""
    return int(checkpoint.name.removeprefix("step_"))


def preflight(config: TrainConfig, *, stage: str = "train") -> None:
    """Check what a run needs before anything is written or a model loads: one-line errors, no traceback.

    Checks: a local ``model.path`` exists; the env id and its settings (one env is built, for training and
    validation settings); SFT data (read whole, each line and image) or, for expert demos, a solver; the
    checkpoint to resume; optional packages (wandb); and that a new run does not write into another run's
    directory.

    Args:
        stage: ``train`` (``turnrl train``) or ``sft`` (``turnrl sft``, which writes only ``sft/``).

    Raises:
        ConfigError: naming the key at fault and what to do.
    """
    run_dir = run_directory(config)
    if config.resume:
        if not run_dir.is_dir():
            raise ConfigError(f"resume={config.resume!r}: no such run directory")
        if latest_checkpoint(run_dir) is None:
            raise ConfigError(f"resume={config.resume!r} holds no checkpoint (no checkpoints/latest); a run saves one "
                              "every run.save_every steps, at its end and on Ctrl-C")
    path = config.model.path
    # A local path (absolute, relative with ./, or deeper than a hub id's org/name) must exist; a hub id
    # is left to the loader, which may find it in the local cache.
    if path is not None and not Path(path).exists() and (path.startswith((".", "/", "~")) or path.count("/") > 1):
        raise ConfigError(f"model.path={path!r} does not exist; give a transformers model directory or a hub id "
                          "(org/name), or leave model.path unset for the built-in model")
    env = env_factory(config.env.id, dict(config.env.settings), config.env.remote)()
    if config.env.val_settings is not None:
        env_factory(config.env.id, dict(config.env.val_settings), config.env.remote, where="env.val_settings")
    sft_runs = stage == "sft" or (config.sft.enabled and not config.resume)
    if sft_runs and config.sft.data:
        try:
            read_chat_jsonl(config.sft.data)
        except (OSError, ValueError) as error:
            raise ConfigError(f"sft.data={config.sft.data!r}: {error}") from error
    elif sft_runs:
        env.reset(seed=config.sft.seed_start)
        if env.solve() is None:
            raise ConfigError(f"env.id={config.env.id!r} has no solver here (solve() is None), so it has no expert "
                              "demos; give SFT chats with sft.data=chats.jsonl, or set sft.enabled=false")
    if config.run.wandb_project and importlib.util.find_spec("wandb") is None:
        raise ConfigError(f"run.wandb_project={config.run.wandb_project!r} needs wandb: pip install wandb "
                          "(or leave run.wandb_project unset)")
    if config.resume or config.run.overwrite:
        return
    taken = [name for name in (RL_OUTPUTS if stage == "train" else ()) if (run_dir / name).exists()]
    if sft_runs and (run_dir / "sft").exists():
        taken.append("sft")
    if taken:
        resume = f"continue it with `turnrl train resume={run_dir}`, " if stage == "train" else ""
        raise ConfigError(
            f"run directory {run_dir} already holds a run ({', '.join(taken)}); {resume}pick another run.name, "
            "or pass run.overwrite=true to delete it and start afresh"
        )


def start_run(config: TrainConfig, *, stage: str = "train") -> Path:
    """Threads, seeds, the run directory and its ``config.yaml``: what every stage of a run starts from.

    With ``run.overwrite`` (and no resume) the outputs of the run that was there are deleted first, so old
    and new checkpoints, metrics and TensorBoard files never mix: every output (``stage=train``), the SFT
    model (``sft``), or the RL outputs only (``rl``: after this run's own SFT stage).
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
        (run_dir / "config.yaml").write_text(to_yaml(config))
    ranks.barrier()
    return run_dir


class GracefulStop:
    """Ctrl-C (SIGINT) as a request: the first asks the loop to stop after the step in progress (which then
    saves a checkpoint); a second one interrupts at once. Outside the main thread, or where SIGINT is
    ignored, it changes nothing."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: Any = None

    def __enter__(self) -> GracefulStop:
        # A process started with SIGINT ignored (a background job of a script) keeps ignoring it.
        if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) != signal.SIG_IGN:
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        console.print("\n[bold]stopping after this step[/bold] to save a checkpoint (Ctrl-C again stops at once, "
                      "without saving)")

    def __exit__(self, *exc: object) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


class Recipe:
    """Everything an RL run holds, built at once from a :class:`TrainConfig` (or restored from a checkpoint).

    Args:
        config: the run.
        start_model: the model RL starts from (the SFT stage's output); None: ``model.path`` or the
            built-in model. Ignored on resume, where the checkpoint says.
        rewards: the run's rewards, when already built (``train`` builds them first, so that a bad reward
            spec stops the run before SFT); None builds them from ``config.rewards``.
    """

    def __init__(
        self, config: TrainConfig, start_model: Path | str | None = None, rewards: Rewards | None = None
    ) -> None:
        self.config = config
        # After this run's SFT stage, its model stays (run.overwrite deletes only the RL outputs).
        self.run_dir = start_run(config, stage="rl" if config.sft.enabled else "train")
        self.device = ranks.process_device() or resolve_device(config.model.device)
        self.dtype = resolve_dtype(config.model.dtype, self.device)
        self.timings: dict[str, float] = {}
        self.summary: dict[str, Any] = {}
        self.checkpoint = latest_checkpoint(self.run_dir) if config.resume else None
        if config.resume and self.checkpoint is None:
            raise ConfigError(f"resume={config.resume!r} holds no checkpoint (no checkpoints/latest)")
        self.first_step = 0
        self.elapsed_before_s = 0.0
        """Wall time of the run before this process (a resumed run's earlier sessions)."""
        self.session_start = time.time()

        self._build_envs()
        self._build_models(start_model)
        self._build_optimizers()
        fmt = get_format(config.agent.format, action_separator=config.agent.action_separator,
                         max_actions_per_turn=config.agent.max_actions_per_turn)
        rewards = rewards or Rewards(config.rewards)
        batch_size = max(64, config.groups.n_groups * config.groups.group_size)
        policy = model_policy(self.rollout_model(), self.tokenizer, config.model,
                              max_batch_size=max(batch_size, config.validation.batch_size),
                              processor=self.processor, dtype=self.dtype)
        self.rollout: Rollout | RayRollout = Rollout(policy, fmt, config.agent, env_id=config.env.id,
                                                     executor=self.executor, rewards=rewards)
        if config.distributed.backend == "ray":
            self.rollout = ray_rollout(config, self.start_path, self.tokenizer, batch_size)
        # The engine batches continuously whatever the batch size, and one cache serves both.
        val_policy = policy if not isinstance(policy, HFPolicy) else HFPolicy(
            self.rollout_model(), self.tokenizer, max_batch_size=config.validation.batch_size,  # type: ignore[arg-type]
            processor=self.processor)
        self.val_rollout = Rollout(val_policy, fmt, config.agent, env_id=config.env.id, executor=self.executor,
                                   rewards=rewards)
        if self.checkpoint is not None:
            self._restore()

    # ------------------------------------------------------------------ setup
    def rollout_model(self) -> torch.nn.Module:
        """The model the rollouts sample from: the actor itself (its own weights, no copy)."""
        return self.actor

    def _build_envs(self) -> None:
        config = self.config
        seeds = SeedSplits(config.seeds.train_start, config.seeds.val_start, config.seeds.val_size)
        train_settings = dict(config.env.settings)
        val_settings = dict(config.env.val_settings if config.env.val_settings is not None else train_settings)
        dist = config.distributed
        ray_rollouts = dist.backend == "ray"
        # Ray rollout workers play on envs of their own (and start their own env workers); the trainer's
        # envs are then only for validation.
        env_workers = 0 if ray_rollouts else dist.env_workers
        where = {"ray_workers": env_workers, "ray_address": dist.ray_address, "timeout_s": dist.timeout_s}
        # Here, on the env servers of env.remote or in Ray env workers; a bad id or setting fails now, not mid-run.
        make_train = env_factory(config.env.id, train_settings, config.env.remote, **where)  # type: ignore[arg-type]
        make_val = make_train if config.env.val_settings is None else env_factory(
            config.env.id, val_settings, config.env.remote, where="env.val_settings", **where)  # type: ignore[arg-type]
        self.env_factories = [make_train, make_val]
        if ray_rollouts:
            stand_in = make_train()  # the slots only carry seeds to the workers; one local env stands in for all
            make_train = lambda: stand_in  # noqa: E731
        self.train_groups = EnvGroups(make_train, config.groups.n_groups, config.groups.group_size, seeds)
        self.val_groups = EnvGroups(make_val, 1, 1, seeds)
        workers = config.groups.env_workers or (4 * env_workers)  # env workers step in parallel only from threads
        self.executor: Executor | None = ThreadPoolExecutor(workers) if workers else None

    def _build_models(self, start_model: Path | str | None) -> None:
        """Actor, tokenizer (and processor), critic and reference: all from the model RL starts from."""
        config = self.config
        start = start_model if start_model is not None else base_model_path(config.model)
        if self.checkpoint is not None:
            # LoRA adapters were trained on top of the SFT model when there was one.
            sft_model = self.run_dir / "sft" / "model"
            start = self.checkpoint / "actor" if not config.lora.enabled else (
                sft_model if sft_model.is_dir() else base_model_path(config.model))
        self.start_path = Path(start)
        self.tokenizer = load_tokenizer(start)
        self.processor = load_processor(start, config.model.min_pixels, config.model.max_pixels)
        self.actor = load_model(start, device=self.device)
        if not config.model.train_vision:
            freeze_vision_tower(self.actor)
        if config.model.gradient_checkpointing:
            enable_checkpointing(self.actor)

        self.critic: ValueModel | None = None
        if config.algorithm.uses_critic:
            if self.checkpoint is not None:
                self.critic = ValueModel.from_pretrained(self.checkpoint / "critic")
                if not config.model.train_vision:  # loaded weights are all trainable again
                    freeze_vision_tower(self.critic.backbone)
            else:
                self.critic = ValueModel(copy.deepcopy(self.actor.base_model))  # a frozen tower stays frozen
            self.critic.to(self.device)
            if config.model.gradient_checkpointing:
                enable_checkpointing(self.critic.backbone)
        self.reference: torch.nn.Module | None = None
        if config.algorithm.kl_coef > 0 and not config.lora.enabled:  # with LoRA: the adapters switched off
            reference_path = self.run_dir / "reference"
            if self.checkpoint is None and ranks.is_main():
                self.actor.save_pretrained(reference_path)
            ranks.barrier()
            self.reference = load_model(reference_path, device=self.device)
            self.reference.eval().requires_grad_(False)
        if config.lora.enabled:
            from peft import LoraConfig, PeftModel, get_peft_model

            if self.checkpoint is not None:
                self.actor = PeftModel.from_pretrained(self.actor, self.checkpoint / "actor", is_trainable=True)
            else:
                targets = config.lora.target_modules
                self.actor = get_peft_model(self.actor, LoraConfig(
                    r=config.lora.r, lora_alpha=config.lora.alpha, lora_dropout=config.lora.dropout,
                    target_modules=targets if targets == "all-linear" else [t.strip() for t in targets.split(",")],
                    exclude_modules=None if config.model.train_vision else vision_module_pattern(self.actor),
                ))
            if config.model.gradient_checkpointing:
                self.actor.enable_input_require_grads()

    def _build_optimizers(self) -> None:
        optim = self.config.optim
        warmup = lambda s: min(1.0, (s + 1) / optim.warmup_steps) if optim.warmup_steps > 0 else 1.0  # noqa: E731
        self.actor_optimizer = torch.optim.AdamW(
            [p for p in self.actor.parameters() if p.requires_grad], lr=optim.actor_lr, weight_decay=optim.weight_decay,
            eps=optim.adam_eps,
        )
        self.actor_scheduler = torch.optim.lr_scheduler.LambdaLR(self.actor_optimizer, warmup)
        self.critic_optimizer = None
        if self.critic is not None:
            self.critic_optimizer = torch.optim.AdamW(self.critic.parameters(), lr=optim.critic_lr,
                                                      weight_decay=optim.weight_decay, eps=optim.adam_eps)

    def _restore(self) -> None:
        assert self.checkpoint is not None
        state = load_trainer_state(self.checkpoint)
        processes, now = state.get("world_size", 1), ranks.world_size()
        if processes != now:
            how = (f"distributed.nproc_per_node={processes} (or torchrun --nproc-per-node {processes})"
                   if processes > 1 else "one process (without torchrun, distributed.nproc_per_node=1)")
            raise ConfigError(f"resume={self.config.resume!r} was saved by {processes} process(es) and this run has "
                              f"{now}: its optimizer states are split that way; resume it with {how}")
        if "actor_optimizer" in state:  # a distributed run keeps its optimizers' shards apart
            self.actor_optimizer.load_state_dict(state["actor_optimizer"])
        if self.critic_optimizer is not None and state.get("critic_optimizer") is not None:
            self.critic_optimizer.load_state_dict(state["critic_optimizer"])
        self.actor_scheduler.load_state_dict(state["actor_scheduler"])
        set_rng_state(state["rng"])
        self.summary = state.get("summary", {})
        self.timings = state.get("timings", {})
        self.elapsed_before_s = float(state.get("elapsed_s", 0.0))
        self.first_step = state["step"] + 1

    def precision(self) -> AbstractContextManager:
        return autocast(self.device, self.dtype)

    def _timed(self, name: str, seconds: float) -> float:
        self.timings[name] = self.timings.get(name, 0.0) + seconds
        return seconds

    # ------------------------------------------------------------------ validation
    def validate(self) -> StepOutput:
        """Success and friends on the fixed validation seeds, at the validation temperature."""
        config = self.config
        sampling = SamplingConfig(**{**vars(config.sampling), "temperature": config.validation.temperature})
        slots = self.val_groups.val_slots(config.validation.episodes, config.validation.samples_per_seed)
        torch.manual_seed(step_seed(config.seeds.seed, -1))  # the same sampling noise at every validation
        start = time.time()
        trajectories: list[Trajectory] = []
        with RunProgress(console, "validation", len(slots)) as progress:
            for begin in range(0, len(slots), config.validation.batch_size):
                part = collect(self.val_rollout, slots[begin : begin + config.validation.batch_size], sampling,
                               self.precision())
                trajectories.extend(part.trajectories)
                progress.update(len(part.trajectories), f"success {rollout_metrics(trajectories)['success']:.2f}")
        self._timed("validation_s", time.time() - start)
        return StepOutput({f"val/{k}": v for k, v in rollout_metrics(trajectories).items()}, trajectories)

    # ------------------------------------------------------------------ one RL step
    def step(self, step: int) -> StepOutput:
        """Roll out the step's groups, then update on the kept episodes."""
        step_start = time.time()
        rollout, keep = self.roll_out(step)
        output = self.update(step, rollout, keep) if keep else rollout
        output.metrics["timing/step_s"] = time.time() - step_start
        return output

    def roll_out(self, step: int) -> tuple[StepOutput, list[int]]:
        """1-2: the step's episodes and the indices of those to train on (empty: skip the update)."""
        config, algo = self.config, self.config.algorithm
        torch.manual_seed(step_seed(config.seeds.seed, step))
        self.actor.eval()
        if isinstance(self.rollout, RayRollout):
            # The actor's update count: a step that did not update it (critic warm-up) sends nothing.
            self.rollout.set_weights(self.actor, version=self.actor_scheduler.last_epoch)
        if algo.dynamic_sampling:
            # 1-2. rounds of groups until enough of them have varied rewards (DAPO)
            rollout, keep = dynamic_sample(self.rollout, self.train_groups, step, config, self.precision())
            metrics = rollout.metrics
        else:
            rollout = collect(self.rollout, self.train_groups.train_slots(step), config.sampling, self.precision())
            metrics = rollout.metrics
            # 2. filter groups (StarPO-S), drop errored episodes
            keep, filter_metrics = select_trajectories(rollout.trajectories, algo.filter)
            metrics.update(filter_metrics)
        self._timed("rollout_s", metrics["timing/rollout_s"])
        return rollout, keep

    def update(self, step: int, rollout: StepOutput, keep: list[int]) -> StepOutput:
        """3-6: batch, scores, advantages and the PPO epochs on the kept episodes of ``rollout``."""
        config, algo = self.config, self.config.algorithm
        metrics = rollout.metrics
        generator = torch.Generator().manual_seed(step_seed(config.seeds.seed, step))
        # 3. samples -> padded batch
        batch = make_batch(rollout.trajectories, keep, algo.sample_mode, self.tokenizer.pad_token_id, self.device)
        metrics["batch/samples"] = float(len(batch))
        metrics["batch/trained_tokens"] = float(batch.loss_mask.sum())
        metrics["batch/sequence_length_mean"] = float(batch.attention_mask.sum(1).float().mean())

        # 4. old logprobs, reference logprobs, values
        scores = self.score(batch, generator)
        metrics.update(scores.metrics)
        for phase in ("old_logprobs_s", "reference_s", "values_s"):
            if f"timing/{phase}" in scores.metrics:
                self._timed(phase, scores.metrics[f"timing/{phase}"])

        # 5. advantages
        mask = batch.loss_mask
        kl = None
        if scores.ref_logprobs is not None:
            kl = kl_penalty(scores.old_logprobs, scores.ref_logprobs, kind=algo.kl_kind, mask=mask)
        advantages = compute_advantages(batch, algo, scores.values, kl)
        token_advantages: list[dict[str, Any]] = []
        every = config.run.trajectories_every
        if every > 0 and step % every == 0:  # the steps whose trajectories train() writes: the viewer's heatmap
            token_advantages = token_advantage_records(
                batch.input_ids.tolist(), batch.loss_mask.tolist(), advantages.advantages.float().tolist(),
                batch.turn_end_index.tolist(), batch.episode.tolist(), batch.turn.tolist(),
                decode=lambda i: str(self.tokenizer.decode([i])))
        if algo.advantage == "gigpo" and batch.turn_states is not None:
            metrics["actor/gigpo_anchored_turns"] = anchored_share(batch.turn_states, batch.group)
        n_tokens = mask.sum().clamp(min=1)
        metrics["actor/advantage_mean"] = float((advantages.advantages * mask).sum() / n_tokens)
        metrics["actor/advantage_abs_mean"] = float((advantages.advantages.abs() * mask).sum() / n_tokens)
        if scores.values is not None:
            metrics["critic/values_mean"] = float((scores.values * mask).sum() / n_tokens)
            metrics["critic/returns_mean"] = float((advantages.returns * mask).sum() / n_tokens)

        # 6. PPO epochs
        start = time.time()
        self.actor.train()
        if self.critic is not None:
            self.critic.train()
        train_actor = step >= algo.critic_warmup_steps
        inputs = UpdateInputs(batch, scores.old_logprobs, advantages.advantages, advantages.returns, scores.values,
                              scores.ref_logprobs, advantages.sample_weights)
        metrics.update(self.train_on(inputs, train_actor, generator))
        if train_actor:
            self.actor_scheduler.step()
        self.actor.eval()
        update_s = self._timed("update_s", time.time() - start)
        metrics["timing/update_s"] = update_s
        trained = float(batch.attention_mask.sum()) * algo.ppo_epochs
        metrics["throughput/trained_tokens_per_s"] = trained / max(update_s, 1e-9)
        metrics["actor/lr"] = float(self.actor_scheduler.get_last_lr()[0])
        if self.device.type == "cuda":
            metrics["memory/peak_allocated_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        return StepOutput(metrics, rollout.trajectories, token_advantages)

    def score(self, batch: Batch, generator: torch.Generator) -> Scores:
        """4: old logprobs, reference logprobs and values of ``batch`` (:func:`score_batch`)."""
        return score_batch(batch, self.actor, self.reference, self.critic, self.config.algorithm,
                           self.config.sampling.temperature, generator, self.precision())

    def train_on(self, inputs: UpdateInputs, train_actor: bool, generator: torch.Generator) -> dict[str, float]:
        """6: the PPO epochs (:func:`ppo_epochs`); the actor only when ``train_actor`` (after critic warm-up)."""
        config = self.config
        with self.precision():
            return ppo_epochs(self.actor, self.critic, inputs, config.algorithm, config.optim,
                              self.actor_optimizer if train_actor else None, self.critic_optimizer,
                              config.sampling.temperature, generator)

    # ------------------------------------------------------------------ checkpoints
    def save(self, step: int) -> Path:
        state = {
            "actor_optimizer": self.actor_optimizer.state_dict(),
            "actor_scheduler": self.actor_scheduler.state_dict(),
            "critic_optimizer": self.critic_optimizer.state_dict() if self.critic_optimizer is not None else None,
            "summary": self.summary,
            "timings": self.timings,
            "elapsed_s": self.elapsed_s(),
        }
        path = save_checkpoint(self.run_dir, step, self.actor, self.processor or self.tokenizer, state,
                               critic=self.critic)
        prune_checkpoints(self.run_dir, self.config.run.keep_checkpoints)
        return path

    def close(self) -> None:
        """Release what the recipe holds beyond memory: an asynchronous recipe's rollout thread, Ray actors."""
        if isinstance(self.rollout, RayRollout):
            self.rollout.close()
        for factory in self.env_factories:
            close = getattr(factory, "close", None)
            if close is not None:
                close()

    def elapsed_s(self) -> float:
        """Wall time of the whole run: earlier sessions (before a resume) and this one."""
        return self.elapsed_before_s + time.time() - self.session_start

    def write_summary(self) -> Path:
        self.summary["timings_s"] = {k: round(v, 2) for k, v in self.timings.items()}
        self.summary["total_s"] = round(self.elapsed_s(), 2)
        path = self.run_dir / "summary.json"
        path.write_text(json.dumps(self.summary, indent=2))
        return path


# --------------------------------------------------------------------------- the commands
def sft_only(config: TrainConfig, data: str | None = None) -> Path:
    """``turnrl sft``: warm up the configured model and save it under the run directory."""
    if data is not None:
        config.sft.data = data
    preflight(config, stage="sft")
    path = sft_stage(config, start_run(config, stage="sft")).model_path
    console.print(f"SFT model written to {path}")
    return path


def _validate_and_write(recipe: Recipe, logger: MetricsLogger | None, step: int, name: str) -> dict[str, float]:
    output = recipe.validate()
    if logger is not None:  # rank 0 of a distributed run
        logger.log(step, output.metrics)
        write_trajectories(output.trajectories, recipe.run_dir / "trajectories", name=name)
    return output.metrics


def _every(n: int) -> Callable[[int], bool]:
    return lambda count: n > 0 and count % n == 0


def finished_summary(config: TrainConfig) -> dict[str, Any] | None:
    """The summary of a resumed run that has already run its ``run.steps`` (None when steps are left)."""
    checkpoint = latest_checkpoint(run_directory(config)) if config.resume else None
    summary_path = run_directory(config) / "summary.json"
    if checkpoint is None or checkpoint_step(checkpoint) + 1 < config.run.steps or not summary_path.is_file():
        return None
    try:
        summary = json.loads(summary_path.read_text())
    except json.JSONDecodeError:
        return None
    return summary if isinstance(summary, dict) and "val_success_after_rl" in summary else None


def train(config: TrainConfig) -> dict[str, Any]:
    """SFT (when enabled), validation, ``run.steps`` RL steps, validation, summary.

    Ctrl-C stops after the step in progress: a checkpoint is saved, the way to resume printed, and the
    summary returned has ``interrupted_at_step``.

    Raises:
        ConfigError: before anything is written, for what :func:`preflight` checks.
    """
    start = time.time()
    distributed = ranks.launched_by_torchrun()
    if distributed and (config.distributed.async_rollout or config.distributed.backend == "ray"):
        raise ConfigError("several processes under torchrun train with FSDP; distributed.async_rollout and "
                          "distributed.backend=ray run in one process: start them without torchrun")
    if distributed:
        ranks.init_process_group(config.model.device, config.distributed.timeout_s)
        # config.yaml then says how many processes a resume needs (`turnrl train resume=RUN_DIR` starts them).
        config.distributed.nproc_per_node = ranks.world_size()
    elif config.distributed.backend == "fsdp":
        raise ConfigError("distributed.backend=fsdp runs one process per GPU: start them with "
                          "`torchrun --nproc-per-node N -m turnrl.cli train ...` or distributed.nproc_per_node=N")
    try:
        return _train(config, start, distributed)
    finally:
        if distributed:
            ranks.close_process_group()


def _train(config: TrainConfig, start: float, distributed: bool) -> dict[str, Any]:
    preflight(config)
    rewards = Rewards(config.rewards)  # a bad reward spec stops here, not after SFT
    done = finished_summary(config)
    if done is not None:
        console.print(f"run {config.resume} already ran its {config.run.steps} steps; nothing to do "
                      f"(raise run.steps to continue it). Summary: {run_directory(config) / 'summary.json'}")
        return done
    resumed = config.resume is not None
    sft = None
    if config.sft.enabled and not resumed:
        run_dir = start_run(config)
        if ranks.is_main():
            sft = sft_stage(config, run_dir)
        ranks.wait_for_main()  # the other processes start RL from the SFT model rank 0 wrote
    if distributed:
        from turnrl.training.distributed import FSDPRecipe

        recipe: Recipe = FSDPRecipe(config, start_model=_sft_model(config) if config.sft.enabled and not resumed
                                    else None, rewards=rewards)
    elif config.distributed.async_rollout:
        from turnrl.training.asynchronous import AsyncRecipe

        recipe = AsyncRecipe(config, start_model=sft.model_path if sft is not None else None, rewards=rewards)
    else:
        recipe = Recipe(config, start_model=sft.model_path if sft is not None else None, rewards=rewards)
    try:
        return _run_steps(config, recipe, sft, resumed, start)
    finally:
        recipe.close()


def _run_steps(config: TrainConfig, recipe: Recipe, sft: Any, resumed: bool, start: float) -> dict[str, Any]:
    """Validation, the RL steps, validation, the last checkpoint and the summary (rank 0 writes)."""
    distributed = ranks.world_size() > 1
    recipe.session_start = start
    if sft is not None:
        recipe.summary.update(sft.metrics)
        recipe._timed("sft_s", sft.seconds)
    processes = f", {ranks.world_size()} processes (FSDP)" if distributed else ""
    console.print(f"[bold]turnrl train[/bold] {config.run.name}: {config.env.id}, {config.algorithm.advantage}, "
                  f"run dir {recipe.run_dir}{processes}")
    logger = MetricsLogger(recipe.run_dir, config.run.tensorboard, config.run.wandb_project,
                           config=json.loads(json.dumps(vars(config), default=lambda o: vars(o))),
                           resume_step=recipe.first_step if resumed else None) if ranks.is_main() else None

    if not resumed:
        before = _validate_and_write(recipe, logger, 0, "val_before_rl.jsonl")
        recipe.summary["val_success_before_rl"] = before["val/success"]
        console.print(f"validation success before RL: [bold]{before['val/success']:.3f}[/bold]")

    validate_now, save_now = _every(config.validation.every), _every(config.run.save_every)
    write_now = _every(config.run.trajectories_every)
    with GracefulStop() as stop, RunProgress(console, "rl", config.run.steps, recipe.first_step) as progress:
        for step in range(recipe.first_step, config.run.steps):
            try:
                output = recipe.step(step)
            except RolloutWorkerError as error:
                console.print(f"[bold red]rollout stopped:[/bold red] {error}", soft_wrap=True)
                if step == 0:
                    raise
                return _stop(recipe, logger, step - 1, error=True)  # saves the last finished step
            metrics = output.metrics
            last = step + 1 == config.run.steps
            if validate_now(step + 1) and not last:
                metrics.update(recipe.validate().metrics)
            if logger is not None:
                logger.log(step + 1, metrics)
            if write_now(step) and logger is not None:
                write_trajectories(output.trajectories, recipe.run_dir / "trajectories", name=f"step_{step:06d}.jsonl")
                if output.token_advantages:
                    write_token_advantages(recipe.run_dir / "trajectories" / f"step_{step:06d}.advantages.jsonl",
                                           output.token_advantages)
            progress.update(1, f"success {metrics.get('rollout/success', 0):.2f} "
                               f"reward {metrics.get('rollout/reward_mean', 0):.2f}")
            # Ctrl-C, or the stop file (what stops every process of a torchrun run after the same step).
            requested = stop.requested or (recipe.run_dir / STOP_FILE).exists()
            stop_requested = ranks.any_rank(requested) if distributed else requested
            if stop_requested and not last:
                return _stop(recipe, logger, step)
            if save_now(step + 1) and not last:
                recipe.save(step)

    after = _validate_and_write(recipe, logger, config.run.steps, "val_after_rl.jsonl")
    recipe.summary["val_success_after_rl"] = after["val/success"]
    recipe.summary["val_after_rl"] = after
    recipe.summary["steps"] = config.run.steps
    if config.run.steps > 0:
        recipe.save(config.run.steps - 1)
    if logger is None:
        return recipe.summary
    path = recipe.write_summary()
    logger.close()
    before_value = recipe.summary.get("val_success_before_rl")
    console.print(f"validation success before RL: {before_value:.3f}, after RL: [bold]{after['val/success']:.3f}[/bold]"
                  if before_value is not None else f"validation success after RL: {after['val/success']:.3f}")
    console.print(f"summary: {path}")
    _report(recipe.run_dir)
    return recipe.summary


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


def _stop(recipe: Recipe, logger: MetricsLogger | None, step: int, error: bool = False) -> dict[str, Any]:
    """Ctrl-C, the stop file or a lost rollout worker (``error``): save the finished ``step``, say how to
    resume; the summary says where the run stopped and why."""
    checkpoint = recipe.save(step)
    if ranks.is_main():
        (recipe.run_dir / STOP_FILE).unlink(missing_ok=True)
    stopped = {"interrupted_at_step": step + 1, "stopped_by": "error" if error else "request"}
    if logger is None:
        return {**recipe.summary, **stopped}
    logger.close()
    console.print(f"[bold]{'stopped by the error above' if error else 'interrupted'}[/bold] after step {step + 1} "
                  f"of {recipe.config.run.steps}; checkpoint {checkpoint}")
    # One unwrapped line, to copy whole.
    console.print(f"continue with: turnrl train resume={recipe.run_dir}", markup=False, highlight=False,
                  soft_wrap=True)
    _report(recipe.run_dir)
    return {**recipe.summary, **stopped}

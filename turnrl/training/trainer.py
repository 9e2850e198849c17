"""The RL recipe: setup, (SFT,) validation, the loop of rollout + update, cleanup.

One step reads top to bottom in :meth:`Recipe.step`:

    rollout -> filter groups -> samples -> old logprobs (sampler's; recomputed
    ones reported as a mismatch) -> reference logprobs -> values -> advantages
    -> PPO epochs for actor and critic -> metrics, trajectories, checkpoint

Run it with ``turnrl train --config configs/X.yaml key=value ...``.
"""

from __future__ import annotations

import copy
import json
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from transformers import AutoModelForCausalLM, AutoTokenizer

from turnrl.agent.formats import get_format
from turnrl.algorithms import group_stats, select_groups
from turnrl.config import ConfigError, SamplingConfig, to_yaml
from turnrl.envs import make
from turnrl.envs.seeds import SeedSplits
from turnrl.evaluate import write_trajectories
from turnrl.policy.hf import HFPolicy, resolve_device, resolve_dtype
from turnrl.rollout.groups import EnvGroups
from turnrl.rollout.metrics import rollout_metrics
from turnrl.rollout.runner import Rollout
from turnrl.rollout.trajectory import Trajectory
from turnrl.training.batch import collate, trajectory_samples, turn_samples
from turnrl.training.checkpoint import latest_checkpoint, load_trainer_state, save_checkpoint, set_rng_state
from turnrl.training.config import TrainConfig
from turnrl.training.forward import ValueModel
from turnrl.training.logger import MetricsLogger
from turnrl.training.ppo import UpdateInputs, batched_logprobs, batched_values, compute_advantages, ppo_epochs
from turnrl.training.sft import (
    conversation_samples,
    expert_demos,
    read_chat_jsonl,
    sft_train,
    trajectory_messages,
)

console = Console()


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def enable_checkpointing(model: torch.nn.Module) -> None:
    """Recompute activations in the backward pass (the method's name changed in transformers 5)."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable()
    else:
        model.gradient_checkpointing_enable()


def step_seed(seed: int, step: int) -> int:
    """The seed of one step's sampling and shuffling: a function of (seed, step), so resume is exact."""
    return (seed * 1_000_003 + step) % 2**31


class Recipe:
    """Everything a run holds: models, optimizers, envs, logger. Built from a :class:`TrainConfig`."""

    def __init__(self, config: TrainConfig) -> None:
        self.config = config
        self.start_time = time.time()
        if config.run.threads > 0:
            torch.set_num_threads(config.run.threads)
        seed_everything(config.seeds.seed)
        self.run_dir = Path(config.resume) if config.resume else Path(config.run.output_dir) / config.run.name
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.yaml").write_text(to_yaml(config))
        self.device = resolve_device(config.model.device)
        self.dtype = resolve_dtype(config.model.dtype, self.device)
        self.fmt = get_format(
            config.agent.format,
            action_separator=config.agent.action_separator,
            max_actions_per_turn=config.agent.max_actions_per_turn,
        )
        self.timings: dict[str, float] = {}
        self.summary: dict[str, Any] = {}

        self.checkpoint = latest_checkpoint(self.run_dir) if config.resume else None
        if config.resume and self.checkpoint is None:
            raise ConfigError(f"resume={config.resume!r} holds no checkpoint (no checkpoints/latest)")
        self.model_path = self._initial_model_path()
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        # Weights stay float32 (AdamW master weights); bf16 comes from autocast on GPU.
        self.actor = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=torch.float32).to(self.device)
        if config.model.gradient_checkpointing:
            enable_checkpointing(self.actor)

        seeds = SeedSplits(config.seeds.train_start, config.seeds.val_start, config.seeds.val_size)
        train_settings = dict(config.env.settings)
        val_settings = dict(config.env.val_settings if config.env.val_settings is not None else train_settings)
        make(config.env.id, **train_settings)  # fail now, naming the bad setting, not mid-run
        self.make_train_env = lambda: make(config.env.id, **train_settings)
        self.train_groups = EnvGroups(self.make_train_env, config.groups.n_groups, config.groups.group_size, seeds)
        self.val_groups = EnvGroups(lambda: make(config.env.id, **val_settings), 1, 1, seeds)
        self.executor = None
        if config.groups.env_workers > 0:
            from concurrent.futures import ThreadPoolExecutor

            self.executor = ThreadPoolExecutor(config.groups.env_workers)

    # ------------------------------------------------------------------ setup helpers
    def _initial_model_path(self) -> Path | str:
        if self.checkpoint is None:
            return self._base_path()
        if not self.config.lora.enabled:
            return self.checkpoint / "actor"
        # LoRA adapters were trained on top of the SFT model when there was one.
        sft_model = self.run_dir / "sft" / "model"
        return sft_model if sft_model.is_dir() else self._base_path()

    def _base_path(self) -> Path | str:
        if self.config.model.path is not None:
            return self.config.model.path
        from turnrl.models.builtin import builtin_model_path

        return builtin_model_path(self.config.model)

    def autocast(self):
        if self.device.type == "cuda" and self.dtype != torch.float32:
            return torch.autocast("cuda", dtype=self.dtype)
        return torch.autocast("cpu", enabled=False)

    def _timed(self, name: str, start: float) -> float:
        elapsed = time.time() - start
        self.timings[name] = self.timings.get(name, 0.0) + elapsed
        return elapsed

    # ------------------------------------------------------------------ SFT
    def sft_samples(self) -> list:
        config = self.config
        window = config.agent.max_context_window
        if config.sft.data:
            chats = read_chat_jsonl(config.sft.data)
        else:
            demos = expert_demos(self.make_train_env, self.fmt, config.agent, config.sft, config.env.id,
                                 seed=config.seeds.seed)
            write_trajectories(demos[:50], self.run_dir / "sft", name="demos_sample.jsonl")
            chats = [trajectory_messages(t) for t in demos]
        return [sample for chat in chats for sample in conversation_samples(chat, self.tokenizer, window)]

    def run_sft(self) -> Path:
        """Supervised warm start of the actor; saves it to ``RUN_DIR/sft``."""
        start = time.time()
        samples = self.sft_samples()
        console.print(f"[bold]SFT[/bold] on {len(samples)} samples "
                      f"({sum(sum(s.loss_mask) for s in samples)} target tokens)")
        logger = MetricsLogger(self.run_dir / "sft", tensorboard=self.config.run.tensorboard)
        with self.autocast():
            metrics = sft_train(self.actor, self.tokenizer.pad_token_id, samples, self.config.sft,
                                seed=self.config.seeds.seed, log=logger.log)
        logger.close()
        path = self.run_dir / "sft" / "model"
        self.actor.save_pretrained(path)
        self.tokenizer.save_pretrained(path)
        # Adapters and checkpoints made from here on name the SFT model as their base.
        self.actor.config._name_or_path = str(path)
        self._timed("sft_s", start)
        self.summary.update(metrics)
        return path

    # ------------------------------------------------------------------ RL setup
    def setup_rl(self) -> None:
        config = self.config
        # The critic and the reference start from the policy RL starts from (after SFT).
        self.critic = None
        if config.algorithm.uses_critic:
            if self.checkpoint is not None:
                self.critic = ValueModel.from_pretrained(self.checkpoint / "critic")
            else:
                self.critic = ValueModel(copy.deepcopy(self.actor.base_model))
            self.critic.to(self.device)
            if config.model.gradient_checkpointing:
                enable_checkpointing(self.critic.backbone)
        self.reference = None
        if config.algorithm.kl_coef > 0 and not config.lora.enabled:  # with LoRA: the adapters switched off
            reference_path = self.run_dir / "reference"
            if self.checkpoint is None:
                self.actor.save_pretrained(reference_path)
            self.reference = AutoModelForCausalLM.from_pretrained(reference_path).to(self.device)
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
                ))
            if config.model.gradient_checkpointing:
                self.actor.enable_input_require_grads()
        optim = config.optim
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
        self.policy = HFPolicy(self.actor, self.tokenizer, max_batch_size=max(64, config.groups.n_groups * config.groups.group_size))
        self.rollout = Rollout(self.policy, self.fmt, config.agent, env_id=config.env.id, executor=self.executor)
        self.first_step = 0
        if self.checkpoint is not None:
            state = load_trainer_state(self.checkpoint)
            self.actor_optimizer.load_state_dict(state["actor_optimizer"])
            self.actor_scheduler.load_state_dict(state["actor_scheduler"])
            if self.critic_optimizer is not None:
                self.critic_optimizer.load_state_dict(state["critic_optimizer"])
            set_rng_state(state["rng"])
            self.summary = state.get("summary", {})
            self.timings = state.get("timings", {})
            self.first_step = state["step"] + 1

    # ------------------------------------------------------------------ validation
    def validate(self) -> dict[str, float]:
        """Success and friends on the fixed validation seeds, at the validation temperature."""
        start = time.time()
        config = self.config
        sampling = SamplingConfig(**{**vars(config.sampling), "temperature": config.validation.temperature})
        policy = HFPolicy(self.actor, self.tokenizer, max_batch_size=config.validation.batch_size)
        rollout = Rollout(policy, self.fmt, config.agent, env_id=config.env.id, executor=self.executor)
        slots = self.val_groups.val_slots(config.validation.episodes, config.validation.samples_per_seed)
        torch.manual_seed(step_seed(config.seeds.seed, -1))  # the same sampling noise at every validation
        trajectories: list[Trajectory] = []
        with self.autocast():
            for begin in range(0, len(slots), config.validation.batch_size):
                trajectories.extend(rollout.run(slots[begin : begin + config.validation.batch_size], sampling))
        self._timed("validation_s", start)
        self.last_val_trajectories = trajectories
        return {f"val/{k}": v for k, v in rollout_metrics(trajectories).items()}

    # ------------------------------------------------------------------ one RL step
    def step(self, step: int) -> dict[str, float]:
        config, algo = self.config, self.config.algorithm
        step_start = time.time()
        torch.manual_seed(step_seed(config.seeds.seed, step))
        generator = torch.Generator().manual_seed(step_seed(config.seeds.seed, step))

        # 1. rollout
        start = time.time()
        self.actor.eval()
        with self.autocast():
            trajectories = self.rollout.run(self.train_groups.train_slots(step), config.sampling)
        metrics = {f"rollout/{k}": v for k, v in rollout_metrics(trajectories).items()}
        metrics["timing/rollout_s"] = self._timed("rollout_s", start)
        metrics["timing/generate_s"] = self.rollout.timings.generate_s
        metrics["timing/env_s"] = self.rollout.timings.env_s
        generated = sum(len(turn.response_ids) for t in trajectories for turn in t.turns)
        metrics["throughput/generated_tokens_per_s"] = generated / max(self.rollout.timings.generate_s, 1e-9)
        self.last_trajectories = trajectories

        # 2. filter groups (StarPO-S), drop errored episodes
        rewards = torch.tensor([t.total_reward for t in trajectories])
        groups = torch.tensor([t.group for t in trajectories])
        metrics["rollout/in_group_reward_std"] = float(group_stats(rewards, groups).std.mean())
        metrics["rollout/zero_variance_groups"] = float((group_stats(rewards, groups).std == 0).float().mean())
        selection = self._select(rewards, groups, trajectories)
        metrics["filter/kept_ratio"] = selection.kept_ratio
        keep = [i for i, t in enumerate(trajectories) if bool(selection.keep_mask[i]) and t.trainable]
        if selection.skip_step or not keep:
            metrics["filter/skipped_step"] = 1.0
            metrics["timing/step_s"] = time.time() - step_start
            return metrics
        metrics["filter/skipped_step"] = 0.0

        # 3. samples -> padded batch
        kept = [trajectories[i] for i in keep]
        make_samples = trajectory_samples if algo.sample_mode == "trajectory" else turn_samples
        batch = collate(make_samples(kept, keep), self.tokenizer.pad_token_id).to(self.device)
        metrics["batch/samples"] = float(len(batch))
        metrics["batch/trained_tokens"] = float(batch.loss_mask.sum())
        metrics["batch/sequence_length_mean"] = float(batch.attention_mask.sum(1).float().mean())

        # 4. old logprobs (sampler's), the recomputed ones as a mismatch metric, reference logprobs, values
        start = time.time()
        mask = batch.loss_mask
        n_tokens = mask.sum().clamp(min=1)
        if algo.old_logprobs == "recompute":
            with self.autocast():
                old_logprobs = batched_logprobs(self.actor, batch, algo.micro_batch_size, config.sampling.temperature)
            checked, recomputed = batch, old_logprobs
        else:
            # The sampler's logprobs are PPO's old logprobs; recomputing one micro-batch is enough to
            # watch how far training's forward pass drifts from the sampler's (bf16, kernels, padding).
            old_logprobs = batch.sampler_logprobs
            rows = torch.randperm(len(batch), generator=generator)[: algo.micro_batch_size].sort().values
            checked = batch.select(rows)
            with self.autocast():
                recomputed = batched_logprobs(self.actor, checked, algo.micro_batch_size, config.sampling.temperature)
        checked_tokens = checked.loss_mask.sum().clamp(min=1)
        metrics["actor/logprob_mismatch"] = float(
            ((recomputed - checked.sampler_logprobs).abs() * checked.loss_mask).sum() / checked_tokens
        )
        metrics["timing/old_logprobs_s"] = self._timed("old_logprobs_s", start)
        ref_logprobs = None
        if algo.kl_coef > 0:
            start = time.time()
            with self.autocast():
                if config.lora.enabled:
                    with self.actor.disable_adapter():
                        ref_logprobs = batched_logprobs(self.actor, batch, algo.micro_batch_size, config.sampling.temperature)
                else:
                    ref_logprobs = batched_logprobs(self.reference, batch, algo.micro_batch_size, config.sampling.temperature)
            metrics["timing/reference_s"] = self._timed("reference_s", start)
        values = None
        if self.critic is not None:
            start = time.time()
            with self.autocast():
                values = batched_values(self.critic, batch, algo.micro_batch_size)
            metrics["timing/values_s"] = self._timed("values_s", start)

        # 5. advantages
        from turnrl.algorithms import kl_penalty

        kl = kl_penalty(old_logprobs, ref_logprobs, kind=algo.kl_kind) * mask if ref_logprobs is not None else None
        advantages, returns = compute_advantages(batch, values, algo, kl)
        metrics["actor/advantage_mean"] = float((advantages * mask).sum() / n_tokens)
        metrics["actor/advantage_abs_mean"] = float((advantages.abs() * mask).sum() / n_tokens)
        if values is not None:
            metrics["critic/values_mean"] = float((values * mask).sum() / n_tokens)
            metrics["critic/returns_mean"] = float((returns * mask).sum() / n_tokens)

        # 6. PPO epochs
        start = time.time()
        self.actor.train()
        if self.critic is not None:
            self.critic.train()
        train_actor = step >= algo.critic_warmup_steps
        inputs = UpdateInputs(batch, old_logprobs, advantages.detach(), returns.detach(), values, ref_logprobs)
        with self.autocast():
            metrics.update(ppo_epochs(
                self.actor, self.critic, inputs, algo, config.optim,
                self.actor_optimizer if train_actor else None, self.critic_optimizer,
                config.sampling.temperature, generator,
            ))
        if train_actor:
            self.actor_scheduler.step()
        self.actor.eval()
        update_s = self._timed("update_s", start)
        metrics["timing/update_s"] = update_s
        metrics["throughput/trained_tokens_per_s"] = float(batch.attention_mask.sum()) * algo.ppo_epochs / max(update_s, 1e-9)
        metrics["actor/lr"] = self.actor_scheduler.get_last_lr()[0]
        if self.device.type == "cuda":
            metrics["memory/peak_allocated_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        metrics["timing/step_s"] = time.time() - step_start
        return metrics

    def _select(self, rewards: torch.Tensor, groups: torch.Tensor, trajectories: list[Trajectory]):
        f = self.config.algorithm.filter
        # FilterConfig.value above 1 is a count of groups, at most 1 a share.
        value: float | int = int(f.value) if f.method == "top_k" and f.value > 1 else f.value
        scores = None  # select_groups scores a group by its reward std unless given other scores
        if f.metric != "reward_std":
            per_sample = rewards if f.metric == "reward_mean" else torch.tensor(
                [float(sum(len(turn.response_ids) for turn in t.turns)) for t in trajectories])
            scores = group_stats(per_sample, groups).mean
        return select_groups(groups, rewards=rewards, scores=scores, strategy=f.method, value=value,
                             weighting=f.weighting, drop_zero_variance=f.drop_zero_variance, on_empty=f.on_empty)

    # ------------------------------------------------------------------ checkpoints
    def save(self, step: int) -> Path:
        state = {
            "actor_optimizer": self.actor_optimizer.state_dict(),
            "actor_scheduler": self.actor_scheduler.state_dict(),
            "critic_optimizer": self.critic_optimizer.state_dict() if self.critic_optimizer is not None else None,
            "summary": self.summary,
            "timings": self.timings,
        }
        return save_checkpoint(self.run_dir, step, self.actor, self.tokenizer, state, critic=self.critic)

    def write_summary(self) -> Path:
        self.summary["timings_s"] = {k: round(v, 2) for k, v in self.timings.items()}
        self.summary["total_s"] = round(time.time() - self.start_time, 2)
        path = self.run_dir / "summary.json"
        path.write_text(json.dumps(self.summary, indent=2))
        return path


# --------------------------------------------------------------------------- the commands
def sft_only(config: TrainConfig, data: str | None = None) -> Path:
    """``turnrl sft``: warm up the configured model and save it under the run directory."""
    if data is not None:
        config.sft.data = data
    config.sft.enabled = True
    path = Recipe(config).run_sft()
    console.print(f"SFT model written to {path}")
    return path


def train(config: TrainConfig) -> dict[str, Any]:
    """SFT (when enabled), validation, ``run.steps`` RL steps, validation, summary."""
    recipe = Recipe(config)
    console.print(f"[bold]turnrl train[/bold] {config.run.name}: {config.env.id}, {config.algorithm.advantage}, "
                  f"run dir {recipe.run_dir}")
    resumed = recipe.checkpoint is not None
    if config.sft.enabled and not resumed:
        recipe.run_sft()
    recipe.setup_rl()
    logger = MetricsLogger(recipe.run_dir, config.run.tensorboard, config.run.wandb_project,
                           config=json.loads(json.dumps(vars(config), default=lambda o: vars(o))), resume=resumed)

    if not resumed:
        before = recipe.validate()
        logger.log(0, before)
        recipe.summary["val_success_before_rl"] = before["val/success"]
        write_trajectories(recipe.last_val_trajectories, recipe.run_dir / "trajectories", name="val_before_rl.jsonl")
        console.print(f"validation success before RL: [bold]{before['val/success']:.3f}[/bold]")

    columns = [TextColumn("[bold]rl[/bold] {task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn(), TimeRemainingColumn()]
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("", total=config.run.steps, completed=recipe.first_step)
        for step in range(recipe.first_step, config.run.steps):
            metrics = recipe.step(step)
            if config.validation.every and (step + 1) % config.validation.every == 0 and step + 1 < config.run.steps:
                metrics.update(recipe.validate())
            logger.log(step + 1, metrics)
            if config.run.trajectories_every and step % config.run.trajectories_every == 0:
                write_trajectories(recipe.last_trajectories, recipe.run_dir / "trajectories", name=f"step_{step:06d}.jsonl")
            progress.update(task, advance=1, description=(
                f"success {metrics.get('rollout/success', 0):.2f} reward {metrics.get('rollout/reward_mean', 0):.2f}"))
            if config.run.save_every and (step + 1) % config.run.save_every == 0 and step + 1 < config.run.steps:
                recipe.save(step)

    after = recipe.validate()
    logger.log(config.run.steps, after)
    recipe.summary["val_success_after_rl"] = after["val/success"]
    recipe.summary["val_after_rl"] = after
    recipe.summary["steps"] = config.run.steps
    write_trajectories(recipe.last_val_trajectories, recipe.run_dir / "trajectories", name="val_after_rl.jsonl")
    recipe.save(config.run.steps - 1) if config.run.steps > 0 else None
    path = recipe.write_summary()
    logger.close()
    before_text = recipe.summary.get("val_success_before_rl")
    console.print(f"validation success before RL: {before_text:.3f}, after RL: [bold]{after['val/success']:.3f}[/bold]"
                  if before_text is not None else f"validation success after RL: {after['val/success']:.3f}")
    console.print(f"summary: {path}")
    return recipe.summary

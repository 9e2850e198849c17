"""The RL trainer: everything a run holds (models, optimizers, envs, rollout) and one step of it.

    Trainer(config)       setup builds everything, or restores it from a checkpoint
    trainer.step(step)    roll_out (rollout, group filter) then update -> StepOutput

One step reads top to bottom in :meth:`Trainer.roll_out` and :meth:`Trainer.update`:

    rollout -> filter groups -> batch -> old logprobs (sampler's; recomputed
    ones reported as a mismatch) -> reference logprobs -> values -> advantages
    -> PPO epochs for actor and critic -> metrics

Each phase is a function that takes values: the episodes in :mod:`turnrl.training.step_episodes`
(:func:`~turnrl.training.step_episodes.collect`, :func:`~turnrl.training.step_episodes.select_trajectories`,
DAPO's :func:`~turnrl.training.step_episodes.dynamic_sample`), the batch and its scores in
:mod:`turnrl.training.scoring` (:func:`~turnrl.training.scoring.make_batch`,
:func:`~turnrl.training.scoring.score_batch`), then
:func:`~turnrl.training.batch_advantages.compute_advantages` and
:func:`~turnrl.training.ppo.ppo_epochs`. What varies between runs is two parts the
trainer is given (:mod:`turnrl.training.compose` picks them): a
:class:`~turnrl.training.backends.backend.RolloutBackend` (episodes here, on each
``torchrun`` process's share, on Ray workers, or a batch ahead in a thread) and a
:class:`~turnrl.training.parallel.strategy.ParallelStrategy` (one process, or FSDP2
shards: placing the models, the rows each process scores, the reductions, checkpoint I/O).

The commands around the steps (``turnrl train``, ``turnrl sft``: SFT, validation,
checkpoints, Ctrl-C) are in :mod:`turnrl.training.commands`; what they check before
anything is written or loaded in :mod:`turnrl.training.preflight`; the run
directory in :mod:`turnrl.training.run_dir`. Backends are the policy factory's
choice (:func:`~turnrl.policy.factory.rollout_policies`).
"""

from __future__ import annotations

import copy
import json
import pickle
import re
import sys
import time
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch
from rich.markup import escape

from turnrl.agent.formats import get_format
from turnrl.algorithms import kl_penalty
from turnrl.config import ConfigError, SamplingConfig, to_yaml
from turnrl.envs.seeds import SeedSplits
from turnrl.envservice.placement import env_factory
from turnrl.files import atomic_write_text
from turnrl.models.devices import resolve_dtype
from turnrl.models.loading import (
    base_model_path,
    cast_copy,
    compile_layer_parts,
    enable_checkpointing,
    freeze_vision_tower,
    load_model,
    load_processor,
    load_tokenizer,
    vision_tower,
)
from turnrl.models.throughput import (
    mfu,
    peak_bandwidth,
    peak_flops,
    training_flops,
    training_flops_per_token,
    vision_training_flops,
)
from turnrl.policy.factory import rollout_policies
from turnrl.rewards import Rewards
from turnrl.rollout.groups import EnvGroups
from turnrl.rollout.metrics import rollout_metrics
from turnrl.rollout.runner import Rollout
from turnrl.rollout.trajectory import Trajectory
from turnrl.training import ranks
from turnrl.training.allocator import phase_peak_gib, start_phase
from turnrl.training.backends.backend import (
    EpisodeRunner,
    MakeRollouts,
    RolloutBackend,
    RolloutParts,
    WeightsVersion,
)
from turnrl.training.batch import Batch
from turnrl.training.batch_advantages import compute_advantages
from turnrl.training.checkpoint import (
    checkpoint_bytes,
    disk_space_problem,
    load_trainer_state,
    rng_state,
    save_reference,
    set_rng_state,
    steps_done,
)
from turnrl.training.collapse_watch import CollapseDiagnostics
from turnrl.training.head import install_scoring_head
from turnrl.training.logger import RunConsole, RunProgress
from turnrl.training.model_passes import ValueModel
from turnrl.training.optimizers import adamw, apply_optimizer_settings
from turnrl.training.out_of_memory import OptimizerSteps, halved_micro_batches, torch_said
from turnrl.training.packed_attention import run_attention
from turnrl.training.parallel.strategy import (
    CheckpointFiles,
    Models,
    Optimizers,
    ParallelStrategy,
    has_sharded_optimizers,
)
from turnrl.training.ppo import DRIFT, MicroBatching, UpdateInputs, batched_logprobs, ppo_epochs
from turnrl.training.precision import autocast, skip_cudnn_attention
from turnrl.training.run_dir import (
    kept_setting_change,
    lora_change,
    moved_levels,
    resumed_checkpoint,
    saved_config,
    start_run,
    write_config,
    write_resumed_config,
)
from turnrl.training.schedules import kl_adaptive_scale, lr_factor
from turnrl.training.scoring import (
    TokenScores,
    encodes_images_once,
    keep_shuffles,
    make_batch,
    sampler_drift,
    score_batch,
)
from turnrl.training.seeding import step_seed
from turnrl.training.step_episodes import StepOutput, collect, play_step, rollout_roofline
from turnrl.training.train_config import TrainConfig
from turnrl.viz.records import token_advantage_records

# The process's console, shared with the commands around the steps and made before any strategy: rank 0 speaks.
console = RunConsole(quiet=not ranks.is_main())


# --------------------------------------------------------------------------- the trainer
def rollout_memory_metrics(rollout_peak: float | None, metrics: dict[str, float], runs_ahead: bool
                           ) -> dict[str, float]:
    """The peak memory of a step's rollout on the trainer's device, and the step's peak (scores and update in
    ``metrics`` too); none on a CPU, nor where the backend runs ahead: the trainer's device then held only what
    the trainer allocated while it waited for the rollout thread, not what the rollout used."""
    if rollout_peak is None or runs_ahead:
        return {}
    return {"memory/rollout_peak_gib": rollout_peak,
            "memory/peak_allocated_gib": max(rollout_peak, metrics.get("memory/scores_peak_gib", 0.0),
                                             metrics.get("memory/update_peak_gib", 0.0))}


def vision_module_pattern(model: torch.nn.Module) -> str | None:
    """A regex of the vision encoder's module names (for LoRA's ``exclude_modules``), None for text models."""
    tower = vision_tower(model)
    name = next((name for name, module in model.named_modules() if module is tower), None)
    return None if name is None else rf"{re.escape(name)}(\..*)?"


def _lookup_only(model: Any) -> torch.Tensor | None:
    """The input embeddings of a transformers model (peft-wrapped or not) unless they double as its LM head:
    a lookup, no FLOPs (see :func:`~turnrl.models.throughput.training_flops_per_token`)."""
    embeddings = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    return None if head is not None and head.weight is embeddings else embeddings


def resume_mismatch(resume: str | None, processes: int, sharded: bool, parallel: ParallelStrategy) -> str | None:
    """Why a checkpoint saved by ``processes`` processes, with its optimizer states ``sharded`` (FSDP2) or in the
    trainer state, cannot resume with ``parallel`` (its optimizer states are laid out another way), and how to
    resume it; None when it can."""
    if sharded and not parallel.shards_optimizers:
        return (f"resume={resume!r} was saved by {processes} FSDP process(es) (its optimizer states are shards) and "
                f"this run is one process without FSDP: resume it under torchrun with distributed.backend=fsdp and "
                f"distributed.nproc_per_node={processes}")
    if not sharded and parallel.shards_optimizers:
        return (f"resume={resume!r} was saved by one process without FSDP (its optimizer states are in its trainer "
                f"state) and this run is FSDP under torchrun: resume it without torchrun, with "
                f"distributed.nproc_per_node=1 and a distributed.backend other than fsdp")
    if processes != parallel.world_size:
        how = (f"distributed.nproc_per_node={processes} (or torchrun --nproc-per-node {processes})"
               if processes > 1 else "one process (without torchrun, distributed.nproc_per_node=1)")
        return (f"resume={resume!r} was saved by {processes} process(es) and this run has {parallel.world_size}: "
                f"its optimizer states are split that way; resume it with {how}")
    return None


class Trainer:
    """Everything an RL run holds, built at once from a :class:`TrainConfig` (or restored from a checkpoint).

    Args:
        config: the run.
        start_model: the model RL starts from (the SFT stage's output); None: ``model.path`` or the
            built-in model. Ignored on resume, where the checkpoint says.
        rewards: the run's rewards, when already built (``train`` builds them first, so that a bad reward
            spec stops the run before SFT); None builds them from ``config.rewards``.
        parallel: how the models are spread over processes; None: :mod:`turnrl.training.compose`'s choice.
        rollouts: makes the rollout backends from the built parts; None: :mod:`turnrl.training.compose`'s choice.
    """

    def __init__(
        self, config: TrainConfig, start_model: Path | str | None = None, rewards: Rewards | None = None,
        parallel: ParallelStrategy | None = None, rollouts: MakeRollouts | None = None,
    ) -> None:
        if parallel is None or rollouts is None:
            from turnrl.training import compose  # it names every implementation; the trainer needs none of them

            chosen = compose.parts(config)
            parallel, rollouts = parallel or chosen.parallel, rollouts or chosen.rollouts
        self.config = config
        self.parallel = parallel
        self.memory_retries: dict[int, str] = {}
        """Steps (counted from 1) of this process that ran out of memory and were run again, with the setting."""
        self.shortest_pair = 0
        """The tokens of the two shortest sequences the step in progress trains on, together (0 before its batch is
        made): where a pass's budget is smaller, no two sequences share a pass (the out-of-memory advice)."""
        # After this run's SFT stage, its model stays (run.overwrite deletes only the RL outputs).
        self.run_dir = start_run(config, stage="rl" if config.sft.enabled else "train")
        self.device = ranks.training_device(config.model.device)
        self.dtype = resolve_dtype(config.model.dtype, self.device)
        skip_cudnn_attention(self.device)
        self.timings: dict[str, float] = {}
        self.summary: dict[str, Any] = {}
        self.checkpoint: Path | None = None
        """The checkpoint a resumed run continues from."""
        if config.resume:
            point = resumed_checkpoint(config)
            self.checkpoint = point.checkpoint
            assert self.checkpoint is not None, "resumed_checkpoint raises where there is none"
            if point.note is not None:
                console.print(point.note, markup=False, highlight=False, soft_wrap=True)
            # Said before the envs and models are built: the first step is a build away.
            console.print(f"resuming {config.resume} from {self.checkpoint.name} to step {config.run.steps}",
                          markup=False, highlight=False, soft_wrap=True)
            saved = saved_config(self.checkpoint)  # nothing said without it: the copy is a spare
            if saved is not None:
                for problem in (moved_levels(saved, self.checkpoint, config),
                                lora_change(saved, self.checkpoint, config),
                                kept_setting_change(saved, self.checkpoint, config)):
                    if problem is not None:
                        raise ConfigError(problem)
        self.first_step = 0
        """How many steps were done before this process: the index (from 0) of the first step it runs."""
        self.elapsed_before_s = 0.0
        """Wall time of the run before this process (a resumed run's earlier sessions)."""
        self.session_start = time.time()

        self._build_envs()
        self.startup: dict[str, float] = {}
        """Seconds of each part of the start, logged with the first step (``startup/``)."""
        started = time.time()
        self._build_models(start_model)
        self.startup["models_s"] = time.time() - started
        self._build_optimizers()
        fmt = get_format(config.agent.format, action_separator=config.agent.action_separator,
                         max_actions_per_turn=config.agent.max_actions_per_turn, strict=config.agent.strict_format)
        rewards = rewards or Rewards(config.rewards)
        batch_size = max(64, config.groups.n_groups * config.groups.group_size)
        started = time.time()
        policy, val_policy = rollout_policies(self.rollout_model(), self.tokenizer, config.model, batch_size,
                                              config.validation.batch_size, processor=self.processor, dtype=self.dtype)
        self.policies = (policy, val_policy)
        train = Rollout(policy, fmt, config.agent, env_id=config.env.id, executor=self.executor, rewards=rewards)
        made = rollouts(RolloutParts(
            config, self.actor, train,
            Rollout(val_policy, train.fmt, config.agent, env_id=config.env.id, executor=self.executor, rewards=rewards),
            self.tokenizer, self.processor, self.device, self.dtype, self.precision, self.start_path))
        self.rollout: RolloutBackend = made.train
        self.val_rollout: RolloutBackend = made.validation
        self.retries_out_of_memory = parallel.retries_out_of_memory and not self.rollout.runs_ahead
        """Whether an update that runs out of GPU memory before its first optimizer step is run again once with
        half the micro-batches (:meth:`update_or_retry`): not where other processes wait for this one in a
        collective, nor where a rollout thread shares the random state."""
        self.startup["policy_s"] = time.time() - started
        self.collapse = CollapseDiagnostics(config.collapse, train.fmt, self.decode, self.tokenizer.pad_token_id,
                                            config.seeds.seed)
        if self.checkpoint is not None:
            self._restore()
            changed = write_resumed_config(config)  # only now: a resume that fails leaves config.yaml as it was
            if changed:
                console.print(f"note: resumed with settings changed from the run's: {'; '.join(changed)} (its "
                              "config.yaml now holds them)", markup=False, highlight=False, soft_wrap=True)
        self.set_weights(self.first_step)
        if not self.rollout.plays_on_trainer_policy:  # it only validates: nothing held until it does
            self.release_rollout_memory()
        self.peak_flops = peak_flops(self.device, config.run.peak_tflops * 1e12)
        self.peak_bandwidth = peak_bandwidth(self.device)

    # ------------------------------------------------------------------ setup
    def rollout_model(self) -> torch.nn.Module:
        """The model the rollouts sample from: the actor itself, or the strategy's unsharded copy of it."""
        return self.parallel.rollout_model(self.actor)

    def load_device(self) -> torch.device:
        """Where models are loaded: the training device (a sharded run's rank 0 loads on the CPU, the other
        processes build the models' structure on ``meta``; sharding fills every process's shards)."""
        return self.parallel.load_device(self.device)

    def weights_version(self, steps: int) -> WeightsVersion:
        """The actor's weights after ``steps`` steps (and its updates so far)."""
        return WeightsVersion(steps, self.actor_scheduler.last_epoch)

    def set_weights(self, steps: int) -> dict[str, float]:
        """Hand both rollout backends the actor's weights after ``steps`` steps (each checks, once its rollout has
        them, that it computes with them); the transfer's metrics."""
        version = self.weights_version(steps)
        self.val_rollout.set_weights(self.actor, version)
        return self.rollout.set_weights(self.actor, version)

    def _build_envs(self) -> None:
        config = self.config
        seeds = SeedSplits(config.seeds.first_train_seed(), config.seeds.val_start, config.seeds.val_size)
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
        make_train_env: Callable[[], Any] = make_train
        if ray_rollouts:
            stand_in = make_train()  # the slots only carry seeds to the workers; one local env stands in for all
            make_train_env = lambda: stand_in  # noqa: E731
        self.train_groups = EnvGroups(make_train_env, config.groups.n_groups, config.groups.group_size, seeds)
        self.val_groups = EnvGroups(make_val, 1, 1, seeds)  # one batch's envs, made by the first validation
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
        if Path(start).expanduser().is_dir():  # LoRA adapters saved from it name it whole: found from any folder
            start = Path(start).expanduser().resolve()
        self.start_path = Path(start)
        self.tokenizer = load_tokenizer(start)
        self.processor = load_processor(start, config.model.min_pixels, config.model.max_pixels)
        attention = run_attention(config.model, self.device)
        self.actor = load_model(start, device=self.load_device(), attention=attention)
        install_scoring_head(self.actor, len(self.tokenizer), compiled=config.model.compile)
        if not config.model.train_vision:
            freeze_vision_tower(self.actor)
        if config.model.gradient_checkpointing:
            enable_checkpointing(self.actor, config.model.checkpointed_layers)

        self.critic: ValueModel | None = None
        if config.algorithm.uses_critic:
            if self.checkpoint is not None:
                self.critic = ValueModel.from_pretrained(self.checkpoint / "critic", attention=attention,
                                                         device=self.load_device())
                if not config.model.train_vision:  # loaded weights are all trainable again
                    freeze_vision_tower(self.critic.backbone)
            else:
                self.critic = ValueModel(copy.deepcopy(self.actor.base_model))  # a frozen tower stays frozen
            if config.model.gradient_checkpointing:
                enable_checkpointing(self.critic.backbone, config.model.checkpointed_layers)
        self.reference: torch.nn.Module | None = None
        if config.algorithm.kl_coef > 0 and not config.lora.enabled:  # with LoRA: the adapters switched off
            # Never trained: held in the compute dtype (bf16 on a GPU), half the memory of float32 weights, and
            # saved with the run (a resumed run reads it back).
            reference_path = self.run_dir / "reference"
            if self.checkpoint is None:
                # Cast as copied: never a second float32 actor on the way (14 GiB at 3B).
                reference: Any = cast_copy(self.actor, self.dtype, self.load_device())
                if self.parallel.rank == 0:
                    save_reference(reference, reference_path)
                self.reference = reference
            else:
                self.reference = load_model(reference_path, dtype=self.dtype, device=self.load_device(),
                                            attention=attention)
                install_scoring_head(self.reference, len(self.tokenizer), compiled=config.model.compile)
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
        self.compiled_parts = sum(compile_layer_parts(model) for model in (self.actor, self.critic, self.reference)
                                  if model is not None and config.model.compile)
        self.actor_flops_per_token = training_flops_per_token(self.actor, _lookup_only(self.actor))
        self.critic_flops_per_token = 0.0 if self.critic is None else training_flops_per_token(
            self.critic, _lookup_only(self.critic.backbone))
        placed = self.parallel.place(Models(self.actor, self.critic, self.reference), self.device, self.dtype)
        self.actor, self.critic, self.reference = placed.actor, placed.critic, placed.reference
        self.startup.update(self.parallel.startup)

    def _build_optimizers(self) -> None:
        optim = self.config.optim
        # The schedule moves once an actor update: none in the critic's warm-up steps.
        updates = max(1, self.config.run.steps - self.config.algorithm.critic_warmup_steps)
        self.lr_scale = 1.0  # optim.kl_adaptive_target's scale, moved after each actor update
        schedule = lambda s: self.lr_scale * lr_factor(  # noqa: E731
            s, optim.warmup_steps, updates, optim.lr_schedule, optim.min_lr_ratio)
        # One fused kernel for every parameter's update where the parameters are on a GPU (offloaded shards
        # are stepped on the host).
        fused = self.device.type == "cuda" and not self.config.distributed.cpu_offload
        betas = (optim.adam_beta1, optim.adam_beta2)
        self.actor_optimizer = adamw([p for p in self.actor.parameters() if p.requires_grad], optim.actor_lr,
                                     optim.weight_decay, optim.adam_eps, fused, betas)
        self.actor_scheduler = torch.optim.lr_scheduler.LambdaLR(self.actor_optimizer, schedule)
        self.critic_optimizer = None
        if self.critic is not None:
            self.critic_optimizer = adamw(list(self.critic.parameters()), optim.critic_lr, optim.weight_decay,
                                          optim.adam_eps, fused, betas)

    def _restore(self) -> None:
        assert self.checkpoint is not None
        try:
            state = load_trainer_state(self.checkpoint)
        except (OSError, RuntimeError, EOFError, pickle.UnpicklingError) as error:  # damaged past its zip index
            raise ConfigError(f"resume={self.config.resume!r}: {self.checkpoint / 'trainer_state.pt'} cannot be read "
                              f"({str(error).splitlines()[0] if str(error) else type(error).__name__}); move "
                              f"{self.checkpoint.name} away to resume from an earlier checkpoint") from error
        if not isinstance(state, dict):
            state = {}  # then named below by the first part it lacks
        problem = resume_mismatch(self.config.resume, state.get("world_size", 1),
                                  has_sharded_optimizers(self.checkpoint), self.parallel)
        if problem is not None:
            raise ConfigError(problem)
        try:
            self.parallel.restore_optimizers(self.checkpoint, state, self.models(), self.optimizers())
            self.lr_scale = float(state.get("lr_scale", 1.0))  # the scheduler's next step multiplies by it
            self.actor_scheduler.load_state_dict(state["actor_scheduler"])
            optim, betas = self.config.optim, (self.config.optim.adam_beta1, self.config.optim.adam_beta2)
            apply_optimizer_settings(self.actor_optimizer, optim.actor_lr, optim.weight_decay, optim.adam_eps, betas,
                                     self.actor_scheduler)
            if self.critic_optimizer is not None:
                apply_optimizer_settings(self.critic_optimizer, optim.critic_lr, optim.weight_decay, optim.adam_eps,
                                         betas)
            set_rng_state(state["rng"])
            self.first_step = steps_done(state)
        except ConfigError:  # a check of the restore's own (a ValueError) says what it found
            raise
        except (KeyError, TypeError, ValueError) as error:  # readable, but not (all of) a trainer's state
            what = f"it has no {error.args[0]!r}" if isinstance(error, KeyError) else str(error).splitlines()[0]
            raise ConfigError(f"resume={self.config.resume!r}: {self.checkpoint / 'trainer_state.pt'} is not this "
                              f"run's trainer state ({what}); move {self.checkpoint.name} away to resume from an "
                              "earlier checkpoint") from error
        self.summary = state.get("summary", {})
        self.timings = state.get("timings", {})
        self.elapsed_before_s = float(state.get("elapsed_s", 0.0))

    def models(self) -> Models:
        return Models(self.actor, self.critic, self.reference)

    def optimizers(self) -> Optimizers:
        return Optimizers(self.actor_optimizer, self.critic_optimizer)

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
        validation = config.validation
        slots = self.val_groups.val_slots(validation.episodes, validation.samples_per_seed,
                                          envs=validation.batch_size)
        self.parallel.sync_rollout_model(self.actor, self.actor_scheduler.last_epoch)
        start = time.time()
        trajectories: list[Trajectory] = []
        with self.rollout.exclusive(), RunProgress(console, "validation", len(slots)) as progress:
            torch.manual_seed(step_seed(config.seeds.seed, -1))  # the same sampling noise at every validation
            for begin in range(0, len(slots), config.validation.batch_size):
                part = collect(self.val_rollout, slots[begin : begin + config.validation.batch_size], sampling,
                               self.precision())
                trajectories.extend(part.trajectories)
                progress.update(len(part.trajectories), f"success {rollout_metrics(trajectories)['success']:.2f}")
        self._timed("validation_s", time.time() - start)
        if not self.rollout.plays_on_trainer_policy:
            # The steps' episodes play elsewhere (on a copy, in other processes, on Ray workers): the trainer's own
            # policy serves validations alone, and what it holds between them (its engine's cache pages and
            # computed weights, 7 GiB at 3B; under FSDP the unsharded copy of the actor it samples from) would
            # sit beside the update's peak on the trainer's GPU.
            self.release_rollout_memory()
        return StepOutput({f"val/{k}": v for k, v in rollout_metrics(trajectories).items()}, trajectories)

    # ------------------------------------------------------------------ one RL step
    def step(self, step: int) -> StepOutput:
        """Roll out the step's groups, then update on the kept episodes."""
        step_start = time.time()
        first = bool(self.startup) and "to_first_rollout_s" not in self.startup
        if first:
            self.startup["to_first_rollout_s"] = step_start - self.session_start
        start_phase(self.device)
        self.shortest_pair = 0
        rollout, keep = self.roll_out(step)
        rollout_peak = phase_peak_gib(self.device)
        self.measure_collapse(step, rollout)
        output = self.update_or_retry(step, rollout, keep) if keep else rollout
        weights_start = time.time()
        output.metrics.update(self.set_weights(step + 1))
        output.metrics["timing/set_weights_s"] = time.time() - weights_start
        output.metrics["timing/step_s"] = time.time() - step_start
        output.metrics.update(rollout_memory_metrics(rollout_peak, output.metrics, self.rollout.runs_ahead))
        if first:
            output.metrics.update({f"startup/{key}": value for key, value in self.startup.items()})
        return output

    def roll_out(self, step: int) -> tuple[StepOutput, list[int]]:
        """1-2: the step's episodes and the indices of those to train on (empty: skip the update), played by
        the rollout backend (:func:`~turnrl.training.step_episodes.play_step`; here and now, or ahead in its own
        thread)."""
        self.actor.eval()
        if self.rollout.plays_on_trainer_policy:
            self.parallel.sync_rollout_model(self.actor, self.actor_scheduler.last_epoch)
        played = self.rollout.roll_out(step, self.play_step)
        rollout, keep = played.played
        rollout.metrics.update(played.metrics)
        rollout.metrics.update(rollout_roofline(rollout.metrics, self.peak_flops, self.peak_bandwidth))
        rollout.image_features = played.image_features
        self._timed("rollout_s", rollout.metrics["timing/rollout_s"])
        return rollout, keep

    def play_step(self, runner: EpisodeRunner, step: int,
                  precision: AbstractContextManager) -> tuple[StepOutput, list[int]]:
        return play_step(runner, self.train_groups, step, self.config, precision)

    def measure_collapse(self, step: int, rollout: StepOutput) -> None:
        """RAGEN's collapse diagnostics (``collapse.every``) on all the step's episodes, scored by the actor that
        rolled them out, before its update; adds ``collapse/`` metrics to the rollout's."""
        if self.collapse.due(step):
            metrics = self.collapse.measure(step, rollout.trajectories, self.cross_logprobs)
            self._timed("collapse_s", metrics["timing/collapse_s"])
            rollout.metrics.update(metrics)

    def cross_logprobs(self, batch: Batch) -> torch.Tensor:
        """Shape (b, s): the actor's log-probs of ``batch``'s scored tokens (the collapse diagnostics' scorer)."""
        n, rows = len(batch), self.parallel.rows(len(batch))
        with self.precision():  # each process scores its rows (the same batch on every process)
            local = batched_logprobs(self.actor, (batch if rows is None else batch.select(rows)).to(self.device),
                                     MicroBatching.scoring(self.config.algorithm), self.config.sampling.temperature,
                                     self.parallel.most)
        self.parallel.release_gathered([self.actor])
        return self.parallel.gather_rows(local, n)

    def decode(self, ids: list[int]) -> str:
        """Token ids as text, special tokens kept (where a response's reasoning lies)."""
        return str(self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False))

    def release_rollout_memory(self) -> None:
        """Free what the rollouts hold between generations (the engine's cache and computed weights) for the
        scores and the update to use; the next rollout builds it again (``model.engine.free_during_update``)."""
        for policy in {id(policy): policy for policy in self.policies}.values():
            policy.release_memory()
        self.parallel.release_rollout_model()

    def update_or_retry(self, step: int, rollout: StepOutput, keep: list[int]) -> StepOutput:
        """:meth:`update`; one that runs out of GPU memory before any optimizer step began runs again once, with
        half the micro-batches (:func:`halved_micro_batches`), on the same episodes from the same random state,
        as a run set so from the start would (the gradients the failed pass accumulated are dropped).
        The halved setting stays for the rest of the run, also in ``config.yaml`` for a resume, since the later
        steps are as large. One that began an optimizer step, or runs out again, raises (the run stops with
        what to set). Not with ``retries_out_of_memory`` off."""
        random_state = rng_state()
        modes = [(model, model.training) for model in (self.actor, self.critic) if model is not None]
        watch = OptimizerSteps([self.actor_optimizer, self.critic_optimizer])
        try:
            with watch:
                return self.update(step, rollout, keep)
        except torch.OutOfMemoryError as error:
            halved = halved_micro_batches(self.config.algorithm, self.shortest_pair) \
                if self.retries_out_of_memory and not watch.began else None
            if halved is None:
                raise
            said = torch_said(error)
        # Outside the except clause, whose traceback holds the failed attempt's tensors.
        for optimizer in watch.optimizers:
            optimizer.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # new segments can then be cut to the smaller passes
        set_rng_state(random_state)
        for model, training in modes:  # a failure in the PPO epochs left them training: score as the first try did
            model.train(training)
        self.memory_retries[step + 1] = halved
        self.summary.setdefault("memory_retries", []).append({"step": step + 1, "setting": halved})
        if self.parallel.rank == 0:
            write_config(self.config)
        console.print(f"[bold]RL step {step + 1} ran out of GPU memory before its first optimizer step[/bold]: "
                      f"running it again on the same episodes with {halved}, kept for the rest of the run. "
                      f"torch: {escape(said)}", soft_wrap=True)
        output = self.update(step, rollout, keep)
        output.metrics["memory/oom_retries"] = 1.0
        return output

    def update(self, step: int, rollout: StepOutput, keep: list[int]) -> StepOutput:
        """3-6: batch, scores, advantages and the PPO epochs on the kept episodes of ``rollout``."""
        config, algo = self.config, self.config.algorithm
        if config.model.engine.free_during_update:
            self.release_rollout_memory()
        metrics = rollout.metrics
        generator = torch.Generator().manual_seed(step_seed(config.seeds.seed, step))
        # 3. samples -> padded batch
        start = time.time()
        batch = make_batch(rollout.trajectories, keep, algo.sample_mode, self.tokenizer.pad_token_id, self.device)
        if encodes_images_once(config, batch):
            batch = batch.with_image_features(rollout.image_features)
        metrics["batch/samples"] = float(len(batch))
        metrics["batch/trained_tokens"] = float(batch.loss_mask.sum())
        lengths = batch.attention_mask.sum(1)
        # One sequence alone can share no pass: as if its pair were over any budget.
        self.shortest_pair = int(lengths.sort().values[:2].sum()) if len(lengths) > 1 else sys.maxsize
        metrics["batch/sequence_length_mean"] = float(lengths.float().mean())
        metrics["batch/sequence_length_max"] = float(lengths.max())
        metrics["timing/batch_s"] = time.time() - start

        # 4. old logprobs, reference logprobs, values
        start_phase(self.device)
        scores = self.score(batch, generator)
        scores_peak = phase_peak_gib(self.device)
        metrics.update(scores.metrics)
        for phase in ("old_logprobs_s", "reference_s", "values_s"):
            if f"timing/{phase}" in scores.metrics:
                self._timed(phase, scores.metrics[f"timing/{phase}"])

        # 5. advantages
        start = time.time()
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
        metrics.update(advantages.metrics)
        n_tokens = mask.sum().clamp(min=1)
        metrics["actor/advantage_mean"] = float((advantages.advantages * mask).sum() / n_tokens)
        metrics["actor/advantage_abs_mean"] = float((advantages.advantages.abs() * mask).sum() / n_tokens)
        if scores.values is not None:
            metrics["critic/values_mean"] = float((scores.values * mask).sum() / n_tokens)
            metrics["critic/returns_mean"] = float((advantages.returns * mask).sum() / n_tokens)
        metrics["timing/advantages_s"] = time.time() - start

        # 6. PPO epochs
        start_phase(self.device)
        start = time.time()
        self.actor.train()
        if self.critic is not None:
            self.critic.train()
        train_actor = step >= algo.critic_warmup_steps
        inputs = UpdateInputs(batch, scores.old_logprobs, advantages.advantages, advantages.returns, scores.values,
                              scores.ref_logprobs, advantages.sample_weights)
        metrics.update(self.train_on(inputs, train_actor, generator))
        if train_actor:
            optim = config.optim
            if optim.kl_adaptive_target > 0 and "actor/approx_kl" in metrics:  # the same on every process
                self.lr_scale = kl_adaptive_scale(self.lr_scale, metrics["actor/approx_kl"], optim.kl_adaptive_target,
                                                  optim.kl_adaptive_min, optim.kl_adaptive_max)
                metrics["actor/lr_scale"] = self.lr_scale
            self.actor_scheduler.step()
        self.actor.eval()
        update_s = self._timed("update_s", time.time() - start)
        metrics["timing/update_s"] = update_s
        trained = float(lengths.sum()) * algo.ppo_epochs
        metrics["throughput/trained_tokens_per_s"] = trained / max(update_s, 1e-9)
        # Model FLOPs of the update (actor once it trains, critic) over the devices' peak.
        trained_models = [(self.actor_flops_per_token, self.actor.config)] if train_actor else []
        if self.critic is not None:
            trained_models.append((self.critic_flops_per_token, self.critic.backbone.config))
        flops = algo.ppo_epochs * sum(training_flops(per_token, model_config, lengths)
                                      for per_token, model_config in trained_models)
        grids = batch.model_inputs.get("image_grid_thw")
        if grids is not None:  # a VLM: its tower's FLOPs where it is trained (each pass encodes then)
            towers = [vision_tower(self.actor)] if train_actor else []
            towers += [vision_tower(self.critic.backbone)] if self.critic is not None else []
            trained_towers = [tower for tower in towers if tower is not None and any(
                parameter.requires_grad for parameter in tower.parameters())]
            flops += algo.ppo_epochs * sum(vision_training_flops(tower, self.actor.config.vision_config, grids)
                                           for tower in trained_towers)
            metrics["throughput/update_mfu_counts_vision"] = float(bool(trained_towers))
        utilization = mfu(flops, update_s, self.peak_flops, self.parallel.world_size)
        if utilization is not None:
            metrics["throughput/update_mfu"] = utilization
        if batch.image_features is not None:  # each process's own store, summed over the processes
            counts = {"vision/images_encoded": float(batch.image_features.encoded),
                      "vision/images_reused": float(batch.image_features.served),
                      "vision/images_from_rollout": float(batch.image_features.from_rollout)}
            shard = self.parallel.shard()
            metrics.update(shard.reduce(counts) if shard is not None else counts)
        metrics["actor/lr"] = float(self.actor_scheduler.get_last_lr()[0])
        update_peak = phase_peak_gib(self.device)
        if update_peak is not None and scores_peak is not None:
            metrics["memory/scores_peak_gib"] = scores_peak
            metrics["memory/update_peak_gib"] = update_peak
        return StepOutput(metrics, rollout.trajectories, token_advantages)

    def score(self, batch: Batch, generator: torch.Generator) -> TokenScores:
        """4: old logprobs, reference logprobs and values of ``batch`` (:func:`score_batch`): each process scores
        its rows, and the scores of the whole batch are gathered on every process."""
        config, n = self.config, len(batch)
        keep_shuffles(n, config.algorithm, generator)
        rows = self.parallel.rows(n)
        local = score_batch(batch if rows is None else batch.select(rows), self.actor, self.reference, self.critic,
                            config.algorithm, config.sampling.temperature, self.precision(), self.parallel.most)
        self.parallel.release_gathered([model for model in (self.actor, self.reference, self.critic)
                                        if model is not None])

        def gather(local_rows: torch.Tensor | None) -> torch.Tensor | None:
            return None if local_rows is None else self.parallel.gather_rows(local_rows, n)

        old_logprobs = batch.sampler_logprobs if config.algorithm.old_logprobs == "sampler" else \
            self.parallel.gather_rows(local.old_logprobs, n)
        metrics = self.parallel.mean_metrics(local.metrics)
        if DRIFT in metrics and rows is not None:  # each process measured its rows and the copies of row 0
            metrics[DRIFT] = sampler_drift(old_logprobs, batch)  # padding them: measured on the whole batch
        return TokenScores(old_logprobs, gather(local.ref_logprobs), gather(local.values), metrics)

    def train_on(self, inputs: UpdateInputs, train_actor: bool, generator: torch.Generator) -> dict[str, float]:
        """6: the PPO epochs (:func:`ppo_epochs`); the actor only when ``train_actor`` (after critic warm-up)."""
        config = self.config
        with self.precision():
            return ppo_epochs(self.actor, self.critic, inputs, config.algorithm, config.optim,
                              self.actor_optimizer if train_actor else None, self.critic_optimizer,
                              config.sampling.temperature, generator, shard=self.parallel.shard())

    # ------------------------------------------------------------------ checkpoints
    def checkpoint_space_problem(self) -> str | None:
        """Why the next checkpoint would not fit on its disk (:func:`disk_space_problem`), or None; the same
        answer on every process (each saves its part only if all do)."""
        models = [model for model in (self.actor, self.critic) if model is not None]
        problem = disk_space_problem(self.run_dir / "checkpoints", checkpoint_bytes(models))
        return next((p for p in ranks.all_gather_objects(problem) if p is not None), None)

    def save(self, step: int) -> Path:
        """Checkpoint ``checkpoints/step_{step}``: the run after ``step`` steps (its step numbers count from 1)."""
        state = {
            "actor_scheduler": self.actor_scheduler.state_dict(),
            "lr_scale": self.lr_scale,
            "summary": self.summary,
            "timings": self.timings,
            "elapsed_s": self.elapsed_s(),
        }
        files = CheckpointFiles(self.run_dir, step, self.processor or self.tokenizer, state, to_yaml(self.config),
                                self.config.run.keep_checkpoints)
        return self.parallel.save(files, self.models(), self.optimizers())

    def close(self) -> None:
        """Release what the trainer holds beyond memory: an asynchronous backend's rollout thread, Ray actors,
        sessions on env servers, the threads that step envs. Safe to call twice."""
        self.rollout.close()
        self.val_rollout.close()
        for factory in self.env_factories:
            factory.close()
        if self.executor is not None:  # a process that makes trainers one after another would keep each one's
            self.executor.shutdown(wait=False, cancel_futures=True)  # a hung env must not hang the close

    def elapsed_s(self) -> float:
        """Wall time of the whole run: earlier sessions (before a resume) and this one."""
        return self.elapsed_before_s + time.time() - self.session_start

    def write_summary(self) -> Path:
        self.summary["timings_s"] = {k: round(v, 2) for k, v in self.timings.items()}
        self.summary["total_s"] = round(self.elapsed_s(), 2)
        path = self.run_dir / "summary.json"
        atomic_write_text(path, json.dumps(self.summary, indent=2))
        return path

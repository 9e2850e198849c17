"""The training recipe's configuration (``turnrl train --config X.yaml key=value``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from turnrl.agent.formats import get_format
from turnrl.config import (
    AgentConfig,
    ConfigError,
    EnvConfig,
    GroupsConfig,
    ModelConfig,
    RewardsConfig,
    SamplingConfig,
    SeedConfig,
    check_choice,
    check_finite_fields,
    check_range,
)
from turnrl.policy.factory import check_model_choices
from turnrl.training.algorithm_config import AlgorithmConfig
from turnrl.training.schedules import SCHEDULES


@dataclass
class OptimConfig:
    actor_lr: float = 1e-6
    """Actor learning rate (RAGEN: 1e-6 full fine-tuning)."""
    critic_lr: float = 1e-5
    """Critic learning rate (RAGEN: 1e-5)."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    adam_eps: float = 1e-8
    """AdamW epsilon. Adam's step is about the learning rate however small the gradient, so the tiny
    gradients of near-certain tokens (a format's tags) still move them; a larger epsilon (the
    quickstart uses 1e-5) damps those steps."""
    adam_beta1: float = 0.9
    """AdamW's decay of its running mean of the gradients."""
    adam_beta2: float = 0.999
    """AdamW's decay of its running mean of the squared gradients. With 0.999 that mean follows a weight's
    gradients over about a thousand steps, so a weight whose gradients were tiny for long (a format tag's) takes a
    step of up to about three times the learning rate when a large gradient comes; 0.95 (OpenRLHF's default, as in
    LLM pre-training) follows them over about twenty steps and bounds such a step nearer the learning rate."""
    warmup_steps: int = 0
    """Linear learning-rate warm-up of the actor over this many of its updates."""
    lr_schedule: str = "constant"
    """The actor's learning rate after the warm-up: ``constant``, or ``cosine`` (a half cosine from ``actor_lr``
    towards ``min_lr_ratio * actor_lr``, which it reaches one step past the run's last actor update, as verl's
    ``lr_scheduler_type=cosine`` does).
    Warm-up and decay count actor updates: the steps of ``run.steps`` less ``algorithm.critic_warmup_steps``; a
    step whose update is skipped (no group kept) does not move them."""
    min_lr_ratio: float = 0.1
    """``lr_schedule=cosine``: the floor of the learning rate as a share of ``actor_lr`` (the last update's is a
    little above it)."""
    kl_adaptive_target: float = 0.0
    """Above 0, the actor's learning rate follows each update's ``actor/approx_kl`` (rsl_rl's adaptive
    schedule): after an update whose KL exceeded twice this, the rate's scale is divided by 1.5; after one under
    half of it, multiplied by 1.5; always within ``kl_adaptive_min`` and ``kl_adaptive_max``. The scale multiplies
    the warm-up and ``lr_schedule``, is logged as ``actor/lr_scale`` and is kept in checkpoints. A small policy
    whose answer format rests on a few weights can lose it in one update (docs/benchmarks.md, the quickstart's
    seventh look); where the KL of the updates before such a one rises, this steps less then; a break that comes
    with no rise before it, it cannot foresee. 0: off."""
    kl_adaptive_min: float = 0.1
    """The smallest scale of ``actor_lr`` that ``kl_adaptive_target`` sets."""
    kl_adaptive_max: float = 1.0
    """The largest scale of ``actor_lr`` that ``kl_adaptive_target`` sets (above 1: it may raise the rate)."""
    grad_clip: float = 1.0
    """Clip the gradient norm to this."""
    skip_grad_norm_above: Optional[float] = None
    """Skip (and count) an optimizer step whose gradient norm exceeds this; None never skips for size."""

    def validate(self) -> None:
        check_range("optim.actor_lr", self.actor_lr, 0)
        check_range("optim.critic_lr", self.critic_lr, 0)
        check_range("optim.weight_decay", self.weight_decay, 0)
        check_range("optim.adam_eps", self.adam_eps, 1e-12, 1.0)
        check_range("optim.adam_beta1", self.adam_beta1, 0.0, 0.999999)
        check_range("optim.adam_beta2", self.adam_beta2, 0.0, 0.999999)
        check_range("optim.grad_clip", self.grad_clip, 0)
        check_range("optim.warmup_steps", self.warmup_steps, 0)
        if self.skip_grad_norm_above is not None:  # at 0 or below, every optimizer step would be skipped
            check_range("optim.skip_grad_norm_above", self.skip_grad_norm_above, 1e-9)
        check_choice("optim.lr_schedule", self.lr_schedule, list(SCHEDULES))
        check_range("optim.min_lr_ratio", self.min_lr_ratio, 0.0, 1.0)
        check_range("optim.kl_adaptive_target", self.kl_adaptive_target, 0)
        check_range("optim.kl_adaptive_min", self.kl_adaptive_min, 1e-6, 1.0)
        check_range("optim.kl_adaptive_max", self.kl_adaptive_max, 1.0)


@dataclass
class LoraConfig:
    enabled: bool = False
    """Train LoRA adapters instead of all weights (the reference policy is then the adapters switched off)."""
    r: int = 64
    """Adapter rank."""
    alpha: int = 64
    """Adapter scaling numerator."""
    dropout: float = 0.0
    """Adapter dropout."""
    target_modules: str = "all-linear"
    """Modules that get adapters (peft's ``all-linear`` or a comma-separated list)."""

    def validate(self) -> None:
        # Checked whether or not LoRA is on: peft would refuse them only once the model loads, after SFT.
        check_range("lora.r", self.r, 1)
        check_range("lora.alpha", self.alpha, 1)  # the adapters' scale is alpha / r: 0 would switch them off
        check_range("lora.dropout", self.dropout, 0.0, 1.0)


@dataclass
class SFTConfig:
    enabled: bool = False
    """Warm up with supervised fine-tuning before RL (``turnrl train``)."""
    data: Optional[str] = None
    """A JSONL of chats (``{"messages": [...]}``) instead of expert demos. Under a format with a response prefix
    (``ragen``: ``<think>``) each assistant message starts with it; the target is what follows."""
    episodes: int = 2000
    """Expert episodes played for demos (training seeds, never validation seeds)."""
    random_action_share: float = 0.3
    """Share of demo actions replaced by random ones, so the demos are imperfect."""
    target_random_share: Optional[float] = None
    """Soft targets for the demos' actions: each demo turn's action token is trained toward the noisy expert's
    distribution, ``1 - share`` on the solver's action and ``share`` spread evenly over the env's actions,
    instead of toward the action the demo played (``random_action_share`` still decides which states the demos
    visit). The SFT model then prefers the solver's move wherever it reads the map right, with a policy as soft
    as the share makes it, which RL sharpens. None: the played actions, one-hot. Needs expert demos of one
    action a turn, in a format whose answer is the whole response, and action names of one token each."""
    epochs: int = 2
    """Passes over the demos."""
    lr: float = 1e-3
    """Learning rate (cosine decay after warm-up)."""
    warmup_steps: int = 20
    """Linear warm-up steps."""
    schedule: str = "cosine"
    """After warm-up: ``cosine`` decay to 10% of ``lr``, or ``constant``."""
    batch_size: int = 32
    """Samples per optimizer step."""
    micro_batch_size: int = 32
    """Samples per forward/backward."""
    seed_start: int = 1_000_000
    """First env seed of demo episodes, far from RL training seeds."""
    data_workers: int = 0
    """Processes that tokenize the chats into samples (rendering the chat template is most of making the data:
    20,000 Sokoban demos took 28 s in one process of a 2-core VM); 0: half the machine's cores, at most 8,
    when there are 2,000 chats or more, else one. A VLM's chats (with their images' pixels) are tokenized in
    the training process whatever this says."""

    def validate(self) -> None:
        check_range("sft.random_action_share", self.random_action_share, 0.0, 1.0)
        if self.target_random_share is not None:
            check_range("sft.target_random_share", self.target_random_share, 0.0, 1.0)
            if self.data is not None:
                raise ConfigError("sft.target_random_share makes soft targets from the expert's own actions, which "
                                  "chats from sft.data do not have: drop one of the two")
        check_range("sft.data_workers", self.data_workers, 0)
        check_range("sft.lr", self.lr, 0.0)
        check_range("sft.warmup_steps", self.warmup_steps, 0)
        check_range("sft.seed_start", self.seed_start, 0)  # Gymnasium's reset takes non-negative seeds
        check_choice("sft.schedule", self.schedule, ["cosine", "constant"])
        check_range("sft.episodes", self.episodes, 1)
        check_range("sft.epochs", self.epochs, 1)
        check_range("sft.micro_batch_size", self.micro_batch_size, 1)
        check_range("sft.batch_size", self.batch_size, self.micro_batch_size)


@dataclass
class ValidationConfig:
    episodes: int = 64
    """Validation seeds played (fixed, disjoint from training seeds)."""
    samples_per_seed: int = 1
    """Episodes per validation seed."""
    temperature: float = 0.5
    """Sampling temperature of validation (RAGEN: 0.5)."""
    every: int = 0
    """Validate every N RL steps; 0 validates only before and after RL."""
    batch_size: int = 128
    """Episodes rolled out together."""

    def validate(self) -> None:
        # Below 0 would sample greedily without a word (as below 1e-5 does, on purpose), and a negative ``every``
        # would never validate while collapse.stop_on_low_success, which counts validations, took it for on.
        check_range("validation.temperature", self.temperature, 0.0)
        check_range("validation.every", self.every, 0)


NAME_MAX_BYTES = 255
"""The longest file name that common file systems take (ext4, XFS, APFS, NTFS: 255 bytes or characters)."""


def check_run_name(name: str) -> None:
    """``run.name`` names a folder inside ``run.output_dir``: ``.`` or ``..`` would make the run write into the
    output folder itself or beside it, and a part too long for a file name fails only when the run starts."""
    parts = name.split("/")
    if any(part in (".", "..") for part in parts):
        raise ConfigError(f"run.name={name!r} must name a folder inside run.output_dir, without . or .. parts; "
                          "set run.output_dir for where runs go")
    too_long = next((part for part in parts if len(part.encode()) > NAME_MAX_BYTES), None)
    if too_long is not None:
        raise ConfigError(f"run.name={name[:40]!r}... has a part of {len(too_long.encode())} bytes; a folder name "
                          f"holds {NAME_MAX_BYTES} at most")


@dataclass
class RunConfig:
    name: str = "run"
    """Run name; the run directory is ``output_dir/name``."""
    output_dir: str = "runs"
    """Parent folder of run directories."""
    steps: int = 100
    """RL steps (rollout + update)."""
    time_limit_minutes: float = 0.0
    """End RL after the first step that finishes this many minutes after the command started, as a finished
    run ends (the last validation, a checkpoint, the summary with ``stopped_by: time_limit``), so a job with
    a wall-clock limit keeps its results; leave room for them. 0: no limit."""
    stall_dump_minutes: float = 30.0
    """Past this many minutes without a step ending (or the run's end after its last step), every thread's Python
    stack is written to ``RUN_DIR/stalls.txt`` (``stalls.rank{r}.txt`` for the other processes), and again every
    such interval while nothing moves: where a stuck run waits. The run goes on. 0: never. (``kill -USR1 PID``
    prints the stacks at once.)"""
    save_every: int = 0
    """Checkpoint every N steps (``checkpoints/step_N``: the run after step N, steps counted from 1); 0 saves
    only at the end (``save_at_end``) and on Ctrl-C."""
    save_at_end: bool = True
    """Checkpoint the run when it ends (finished, stopped early or at its time limit); false for runs whose
    weights are not kept (speed measurements, sweeps): at 7B with a critic a checkpoint is some 180 GB. A
    Ctrl-C or stop file still saves, to resume from."""
    keep_checkpoints: int = 0
    """Keep only the newest N checkpoints (older ones are deleted after each save); 0 keeps them all."""
    overwrite: bool = False
    """Start afresh in a run directory that already holds a run (its checkpoints, metrics and TensorBoard
    files are deleted first); false refuses, so two runs never mix. ``resume=RUN_DIR`` continues one."""
    trajectories_every: int = 10
    """Write the trajectories of step 1 and of every N-th step after it (1, 1 + N, 1 + 2N, ...) to
    ``trajectories/step_NNNNNN.jsonl`` (six digits: ``step_000001.jsonl``); 0 writes none."""
    tensorboard: bool = True
    """Write TensorBoard event files."""
    wandb_project: Optional[str] = None
    """Log to this Weights & Biases project too (needs ``wandb``)."""
    threads: int = 0
    """torch CPU threads; 0 keeps torch's default (under torchrun: the host's cores shared among its processes,
    where torchrun would leave one each). Several runs on one host: give each its share of the cores; with
    every run on every core, small tensor operations (a VLM's image processing) wait on threads the others
    hold, 10-18x slower."""
    peak_tflops: float = 0.0
    """Dense bf16 peak of one device in TFLOP/s, the denominator of ``throughput/update_mfu``; 0 detects it
    (H100, H200, A100 and others by name); a CPU or an unknown GPU logs no MFU."""
    check_memory: bool = True
    """On a GPU, estimate each GPU's memory before the models load and stop a run that cannot fit, with what
    to turn on (see :mod:`turnrl.training.memory`); false skips the check."""
    memory_snapshot_steps: int = 0
    """On a GPU, record the CUDA allocator's history over RL steps 1-N and write, for each step and process,
    ``memory/rank{R}_step{N}.pickle`` (for pytorch.org/memory_viz) and ``.txt``: the step's peak and what was
    live then, by the line that made it (:mod:`turnrl.training.memory_trace`); a step that runs out of memory
    writes them before it fails. For finding what the memory estimate misses; recording slows those steps.
    Torch 2.11's recorder breaks a compiled part under activation checkpointing (pytorch/pytorch#179536): record
    such a run with ``model.compile=false``. 0: off."""
    profile_steps: list[int] = field(default_factory=list)
    """RL steps (counted from 1) to trace with ``torch.profiler`` (kernels on a GPU, the host's Python frames),
    writing for each step and process ``profile/rank{R}_step{N}.json.gz`` (for Perfetto or chrome://tracing) and
    ``.txt``: where the device waited on the host, by phase (the engine's prefill and decode, the rollout, the
    scores, the update) and by the line it was in, and the costliest kernels
    (:mod:`turnrl.training.device_idle`); for a trace too large to read within the run (a whole VisGym step's),
    the command that reads it. Tracing slows those steps (Python stacks): leave them out of timings. A traced
    step is mostly its rollout's decode steps (53 MiB for 8 VLM episodes of 8 turns); the update alone is
    traced by ``benchmarks/update_profile.py``. Empty: off."""
    gpu_share: float = 1.0
    """The share of each GPU's memory this run may use, for several runs on one card (``1/N`` each; the
    estimator benchmarks set it from ``--parallel``): the memory check counts that share, and torch's
    allocator is capped to it, so a run that outgrows it stops alone, at its start where the estimate
    says so, instead of taking the memory its neighbours hold. With ``run.check_memory=false`` set
    ``model.engine.kv_cache_gb`` too (the engine's own default takes 30% of the card's free memory)."""
    cuda_alloc_conf: str = "expandable_segments:True"
    """Torch's CUDA allocator settings for a GPU run, set as ``PYTORCH_CUDA_ALLOC_CONF`` before CUDA starts
    (torch's format, ``key:value,...``); the variable set in the environment (or ``PYTORCH_ALLOC_CONF``) wins
    and is logged. Expandable segments let freed memory be reused where the default allocator's cached blocks
    can strand gigabytes (docs/benchmarks.md); the memory check keeps a larger margin without them. ``""``:
    torch's defaults."""


@dataclass
class DistributedConfig:
    """Training on several processes or GPUs (see docs/distributed.md)."""

    backend: str = "none"
    """``none``: one process (``fsdp`` is taken by itself under ``torchrun`` with several processes);
    ``fsdp``: data parallel with FSDP2, one process per GPU (``torchrun`` or ``nproc_per_node``);
    ``ray``: rollouts on Ray actors (``rollout_workers`` of them) that get new weights after each update."""
    nproc_per_node: int = 1
    """Above 1, ``turnrl train`` starts this many processes itself (through ``torchrun``) with ``fsdp``."""
    timeout_s: float = 900.0
    """Longest wait on a collective (or a Ray call) before the run stops with an error instead of hanging."""
    cpu_offload: bool = False
    """``fsdp``: keep the sharded weights, gradients and optimizer states of actor, critic and reference in
    host memory (FSDP2's ``CPUOffloadPolicy``); the GPU gathers a layer's weights when it runs it, and the
    optimizer steps on the CPU. What lets a model whose training states do not fit the GPUs train, slower."""
    ray_address: Optional[str] = None
    """``ray``: the cluster to join (``auto``, or ``ray://host:10001``); None starts a local one."""
    rollout_workers: int = 2
    """``ray``: rollout actors, each with a copy of the policy; the groups are split between them."""
    worker_gpus: float = 0.0
    """``ray``: GPUs per rollout actor (0 on a CPU)."""
    env_workers: int = 0
    """Envs stepped inside this many Ray actors (expensive envs: 3D, physics) instead of this process;
    0 keeps them here. Works with every backend."""
    async_rollout: bool = False
    """Roll out the next batches with the previous weights while the trainer updates (one process, the
    rollout on ``rollout_device``; or on ``rollout_processes``); the loss corrects the lag (recomputed old
    log-probs with ``algorithm.tis_cap``, or PPO's ratio against the sampler: docs/distributed.md)."""
    max_staleness: int = 1
    """``async_rollout``: how many updates a batch's weights may lag behind; 0 is the synchronous algorithm."""
    rollout_device: Optional[str] = None
    """``async_rollout``: where the rollout copy of the policy lives (e.g. ``cuda:1``); None: the trainer's."""
    partial_rollouts: bool = False
    """``async_rollout``: the episodes in flight take weights published mid-batch from their next turn on,
    instead of finishing the batch on the weights it started with (each turn keeps its version and log-probs);
    with ``rollout_processes``, each process at its own turn boundaries."""
    rollout_processes: int = 0
    """Disaggregated pools: of the ``nproc_per_node`` processes, the last this many roll out (each its own policy
    and envs, on its own GPU) and the others train (FSDP2 among themselves, one process: on its own); weights go
    from the trainers' shards to them after each update. With ``async_rollout`` they play up to ``max_staleness``
    updates ahead. 0: every process trains and plays its share (docs/distributed.md, "Disaggregated pools")."""
    rollout_host: str = "turnrl.rollout.ray_workers:RolloutHost"
    """``rollout_processes``: the class each rollout process serves with (``module:Class``, a ``RolloutHost`` or a
    subclass of it: a policy built otherwise, instrumentation)."""

    def validate(self) -> None:
        check_choice("distributed.backend", self.backend, ["none", "fsdp", "ray"])
        check_range("distributed.nproc_per_node", self.nproc_per_node, 1)
        check_range("distributed.timeout_s", self.timeout_s, 1.0)
        check_range("distributed.rollout_workers", self.rollout_workers, 1)
        check_range("distributed.worker_gpus", self.worker_gpus, 0.0)
        check_range("distributed.env_workers", self.env_workers, 0)
        check_range("distributed.max_staleness", self.max_staleness, 0)
        if self.ray_address is not None and self.backend != "ray" and not self.env_workers:
            raise ConfigError(f"distributed.ray_address={self.ray_address!r} names the Ray cluster of the Ray "
                              "rollout (distributed.backend=ray) and of env workers (distributed.env_workers); "
                              "this run uses neither: set one, or drop distributed.ray_address")
        if self.nproc_per_node > 1 and self.backend not in ("none", "fsdp"):
            raise ConfigError(f"distributed.nproc_per_node={self.nproc_per_node} starts FSDP processes; it does "
                              f"not go with distributed.backend={self.backend} (set one or the other)")
        if self.async_rollout and self.backend != "none":
            raise ConfigError("distributed.async_rollout runs in one process (rollout and trainer on their own "
                              f"devices); it does not go with distributed.backend={self.backend}")
        check_range("distributed.rollout_processes", self.rollout_processes, 0)
        if self.rollout_processes and self.nproc_per_node <= self.rollout_processes:
            raise ConfigError(f"distributed.rollout_processes={self.rollout_processes} of "
                              f"distributed.nproc_per_node={self.nproc_per_node} leaves no process to train: set "
                              f"distributed.nproc_per_node={self.rollout_processes + 1} or more")
        if self.rollout_processes and self.backend == "ray":
            raise ConfigError("distributed.rollout_processes are rollout processes of torchrun; they do not go with "
                              "distributed.backend=ray (its rollout workers are Ray actors): set one or the other")
        if self.partial_rollouts and not self.async_rollout:
            raise ConfigError("distributed.partial_rollouts switches the weights of episodes in flight in the "
                              "asynchronous backend: set distributed.async_rollout=true, or drop it")
        if self.rollout_device is not None and not self.async_rollout:
            raise ConfigError(f"distributed.rollout_device={self.rollout_device!r} places the asynchronous rollout's "
                              "copy of the policy; without distributed.async_rollout=true the rollout runs on the "
                              "actor, on model.device: set distributed.async_rollout=true, or drop it")
        if self.async_rollout and self.nproc_per_node > 1 and not self.rollout_processes:
            # Refused here, before the processes start, rather than by each of them under torchrun.
            raise ConfigError(f"distributed.async_rollout rolls out in a thread of one process, and "
                              f"distributed.nproc_per_node={self.nproc_per_node} starts FSDP processes: set "
                              "distributed.nproc_per_node=1, or roll out in processes of their own with "
                              "distributed.rollout_processes=K (fewer than nproc_per_node)")


@dataclass
class CollapseConfig:
    """RAGEN's collapse diagnostics and early stops (docs/collapse.md)."""

    every: int = 0
    """Measure how much the reasoning depends on the prompt (mutual information, conditional entropy, retrieval
    accuracy: ``collapse/``) at the first step and every N steps; 0 never does. Each measurement scores every
    drawn reasoning after every drawn prompt: ``samples`` x ``samples`` forward passes without gradient (RAGEN's
    recipes: every 5)."""
    samples: int = 64
    """(prompt, reasoning) pairs drawn from the step's rollouts for each kind of measurement; 0 takes all (RAGEN:
    64)."""
    first_turn: bool = True
    """Measure on first turns: pairs drawn among the episodes' first turns, one column per group's prompt."""
    multi_turn: bool = True
    """Measure on all turns: an episode drawn uniformly, then one of its turns, each pair its own column."""
    std_eps: float = 1e-3
    """Keeps the MI z-scores' division by the marginal log-prob's std finite."""
    ema_decay: float = 0.9
    """Decay of the moving average of that std (``mi_zscore_ema``)."""
    stop_on_reward_spread: bool = False
    """Stop the run once the in-group reward std (``rollout/in_group_reward_std``) of ``spread_window``
    training steps in a row lies below ``spread_ratio`` times its mean over the first ``spread_baseline_steps``
    training steps (RAGEN's reward-variance collapse; steps whose filter kept nothing do not count)."""
    spread_baseline_steps: int = 10
    """Training steps whose mean reward std is the baseline (RAGEN: 10)."""
    spread_window: int = 10
    """Training steps in a row below the threshold that stop the run (RAGEN: 10)."""
    spread_ratio: float = 0.1
    """The threshold, a share of the baseline (RAGEN: 0.1)."""
    stop_on_low_success: bool = False
    """Stop the run once ``low_success_validations`` validations in a row (those every ``validation.every``
    steps) had a success rate below ``low_success`` (RAGEN: 5 under 0.01)."""
    low_success: float = 0.01
    """The success rate a validation must reach to reset the count."""
    low_success_validations: int = 5
    """Validations in a row under ``low_success`` that stop the run."""
    stop_after_empty_steps: int = 0
    """Stop the run after this many steps in a row whose group filter kept nothing to train on; 0 never stops
    (RAGEN's rollout_filter_empty_stop_steps: 5)."""

    def validate(self) -> None:
        check_range("collapse.every", self.every, 0)
        check_range("collapse.samples", self.samples, 0)
        check_range("collapse.std_eps", self.std_eps, 0.0)
        check_range("collapse.ema_decay", self.ema_decay, 0.0, 1.0)
        check_range("collapse.spread_baseline_steps", self.spread_baseline_steps, 1)
        check_range("collapse.spread_window", self.spread_window, 1)
        check_range("collapse.spread_ratio", self.spread_ratio, 0.0)
        check_range("collapse.low_success", self.low_success, 0.0, 1.0)
        check_range("collapse.low_success_validations", self.low_success_validations, 1)
        check_range("collapse.stop_after_empty_steps", self.stop_after_empty_steps, 0)
        if self.every > 0 and not (self.first_turn or self.multi_turn):
            raise ConfigError(f"collapse.every={self.every} measures on first turns, all turns or both: set "
                              "collapse.first_turn=true or collapse.multi_turn=true (or collapse.every=0)")


@dataclass
class TrainConfig:
    run: RunConfig = field(default_factory=RunConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    rewards: RewardsConfig = field(default_factory=RewardsConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    groups: GroupsConfig = field(default_factory=GroupsConfig)
    seeds: SeedConfig = field(default_factory=SeedConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    collapse: CollapseConfig = field(default_factory=CollapseConfig)
    resume: Optional[str] = None
    """A run directory to continue from its latest checkpoint."""

    def validate(self) -> None:
        self.agent.validate()
        self.agent.validate_for_env(self.env.id)
        self.rewards.validate()
        self.sampling.validate()
        self.model.validate()
        if self.model.dtype == "float16":
            # Gradients under float16 autocast underflow to 0 without a loss scaler, which the trainer has not.
            raise ConfigError("model.dtype=float16 trains without a loss scaler here: small gradients flush to 0 "
                              "(the output layer's first); train in bfloat16 (or float32 where the GPU has no "
                              "bf16), and evaluate or serve in float16 if you like")
        check_model_choices(self.model)
        self.groups.validate()
        self.algorithm.validate()
        self.sft.validate()
        self.optim.validate()
        self.lora.validate()
        self.validation.validate()
        self.seeds.validate()
        self.distributed.validate()
        self.collapse.validate()
        self._validate_collapse()
        staleness, algo = self.distributed.max_staleness, self.algorithm
        if (self.distributed.async_rollout and staleness > 0 and algo.old_logprobs == "recompute"
                and algo.tis_cap is None):
            raise ConfigError(
                f"distributed.async_rollout with distributed.max_staleness={staleness} samples with weights up to "
                f"{staleness} update(s) old; with recomputed old log-probs the loss corrects for that with "
                "truncated importance weights: set algorithm.tis_cap=2.0 (or algorithm.old_logprobs=sampler, PPO's "
                "ratio taken against the sampling weights themselves, or distributed.max_staleness=0 for the "
                "synchronous algorithm)")
        if self.distributed.partial_rollouts and not self.agent.wait_for_turns:
            raise ConfigError("distributed.partial_rollouts takes new weights between rounds of turns, when no "
                              "sequence is generating; agent.wait_for_turns=false has no rounds: set it to true")
        if self.distributed.async_rollout and self.model.engine.free_during_update:
            raise ConfigError("model.engine.free_during_update frees the rollout's memory while the trainer "
                              "updates, and distributed.async_rollout rolls out during the update: turn one off")
        check_run_name(self.run.name)
        check_range("run.steps", self.run.steps, 0)
        check_range("run.save_every", self.run.save_every, 0)
        check_range("run.keep_checkpoints", self.run.keep_checkpoints, 0)
        check_range("run.trajectories_every", self.run.trajectories_every, 0)
        check_range("run.threads", self.run.threads, 0)
        if not self.run.time_limit_minutes >= 0:  # NaN too, which no limit compares with
            raise ConfigError(f"run.time_limit_minutes={self.run.time_limit_minutes!r} is out of range; allowed: "
                              "0 (no limit) or more")
        if not self.run.stall_dump_minutes >= 0:
            raise ConfigError(f"run.stall_dump_minutes={self.run.stall_dump_minutes!r} is out of range; allowed: "
                              "0 (never) or more")
        if not 0 < self.run.gpu_share <= 1:
            raise ConfigError(f"run.gpu_share={self.run.gpu_share!r} is out of range; allowed: (0, 1], the share of "
                              "each GPU's memory this run may use")
        check_range("run.peak_tflops", self.run.peak_tflops, 0.0)
        check_range("run.memory_snapshot_steps", self.run.memory_snapshot_steps, 0)
        for step in self.run.profile_steps:
            check_range("run.profile_steps", step, 1)
        check_range("validation.episodes", self.validation.episodes, 1, self.seeds.val_size)
        check_range("validation.batch_size", self.validation.batch_size, 1)
        check_range("validation.samples_per_seed", self.validation.samples_per_seed, 1)
        if self.algorithm.sample_mode == "trajectory" and self.agent.max_images is not None:
            # Exact, not a guess: an observation carries at most one image (the env contract's ``"image"``), and
            # the last prompt holds the observations of all max_turns turns (the one after the last turn is in
            # none), so max_turns images at most, and that many once an episode plays every turn.
            if self.agent.max_images < self.agent.max_turns:
                raise ConfigError(
                    f"agent.max_images={self.agent.max_images} drops older images from later prompts, so a whole "
                    "episode is not what the model saw; use algorithm.sample_mode=turn (one sample per turn) or "
                    f"agent.max_images=null (or >= agent.max_turns={self.agent.max_turns})"
                )
        if self.algorithm.sample_mode == "trajectory" and self.agent.max_context_window is not None:
            if self.agent.max_context_window < self.agent.max_turns:
                raise ConfigError(
                    f"agent.max_context_window={self.agent.max_context_window} cuts the context, so a whole episode is "
                    "not what the model saw; use algorithm.sample_mode=turn (one sample per turn) or "
                    f"agent.max_context_window=null (or >= agent.max_turns={self.agent.max_turns})"
                )
        if "groups" in self.algorithm.estimator.needs and self.groups.group_size < 2:
            raise ConfigError(
                f"algorithm.advantage={self.algorithm.advantage} compares episodes within a group: "
                "set groups.group_size >= 2"
            )
        check_finite_fields(self)  # last: the keys with a check of their own say more than this

    def _validate_collapse(self) -> None:
        """What the collapse diagnostics and early stops need from the rest of the run."""
        collapse = self.collapse
        if collapse.every > 0 and not get_format(self.agent.format).has_reasoning:
            raise ConfigError(f"collapse.every={collapse.every} measures how the reasoning depends on the prompt, and "
                              f"agent.format={self.agent.format} has none: choose a format with reasoning (ragen, "
                              "free_think, ...) or set collapse.every=0")
        if collapse.stop_on_reward_spread and self.algorithm.dynamic_sampling:
            raise ConfigError("collapse.stop_on_reward_spread watches the spread of all rolled-out groups, which "
                              "algorithm.dynamic_sampling does not report (it keeps only varied groups): turn one off")
        if collapse.stop_on_low_success and self.validation.every == 0:
            raise ConfigError("collapse.stop_on_low_success counts the validations during training, and "
                              "validation.every=0 runs none: set validation.every (RAGEN: 10) or turn the stop off")

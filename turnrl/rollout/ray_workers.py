"""Rollouts on Ray actors: rollout workers with their own copy of the policy and their own envs.

    driver (the trainer)                      rollout worker k (a Ray actor, on its GPU)
    RayRollout.set_weights(actor, version) -> RolloutHost.set_weights: load_state_dict in place
    RayRollout.run(slots, sampling)        -> RolloutHost.run(its whole groups, sampling, seed)
      <- trajectories in the slots' order  <-   Rollout.run over its own envs: trajectories, timings

:class:`RayRollout` has the interface the trainer uses of :class:`~turnrl.rollout.runner.Rollout`
(``run(slots, sampling)``, ``timings``, ``rewards.metrics()``), so :func:`turnrl.training.step_episodes.collect`
takes either. The slots are split by whole groups (a group's episodes are compared with each other, so they
play on one worker) and the parts play in parallel; only the slots' seeds, groups and options travel, each
worker plays them on envs of its own (built in its process, on env servers, or in env workers of its own).

A worker builds its model from the model directory's files (config, tokenizer, processor; shipped by the
driver, so that no node needs a shared file system) and gets its weights from :meth:`RayRollout.set_weights`,
which puts the state dict in Ray's object store once for all workers, and only when its version changed.

A worker that dies (or does not answer within ``timeout_s``) raises :class:`RolloutWorkerError`: its
episodes and its copy of the weights are gone, and the trainer saves a checkpoint and stops.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from peft.tuners.lora import LoraLayer

from turnrl.agent.formats import get_format
from turnrl.chat.template_deltas import ChatTemplateDeltas
from turnrl.config import AgentConfig, ModelConfig, RewardsConfig, SamplingConfig
from turnrl.engine.weights import WeightsChecksum, lora_merged_weight
from turnrl.envs.contract import AgentEnv
from turnrl.envservice.placement import env_factory
from turnrl.envservice.ray import ensure_ray, ray_env_factory
from turnrl.rewards import Rewards
from turnrl.rollout.context import format_for_template
from turnrl.rollout.runner import EpisodeSlot, Rollout, RolloutTimings
from turnrl.rollout.trajectory import Trajectory, sum_by_name

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf")
"""Files a worker does not need from the model directory: its weights come from ``set_weights``."""


class RolloutWorkerError(RuntimeError):
    """A rollout worker died, failed or hung; the batch is lost and the run cannot go on with that worker.

    ``worker`` is its index (None when several did not answer).
    """

    def __init__(self, message: str, worker: int | None = None) -> None:
        super().__init__(message)
        self.worker = worker


class WeightsTransferError(RolloutWorkerError):
    """A rollout worker failed to take the weights after an update: the trainer's weights are a step ahead of what
    the run recorded, so nothing is saved after it; the run continues from its last checkpoint (the steps after it
    are trained again, once)."""


# --------------------------------------------------------------------------- what a worker is given
def model_files(path: Path | str) -> dict[str, bytes]:
    """The files of a transformers model directory but its weights: config, tokenizer, processor, template.

    Raises:
        ValueError: ``path`` is not a model directory (no ``config.json``).
    """
    root = Path(path)
    if not (root / "config.json").is_file():
        raise ValueError(f"{root} is not a transformers model directory (no config.json)")
    return {
        str(file.relative_to(root)): file.read_bytes()
        for file in sorted(root.rglob("*"))
        if file.is_file() and not file.name.endswith(WEIGHT_SUFFIXES) and not file.name.startswith(".")
    }


@dataclass(frozen=True)
class EnvSpec:
    """The envs a worker plays on: built in its process, on env servers, or in env workers of its own."""

    id: str
    settings: dict[str, Any] = field(default_factory=dict)
    remote: tuple[str, ...] = ()
    """``env.remote``: URLs of ``turnrl serve-env`` servers."""
    env_workers: int = 0
    """Ray env workers this rollout worker starts for its envs (0: its envs live in its own process)."""
    timeout_s: float = 60.0
    """Longest wait for one env call in an env worker."""


@dataclass
class WorkerSpec:
    """Everything a rollout worker builds itself from."""

    model_files: dict[str, bytes]
    """The model directory without its weights (:func:`model_files`)."""
    model: ModelConfig
    """Device, dtype, backend and image sizes of the worker's policy (``device=auto``: the GPU Ray gave it)."""
    agent: AgentConfig
    env: EnvSpec
    rewards: RewardsConfig = field(default_factory=RewardsConfig)
    max_batch_size: int = 64
    """Prompts the policy samples together at most."""
    env_threads: int = 0
    """Threads stepping the worker's envs in parallel (``groups.env_workers``); 0 steps them in turn."""
    torch_threads: int = 0
    """torch CPU threads of the worker; 0 keeps torch's default."""


@dataclass(frozen=True)
class SlotSpec:
    """An :class:`~turnrl.rollout.runner.EpisodeSlot` without its env: what a worker needs to play it."""

    seed: int
    group: int = 0
    sample: int = 0
    options: dict[str, Any] | None = None


@dataclass
class WorkerResult:
    """What a worker sends back from one ``run``."""

    trajectories: list[Trajectory]
    timings: RolloutTimings
    reward_metrics: dict[str, float]
    """``Rewards.metrics()`` of the worker's reward functions for this run."""
    weights_version: int
    wall_s: float


# --------------------------------------------------------------------------- inside the worker
class RolloutHost:
    """The body of a rollout worker: a policy, a :class:`Rollout` and envs, built from a :class:`WorkerSpec`.

    Plain Python (Ray wraps it in an actor). Its model starts with the architecture's initial weights and
    plays only after :meth:`set_weights` has given it the policy's.
    """

    def __init__(self, spec: WorkerSpec) -> None:
        from turnrl.models.devices import resolve_device, resolve_dtype
        from turnrl.models.loading import is_vision_language, load_processor, load_tokenizer
        from turnrl.policy.factory import model_policy

        if spec.torch_threads > 0:
            torch.set_num_threads(spec.torch_threads)
        # Removed with the worker (the object is kept on it; its finalizer deletes the directory).
        self._files = tempfile.TemporaryDirectory(prefix="turnrl-rollout-worker-")
        self.directory = Path(self._files.name)
        for name, data in spec.model_files.items():
            (self.directory / name).parent.mkdir(parents=True, exist_ok=True)
            (self.directory / name).write_bytes(data)
        self.device = resolve_device(spec.model.device)
        self.dtype = resolve_dtype(spec.model.dtype, self.device)
        self.model = build_model(self.directory, is_vision_language(self.directory), self.dtype, self.device)
        processor = load_processor(self.directory, spec.model.min_pixels, spec.model.max_pixels)
        policy = model_policy(self.model, load_tokenizer(self.directory), spec.model,
                              max_batch_size=spec.max_batch_size, processor=processor, dtype=self.dtype)
        fmt = get_format(spec.agent.format, action_separator=spec.agent.action_separator,
                         max_actions_per_turn=spec.agent.max_actions_per_turn, strict=spec.agent.strict_format)
        executor = ThreadPoolExecutor(spec.env_threads) if spec.env_threads > 0 else None
        self.rollout = Rollout(policy, fmt, spec.agent, env_id=spec.env.id, executor=executor,
                               rewards=Rewards(spec.rewards))
        self.make_env = env_maker(spec.env)
        self.envs: list[AgentEnv] = []
        self.version: int | None = None

    def info(self) -> dict[str, Any]:
        """Where this worker runs: node, process, device, dtype and policy class (for messages and checks)."""
        import socket

        return {"host": socket.gethostname(), "pid": os.getpid(), "device": str(self.device),
                "dtype": str(self.dtype).removeprefix("torch."), "policy": type(self.rollout.policy).__name__}

    def set_weights(self, version: int, state_dict: dict[str, torch.Tensor]) -> WeightsChecksum | None:
        """Copy ``state_dict`` into the model in place (the policy and the engine see it), as ``version`` (the
        trainer's update count, which the turns this worker plays record). Returns the checksum of the weights the
        policy computes with now (the engine's buffers brought up to date), for the driver to check against the
        trainer's (None for a model of no engine family, whose weights the check cannot probe)."""
        missing, unexpected = self.model.load_state_dict(state_dict, strict=False)
        if missing or unexpected:
            raise ValueError(f"the weights do not fit the worker's model: missing {sorted(missing)[:5]}, "
                             f"unexpected {sorted(unexpected)[:5]}; send a state dict of the same architecture")
        self.version = version
        self.rollout.policy.weights_version = version
        return self.rollout.policy.weights_checksum()

    @torch.no_grad()
    def load_weights(self, version: int, weights: Iterable[tuple[str, torch.Tensor]]) -> WeightsChecksum | None:
        """Copy ``weights`` (name and tensor, one at a time as they arrive: a rollout process receives them from
        the trainer) into the model's parameters of those names, as ``version``; the checksum as
        :meth:`set_weights` returns it. Every tensor of ``weights`` is read (the sender waits for each)."""
        parameters = dict(self.model.named_parameters())
        for name, tensor in weights:
            if name not in parameters or parameters[name].shape != tensor.shape:
                raise ValueError(f"the weight {name!r} {tuple(tensor.shape)} does not fit the rollout's model "
                                 f"(its parameter: {tuple(parameters[name].shape) if name in parameters else 'none'})")
            parameters[name].copy_(tensor)
        self.version = version
        self.rollout.policy.weights_version = version
        return self.rollout.policy.weights_checksum()

    def run(self, slots: Sequence[SlotSpec], sampling: SamplingConfig, seed: int) -> WorkerResult:
        """Play ``slots`` on this worker's envs (the k-th slot on its k-th env), sampling seeded by ``seed``."""
        if self.version is None:
            raise RuntimeError("this rollout worker has no weights yet: call RayRollout.set_weights(model) first")
        start = time.perf_counter()
        while len(self.envs) < len(slots):
            self.envs.append(self.make_env())
        torch.manual_seed(seed)
        episode_slots = [EpisodeSlot(env, slot.seed, slot.group, slot.sample, slot.options)
                         for env, slot in zip(self.envs, slots)]
        trajectories = self.rollout.run(episode_slots, sampling)
        for trajectory in trajectories:
            if trajectory.tokens is not None:
                # The driver attaches its own copy: the tokenizer would otherwise travel with every batch.
                trajectory.tokens.deltas = None  # type: ignore[assignment]
        return WorkerResult(trajectories, replace(self.rollout.timings), self.rollout.rewards.metrics(),
                            self.version, time.perf_counter() - start)


def build_model(directory: Path, vision: bool, dtype: torch.dtype, device: torch.device) -> Any:
    """The architecture of the model directory with its initial weights, on ``device`` in ``dtype``, for eval; a
    VLM's vision tower prepared as every loaded one is (its attention and MLPs, :func:`prepare_vision_tower`)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    from turnrl.models.loading import prepare_vision_tower

    auto = AutoModelForImageTextToText if vision else AutoModelForCausalLM
    with device:  # initialised where it runs: a large model never sits in CPU memory first
        model = auto.from_config(AutoConfig.from_pretrained(directory), dtype=dtype)
    prepare_vision_tower(model)
    return model.eval().requires_grad_(False)


def env_maker(spec: EnvSpec) -> Callable[[], AgentEnv]:
    """The worker's ``make_env``: env workers of its own, env servers, or envs in its process."""
    if spec.env_workers > 0:
        return ray_env_factory(spec.id, dict(spec.settings), spec.env_workers, timeout_s=spec.timeout_s)
    return env_factory(spec.id, dict(spec.settings), list(spec.remote))


# --------------------------------------------------------------------------- the driver's side
def policy_weights(model: torch.nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The weights of ``model`` as a plain transformers model holds them, on the CPU (in ``dtype`` for floats).

    A peft model's LoRA adapters are merged into the weights they adapt (the worker runs a plain model), out
    of place, as the engine merges them (:func:`~turnrl.engine.weights.lora_merged_weight`).
    """

    def to_cpu(tensor: torch.Tensor) -> torch.Tensor:
        cast = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
        return tensor.detach().to(device="cpu", dtype=cast, copy=True)

    if not hasattr(model, "get_base_model"):
        return {name: to_cpu(tensor) for name, tensor in model.state_dict().items()}
    base: Any = model.get_base_model()  # type: ignore[operator]
    with torch.no_grad():
        merged = {f"{name}.weight": lora_merged_weight(module) for name, module in base.named_modules()
                  if isinstance(module, LoraLayer)}
    weights = {}
    for name, tensor in base.state_dict().items():
        if ".lora_" in name:
            continue
        plain = name.replace(".base_layer.", ".")
        weights[plain] = to_cpu(merged.get(plain, tensor))
    return weights


def split_groups(slots: Sequence[EpisodeSlot], parts: int) -> list[list[int]]:
    """Slot indices for ``parts`` workers: whole groups, in order, each part closed once it holds its share of
    the episodes left (rounded up). Six slots in three groups of two over two parts: ``[[0, 1, 2, 3], [4, 5]]``.
    """
    groups: dict[int, list[int]] = {}
    for index, slot in enumerate(slots):
        groups.setdefault(slot.group, []).append(index)
    out: list[list[int]] = []
    current: list[int] = []
    left = len(slots)  # slots not in a closed part
    for members in groups.values():
        parts_left = parts - len(out)
        if current and parts_left > 1 and len(current) >= -(-left // parts_left):
            out.append(current)
            left -= len(current)
            current = []
        current.extend(members)
    out.append(current)
    return out + [[] for _ in range(parts - len(out))]


class WorkerRewardMetrics:
    """``rewards.metrics()`` of a :class:`RayRollout`: what the workers' reward functions reported about the
    last batch, each key the mean over the workers that reported it (counts are per worker)."""

    def __init__(self, reports: Sequence[dict[str, float]] = ()) -> None:
        self.reports = list(reports)

    def metrics(self) -> dict[str, float]:
        keys = {key for report in self.reports for key in report}
        return {key: sum(r[key] for r in self.reports if key in r) / sum(key in r for r in self.reports)
                for key in sorted(keys)}


class RayRollout:
    """Rollouts on ``workers`` Ray actors, with the interface the trainer uses of :class:`Rollout`.

    Args:
        spec: what each worker builds (model files, model and agent settings, envs, rewards).
        workers: rollout workers (``distributed.rollout_workers``).
        tokenizer: the driver's tokenizer of the same model (the trajectories' token contexts use it).
        worker_gpus: GPUs each worker reserves (``distributed.worker_gpus``; 0 on CPUs).
        worker_cpus: CPUs each reserves; None: Ray's default for actors.
        timeout_s: longest wait for a worker's start, weights or batch (``distributed.timeout_s``).
        address: the Ray cluster when Ray is not running yet (``distributed.ray_address``).

    Raises:
        RolloutWorkerError: a worker could not start (its error, e.g. a bad env setting, is in the message).
    """

    def __init__(self, spec: WorkerSpec, workers: int, tokenizer: Any, *, worker_gpus: float = 0.0,
                 worker_cpus: float | None = None, timeout_s: float = 900.0, address: str | None = None) -> None:
        if workers < 1:
            raise ValueError(f"rollout workers: need at least 1, got {workers}")
        self.ray = ensure_ray(address)
        self.timeout_s = timeout_s
        # The workers' token contexts end their prompts with the format's response prefix (as read under the
        # model's chat template): so do the driver's.
        prefix = format_for_template(get_format(spec.agent.format), tokenizer).response_prefix
        self.deltas = ChatTemplateDeltas.for_tokenizer(tokenizer, response_prefix=prefix)
        resources: dict[str, Any] = {"num_gpus": worker_gpus}
        if worker_cpus is not None:
            resources["num_cpus"] = worker_cpus
        actor = self.ray.remote(RolloutHost).options(max_restarts=0, **resources)
        self.workers = [actor.remote(spec) for _ in range(workers)]
        self.infos: list[dict[str, Any]] = [{} for _ in self.workers]
        started = self._gather({k: worker.info.remote() for k, worker in enumerate(self.workers)}, "start")
        self.infos = [started[k] for k in range(workers)]
        dtypes = {info["dtype"] for info in self.infos}
        # Weights travel in the workers' dtype: half the bytes of float32 for bf16 workers.
        self.transfer_dtype = getattr(torch, dtypes.pop()) if len(dtypes) == 1 else None
        self.version: int | None = None
        """The weights version the workers hold (None: none sent yet)."""
        self.checksums: list[WeightsChecksum | None] = []
        """Each worker's checksum of the weights its policy computes with, after the last weights sent."""
        self.timings = RolloutTimings()
        self.rewards = WorkerRewardMetrics()
        self.last_results: list[WorkerResult] = []
        """Each worker's result of the last ``run`` (its timings and wall time), in worker order."""

    # ------------------------------------------------------------------ weights
    def set_weights(self, model: torch.nn.Module, version: int) -> bool:
        """Send ``model``'s weights to every worker, unless they hold ``version`` already; whether it sent.

        The state dict is put in Ray's object store once; each worker reads it from there (its node's copy).
        """
        if version == self.version:
            return False
        start = time.perf_counter()
        reference = self.ray.put(policy_weights(model, self.transfer_dtype))
        try:
            taken = self._gather({k: w.set_weights.remote(version, reference) for k, w in enumerate(self.workers)},
                                 "set_weights")
            self.checksums = [taken[k] for k in range(len(self.workers))]
        finally:
            del reference  # the store frees it once no worker holds it
        self.version = version
        self.last_sync_s = time.perf_counter() - start
        return True

    # ------------------------------------------------------------------ the rollout
    def run(self, slots: Sequence[EpisodeSlot], sampling: SamplingConfig,
            on_turn: Callable[[int, int], None] | None = None) -> list[Trajectory]:
        """Play every slot's episode on the workers; the trajectories in the slots' order.

        The slots' envs are not used: each worker plays the seeds on envs of its own. Sampling is seeded
        from torch's generator here (the trainer seeds it per step), one seed per worker. ``on_turn`` is
        not called (the turns happen on the workers).

        Raises:
            RolloutWorkerError: a worker died, failed or did not finish within ``timeout_s``.
        """
        if self.version is None:
            raise RuntimeError("RayRollout.run before any weights were sent: call set_weights(model, version) first")
        parts = split_groups(slots, len(self.workers))
        base_seed = int(torch.randint(0, 2**31 - len(self.workers), (1,)))
        calls = {
            k: self.workers[k].run.remote(
                [SlotSpec(slots[i].seed, slots[i].group, slots[i].sample, slots[i].options) for i in part],
                sampling, base_seed + k)
            for k, part in enumerate(parts) if part
        }
        results = self._gather(calls, "run")
        trajectories: list[Trajectory | None] = [None] * len(slots)
        for k, result in results.items():
            for index, trajectory in zip(parts[k], result.trajectories):
                if trajectory.tokens is not None:
                    trajectory.tokens.deltas = self.deltas
                trajectories[index] = trajectory
        ordered = sorted(results)
        self.last_results = [results[k] for k in ordered]
        # The workers play at once: the batch waited for the slowest of each.
        self.timings = RolloutTimings(generate_s=max((r.timings.generate_s for r in self.last_results), default=0.0),
                                      env_s=max((r.timings.env_s for r in self.last_results), default=0.0),
                                      policy_work=sum_by_name([r.timings.policy_work for r in self.last_results]))
        self.rewards = WorkerRewardMetrics([r.reward_metrics for r in self.last_results])
        missing = [i for i, t in enumerate(trajectories) if t is None]
        if missing:
            raise RolloutWorkerError(f"the rollout workers returned no trajectory for slots {missing[:5]}")
        return [t for t in trajectories if t is not None]

    def _gather(self, calls: dict[int, Any], what: str) -> dict[int, Any]:
        """Each worker's answer to its call, waiting at most ``timeout_s`` in all.

        Raises:
            RolloutWorkerError: naming the worker that died or failed, or those that did not answer.
        """
        exceptions = self.ray.exceptions
        pending = {reference: k for k, reference in calls.items()}
        results: dict[int, Any] = {}
        deadline = time.monotonic() + self.timeout_s
        while pending:
            ready, _ = self.ray.wait(list(pending), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                late = sorted(pending.values())
                raise RolloutWorkerError(
                    f"rollout worker(s) {late} did not finish {what} within distributed.timeout_s={self.timeout_s:g} "
                    f"s ({self._where(late)}); the batch is lost. Raise distributed.timeout_s if a batch takes this "
                    "long, else read the worker's log (`ray logs`, or the logs of Ray's session directory)",
                    worker=late[0] if len(late) == 1 else None)
            for reference in ready:
                k = pending.pop(reference)
                try:
                    results[k] = self.ray.get(reference)
                except exceptions.RayActorError as error:
                    reason = str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__
                    raise RolloutWorkerError(
                        f"rollout worker {k} ({self._where([k])}) died during {what}: {reason}. Its episodes and "
                        "weights are gone; resume the run from its last checkpoint (`turnrl train resume=RUN_DIR`) "
                        "once `ray status` shows the resources of distributed.rollout_workers again",
                        worker=k) from None
                except exceptions.RayTaskError as error:
                    cause = error.cause if isinstance(error.cause, BaseException) else error
                    raise RolloutWorkerError(
                        f"rollout worker {k} ({self._where([k])}) failed in {what}: {type(cause).__name__}: {cause}",
                        worker=k) from None
        return results

    def _where(self, workers: list[int]) -> str:
        infos = [self.infos[k] for k in workers if self.infos[k]]
        return ", ".join(f"pid {i['pid']} on {i['host']}, {i['device']}" for i in infos) or "not started"

    def close(self) -> None:
        """Kill the workers (and with them the env workers they started)."""
        for worker in self.workers:
            try:
                self.ray.kill(worker, no_restart=True)
            except Exception:  # dead already
                pass
        self.workers = []

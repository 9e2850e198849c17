"""Disaggregated pools: the last ``distributed.rollout_processes`` of the processes ``torchrun`` started roll out,
the others train (docs/distributed.md, "Disaggregated pools").

    trainer ranks 0 .. n-k-1     the trainer (FSDP2 over their own default group; one: on its own), validation
    rollout ranks n-k .. n-1     each a RolloutHost (policy + envs of its own, on its GPU) serving trainer 0

Trainer 0 and the rollout processes form the pool's groups (made on torchrun's store, apart from the trainers'
default group): a gloo group for the messages (pickled objects, sent point to point) and, on GPUs, an NCCL group
for the weights (on CPUs the gloo group carries them too). Pool rank 0 is trainer 0; rollout process ``j`` (from
1) is pool rank ``j``. The protocol, each message from trainer 0 answered by every rollout process it went to:

    Start(spec)                  -> Ready(info)       build the policy and envs (weights: the first Weights)
    Play(slots, sampling, seed)  -> WorkerResult      its share of a step's groups (split_groups), in order
    Weights(version, tensors)    -> Taken(checksum)   each tensor then broadcast from trainer 0 (gathered from the
                                                      trainers' shards one at a time, in the rollout dtype), loaded
                                                      in place; the checksum of what the policy computes with
    Stop                         -> (exit)

A rollout process that fails answers :class:`Failed` (what it was doing, the error) and waits for ``Stop``; one
that dies or does not answer within ``distributed.timeout_s`` is named in the :class:`RolloutWorkerError` trainer 0
raises, as for a Ray worker. The other trainer ranks get each step's played batch (or that error) from trainer 0
(:func:`share_from_main`): the FSDP update sees the batch it sees without a pool.

Synchronous (:class:`PoolRollout`): after each step the trainer's weights are streamed to the pool
(``pool/publish_s``) and checked; the next step is played with them. Asynchronous (``distributed.async_rollout``):
:class:`~turnrl.training.backends.asynchronous.AsyncRollout` on trainer 0 with the pool as its runner and
:class:`PoolCopy` as where its copy lives: the weights are staged on trainer 0's device by every trainer's main
thread (the gather is a collective) and sent by the rollout thread between batches.
"""

from __future__ import annotations

import dataclasses
import io
import pickle
import signal
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Generic, NoReturn, cast

import peft
import torch
import torch.distributed as dist
from peft.tuners.lora import Linear as LoraLinear
from peft.tuners.lora import LoraLayer
from torch.distributed.tensor import DTensor

from turnrl.chat.template_deltas import ChatTemplateDeltas
from turnrl.config import ConfigError, SamplingConfig
from turnrl.engine.weights import WeightsChecksum, model_checksum
from turnrl.models.devices import resolve_dtype
from turnrl.registry import resolve_module_attr
from turnrl.rollout.ray_workers import (
    EnvSpec,
    RolloutHost,
    RolloutWorkerError,
    SlotSpec,
    WeightsTransferError,
    WorkerResult,
    WorkerRewardMetrics,
    WorkerSpec,
    model_files,
    split_groups,
)
from turnrl.rollout.runner import EpisodeSlot, RolloutTimings, TurnBoundary
from turnrl.rollout.trajectory import Trajectory, sum_by_name
from turnrl.training import ranks
from turnrl.training.backends.asynchronous import AsyncRollout, RolloutThreadError
from turnrl.training.backends.backend import (
    Played,
    PlayStep,
    RewardMetrics,
    RolloutBackend,
    RolloutParts,
    Rollouts,
    StepRollout,
    WeightsVersion,
)
from turnrl.training.backends.local import LocalRollout
from turnrl.training.backends.sharded import ShardedRollout
from turnrl.training.backends.weights_check import WeightsCheck, WeightsSyncError
from turnrl.training.train_config import TrainConfig

START_WAIT_S = 24 * 3600.0
"""How long a rollout process waits for its start, and for each next message: the trainer loads and shards the
models, may run an SFT stage, validates and saves checkpoints meanwhile (a trainer that dies closes the group's
connections, which ends the wait at once)."""


# --------------------------------------------------------------------------- the pool's groups and messages
@dataclass
class PoolGroups:
    """Trainer 0 and the rollout processes: their groups and this process's place in them."""

    messages: Any
    """The gloo process group of the messages."""
    weights: Any
    """The group the weights are broadcast on: NCCL between GPUs, else ``messages``."""
    rank: int
    """This process's rank in the pool (0: trainer 0)."""
    size: int
    device: torch.device
    """Where this process's weight tensors travel from or to."""
    timeout_s: float


def pool_groups(trainers: int, processes: int, device: torch.device, timeout_s: float) -> PoolGroups:
    """The pool's groups, made on the store of torchrun's rendezvous under prefixes of their own: the trainers'
    default group does not hold the rollout processes, and torch's group calls (``dist.send``...) only take
    subgroups of the default one, so the pool's are process-group objects used directly (their ``send``,
    ``recv`` and ``broadcast``).

    The rollout processes make them at once, trainer 0 once its models are loaded (and any SFT stage run): gloo's
    connection waits for the other side with the group's own timeout, so that is :data:`START_WAIT_S`; every
    message and broadcast then waits ``timeout_s`` at most (its own ``wait``)."""
    store = ranks.launch_store(timeout_s)
    launched = ranks.launched_rank()
    rank = 0 if launched == 0 else launched - trainers + 1
    size = processes + 1
    timeout = timedelta(seconds=timeout_s)
    messages = dist.ProcessGroupGloo(dist.PrefixStore("turnrl/pool/", store), rank, size,
                                     timedelta(seconds=START_WAIT_S))
    weights: Any = messages
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        weights = dist.ProcessGroupNCCL(dist.PrefixStore("turnrl/pool-weights/", store), rank, size, options)
    return PoolGroups(messages, weights, rank, size, device, timeout_s)


def send_object(groups: PoolGroups, value: Any, to: int) -> None:
    """``value`` pickled to pool rank ``to`` (its size, then its bytes)."""
    payload = torch.frombuffer(bytearray(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)
    timeout = timedelta(seconds=groups.timeout_s)
    groups.messages.send([torch.tensor([len(payload)], dtype=torch.long)], to, 0).wait(timeout)
    groups.messages.send([payload], to, 0).wait(timeout)


def recv_object(groups: PoolGroups, source: int, timeout_s: float) -> Any:
    """The next object pool rank ``source`` sends, waiting at most ``timeout_s`` (raises on a timeout, or at once
    when ``source`` has gone)."""
    timeout = timedelta(seconds=max(timeout_s, 1.0))
    size = torch.empty(1, dtype=torch.long)
    groups.messages.recv([size], source, 0).wait(timeout)
    payload = torch.empty(int(size), dtype=torch.uint8)
    groups.messages.recv([payload], source, 0).wait(timeout)
    return pickle.loads(payload.numpy().data)


@dataclass(frozen=True)
class Start:
    spec: WorkerSpec


@dataclass(frozen=True)
class Ready:
    info: dict[str, Any]


@dataclass(frozen=True)
class Play:
    slots: list[SlotSpec]
    sampling: SamplingConfig
    seed: int


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class Weights:
    version: int
    """The trainer's updates (what the turns played with them record)."""
    tensors: list[TensorSpec]
    """What is broadcast next, in order."""


@dataclass(frozen=True)
class Taken:
    checksum: WeightsChecksum | None


@dataclass(frozen=True)
class Stop:
    pass


@dataclass(frozen=True)
class Failed:
    doing: str
    error: str


# --------------------------------------------------------------------------- a rollout process
def serve_rollouts(config: TrainConfig, device: torch.device) -> None:
    """The body of a rollout process (a rank of the last ``distributed.rollout_processes``): build the host trainer
    0 describes and answer its messages until it says stop. Never builds an optimizer or a trainer.

    Ctrl-C and SIGTERM are ignored here: torchrun forwards them to every process it started, and the trainers
    decide when the run stops (after the step in progress, with its checkpoint); trainer 0 then sends ``Stop``, or
    this process ends when trainer 0 has gone."""
    for number in (signal.SIGINT, signal.SIGTERM):
        signal.signal(number, signal.SIG_IGN)
    dist_config = config.distributed
    trainers = ranks.launched_world() - dist_config.rollout_processes
    groups = pool_groups(trainers, dist_config.rollout_processes, device, dist_config.timeout_s)
    host_class = resolve_module_attr(dist_config.rollout_host, "distributed.rollout_host")
    host: RolloutHost | None = None
    try:
        start = recv_object(groups, 0, START_WAIT_S)
        if isinstance(start, Stop):
            return
        try:
            host = host_class(start.spec)
            answer: Any = Ready(host.info())
        except Exception as error:  # noqa: BLE001 - trainer 0 names this process and raises
            answer = Failed("start", failure_text(error))
        send_object(groups, answer, 0)
        while True:
            message = recv_object(groups, 0, START_WAIT_S)
            if isinstance(message, Stop):
                return
            send_object(groups, answer_to(groups, host, message), 0)
    except RuntimeError as error:  # gloo's, from a send or receive: trainer 0 has gone
        return trainer_gone(error)


def answer_to(groups: PoolGroups, host: RolloutHost | None, message: Any) -> Any:
    """This rollout process's answer to ``message`` (``Failed`` where its host raised, or is missing: it failed to
    start). A transfer of weights is received whole whatever happens: trainer 0 broadcasts every tensor of it."""
    match message:
        case Play(slots, sampling, seed):
            try:
                if host is None:
                    raise RuntimeError("this rollout process failed to start")
                return host.run(slots, sampling, seed)
            except Exception as error:  # noqa: BLE001 - trainer 0 names this process and raises
                return Failed("play", failure_text(error))
        case Weights():
            incoming = Broadcasts(groups, message)
            try:
                if host is None:
                    raise RuntimeError("this rollout process failed to start")
                answer: Any = Taken(host.load_weights(message.version, incoming))
            except Exception as error:  # noqa: BLE001 - trainer 0 names this process and raises
                answer = Failed("take weights", failure_text(error))
            incoming.drain()
            return answer
        case _:
            return Failed("a message", f"unknown message {type(message).__name__} (trainer 0 and this rollout "
                                       "process run different versions of turnrl?)")


def trainer_gone(error: RuntimeError) -> None:
    """Trainer 0 has gone (its own error says why): this rollout process stops, saying so in one line."""
    print(f"rollout process (rank {ranks.launched_rank()}): trainer 0 has gone ({str(error).splitlines()[0][:200]}); "
          "stopping", flush=True)


class Broadcasts:
    """The tensors of a ``Weights`` message as trainer 0 broadcasts them, received one at a time as they are
    iterated; :meth:`drain` receives (and drops) those a failed or partial load left, so that trainer 0's
    broadcasts all complete and the next message is the next one on the channel."""

    def __init__(self, groups: PoolGroups, message: Weights) -> None:
        self.groups = groups
        self.pending = list(message.tensors)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        while self.pending:
            yield self.pending[0].name, self._next()

    def drain(self) -> None:
        while self.pending:
            self._next()

    def _next(self) -> torch.Tensor:
        spec = self.pending.pop(0)
        tensor = torch.empty(spec.shape, dtype=spec.dtype, device=self.groups.device)
        broadcast(self.groups, tensor)
        return tensor


def broadcast(groups: PoolGroups, tensor: torch.Tensor) -> None:
    """``tensor`` from pool rank 0 (trainer 0) to every rollout process, on the weights' group."""
    options = dist.BroadcastOptions()
    options.rootRank = 0
    options.timeout = timedelta(seconds=groups.timeout_s)
    groups.weights.broadcast([tensor], options).wait(timedelta(seconds=groups.timeout_s))


def failure_text(error: BaseException) -> str:
    """An error with the last frames of its traceback (the rollout process's log holds all of it)."""
    frames = traceback.format_exception(type(error), error, error.__traceback__)
    return f"{type(error).__name__}: {error}\n" + "".join(frames[-3:])


# --------------------------------------------------------------------------- trainer 0's side
class ProcessPool:
    """The rollout processes as trainer 0 sees them: the interface the trainer uses of
    :class:`~turnrl.rollout.runner.Rollout` (``run``, ``timings``, ``rewards``), and the weights' transfer.

    Args:
        groups: the pool's groups (this process: trainer 0).
        spec: what each rollout process builds.
        tokenizer: trainer 0's tokenizer (the trajectories' token contexts use it).
        response_prefix: the agent format's (the trajectories' token contexts end their prompts with it).
        trainers: the trainer ranks (rollout process ``j`` is launched rank ``trainers - 1 + j``).
    """

    turn_boundary: TurnBoundary | None = None
    """Not called: the turns happen in the rollout processes."""

    def __init__(self, groups: PoolGroups, spec: WorkerSpec, tokenizer: Any, response_prefix: str,
                 trainers: int) -> None:
        self.groups = groups
        self.trainers = trainers
        self.processes = list(range(1, groups.size))
        self.deltas = ChatTemplateDeltas.for_tokenizer(tokenizer, response_prefix=response_prefix)
        self.infos: dict[int, dict[str, Any]] = {}
        self.closed = False
        self._exchange = threading.Lock()
        """Held for each whole exchange (a message to the processes and all their answers; the broadcasts of a
        transfer): the rollout thread exchanges while the main thread may close, and the channel carries one
        message at a time."""
        with self._exchange:
            for j in self.processes:
                send_object(groups, Start(spec), j)
            self.infos = {j: ready.info for j, ready in self._gather(self.processes, "start").items()}
        self.timings = RolloutTimings()
        self.rewards = WorkerRewardMetrics()
        self.checksums: dict[int, WeightsChecksum | None] = {}
        """Each rollout process's checksum after the last weights it took."""
        self.last_sync_s = 0.0

    # ------------------------------------------------------------------ the rollout
    def run(self, slots: Sequence[EpisodeSlot], sampling: SamplingConfig) -> list[Trajectory]:
        """Every slot's episode played by the rollout processes (whole groups each, :func:`split_groups`); the
        trajectories in the slots' order. Sampling is seeded from torch's generator here (the trainer seeds it per
        step), one seed per process, as Ray workers are.

        Raises:
            RolloutWorkerError: a rollout process failed, died or did not answer within ``distributed.timeout_s``.
        """
        parts = split_groups(slots, len(self.processes))
        base_seed = int(torch.randint(0, 2**31 - len(self.processes), (1,)))
        playing = [j for j, part in zip(self.processes, parts) if part]
        with self._exchange:
            self._check_open()
            for j, part in zip(self.processes, parts):
                if part:
                    send_object(self.groups, Play([SlotSpec(slots[i].seed, slots[i].group, slots[i].sample,
                                                            slots[i].options) for i in part],
                                                  sampling, base_seed + j - 1), j)
            results: dict[int, WorkerResult] = self._gather(playing, "play")
        trajectories: list[Trajectory | None] = [None] * len(slots)
        for j, part in zip(self.processes, parts):
            for index, trajectory in zip(part, results[j].trajectories if part else []):
                if trajectory.tokens is not None:
                    trajectory.tokens.deltas = self.deltas
                trajectories[index] = trajectory
        done = [results[j] for j in playing]
        # The processes play at once: the batch waited for the slowest of each.
        self.timings = RolloutTimings(generate_s=max((r.timings.generate_s for r in done), default=0.0),
                                      env_s=max((r.timings.env_s for r in done), default=0.0),
                                      policy_work=sum_by_name([r.timings.policy_work for r in done]))
        self.rewards = WorkerRewardMetrics([r.reward_metrics for r in done])
        missing = [i for i, t in enumerate(trajectories) if t is None]
        if missing:
            raise RolloutWorkerError(f"the rollout processes returned no trajectory for slots {missing[:5]}")
        return [t for t in trajectories if t is not None]

    # ------------------------------------------------------------------ weights
    def send_weights(self, version: int, tensors: Sequence[TensorSpec], values: Iterator[torch.Tensor]) -> None:
        """Broadcast ``values`` (one tensor per spec, made as they are sent) to every rollout process as weights
        ``version``, and note each one's checksum of what its policy computes with then."""
        start = time.perf_counter()
        with self._exchange:
            self._check_open()
            for j in self.processes:
                send_object(self.groups, Weights(version, list(tensors)), j)
            for spec, value in zip(tensors, values):
                tensor = value.to(device=self.groups.device, dtype=spec.dtype)
                try:
                    broadcast(self.groups, tensor)
                except RuntimeError as error:  # gloo's or NCCL's: a process died, or stopped receiving
                    names = ", ".join(self._name(j) for j in self.processes)
                    raise RolloutWorkerError(
                        f"the broadcast of weights {version} ({spec.name}) to rollout process"
                        f"{'es' if len(self.processes) > 1 else ''} {names} failed ({first_line(error)}): one died "
                        "or did not receive within distributed.timeout_s; its log says which. Resume the run from "
                        "its last checkpoint (`turnrl train resume=RUN_DIR`)") from None
            taken: dict[int, Taken] = self._gather(self.processes, "take weights")
        self.checksums = {j: answer.checksum for j, answer in taken.items()}
        self.last_sync_s = time.perf_counter() - start

    # ------------------------------------------------------------------ answers
    def _gather(self, processes: list[int], doing: str) -> dict[int, Any]:
        """Each process's answer, waiting at most ``distributed.timeout_s`` in all.

        Raises:
            RolloutWorkerError: naming the process that failed, died or did not answer, and what it was doing.
        """
        deadline = time.monotonic() + self.groups.timeout_s
        answers: dict[int, Any] = {}
        for j in processes:
            try:
                answer = recv_object(self.groups, j, deadline - time.monotonic())
            except Exception as error:  # noqa: BLE001 - gloo raises RuntimeError subclasses of its own
                raise RolloutWorkerError(
                    f"rollout process {self._name(j)} did not answer during {doing} within "
                    f"distributed.timeout_s={self.groups.timeout_s:g} s, or died ({first_line(error)}); the batch is "
                    "lost. Resume the run from its last checkpoint (`turnrl train resume=RUN_DIR`)", worker=j) from None
            if isinstance(answer, Failed):
                raise RolloutWorkerError(f"rollout process {self._name(j)} failed during {answer.doing}: "
                                         f"{answer.error.strip()}", worker=j)
            answers[j] = answer
        return answers

    def _name(self, j: int) -> str:
        info = self.infos.get(j, {})
        where = f", pid {info['pid']} on {info['host']}, {info['device']}" if info else ""
        return f"{j} (rank {self.trainers - 1 + j}{where})"

    @property
    def dtype(self) -> torch.dtype:
        """The rollout processes' compute dtype (the weights travel in it)."""
        return getattr(torch, next(iter(self.infos.values()))["dtype"])

    def _check_open(self) -> None:
        if self.closed:
            raise RolloutWorkerError("the rollout processes were told to stop: no exchange with them after close()")

    def close(self) -> None:
        """Tell every rollout process to stop (safe to call twice). Not while the rollout thread is still in an
        exchange (one it did not finish within its ``close``): a ``Stop`` then would land amid its messages, so
        none is sent, and the rollout processes end when this process has gone (their receive fails)."""
        if not self._exchange.acquire(blocking=False):
            self.closed = True
            return
        try:
            if self.closed:
                return
            self.closed = True
            for j in self.processes:
                try:
                    send_object(self.groups, Stop(), j)
                except RuntimeError:  # gloo's: gone already
                    pass
        finally:
            self._exchange.release()


def first_line(error: BaseException) -> str:
    """An error's first line, or its type's name where it says nothing."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


# --------------------------------------------------------------------------- the trainer's weights, as sent
def sent_weights(model: torch.nn.Module, every: bool) -> list[tuple[str, Callable[[], torch.Tensor]]]:
    """The weights the rollout processes' plain model takes from ``model``, by its parameter names, each made
    whole when its function is called (a collective of the trainer ranks for a sharded one): with ``every`` all of
    them (the first transfer: the rollout processes start from the architecture's initial weights), else the
    trainable ones. A peft model's LoRA layers send their weights merged with the adapters (``W + B A * scaling``),
    every time: the adapters change them; its frozen base weights only with ``every``.

    Raises:
        ConfigError: a LoRA setup this merge does not handle (see :func:`unmergeable_lora`).
    """
    if not isinstance(model, peft.PeftModel):
        return [(name, whole_of(parameter)) for name, parameter in model.named_parameters()
                if every or parameter.requires_grad]
    problem = unmergeable_lora(model)
    if problem is not None:
        raise ConfigError(f"distributed.rollout_processes send LoRA weights merged into plain linear layers; "
                          f"{problem}: train without rollout processes, or adapt linear layers alone")
    base = model.get_base_model()
    out: list[tuple[str, Callable[[], torch.Tensor]]] = []
    lora_prefixes: list[str] = []
    for name, module in base.named_modules():
        if not isinstance(module, LoraLinear):  # the only LoRA layers unmergeable_lora lets through
            continue
        lora_prefixes.append(f"{name}.")
        out.append((f"{name}.weight", merged_weight(module)))
        bias = base_linear(module).bias
        if every and bias is not None:
            out.append((f"{name}.bias", whole_of(bias)))
    for name, parameter in base.named_parameters():
        if ".lora_" in name or any(name.startswith(prefix) for prefix in lora_prefixes):
            continue
        if every or parameter.requires_grad:
            out.append((name.replace(".base_layer.", "."), whole_of(parameter)))
    return out


def unmergeable_lora(model: peft.PeftModel) -> str | None:
    """What of ``model``'s LoRA setup :func:`merged_weight` does not merge (None: all of it is plain LoRA on linear
    layers): DoRA and other variants, a bias on the adapters, adapters on embeddings or convolutions, and
    ``modules_to_save`` (trainable copies the plain model has no names for)."""
    for adapter, settings in model.peft_config.items():
        if isinstance(settings, peft.LoraConfig) and settings.modules_to_save:
            return f"adapter {adapter!r} has modules_to_save={settings.modules_to_save}"
    for name, module in model.get_base_model().named_modules():
        if not isinstance(module, LoraLayer):
            continue
        if not isinstance(module, LoraLinear):
            return f"{name} is a LoRA {type(module).__name__} layer, not a linear one"
        if module.lora_variant or any(module.use_dora.values()):
            return f"{name} uses a LoRA variant (DoRA)"
        if any(module.lora_bias.values()):
            return f"{name} has a bias on its adapters (lora_bias)"
    return None


def whole_of(parameter: torch.Tensor) -> Callable[[], torch.Tensor]:
    return lambda: whole(parameter)


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """A sharded (FSDP2 ``DTensor``) tensor gathered whole (a collective of the trainer ranks); any other as it is."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor.detach()


def base_linear(layer: LoraLinear) -> torch.nn.Linear:
    """The linear layer a LoRA one adapts."""
    return cast(torch.nn.Linear, layer.get_base_layer())


def merged_weight(layer: LoraLinear) -> Callable[[], torch.Tensor]:
    """A LoRA linear layer's weight with its active adapters merged, out of place (the base never changes); as it
    is where peft merged them into it already (``layer.merged``). Written here, where the engine's merge
    (:mod:`turnrl.engine.weights`) calls peft's ``get_delta_weight``, because that multiplies the layer's shards,
    not the FSDP2-gathered whole matrices."""

    def merged() -> torch.Tensor:
        weight = whole(base_linear(layer).weight)
        if layer.merged or layer.disable_adapters:
            return weight
        for adapter in layer.active_adapters:
            if adapter not in layer.lora_A:
                continue
            up, down = cast(torch.nn.Linear, layer.lora_B[adapter]), cast(torch.nn.Linear, layer.lora_A[adapter])
            delta = whole(up.weight) @ whole(down.weight)
            if layer.fan_in_fan_out:
                delta = delta.T
            weight = weight + (delta * layer.scaling[adapter]).to(weight.dtype)
        return weight

    return merged


class PoolCopy:
    """A :class:`~turnrl.training.backends.asynchronous.RolloutCopy` in the rollout processes; every trainer rank
    holds one (the gathers are collectives of theirs), trainer 0's with the pool (``pool``; None elsewhere).

    Args:
        pool: the rollout processes (trainer 0), else None.
        dtype: the rollout dtype: the weights are staged and sent in it.
        device: trainer 0's device, where the staging copy lives.
    """

    def __init__(self, pool: ProcessPool | None, dtype: torch.dtype, device: torch.device) -> None:
        self.pool = pool
        self.dtype = dtype
        self.device = device
        self._staged: list[tuple[TensorSpec, torch.Tensor]] = []

    def send(self, source: torch.nn.Module, version: WeightsVersion, every: bool = False) -> None:
        """Stream ``source``'s weights to the rollout processes now, one tensor at a time (each gathered, cast to the
        rollout dtype, broadcast); the trainable ones, or with ``every`` all."""
        weights = sent_weights(source, every)
        if self.pool is None:
            for _, make in weights:
                make()  # this rank's part of the gather
            return
        shapes = sent_shapes(source)
        specs = [TensorSpec(name, tuple(shapes[name]), self.dtype) for name, _ in weights]
        self.pool.send_weights(version.updates, specs, (make() for _, make in weights))

    def start(self, source: torch.nn.Module, version: WeightsVersion) -> None:
        self.send(source, version, every=True)

    @torch.no_grad()
    def stage(self, source: torch.nn.Module, version: WeightsVersion) -> None:
        staged = []
        for name, make in sent_weights(source, every=False):
            value = make()
            if self.pool is not None:
                staged.append((TensorSpec(name, tuple(value.shape), self.dtype),
                               value.to(device=self.device, dtype=self.dtype, copy=True)))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the rollout thread broadcasts them from another stream
        self._staged = staged

    def apply(self, version: WeightsVersion) -> None:
        assert self.pool is not None, "trainer 0 alone runs the rollout thread"
        self.pool.send_weights(version.updates, [spec for spec, _ in self._staged],
                               (tensor for _, tensor in self._staged))


def sent_shapes(model: torch.nn.Module) -> dict[str, torch.Size]:
    """The whole shape of each weight :func:`sent_weights` sends, by its name, without gathering any (a DTensor knows
    its global shape)."""
    shapes = {name: parameter.shape for name, parameter in model.named_parameters()}
    if not isinstance(model, peft.PeftModel):
        return shapes
    base = model.get_base_model()
    for module_name, module in base.named_modules():
        if isinstance(module, LoraLinear):
            layer = base_linear(module)
            shapes[f"{module_name}.weight"] = layer.weight.shape
            if layer.bias is not None:
                shapes[f"{module_name}.bias"] = layer.bias.shape
    for name, parameter in base.named_parameters():
        shapes.setdefault(name.replace(".base_layer.", "."), parameter.shape)
    return shapes


class PoolWeights:
    """The check of the rollout processes' weights (the :class:`~turnrl.training.backends.asynchronous.CopyCheck`
    of a pool): :meth:`expect` computes the trainer's checksum on every trainer rank (a collective for shards);
    :meth:`take`, on trainer 0, checks each rollout process's checksum of the weights it took against it
    (:class:`WeightsCheck`: a skipped sync stops the run with ``WeightsSyncError``)."""

    def __init__(self, pool: ProcessPool | None, dtype: torch.dtype) -> None:
        self.pool = pool
        self.dtype = dtype
        self.checks: dict[int, WeightsCheck] = {}
        self._expected: dict[int, tuple[WeightsVersion, WeightsChecksum]] = {}
        self._seconds = 0.0
        self._lock = threading.Lock()

    def expect(self, model: torch.nn.Module, version: WeightsVersion) -> None:
        start = time.perf_counter()
        trainer = model_checksum(model, self.dtype)
        with self._lock:
            if self.pool is not None:
                self._expected[version.steps] = (version, trainer)
            self._seconds += time.perf_counter() - start

    def take(self, steps: int | None = None) -> None:
        if self.pool is None:
            return
        with self._lock:
            newer = [s for s in self._expected if steps is None or s <= steps]
            if not newer:
                return
            version, trainer = self._expected[steps if steps in self._expected else max(newer)]
            for s in newer:
                del self._expected[s]
        start = time.perf_counter()
        for j, rollout in self.pool.checksums.items():
            if rollout is not None:
                check = self.checks.setdefault(j, WeightsCheck(f"pool (rollout process {self.pool._name(j)})"))
                check.verify(version, trainer, rollout)
        with self._lock:
            self._seconds += time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        with self._lock:
            seconds, self._seconds = self._seconds, 0.0
        return {"timing/weights_check_s": seconds} if seconds else {}


# --------------------------------------------------------------------------- the backends
class PoolRollout:
    """The synchronous :class:`~turnrl.training.backends.backend.RolloutBackend` on rollout processes (on every
    trainer rank; trainer 0's drives the pool). :meth:`set_weights` streams the trainer's weights to the pool when
    the actor's updates moved (``pool/publish_s``) and checks what each process computes with."""

    runs_ahead = False

    def __init__(self, pool: ProcessPool | None, copy: PoolCopy, checked: PoolWeights,
                 precision: Callable[[], AbstractContextManager]) -> None:
        self.pool = pool
        self.copy = copy
        self.checked = checked
        self.precision = precision
        self.updates: int | None = None

    @property
    def timings(self) -> RolloutTimings:
        assert self.pool is not None, "trainer 0 plays"
        return self.pool.timings

    @property
    def rewards(self) -> RewardMetrics:
        assert self.pool is not None, "trainer 0 plays"
        return self.pool.rewards

    def run(self, slots: Sequence[EpisodeSlot], sampling: SamplingConfig) -> list[Trajectory]:
        assert self.pool is not None, "trainer 0 plays"
        return self.pool.run(slots, sampling)

    def roll_out(self, step: int, play: PlayStep[Played]) -> StepRollout[Played]:
        return StepRollout(play(self, step, self.precision()))

    def set_weights(self, model: torch.nn.Module, version: WeightsVersion) -> dict[str, float]:
        self.checked.expect(model, version)
        start = time.perf_counter()
        if self.updates is None or version.updates != self.updates:
            self.copy.send(model, version, every=self.updates is None)
        publish_s = time.perf_counter() - start
        first = self.updates is None
        self.updates = version.updates
        self.checked.take(version.steps)
        return {} if first else {"pool/publish_s": publish_s, **self.checked.metrics()}

    def exclusive(self) -> AbstractContextManager[Any]:
        return nullcontext()

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()


class PoolFollower:
    """The asynchronous pool's backend on a trainer rank other than 0: no rollout thread; it takes part in the
    weights' collectives in the order trainer 0's :class:`AsyncRollout` runs them (the checksum, then the first
    transfer or the staging)."""

    runs_ahead = True

    def __init__(self, copy: PoolCopy, checked: PoolWeights) -> None:
        self.copy = copy
        self.checked = checked
        self.updates: int | None = None

    timings = RolloutTimings()
    rewards: RewardMetrics = WorkerRewardMetrics()

    def run(self, slots: Sequence[EpisodeSlot], sampling: SamplingConfig) -> list[Trajectory]:
        raise RuntimeError("trainer 0 plays the rollout processes' episodes")

    def roll_out(self, step: int, play: PlayStep[Played]) -> StepRollout[Played]:
        raise RuntimeError("trainer 0 plays the rollout processes' episodes")

    def set_weights(self, model: torch.nn.Module, version: WeightsVersion) -> dict[str, float]:
        self.checked.expect(model, version)
        if self.updates is None:
            self.copy.start(model, version)
        elif version.updates != self.updates:
            self.copy.stage(model, version)
        self.updates = version.updates
        return {}

    def exclusive(self) -> AbstractContextManager[Any]:
        return nullcontext()

    def close(self) -> None:
        pass


@dataclass(frozen=True)
class SharedError:
    """An exception of trainer 0, as the other trainer ranks get it (:func:`share_from_main`): its type's name and
    message, which pickle whatever the exception holds."""

    kind: str
    message: str
    worker: int | None = None

    @classmethod
    def of(cls, error: Exception) -> SharedError:
        """``error`` to share; an error of the rollout thread caused by a lost rollout process as that (the stop
        path saves the last finished step for it, as in the synchronous pool)."""
        if isinstance(error, RolloutThreadError) and isinstance(error.__cause__, RolloutWorkerError):
            error = error.__cause__
        worker = error.worker if isinstance(error, RolloutWorkerError) else None
        return cls(type(error).__name__, str(error), worker)

    def error(self) -> Exception:
        """The exception every trainer rank raises: of the type trainer 0 raised where it is one the run's stop path
        tells apart, else a ``RuntimeError`` naming it."""
        if self.kind in (RolloutWorkerError.__name__, WeightsTransferError.__name__):
            return RolloutWorkerError(self.message, worker=self.worker)
        if self.kind == WeightsSyncError.__name__:
            return WeightsSyncError(self.message)
        return RuntimeError(f"trainer 0 stopped on {self.kind}: {self.message}")


@dataclass
class Shared(Generic[Played]):
    """What trainer 0 hands the other trainer ranks for a step: its rollout, or the error that stopped it."""

    rollout: StepRollout[Played] | None
    error: SharedError | None = None


class TrainerGroup:
    """A rollout backend as every trainer rank sees it: trainer 0's ``inner`` plays each step, and the other trainer
    ranks get the step's rollout from it (:func:`share_from_main`), or the error that stopped it, which every
    rank then raises (they stop together, at the same point). :meth:`set_weights` runs ``inner``'s on every rank
    (its gathers are collectives) and shares trainer 0's failure to send or check the weights the same way."""

    def __init__(self, inner: RolloutBackend, deltas: Callable[[], ChatTemplateDeltas],
                 pool: ProcessPool | None) -> None:
        self.inner = inner
        self.deltas = deltas
        self.pool = pool
        self.runs_ahead = inner.runs_ahead

    @property
    def timings(self) -> RolloutTimings:
        return self.inner.timings

    @property
    def rewards(self) -> RewardMetrics:
        return self.inner.rewards

    def run(self, slots: Sequence[EpisodeSlot], sampling: SamplingConfig) -> list[Trajectory]:
        return self.inner.run(slots, sampling)

    def roll_out(self, step: int, play: PlayStep[Played]) -> StepRollout[Played]:
        """The step's rollout on every trainer rank.

        Raises:
            RolloutWorkerError: a rollout process was lost (on every rank; in the rollout thread too).
            RuntimeError: any other failure of trainer 0's rollout (there, the exception itself).
        """
        shared: Shared[Played] | None = None
        failure: Exception | None = None
        if ranks.is_main():
            try:
                shared = Shared(self.inner.roll_out(step, play))
            except Exception as error:  # noqa: BLE001 - every rank raises it, after the broadcast
                failure, shared = error, Shared(None, SharedError.of(error))
        shared = share_from_main(shared, self.deltas)
        assert shared is not None
        if shared.error is not None:
            raise_shared(shared.error, failure)
        assert shared.rollout is not None
        return shared.rollout

    def set_weights(self, model: torch.nn.Module, version: WeightsVersion) -> dict[str, float]:
        """``inner``'s on every rank; a failure of trainer 0's (a rollout process that failed to take the weights, or
        took other ones) raised on every rank, a lost rollout process as :class:`WeightsTransferError`: the update
        is done, and no checkpoint records it."""
        metrics: dict[str, float] = {}
        error: SharedError | None = None
        failure: Exception | None = None
        try:
            metrics = self.inner.set_weights(model, version)
        except (RolloutWorkerError, WeightsSyncError) as raised:
            if not ranks.is_main():
                raise  # not from the pool: trainer 0 alone talks to it
            failure, error = raised, SharedError.of(raised)
        error = share_from_main(error, self.deltas)
        if error is None:
            return metrics
        if error.kind == RolloutWorkerError.__name__:
            error = dataclasses.replace(error, kind=WeightsTransferError.__name__)
        raise_shared(error, failure)

    def exclusive(self) -> AbstractContextManager[Any]:
        return self.inner.exclusive()

    def close(self) -> None:
        self.inner.close()  # the rollout thread first: it may be talking to the pool
        if self.pool is not None:
            self.pool.close()


def raise_shared(error: SharedError, raised: Exception | None) -> NoReturn:
    """Raise trainer 0's ``error`` on this rank; on trainer 0 from ``raised``, the exception itself (its traceback
    is the one to read)."""
    if error.kind == WeightsTransferError.__name__:
        raise WeightsTransferError(error.message, worker=error.worker) from raised
    rebuilt = error.error()
    if raised is not None and (type(rebuilt) is RuntimeError or rebuilt.__class__ is raised.__class__):
        raise raised
    raise rebuilt from raised


OBJECT_CHUNK_BYTES = 64 * 2**20


def share_from_main(value: Any, deltas: Callable[[], ChatTemplateDeltas]) -> Any:
    """Trainer 0's ``value`` on every trainer rank (a broadcast over their group). The chat template objects the
    trajectories' token contexts refer to (they hold the tokenizer) do not travel: each rank attaches its own.
    Written here because torch's ``broadcast_object_list`` puts the whole pickle on the GPU at once (see
    :func:`ranks.all_gather_objects`)."""
    if ranks.world_size() == 1:
        return value
    device = ranks.process_device() or torch.device("cpu")
    payload = torch.empty(0, dtype=torch.uint8)
    if ranks.is_main():
        buffer = io.BytesIO()
        _DeltasPickler(buffer).dump(value)
        payload = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
    size = torch.tensor([len(payload)], dtype=torch.long, device=device)
    dist.broadcast(size, 0)
    total = int(size)
    received = payload if ranks.is_main() else torch.empty(total, dtype=torch.uint8)
    width = min(OBJECT_CHUNK_BYTES, max(total, 1))
    chunk = torch.zeros(width, dtype=torch.uint8, device=device)
    for start in range(0, total, width):
        count = min(width, total - start)
        if ranks.is_main():
            chunk[:count].copy_(payload[start:start + count])
        dist.broadcast(chunk, 0)
        if not ranks.is_main():
            received[start:start + count].copy_(chunk[:count])
    if ranks.is_main():
        return value
    return _DeltasUnpickler(io.BytesIO(received.numpy().tobytes()), deltas()).load()


class _DeltasPickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Any:
        return "deltas" if isinstance(obj, ChatTemplateDeltas) else None


class _DeltasUnpickler(pickle.Unpickler):
    def __init__(self, file: Any, deltas: ChatTemplateDeltas) -> None:
        super().__init__(file)
        self.deltas = deltas

    def persistent_load(self, pid: Any) -> Any:
        return self.deltas


# --------------------------------------------------------------------------- the run's parts
def pool_rollouts(parts: RolloutParts) -> Rollouts:
    """``distributed.rollout_processes``: the steps' backend on the rollout processes (synchronous, or ahead in a
    thread of trainer 0 with ``async_rollout``) and validation on the trainer ranks (as without a pool)."""
    config = parts.config
    dist_config = config.distributed
    trainers = ranks.launched_world() - dist_config.rollout_processes
    main = ranks.is_main()
    dtype = resolve_dtype(config.model.dtype, parts.device)  # the rollout processes' devices are of the same kind
    pool: ProcessPool | None = None
    if main:
        groups = pool_groups(trainers, dist_config.rollout_processes, parts.device, dist_config.timeout_s)
        batch_size = max(64, config.groups.n_groups * config.groups.group_size)
        spec = WorkerSpec(
            model_files(parts.start_path),
            dataclasses.replace(config.model, device="cuda" if parts.device.type == "cuda" else "cpu"),
            config.agent,
            EnvSpec(config.env.id, dict(config.env.settings), tuple(config.env.remote),
                    timeout_s=dist_config.timeout_s),
            rewards=config.rewards, max_batch_size=batch_size, env_threads=config.groups.env_workers,
            torch_threads=config.run.threads)
        pool = ProcessPool(groups, spec, parts.tokenizer, parts.train.fmt.response_prefix, trainers)
        dtype = pool.dtype
    deltas = lambda: ChatTemplateDeltas.for_tokenizer(  # noqa: E731
        parts.tokenizer, response_prefix=parts.train.fmt.response_prefix)
    # Every trainer rank gathers and checks the weights in the rollout processes' dtype (the checksum is a
    # collective of theirs), which trainer 0 learns from them.
    dtype = share_from_main(dtype, deltas)
    copy = PoolCopy(pool, dtype, parts.device)
    checked = PoolWeights(pool, dtype)
    inner: RolloutBackend
    if not dist_config.async_rollout:
        inner = PoolRollout(pool, copy, checked, parts.precision)
    elif pool is None:
        inner = PoolFollower(copy, checked)
    else:
        inner = AsyncRollout(pool, None, parts.device, parts.dtype, dist_config.max_staleness, config.run.steps,
                             where=copy, checked=checked)
    validation: RolloutBackend = LocalRollout(parts.validation, parts.precision) if trainers == 1 else \
        ShardedRollout(parts.validation, parts.tokenizer, parts.precision)
    return Rollouts(TrainerGroup(inner, deltas, pool), validation)


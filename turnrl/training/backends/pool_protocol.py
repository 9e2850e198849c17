"""The rollout-process pool's protocol: its process groups, its messages, a rollout process's loop
(:func:`serve_rollouts`) and trainer 0's end of it (:class:`ProcessPool`). How the pool fits a run:
:mod:`turnrl.training.backends.pool`.

Trainer 0 and the rollout processes form the pool's groups (made on torchrun's store, apart from the trainers'
default group): a gloo group for the messages (pickled objects, sent point to point) and, on GPUs, an NCCL group
for the weights (on CPUs the gloo group carries them too). Pool rank 0 is trainer 0; rollout process ``j`` (from
1) is pool rank ``j``. Each message from trainer 0 is answered by every rollout process it went to:

    Start(spec)                  -> Ready(info)       build the policy and envs (weights: the first Weights)
    Play(slots, sampling, seed)  -> WorkerResult      its share of a step's groups (split_groups), in order
    Weights(version, tensors)    -> Taken(checksum)   each tensor then broadcast from trainer 0 (gathered from the
                                                      trainers' shards one at a time, in the rollout dtype), loaded
                                                      in place; the checksum of what the policy computes with
    Stop                         -> (exit)

A ``Play`` with ``boundaries`` (the asynchronous backend's batches) is played in rounds that the rollout process
reports as it reaches them, each before its generation: it sends ``Boundary(turns)`` and takes what trainer 0
answers until ``Continue``, which may first be the weights published since it last took some (partial rollouts):

    Boundary(turns)             <-  rollout process j, none of its sequences generating
    Weights(version, direct)    ->  Taken(checksum)  the tensors sent to process j alone, point to point (the other
                                                     processes are generating: no broadcast)
    Continue                    ->  (its round's generation)

Trainer 0 takes the answers of a ``Play`` in the order they come (each process's rounds are its own), so that
one process's boundary never waits for another's round: a thread of its own receives each process's messages
(gloo's receive from any rank would not see a process die until it timed out; a receive from one rank fails as
soon as that rank has gone).

A rollout process that fails answers :class:`Failed` (what it was doing, the error) and waits for ``Stop``; one
that dies or does not answer within ``distributed.timeout_s`` is named in the :class:`RolloutWorkerError` trainer 0
raises, as for a Ray worker.
"""

from __future__ import annotations

import queue
import signal
import threading
import time
import traceback
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from turnrl.chat.template_deltas import ChatTemplateDeltas
from turnrl.config import SamplingConfig
from turnrl.engine.weights import WeightsChecksum
from turnrl.registry import resolve_module_attr
from turnrl.rollout.ray_workers import (
    RolloutHost,
    RolloutWorkerError,
    SlotSpec,
    WorkerResult,
    WorkerRewardMetrics,
    WorkerSpec,
    split_groups,
)
from turnrl.rollout.runner import EpisodeSlot, RolloutTimings, TurnBoundary
from turnrl.rollout.trajectory import Trajectory, sum_by_name
from turnrl.training import heap, ranks, wire
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
    """``value`` pickled to pool rank ``to`` (its size, then its bytes; :mod:`turnrl.training.wire`)."""
    payload = wire.dumps(value)
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
    return wire.loads(payload)


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
    boundaries: bool = False
    """Report each round's turn boundary (``Boundary``) and wait for trainer 0's ``Continue``."""


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
    direct: bool = False
    """The tensors are sent to this rollout process alone (point to point), not broadcast to all."""


@dataclass(frozen=True)
class Taken:
    checksum: WeightsChecksum | None


@dataclass(frozen=True)
class Boundary:
    turns: int
    """The turns of the round about to be generated."""


@dataclass(frozen=True)
class Continue:
    pass


@dataclass(frozen=True)
class Stop:
    pass


class PoolStopped(Exception):
    """Trainer 0 said ``Stop`` while this rollout process waited at a turn boundary: its batch is dropped."""


@dataclass(frozen=True)
class Failed:
    doing: str
    error: str


# --------------------------------------------------------------------------- a rollout process
def leave_stops_to_the_trainers() -> None:
    """Ctrl-C and SIGTERM are ignored by a rollout process: torchrun forwards them to every process it started, and
    the trainers decide when the run stops (after the step in progress, with its checkpoint). Ignored, they stay
    so in the processes it starts, inductor's compile workers among them, which a job-wide SIGTERM would otherwise
    kill while the rollout still needs them."""
    for number in (signal.SIGINT, signal.SIGTERM):
        signal.signal(number, signal.SIG_IGN)


def serve_rollouts(config: TrainConfig, device: torch.device) -> None:
    """The body of a rollout process (a rank of the last ``distributed.rollout_processes``): build the host trainer
    0 describes and answer its messages until it says stop. Never builds an optimizer or a trainer.

    Ctrl-C and SIGTERM do not stop it (:func:`leave_stops_to_the_trainers`); trainer 0 sends ``Stop``, or this
    process ends when trainer 0 has gone."""
    leave_stops_to_the_trainers()
    dist_config = config.distributed
    trainers = ranks.launched_trainers(dist_config.rollout_processes)
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
        heap.settle()
        first_play = True
        while True:
            message = recv_object(groups, 0, START_WAIT_S)
            if isinstance(message, Stop):
                return
            send_object(groups, answer_to(groups, host, message), 0)
            if first_play and isinstance(message, Play):
                heap.settle()  # and what the first rollout built to stay (compiled and CUDA graphs, caches)
                first_play = False
    except PoolStopped:
        return
    except RuntimeError as error:  # gloo's, from a send or receive: trainer 0 has gone
        return trainer_gone(error)


def answer_to(groups: PoolGroups, host: RolloutHost | None, message: Any) -> Any:
    """This rollout process's answer to ``message`` (``Failed`` where its host raised, or is missing: it failed to
    start). A transfer of weights is received whole whatever happens: trainer 0 broadcasts every tensor of it."""
    match message:
        case Play(slots, sampling, seed, boundaries):
            try:
                if host is None:
                    raise RuntimeError("this rollout process failed to start")
                host.rollout.turn_boundary = reported_boundaries(groups, host) if boundaries else None
                try:
                    return host.run(slots, sampling, seed)
                finally:
                    host.rollout.turn_boundary = None
            except PoolStopped:
                raise
            except Exception as error:  # noqa: BLE001 - trainer 0 names this process and raises
                return Failed("play", failure_text(error))
        case Weights():
            return take_weights(groups, host, message)
        case _:
            return unknown(message)


def take_weights(groups: PoolGroups, host: RolloutHost | None, message: Weights) -> Taken | Failed:
    """The weights ``message`` announces, received whole whatever happens (trainer 0 sends every tensor of it),
    loaded into ``host``'s model: the checksum of what its policy computes with then, or what failed."""
    incoming = IncomingWeights(groups, message)
    try:
        if host is None:
            raise RuntimeError("this rollout process failed to start")
        answer: Taken | Failed = Taken(host.load_weights(message.version, incoming))
    except Exception as error:  # noqa: BLE001 - trainer 0 names this process and raises
        answer = Failed("take weights", failure_text(error))
    incoming.drain()
    return answer


def reported_boundaries(groups: PoolGroups, host: RolloutHost) -> TurnBoundary:
    """The turn boundary of a ``Play`` with ``boundaries``: report the round to trainer 0 and take its answers
    (weights: ``Taken`` or ``Failed`` back) until it says ``Continue``.

    Raises:
        PoolStopped: trainer 0 said ``Stop`` instead (the run ends; the batch is dropped).
    """

    def at_boundary(turns: int, part: int) -> None:
        send_object(groups, Boundary(turns), 0)
        while True:
            message = recv_object(groups, 0, START_WAIT_S)
            match message:
                case Continue():
                    return
                case Weights():
                    send_object(groups, take_weights(groups, host, message), 0)
                case Stop():
                    raise PoolStopped
                case _:
                    send_object(groups, unknown(message), 0)

    return at_boundary


def unknown(message: Any) -> Failed:
    return Failed("a message", f"unknown message {type(message).__name__} (trainer 0 and this rollout process run "
                               "different versions of turnrl?)")


def trainer_gone(error: RuntimeError) -> None:
    """Trainer 0 has gone (its own error says why): this rollout process stops, saying so in one line."""
    print(f"rollout process (rank {ranks.launched_rank()}): trainer 0 has gone ({str(error).splitlines()[0][:200]}); "
          "stopping", flush=True)


class IncomingWeights:
    """The tensors of a ``Weights`` message as trainer 0 sends them (broadcast to all, or ``direct`` to this process
    alone), received one at a time as they are iterated; :meth:`drain` receives (and drops) those a failed or
    partial load left, so that trainer 0's sends all complete and the next message is the next one on the
    channel."""

    def __init__(self, groups: PoolGroups, message: Weights) -> None:
        self.groups = groups
        self.pending = list(message.tensors)
        self.direct = message.direct

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        while self.pending:
            yield self.pending[0].name, self._next()

    def drain(self) -> None:
        while self.pending:
            self._next()

    def _next(self) -> torch.Tensor:
        spec = self.pending.pop(0)
        tensor = torch.empty(spec.shape, dtype=spec.dtype, device=self.groups.device)
        if self.direct:
            wait_for(self.groups, self.groups.weights.recv([tensor], 0, WEIGHTS_TAG))
        else:
            broadcast(self.groups, tensor)
        return tensor


WEIGHTS_TAG = 1
"""The tag of weights sent point to point (on CPUs the weights' group is the messages' one, whose tag is 0)."""


def broadcast(groups: PoolGroups, tensor: torch.Tensor) -> None:
    """``tensor`` from pool rank 0 (trainer 0) to every rollout process, on the weights' group."""
    options = dist.BroadcastOptions()
    options.rootRank = 0
    options.timeout = timedelta(seconds=groups.timeout_s)
    wait_for(groups, groups.weights.broadcast([tensor], options))


def wait_for(groups: PoolGroups, work: Any) -> None:
    """Wait for a send, receive or broadcast of the pool, ``distributed.timeout_s`` at most (raises then)."""
    work.wait(timedelta(seconds=groups.timeout_s))


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
    """Called when a rollout process reports a turn boundary (its part: its pool rank), before it generates the
    round: set, every ``Play`` reports them (the asynchronous backend's batches)."""

    def __init__(self, groups: PoolGroups, spec: WorkerSpec, tokenizer: Any, response_prefix: str,
                 trainers: int) -> None:
        self.groups = groups
        self.trainers = trainers
        self.processes = list(range(1, groups.size))
        self.deltas = ChatTemplateDeltas.for_tokenizer(tokenizer, response_prefix=response_prefix)
        self.infos: dict[int, dict[str, Any]] = {}
        self.closed = False
        self._listening = set(self.processes)
        """The processes waiting for trainer 0's next message (the others owe it an answer, which they are sending
        or will send: gloo's sends wait for their receive, so a ``Stop`` sent to one of them would wait for
        ``distributed.timeout_s`` while it waits for its own send)."""
        self._exchange = threading.RLock()
        """Held for each whole exchange (a message to the processes and all their answers; the broadcasts of a
        transfer): the rollout thread exchanges while the main thread may close, and the channel carries one
        message at a time. Re-entrant: a transfer to one process happens within a ``Play``'s exchange, at that
        process's turn boundary."""
        with self._exchange:
            for j in self.processes:
                self._send(Start(spec), j)
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
        boundary = self.turn_boundary
        with self._exchange:
            self._check_open()
            for j, part in zip(self.processes, parts):
                if part:
                    self._send(Play([SlotSpec(slots[i].seed, slots[i].group, slots[i].sample, slots[i].options)
                                     for i in part], sampling, base_seed + j - 1, boundaries=boundary is not None), j)
            results: dict[int, WorkerResult] = self._gather(playing, "play") if boundary is None else \
                self._play_in_rounds(playing, boundary)
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

    def _play_in_rounds(self, playing: list[int], boundary: TurnBoundary) -> dict[int, WorkerResult]:
        """Each playing process's result, its turn boundaries answered as they come (``boundary``, which may send it
        weights, then ``Continue``), each message waited for ``distributed.timeout_s`` at most.

        Raises:
            RolloutWorkerError: naming the process that failed or died, or those that did not answer.
        """
        arrived: queue.Queue[tuple[int, Any]] = queue.Queue()
        answered = {j: threading.Event() for j in playing}
        done = threading.Event()
        for j in playing:
            threading.Thread(target=self._listen, args=(j, arrived, answered[j], done), daemon=True,
                             name=f"turnrl-pool-listener-{j}").start()
        results: dict[int, WorkerResult] = {}
        try:
            while len(results) < len(playing):
                waiting = [j for j in playing if j not in results]
                try:
                    j, answer = arrived.get(timeout=self.groups.timeout_s)
                except queue.Empty:
                    names = ", ".join(self._name(j) for j in waiting)
                    raise RolloutWorkerError(
                        f"rollout process{'es' if len(waiting) > 1 else ''} {names} did not answer during play within "
                        f"distributed.timeout_s={self.groups.timeout_s:g} s; the batch is lost. Resume the run from "
                        "its last checkpoint (`turnrl train resume=RUN_DIR`)",
                        worker=waiting[0] if len(waiting) == 1 else None) from None
                if isinstance(answer, Exception):  # the receive failed: the process died, or its channel broke
                    raise RolloutWorkerError(
                        f"rollout process {self._name(j)} died during play, or stopped answering "
                        f"({first_line(answer)}); the batch is lost. Resume the run from its last checkpoint "
                        "(`turnrl train resume=RUN_DIR`)", worker=j)
                self._listening.add(j)
                if isinstance(answer, Failed):
                    raise self._failed(j, answer)
                if isinstance(answer, Boundary):
                    boundary(answer.turns, j)
                    self._send(Continue(), j)
                    answered[j].set()
                else:
                    results[j] = answer
        finally:
            done.set()
        return results

    def _listen(self, j: int, arrived: queue.Queue[tuple[int, Any]], answered: threading.Event,
                done: threading.Event) -> None:
        """Process ``j``'s messages of a ``Play`` into ``arrived`` as they come (or the error its receive raised),
        until its result. After a ``Boundary`` it waits until trainer 0 has ``answered`` it: trainer 0 receives that
        process's answers to the weights it sends there itself. Ends when the ``Play``'s exchange is ``done``."""
        while True:
            try:
                message = recv_object(self.groups, j, self.groups.timeout_s)
            except Exception as error:  # noqa: BLE001 - gloo's; the rollout thread names the process and raises
                arrived.put((j, error))
                return
            arrived.put((j, message))
            if not isinstance(message, Boundary):
                return
            while not answered.wait(timeout=1.0):
                if done.is_set():
                    return
            answered.clear()

    # ------------------------------------------------------------------ weights
    def send_weights(self, version: int, tensors: Sequence[TensorSpec], values: Iterator[torch.Tensor],
                     to: Sequence[int] | None = None) -> None:
        """Send ``values`` (one tensor per spec, made as they are sent) to the rollout processes ``to`` (None: all)
        as weights ``version``, and note each one's checksum of what its policy computes with then: broadcast to
        all of them, or point to point to each of a part of them (the others are not listening: they play)."""
        receivers = list(self.processes if to is None else to)
        direct = sorted(receivers) != self.processes
        start = time.perf_counter()
        with self._exchange:
            self._check_open()
            for j in receivers:
                self._send(Weights(version, list(tensors), direct=direct), j)
            for spec, value in zip(tensors, values):
                tensor = value.to(device=self.groups.device, dtype=spec.dtype)
                try:
                    if direct:
                        for j in receivers:
                            wait_for(self.groups, self.groups.weights.send([tensor], j, WEIGHTS_TAG))
                    else:
                        broadcast(self.groups, tensor)
                except RuntimeError as error:  # gloo's or NCCL's: a process died, or stopped receiving
                    names = ", ".join(self._name(j) for j in receivers)
                    raise RolloutWorkerError(
                        f"the transfer of weights {version} ({spec.name}) to rollout process"
                        f"{'es' if len(receivers) > 1 else ''} {names} failed ({first_line(error)}): one died "
                        "or did not receive within distributed.timeout_s; its log says which. Resume the run from "
                        "its last checkpoint (`turnrl train resume=RUN_DIR`)") from None
            taken: dict[int, Taken] = self._gather(receivers, "take weights")
        self.checksums.update({j: answer.checksum for j, answer in taken.items()})
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
                self._listening.add(j)
            except Exception as error:  # noqa: BLE001 - gloo raises RuntimeError subclasses of its own
                raise RolloutWorkerError(
                    f"rollout process {self._name(j)} did not answer during {doing} within "
                    f"distributed.timeout_s={self.groups.timeout_s:g} s, or died ({first_line(error)}); the batch is "
                    "lost. Resume the run from its last checkpoint (`turnrl train resume=RUN_DIR`)", worker=j) from None
            if isinstance(answer, Failed):
                raise self._failed(j, answer)
            answers[j] = answer
        return answers

    def _failed(self, j: int, answer: Failed) -> RolloutWorkerError:
        """The error of process ``j``'s answer that it failed."""
        return RolloutWorkerError(f"rollout process {self._name(j)} failed during {answer.doing}: "
                                  f"{answer.error.strip()}", worker=j)

    def _send(self, message: Any, j: int) -> None:
        """``message`` to process ``j``, which answers it: until its answer is taken, ``j`` is not listening.

        Raises:
            RolloutWorkerError: naming ``j``, where the send failed (it died since its last answer): gloo's error
                alone names neither the process nor what to do, and the run's stop path does not catch it.
        """
        self._listening.discard(j)
        try:
            send_object(self.groups, message, j)
        except RuntimeError as error:  # gloo's: the process has gone, or did not receive within the timeout
            raise RolloutWorkerError(
                f"rollout process {self._name(j)} died, or stopped receiving, before {type(message).__name__} "
                f"({first_line(error)}). Resume the run from its last checkpoint (`turnrl train resume=RUN_DIR`)",
                worker=j) from None

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
        """Tell every rollout process that listens to stop (safe to call twice). Not while the rollout thread is
        still in an exchange (one it did not finish within its ``close``): a ``Stop`` then would land amid its
        messages, so none is sent. Nor to a process that owes an answer (an exchange that failed part-way): it
        would not receive it before its own send. Those end when this process has gone (their send or receive
        fails)."""
        if not self._exchange.acquire(blocking=False):
            self.closed = True
            return
        try:
            if self.closed:
                return
            self.closed = True
            for j in sorted(self._listening):
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

"""Which process this is in a data-parallel run, and the few collectives the trainer needs.

``torchrun`` starts one process per GPU and tells each its ``RANK``, ``LOCAL_RANK`` and ``WORLD_SIZE``;
outside ``torchrun`` this is rank 0 of a world of 1 and every function here is a no-op. Collectives are
``torch.distributed``'s (NCCL between GPUs, gloo on CPUs), with the timeout of ``distributed.timeout_s``
so that a process that dies or hangs stops the run with an error instead of a silent wait.
"""

from __future__ import annotations

import atexit
import os
import sys
import time
from datetime import timedelta
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from turnrl.rollout.trajectory import sum_by_name
from turnrl.training import wire


def rank() -> int:
    """This process's rank (0 outside ``torchrun``)."""
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))


def world_size() -> int:
    """How many processes train together (1 outside ``torchrun``)."""
    return dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))


def is_main() -> bool:
    """Whether this process writes the run's files and prints (rank 0)."""
    return rank() == 0


def launched_by_torchrun() -> bool:
    """Processes started by ``torchrun``: several (``WORLD_SIZE`` above 1), or one (its run id is set)."""
    return int(os.environ.get("WORLD_SIZE", 1)) > 1 or "TORCHELASTIC_RUN_ID" in os.environ


COMMAND_START = "TURNRL_COMMAND_START"
"""The environment variable in which ``turnrl train distributed.nproc_per_node=N`` hands its processes the time
it was started (seconds since the epoch): their start counts from the command, not from their own launch."""


def command_start() -> float:
    """When the command that started this process began: :data:`COMMAND_START` when the launcher set it, else
    now."""
    try:
        return float(os.environ[COMMAND_START])
    except (KeyError, ValueError):
        return time.time()


def threads_per_process() -> int:
    """The host's cores shared evenly among the processes of this machine (``LOCAL_WORLD_SIZE``).

    torchrun sets ``OMP_NUM_THREADS=1`` in every process it starts, which leaves a GPU run's CPU work on one
    core a process: loading and copying the models (minutes at 7B) and, with ``distributed.cpu_offload``,
    the optimizer's steps."""
    return max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1)))


_process_device: torch.device | None = None


def process_device() -> torch.device | None:
    """This process's device in a distributed run (the GPU of its ``LOCAL_RANK``), None otherwise."""
    return _process_device


def training_device(setting: str) -> torch.device:
    """Where this process trains: its GPU in a distributed run, else ``model.device`` (``setting``) resolved."""
    # Imported here: turnrl.models loads transformers' model classes, which the launcher that reads
    # COMMAND_START (``turnrl train distributed.nproc_per_node=N``) does not need.
    from turnrl.models.devices import resolve_device

    return process_device() or resolve_device(setting)


def launched_rank() -> int:
    """This process's rank among all that ``torchrun`` started (trainers and rollout processes alike)."""
    return int(os.environ.get("RANK", 0))


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """A sharded tensor (an FSDP2 ``DTensor``) gathered whole, a collective of the processes holding its shards;
    any other tensor as it is (detached)."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor.detach()


def launched_world() -> int:
    """How many processes ``torchrun`` started (trainers and rollout processes alike)."""
    return int(os.environ.get("WORLD_SIZE", 1))


def launched_trainers(rollout_processes: int) -> int:
    """How many of the processes ``torchrun`` started train: all but the last ``rollout_processes``."""
    return launched_world() - rollout_processes


def init_process_group(device: str, timeout_s: float, trainers: int | None = None) -> torch.device:
    """Join the run's process group (NCCL for GPU tensors, gloo for host tensors); returns this process's device.

    Args:
        device: ``model.device``: ``cpu``, or ``cuda``/``auto`` (each process takes the GPU of its
            ``LOCAL_RANK``).
        timeout_s: the longest wait on a collective.
        trainers: the first ``trainers`` of the launched processes train (``distributed.rollout_processes``: the
            others roll out). The default process group is theirs alone, so that every collective of the trainer
            (FSDP2's device mesh, checkpoints, the helpers here) runs over the trainer ranks without naming a
            group; a rollout process joins no default group (:func:`launch_store` connects it to the trainers).
            None: every launched process trains.
    """
    global _process_device
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    use_cuda = device != "cpu" and torch.cuda.is_available()
    where = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(where)
    if not dist.is_initialized():
        # GPU processes get gloo beside NCCL for collectives of tensors in host memory: FSDP2's CPU offload keeps
        # the shards (and their gradients) there, and gathering them whole (the rollout copy, the gradient norm)
        # is a collective NCCL refuses.
        backend = "cuda:nccl,cpu:gloo" if use_cuda else "gloo"
        timeout = timedelta(seconds=timeout_s)
        if trainers is None or trainers == launched_world():
            dist.init_process_group(backend, timeout=timeout, device_id=where if use_cuda else None)
        elif launched_rank() < trainers:
            dist.init_process_group(backend, store=dist.PrefixStore("turnrl/trainers/", launch_store(timeout_s)),
                                    rank=launched_rank(), world_size=trainers, timeout=timeout,
                                    device_id=where if use_cuda else None)
    _process_device = where
    return where


_launch_store: Any = None


def launch_store(timeout_s: float) -> Any:
    """The key-value store of the processes ``torchrun`` started (its ``env://`` rendezvous), shared by all: the
    trainers' default group and the rollout pool's groups are made on it under prefixes of their own."""
    global _launch_store
    if _launch_store is None:
        _launch_store, _, _ = next(dist.rendezvous("env://", launched_rank(), launched_world(),
                                                   timeout=timedelta(seconds=timeout_s)))
    return _launch_store


_long_wait_group: Any = None


def wait_for_main() -> None:
    """Hold every process until rank 0 has finished a long task of its own (an SFT stage: longer than any
    collective's timeout), on a gloo group of its own that waits up to a day."""
    global _long_wait_group
    if world_size() == 1:
        return
    if _long_wait_group is None:
        _long_wait_group = dist.new_group(backend="gloo", timeout=timedelta(days=1))
    dist.barrier(group=_long_wait_group)


def barrier() -> None:
    if world_size() > 1:
        dist.barrier()


OBJECT_CHUNK_BYTES = 64 * 2**20
"""The bytes of each process's pickle that travel through the collective at once (:func:`all_gather_objects`)."""


def all_gather_objects(value: Any, chunk_bytes: int = OBJECT_CHUNK_BYTES) -> list[Any]:
    """Every process's ``value``, in rank order (pickled: trajectories, metric dicts).

    The pickles travel ``chunk_bytes`` a process at a time through buffers on the device of the group's
    collectives (the GPU under NCCL), so that gathering a rollout costs the GPU a few buffers of
    ``world * chunk_bytes`` whatever its size. Written here because torch's ``all_gather_object`` puts every
    process's whole pickle on the GPU at once: a VisGym rollout's trajectories with their images took 9.8 GiB
    of each GPU at 4 processes.
    """
    world = world_size()
    if world == 1:
        return [value]
    device = _process_device or torch.device("cpu")
    payload = wire.dumps(value)
    sizes_sent = torch.tensor([len(payload)], dtype=torch.long, device=device)
    sizes_got = [torch.empty_like(sizes_sent) for _ in range(world)]
    dist.all_gather(sizes_got, sizes_sent)
    sizes = [int(size) for size in sizes_got]
    width = min(chunk_bytes, max(sizes))
    received = [torch.empty(size, dtype=torch.uint8) for size in sizes]
    sent = torch.zeros(width, dtype=torch.uint8, device=device)
    parts = [torch.empty(width, dtype=torch.uint8, device=device) for _ in range(world)]
    for start in range(0, max(sizes), width):
        mine = payload[start:start + width]
        sent[:len(mine)].copy_(mine)
        dist.all_gather(parts, sent)
        for size, part, out in zip(sizes, parts, received):
            count = min(width, size - start)
            if count > 0:
                out[start:start + count].copy_(part[:count])
    return [wire.loads(out) for out in received]


def sum_over_ranks(values: dict[str, float]) -> dict[str, float]:
    """Each key's sum over the processes (a key missing on a process counts 0 there)."""
    return sum_by_name(all_gather_objects(values))


def max_over_ranks(value: int) -> int:
    """The largest ``value`` of any process."""
    return max(all_gather_objects(value))


def any_rank(flag: bool) -> bool:
    """True on every process when ``flag`` is true on any (a Ctrl-C seen by one process stops all)."""
    return any(all_gather_objects(flag))


def first_failure(failure: Any | None) -> tuple[int, Any] | None:
    """The outcome of a stage of work agreed by every process: the first process (by rank) whose ``failure`` is not
    None and that failure, the same on every process; None where no process failed. A collective, in place of a
    barrier at the stage's end: a process that failed says so there instead of leaving the others to wait for it
    in the next collective it never joins."""
    return next(((rank, failed) for rank, failed in enumerate(all_gather_objects(failure)) if failed is not None),
                None)


def close_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def end_process(status: int) -> NoReturn:
    """End a process that torchrun started, once its run is over and its process group closed: the exit
    handlers run and the output is flushed, then the process exits with ``status`` without the interpreter's
    teardown.

    gloo's worker threads release a finished collective's tensors after the collective has returned, taking the
    GIL to do it; one that gets there once the interpreter is tearing down (a process that leaves right after its
    last collective, on a loaded host) is ended by Python mid-destructor, and C++ aborts the process (``terminate
    called without an active exception``, SIGABRT), which torchrun reports as a failed run. Closing the group does
    not stop those threads: FSDP's device meshes keep the groups alive.
    """
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)

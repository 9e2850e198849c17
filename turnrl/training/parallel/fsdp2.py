"""Data-parallel RL with FSDP2: one process per GPU (gloo processes on a CPU), started by ``torchrun``.

    torchrun --nproc-per-node 2 -m turnrl.cli train --config configs/X.yaml
    turnrl train --config configs/X.yaml distributed.nproc_per_node=2      # the same, started for you

:class:`FSDP2` is the :class:`~turnrl.training.parallel.strategy.ParallelStrategy` of such a run; the one
:class:`~turnrl.training.trainer.Trainer` runs a step on every process, in the single-process order:

    rollout     this process's share of the env groups (whole groups: group g on process g % world,
                :class:`~turnrl.training.backends.sharded.ShardedRollout`), on an unsharded copy of the actor
                (the engine needs whole weights), then every process's trajectories gathered: all processes
                hold the batch the single-process trainer would
    scores      old/reference logprobs and values of this process's rows of the batch, gathered
    advantages  over the whole batch, the same on every process (group estimators see whole groups,
                whitening sees every token)
    PPO         each mini-batch split by rows; the loss weighted by its share of the whole mini-batch,
                FSDP2 averages the gradients; then the new weights go to the rollout copy

Actor, critic and reference are sharded with ``fully_shard`` (each decoder layer, then the model), with
FSDP2's mixed precision when ``model.dtype`` is bf16/fp16; a VLM's frozen vision tower is held whole by every
process instead (:func:`shard_model`). Rank 0 alone prints, logs and writes
trajectories; checkpoints are HF models gathered from the shards plus the optimizers' shards through
``torch.distributed.checkpoint``, so a run resumes exactly on the same number of processes.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed.checkpoint
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard

from turnrl.config import ConfigError
from turnrl.models.loading import cast_parameters, vision_tower
from turnrl.training import ranks
from turnrl.training.checkpoint import prune_checkpoints, save_checkpoint, unique_tmp_name
from turnrl.training.head import ScoringHead
from turnrl.training.model_passes import ValueModel, body_and_head
from turnrl.training.parallel.strategy import OPTIMIZER_DIR, CheckpointFiles, Models, Optimizers
from turnrl.training.ppo import Shard


# --------------------------------------------------------------------------- rows and groups of a process
def process_rows(n: int, rank: int, world: int) -> torch.Tensor:
    """This process's rows of a batch of ``n``: ``rank, rank + world, ...``, padded (with row 0) to
    ``ceil(n / world)`` rows so that every process runs the same number of forward passes.

    Returns:
        Shape (ceil(n / world),) long.
    """
    mine = torch.arange(rank, max(rank, n), world)  # empty when the batch has fewer rows than processes
    most = -(-n // world)
    return torch.cat([mine, torch.zeros(most - len(mine), dtype=torch.long)])


def gather_rows(local: torch.Tensor, n: int) -> torch.Tensor:
    """The whole batch's (n, ...) tensor from every process's :func:`process_rows` rows of it.

    Args:
        local: this process's rows, Shape (ceil(n / world), ...), the same shape on every process.
    """
    world = ranks.world_size()
    if world == 1:
        return local[:n]
    parts = [torch.empty_like(local) for _ in range(world)]
    torch.distributed.all_gather(parts, local.contiguous())
    out = torch.empty((n, *local.shape[1:]), dtype=local.dtype, device=local.device)
    for rank, part in enumerate(parts):
        count = len(range(rank, n, world))
        out[rank::world] = part[:count]
    return out


# --------------------------------------------------------------------------- sharding the models
def shard_model(model: torch.nn.Module, dtype: torch.dtype, weights: Mapping[str, torch.Tensor],
                cpu_offload: bool = False) -> None:
    """``fully_shard`` each decoder layer (a transformers model's ``_no_split_modules`` classes), then the
    model, and fill the shards with ``weights``; in place.

    The model's parameters are on the ``meta`` device on every process (its buffers real); rank 0 holds the
    whole model's ``weights`` in host memory (the others pass an empty mapping) and sends each process its
    shards: one process reads the weights, and no process holds them whole on a GPU. With ``cpu_offload`` the
    shards stay in host memory and each unit's weights are gathered onto the GPU when it runs. bf16/fp16 runs
    gather the weights in that dtype and reduce gradients in float32.

    The trainer runs a causal LM's body and its LM head as two calls (the head only on scored positions), so
    body and head are one unit that stays gathered from the body's forward to the backward: a head tied to
    the input embeddings reads the same gathered weight.

    A frozen vision tower (:func:`frozen_tower`) is not sharded: every process holds it whole, in ``dtype`` (the
    bf16 weights FSDP would gather for each pass; its rotary frequencies stay float32), on its GPU even with
    ``cpu_offload``. Its forward then runs no collective, so a process may skip it where the step's image
    features are stored (:mod:`~turnrl.training.image_features`) while the others encode; it costs each process
    the tower in bf16 (1.3 GB for Qwen2.5-VL's 670M parameters) where the float32 shards took 2.7 GB over all.
    A checkpoint gathered from the model then holds that bf16 tower: the start's weights rounded once, as a bf16
    release of the model holds them.
    """
    device = ranks.process_device()
    assert device is not None, "shard_model runs in a process group (ranks.init_process_group)"
    precision = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32) if dtype != torch.float32 \
        else MixedPrecisionPolicy()
    # The mesh of the process's own device: FSDP's default follows the machine's accelerator, so a CPU run
    # (`model.device=cpu`, gloo) on a GPU host got a mesh of GPUs (with two processes on a one-GPU host, the second
    # failed at once on a device ordinal it does not have).
    options: dict[str, Any] = {"mp_policy": precision,
                               "mesh": init_device_mesh(device.type, (ranks.world_size(),))}
    if cpu_offload:
        options["offload_policy"] = CPUOffloadPolicy()
    names: set[str] = set()
    for module in model.modules():
        inner: Any = module
        names |= set(getattr(inner, "_no_split_modules", None) or [])
    tower = frozen_tower(model)
    kept_whole: set[int] = set()
    if tower is not None:
        kept_whole = {id(module) for module in tower.modules()}
        options["ignored_params"] = set(tower.parameters())  # the calls below: the units holding the tower
        cast_parameters(tower, dtype)
    for layer in [module for module in model.modules()
                  if type(module).__name__ in names and module is not model and id(module) not in kept_whole]:
        fully_shard(layer, **options)
    if isinstance(model, ValueModel):
        fully_shard(model, **options)
    else:
        body, head = body_and_head(model)  # a peft model's too
        if not isinstance(head, ScoringHead):  # the trainer scores through the head's forward, which FSDP hooks
            raise TypeError("shard_model needs the model's LM head to be a ScoringHead (install_scoring_head)")
        fully_shard([body, head], reshard_after_forward=False, **options)
        fully_shard(model, **options)
    to_empty(model, torch.device("cpu") if cpu_offload else device, device)
    # Filled where the shards are (torch refuses a state dict on two devices), then the tower goes to the GPU.
    set_model_state_dict(model, dict(weights),
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    if tower is not None and cpu_offload:
        tower.to(device)
    if isinstance(model, ValueModel):
        return
    # FSDP takes the module of the first forward call as the root of the units; the trainer calls the
    # body first, so one forward of the whole model makes the model the root.
    with torch.no_grad():
        model(input_ids=torch.zeros((1, 1), dtype=torch.long, device=device), use_cache=False)
    reshard(model)


def frozen_tower(model: torch.nn.Module) -> torch.nn.Module | None:
    """The vision tower of a VLM (an actor, a reference, a critic's backbone) when none of its weights trains
    (``model.train_vision=false``, a reference); None for a text model or a trained tower."""
    tower = vision_tower(model.backbone if isinstance(model, ValueModel) else model)
    if tower is None or any(param.requires_grad for param in tower.parameters()):
        return None
    return tower


def structure_of(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` whose parameters are on the ``meta`` device (shapes, dtypes, tied weights and
    ``requires_grad`` kept) and whose buffers are copies of its own; costs no parameter memory."""
    memo: dict[int, Any] = {}
    for param in model.parameters():
        memo[id(param)] = torch.nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=param.requires_grad)
    return copy.deepcopy(model, memo)


def to_empty(model: torch.nn.Module, device: torch.device, buffer_device: torch.device) -> None:
    """``model.to_empty(device=device)`` keeping what it loses: parameters tied to each other (an LM head tied
    to the input embeddings) are tied again, and the buffers (rotary frequencies, computed at construction and
    not loaded) keep their values, on ``buffer_device`` (the GPU also where parameters are offloaded)."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    buffers = dict(model.named_buffers())
    model.to_empty(device=device)
    for first, *others in names.values():
        for name in others:
            owner, _, attribute = name.rpartition(".")
            setattr(model.get_submodule(owner), attribute, model.get_parameter(first))
    for name, value in buffers.items():
        owner, _, attribute = name.rpartition(".")
        setattr(model.get_submodule(owner), attribute, value.to(buffer_device))


def allocate(structure: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """``structure`` (parameters on ``meta``, see :func:`structure_of`) with its parameters allocated on
    ``device`` in ``dtype`` and not initialized, its buffers kept in their own dtype (the rotary frequencies in
    float32: :func:`~turnrl.models.loading.cast_parameters`); in place. :func:`copy_full_weights` with
    ``every_parameter`` fills it."""
    to_empty(cast_parameters(structure, dtype), device, device)
    return structure


def free_parameters(model: torch.nn.Module) -> None:
    """Free the memory of every parameter of ``model`` (each keeps its shape and place in the model);
    :func:`reallocate_parameters` gives it back, uninitialized."""
    for param in model.parameters():
        param.untyped_storage().resize_(0)


def reallocate_parameters(model: torch.nn.Module) -> None:
    """Allocate again the parameters :func:`free_parameters` freed (their values are to be copied in)."""
    for param in model.parameters():
        storage = param.untyped_storage()
        if storage.size() == 0 and param.numel() > 0:
            storage.resize_(param.numel() * param.element_size())


def reshard(model: torch.nn.Module | None) -> None:
    """Put every unit of ``model`` back to its shards: the body of a causal LM stays gathered after a forward
    pass without gradient (it waits for a backward), and state dicts read the sharded parameters."""
    for module in model.modules() if model is not None else ():
        if isinstance(module, FSDPModule):
            module.reshard()


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's weights on rank 0's CPU (other processes get an empty dict); a collective."""
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {name: value for name, value in state.items() if isinstance(value, torch.Tensor)}


def without_tied_copies(state: dict[str, torch.Tensor], model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``state`` without the second name of each weight that ``model`` ties to another (an LM head tied to
    the input embeddings): gathered from shards they are two tensors, and a checkpoint holds one."""
    seen: set[int] = set()
    tied = set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen:
            tied.add(name)
        seen.add(id(tensor))
    return {name: value for name, value in state.items() if name not in tied}


@torch.no_grad()
def copy_full_weights(sharded: torch.nn.Module, full: torch.nn.Module, every_parameter: bool = False) -> None:
    """Copy a sharded model's trained parameters into an unsharded copy of it, one parameter at a time (each
    gathered from the shards: a collective), so that no second whole copy is ever held. Frozen parameters (a
    LoRA base, a frozen vision tower) never change, so the copy keeps its own, unless ``every_parameter``
    (the copy's first filling)."""
    targets = dict(full.named_parameters())
    for name, param in sharded.named_parameters():
        if param.requires_grad or every_parameter:
            targets[name].copy_(ranks.whole(param))


# --------------------------------------------------------------------------- optimizer states
UNSTEPPED = "unstepped_optimizers"
"""The trainer state's names (``actor``, ``critic``) of the optimizers that had never stepped when the checkpoint
was saved: their shards hold the state that reading it made up (see :func:`unstepped_optimizers`), which a resume
drops again."""


def _named(optimizers: Optimizers) -> dict[str, torch.optim.Optimizer]:
    return {name: optimizer for name, optimizer in (("actor", optimizers.actor), ("critic", optimizers.critic))
            if optimizer is not None}


def unstepped_optimizers(optimizers: Optimizers) -> list[str]:
    """The names of the optimizers without state: they have not stepped yet (the actor during the critic's warm-up,
    or every update so far skipped).

    ``get_optimizer_state_dict`` gives such an optimizer its state by running a step of learning rate 0 on zero
    gradients. Kept, that state is a step of Adam: its first real step would divide by the bias corrections of a
    second, an update about a quarter smaller than one process makes (whose plain ``state_dict`` reads nothing
    in)."""
    return [name for name, optimizer in _named(optimizers).items() if not optimizer.state]


def forget_states(optimizers: Optimizers, names: list[str]) -> None:
    """Drop the state of the optimizers ``names`` (:func:`unstepped_optimizers`): they step next as for the first
    time."""
    for name, optimizer in _named(optimizers).items():
        if name in names:
            optimizer.state.clear()


def first_failure(error: CheckpointException) -> tuple[int, BaseException]:
    """The first process a ``torch.distributed.checkpoint`` save or load failed on, and its own error there.

    torch raises that failure on every process as a ``BaseException`` of its own, which no handler of write
    failures (nor any ``except Exception``) sees; the callers here raise what it failed of instead."""
    rank, (cause, _) = min(error.failures.items())
    return rank, cause


def shards_not_written(error: CheckpointException) -> NoReturn:
    """Raise why the optimizer shards were not written, from the failed process's own error: a full disk there is
    then told as the checkpoint's other writes tell it (:func:`~turnrl.training.checkpoint.save_checkpoint` names
    it and deletes the unfinished folder)."""
    rank, cause = first_failure(error)
    raise RuntimeError(f"process {rank} could not write its optimizer shards: {type(cause).__name__}: {cause}\n"
                       f"{error}") from cause


def shards_not_read(error: CheckpointException, checkpoint: Path) -> NoReturn:
    """Raise why the optimizer shards of ``checkpoint`` could not be read (a file missing or cut short), and how
    to resume. Not a ConfigError (a ValueError): the trainer would take it for a damaged ``trainer_state.pt``."""
    rank, cause = first_failure(error)
    raise RuntimeError(f"{checkpoint / OPTIMIZER_DIR} cannot be read (process {rank}: {type(cause).__name__}: "
                       f"{cause}); move {checkpoint.name} away to resume from an earlier checkpoint") from cause


# --------------------------------------------------------------------------- a checkpoint rank 0 could not write
@dataclass(frozen=True)
class WriteFailure:
    """Why rank 0 could not write its part of a checkpoint, as it tells the other processes."""

    refused: bool
    """A :class:`~turnrl.config.ConfigError`: the disk or a limit refused the write, said in one line with what to
    do."""
    text: str
    """The error's message; ``Type: message`` for any other error."""


def write_failure(error: Exception) -> WriteFailure:
    """The :class:`WriteFailure` of ``error``, raised by rank 0's part of a checkpoint."""
    if isinstance(error, ConfigError):
        return WriteFailure(refused=True, text=str(error))
    return WriteFailure(refused=False, text=f"{type(error).__name__}: {error}")


def raise_failure(failed: tuple[int, WriteFailure] | None, step: int) -> None:
    """Raise, on a process that did its own part, where process ``failed[0]`` could not write its part of the
    checkpoint after ``step`` (:func:`ranks.first_failure`); nothing where ``failed`` is None. A refused write
    stops every process with the same one line (what to do), any other error with its type and message."""
    if failed is None:
        return
    rank, failure = failed
    if failure.refused:
        raise ConfigError(f"process {rank}: {failure.text}")
    raise RuntimeError(f"process {rank} could not write the checkpoint after step {step}: {failure.text}")


# --------------------------------------------------------------------------- the strategy
FREED = -1
"""The rollout copy's weights version while its parameters are freed: no version the trainer's weights take."""


class FSDP2:
    """A :class:`~turnrl.training.parallel.strategy.ParallelStrategy` over ``torch.distributed`` processes, with
    FSDP2-sharded models (see the module's docstring).

    The process group must be initialized (:func:`ranks.init_process_group`) and the trainer's device be this
    process's.

    Args:
        cpu_offload: ``distributed.cpu_offload``: the shards in host memory (a GPU run's).
    """

    # A process out of memory leaves the others waiting in a collective, and its own layers gathered.
    retries_out_of_memory = False
    shards_optimizers = True

    def __init__(self, cpu_offload: bool) -> None:
        device = ranks.process_device()
        if cpu_offload and (device is None or device.type != "cuda"):
            raise ConfigError("distributed.cpu_offload moves a GPU run's shards to host memory; processes on the "
                              "CPU hold them there already: set distributed.cpu_offload=false")
        self.cpu_offload = cpu_offload
        self.startup: dict[str, float] = {}
        self.rollout_actor: torch.nn.Module | None = None
        """The rollouts' unsharded copy of the actor in the compute dtype, refreshed from the shards."""
        self.rollout_version: int | None = None
        """The actor updates the rollout copy holds (None: filled from the shards as they are, before any update
        of this process); :data:`FREED` while its parameters are freed for the update."""

    @property
    def rank(self) -> int:
        return ranks.rank()

    @property
    def world_size(self) -> int:
        return ranks.world_size()

    # ------------------------------------------------------------------ the models
    def load_device(self, device: torch.device) -> torch.device:
        """Rank 0 reads the models into host memory; the other processes build their structure on ``meta``
        and receive their shards from it (see :func:`shard_model`)."""
        return torch.device("cpu") if ranks.is_main() else torch.device("meta")

    def place(self, models: Models, device: torch.device, dtype: torch.dtype) -> Models:
        started = time.time()
        whole = ranks.is_main()
        weights = {name: model.state_dict() if whole else {}
                   for name, model in (("actor", models.actor), ("critic", models.critic),
                                       ("reference", models.reference)) if model is not None}
        actor = structure_of(models.actor)
        critic = structure_of(models.critic) if models.critic is not None else None
        reference = structure_of(models.reference) if models.reference is not None else None
        rollout_structure = structure_of(actor)  # before sharding changes the actor's modules
        for name, model in (("actor", actor), ("critic", critic), ("reference", reference)):
            if model is not None:
                shard_model(model, dtype, weights.pop(name), self.cpu_offload)
        self.startup["shard_s"] = time.time() - started
        started = time.time()
        self.rollout_actor = allocate(rollout_structure, device, dtype).eval().requires_grad_(False)
        copy_full_weights(actor, self.rollout_actor, every_parameter=True)
        self.startup["rollout_copy_s"] = time.time() - started
        assert critic is None or isinstance(critic, ValueModel)
        return Models(actor, critic, reference)

    def rollout_model(self, actor: torch.nn.Module) -> torch.nn.Module:
        assert self.rollout_actor is not None, "place() builds the rollout copy"
        return self.rollout_actor

    def sync_rollout_model(self, actor: torch.nn.Module, updates: int) -> None:
        assert self.rollout_actor is not None, "place() builds the rollout copy"
        if self.rollout_version is None:
            self.rollout_version = updates
        if self.rollout_version == updates:
            return
        freed = self.rollout_version == FREED  # then the frozen parameters are gathered too
        if freed:
            reallocate_parameters(self.rollout_actor)
        copy_full_weights(actor, self.rollout_actor, every_parameter=freed)
        self.rollout_version = updates

    def release_rollout_model(self) -> None:
        """The rollout copy's parameters, gathered whole from the shards again before the next rollout: the
        update does not hold a second, unsharded actor."""
        assert self.rollout_actor is not None, "place() builds the rollout copy"
        free_parameters(self.rollout_actor)
        self.rollout_version = FREED

    # ------------------------------------------------------------------ reductions
    def rows(self, n: int) -> torch.Tensor | None:
        return process_rows(n, ranks.rank(), ranks.world_size())

    def gather_rows(self, local: torch.Tensor, n: int) -> torch.Tensor:
        return gather_rows(local, n)

    def most(self, count: int) -> int:
        return ranks.max_over_ranks(count)

    def mean_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        return {key: value / ranks.world_size() for key, value in ranks.sum_over_ranks(metrics).items()}

    def shard(self) -> Shard | None:
        return Shard(ranks.rank(), ranks.world_size(), ranks.sum_over_ranks, ranks.max_over_ranks)

    def release_gathered(self, models: list[torch.nn.Module]) -> None:
        for model in models:
            reshard(model)

    # ------------------------------------------------------------------ checkpoints
    def restore_optimizers(self, checkpoint: Path, state: dict[str, Any], models: Models,
                           optimizers: Optimizers) -> None:
        """The optimizers' shards, from ``torch.distributed.checkpoint`` files (the trainer state holds none);
        those that had not stepped when the checkpoint was saved (:data:`UNSTEPPED`) are left without state."""
        shards = self._optimizer_state(models, optimizers)
        try:
            torch.distributed.checkpoint.load(shards, checkpoint_id=str(checkpoint / OPTIMIZER_DIR))
        except CheckpointException as error:  # on every process, where any failed
            shards_not_read(error, checkpoint)
        set_optimizer_state_dict(models.actor, optimizers.actor, shards["actor"])
        if models.critic is not None and optimizers.critic is not None:
            set_optimizer_state_dict(models.critic, optimizers.critic, shards["critic"])
        forget_states(optimizers, state.get(UNSTEPPED, []))

    @staticmethod
    def _optimizer_state(models: Models, optimizers: Optimizers) -> dict[str, Any]:
        reshard(models.actor)
        reshard(models.critic)
        state = {"actor": get_optimizer_state_dict(models.actor, optimizers.actor)}
        if models.critic is not None and optimizers.critic is not None:
            state["critic"] = get_optimizer_state_dict(models.critic, optimizers.critic)
        return state

    def save(self, files: CheckpointFiles, models: Models, optimizers: Optimizers) -> Path:
        """HF models gathered from the shards (written by rank 0), the optimizers' shards by every process.

        Three stages: rank 0 writes its files, every process its shards, rank 0 publishes the checkpoint (renamed
        into place, ``latest``, older ones pruned). The processes agree on the outcome of each stage
        (:func:`ranks.first_failure`), so a write that fails on rank 0 stops the save on every process with its
        error (:func:`raise_failure`) instead of leaving the others in a collective rank 0 never joins."""
        assert self.rollout_actor is not None, "place() builds the rollout copy"
        actor = without_tied_copies(full_state_dict(models.actor), self.rollout_actor)
        critic = full_state_dict(models.critic) if models.critic is not None else None
        # Every process writes its optimizer shards into the folder rank 0 names (a name no other writer uses).
        tmp_name = ranks.all_gather_objects(unique_tmp_name(files.step))[0]
        tmp = files.run_dir / "checkpoints" / tmp_name
        unstepped = unstepped_optimizers(optimizers)
        stage = "files"  # rank 0's stage of the save

        def write_optimizer_shards(directory: Path) -> None:
            nonlocal stage
            stage = "shards"
            raise_failure(ranks.first_failure(None), files.step)  # rank 0 has written its files into the directory
            try:
                torch.distributed.checkpoint.save(self._optimizer_state(models, optimizers),
                                                  checkpoint_id=str(directory / OPTIMIZER_DIR))
            except CheckpointException as error:  # on every process, where any failed
                shards_not_written(error)
            forget_states(optimizers, unstepped)
            ranks.barrier()
            stage = "publish"

        state = {**files.state, "world_size": ranks.world_size(), UNSTEPPED: unstepped}
        if not ranks.is_main():
            write_optimizer_shards(tmp)
            raise_failure(ranks.first_failure(None), files.step)  # rank 0 has published the checkpoint
            return files.run_dir / "checkpoints" / f"step_{files.step:06d}"
        try:
            path = save_checkpoint(files.run_dir, files.step, _WithStateDict(models.actor, actor), files.processor,
                                   state, critic=_WithStateDict(models.critic, critic) if critic is not None else None,
                                   before_publish=write_optimizer_shards, config_yaml=files.config_yaml,
                                   tmp_name=tmp_name)
            prune_checkpoints(files.run_dir, files.keep)
        except Exception as error:
            if stage != "shards":  # the others wait for this stage's outcome; a failed shard stops every process itself
                ranks.first_failure(write_failure(error))
            raise
        ranks.first_failure(None)
        return path


class _WithStateDict:
    """A model whose ``save_pretrained`` writes the given (gathered) weights instead of its own shards."""

    def __init__(self, model: Any, state_dict: dict[str, torch.Tensor]) -> None:
        self.model, self.state_dict = model, state_dict

    def save_pretrained(self, path: Path) -> None:
        self.model.save_pretrained(path, state_dict=self.state_dict)


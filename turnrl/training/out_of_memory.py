"""What a run says and does when its GPU runs out of memory mid-step: the error that names what to change
(:func:`sft_out_of_memory`, :func:`rl_out_of_memory`), and the one retry an RL step gets when no optimizer step
began (:class:`OptimizerSteps`, :func:`halved_micro_batches`).

The estimate that stops a run before it starts is :mod:`turnrl.training.memory`'s; this is what is left for the
runs it lets through (an estimate is an approximation, and a neighbour on a shared card takes memory too).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from pathlib import Path
from types import TracebackType
from typing import Any

import torch

from turnrl.config import ConfigError, turnrl_command
from turnrl.training.algorithm_config import AlgorithmConfig
from turnrl.training.memory import SFT_ELSEWHERE
from turnrl.training.train_config import SFTConfig, TrainConfig


def torch_said(error: torch.OutOfMemoryError) -> str:
    """torch's out-of-memory message without its general advice (``PYTORCH_CUDA_ALLOC_CONF``, the docs): what it
    tried to allocate, what the GPU has free and what this process holds and may use."""
    text = str(error).strip().split(" If reserved but unallocated")[0].strip()
    return text or type(error).__name__


def sft_out_of_memory(error: torch.OutOfMemoryError, config: SFTConfig,
                      micro_batch: tuple[int, int] | None) -> ConfigError:
    """An SFT step that ran out of GPU memory, as an error that says what to change, and torch's message.

    Args:
        micro_batch: the (rows, tokens a row) of the micro-batch that failed: half its rows, gradient
            checkpointing or more of the card; None for the optimizer's step, whose AdamW moments (8 bytes a
            trained parameter) no micro-batch changes: more of the card, or an SFT model made elsewhere.
    """
    share = "give the run more of the card (run.gpu_share) if it shares one"
    if micro_batch is None:
        where, options = "the optimizer's step (AdamW's moments)", [share, SFT_ELSEWHERE]
    else:
        rows, length = micro_batch
        where = f"a micro-batch of {rows} samples of {length} tokens (padded to the longest)"
        options = [f"set sft.micro_batch_size={rows // 2} (sft.batch_size={config.batch_size} stays: the "
                   "micro-batches' gradients add up)"] if rows > 1 else []
        options += ["set model.gradient_checkpointing=true (if off; if on, a larger model.checkpointed_layers or "
                    "none)", share]
    return ConfigError(f"SFT ran out of GPU memory in {where}: {'; or '.join(options)}. torch: {torch_said(error)}")


def halving_can_help(budget: int, shortest_pair: int) -> bool:
    """Whether halving a pass's token ``budget`` can make a pass smaller: not where the step's two shortest
    sequences together (``shortest_pair`` tokens; 0: not known; ``sys.maxsize``: a step of one sequence) are over
    the budget, since then no two sequences share a pass and each pass holds one sequence, at this budget and at
    any smaller one."""
    return budget > 1 and (shortest_pair == 0 or shortest_pair <= budget)


def rl_out_of_memory(error: torch.OutOfMemoryError, config: TrainConfig, step: int,
                     checkpoint: Path | None, retried_with: str | None = None,
                     shortest_pair: int = 0) -> ConfigError:
    """An RL step that ran out of GPU memory, as the run's error: what to change as far as the config has it
    (smaller micro-batches and scoring passes where two sequences share a pass, checkpointing, the rollout
    freed during the update, FSDP2's shards on the host, more of the card), the checkpoint to continue from with the
    change, and torch's message. Nothing is saved: the step's update may have stopped halfway. ``retried_with``:
    the settings the step was run again with (:class:`OptimizerSteps`), which ran out of memory too;
    ``shortest_pair``: the tokens of the step's two shortest sequences together (0: not known yet, the step's
    batch unmade)."""
    algorithm, dist = config.algorithm, config.distributed
    options = []
    alone = []  # the token budgets whose passes hold one sequence each already
    if algorithm.micro_batch_tokens > 1:  # 0 would mean passes counted in rows
        if halving_can_help(algorithm.micro_batch_tokens, shortest_pair):
            options.append(f"algorithm.micro_batch_tokens={algorithm.micro_batch_tokens // 2}")
        else:
            alone.append(f"algorithm.micro_batch_tokens={algorithm.micro_batch_tokens}")
    elif algorithm.micro_batch_tokens == 0 and algorithm.micro_batch_size > 1:
        options.append(f"algorithm.micro_batch_size={algorithm.micro_batch_size // 2}")
    if algorithm.score_micro_batch_tokens > 1:  # the scoring passes' own budget, which the update's leaves as it is
        if halving_can_help(algorithm.score_micro_batch_tokens, shortest_pair):
            options.append(f"algorithm.score_micro_batch_tokens={algorithm.score_micro_batch_tokens // 2}")
        else:
            alone.append(f"algorithm.score_micro_batch_tokens={algorithm.score_micro_batch_tokens}")
    if not config.model.gradient_checkpointing:
        options.append("model.gradient_checkpointing=true")
    elif (recomputed := config.model.checkpointed_layers) is not None:
        options.append(f"model.checkpointed_layers above {recomputed} (more layers recomputed; unset: all)")
    # Trainers beside rollout processes sample only to validate and free the rollout after each validation already.
    engine_rollout = config.model.backend != "hf" and not dist.async_rollout and dist.rollout_processes == 0
    if engine_rollout and not config.model.engine.free_during_update:
        options.append("model.engine.free_during_update=true")
    if _shards(config) and not dist.cpu_offload:
        options.append("distributed.cpu_offload=true")
    if config.run.gpu_share < 1:
        options.append(f"run.gpu_share above {config.run.gpu_share:g}")
    change = f"set {'; or '.join(options)}" if options else "use a GPU with more memory (see `turnrl memory`)"
    resume = f"`{turnrl_command()} train resume={checkpoint.parent.parent}`" if checkpoint is not None else ""
    then = (f"; then continue from {checkpoint.name} with {resume} and the change" if checkpoint is not None else
            "; no checkpoint was saved before it (run.save_every=N saves one every N steps): start again with "
            "run.overwrite=true and the change")
    again = f", also when run again with {retried_with}" if retried_with is not None else ""
    pair = f", its two shortest holding {shortest_pair:,} tokens together" if shortest_pair < sys.maxsize else ""
    single = (f" (smaller passes cannot help: at {' and '.join(alone)} no two of the step's sequences share a "
              f"pass{pair})") if alone else ""
    return ConfigError(f"RL step {step} ran out of GPU memory{again}: {change}{single}{then}. `turnrl memory` "
                       f"estimates each GPU's peak by part. torch: {torch_said(error)}")


def _shards(config: TrainConfig) -> bool:
    """Whether the run's trainers hold FSDP2 shards, which ``distributed.cpu_offload`` can move to the host: two
    trainers or more, or ``distributed.backend=fsdp`` (a lone trainer beside rollout processes trains without)."""
    dist = config.distributed
    trainers = dist.nproc_per_node - dist.rollout_processes
    return trainers > 1 or (dist.backend == "fsdp" and dist.rollout_processes == 0)


def halved_micro_batches(algorithm: AlgorithmConfig, shortest_pair: int = 0) -> str | None:
    """Halve the passes of the update and of the scores in place: ``micro_batch_tokens``, or ``micro_batch_size``
    when the micro-batches are counted in rows; and ``score_micro_batch_tokens`` where the scoring passes have
    their own budget (the error may have come from them, which the update's setting leaves as they are). A token
    budget that no two of the step's sequences share stays (:func:`halving_can_help`, ``shortest_pair``: no pass
    would change). Returns the new settings as ``key=value`` separated by spaces, or None (nothing changed) when every
    pass is one row already."""
    settings = []
    if algorithm.micro_batch_tokens > 1:
        if halving_can_help(algorithm.micro_batch_tokens, shortest_pair):
            algorithm.micro_batch_tokens //= 2
            settings.append(f"algorithm.micro_batch_tokens={algorithm.micro_batch_tokens}")
    elif algorithm.micro_batch_tokens == 0 and algorithm.micro_batch_size > 1:
        algorithm.micro_batch_size //= 2
        settings.append(f"algorithm.micro_batch_size={algorithm.micro_batch_size}")
    if halving_can_help(algorithm.score_micro_batch_tokens, shortest_pair):
        algorithm.score_micro_batch_tokens //= 2
        settings.append(f"algorithm.score_micro_batch_tokens={algorithm.score_micro_batch_tokens}")
    return " ".join(settings) or None


class OptimizerSteps:
    """Whether any of some optimizers began a step while this context is open (torch's step pre-hooks).

    An update that runs out of memory before any optimizer step began has changed no weight, moment or
    learning rate (the gradients it accumulated are dropped with ``zero_grad``), so the step can run again;
    one that began a step may have changed some parameters and not others, since the fused and ``foreach``
    updates work through the parameters in several kernels.
    """

    def __init__(self, optimizers: Iterable[torch.optim.Optimizer | None]) -> None:
        self.optimizers = [optimizer for optimizer in optimizers if optimizer is not None]
        self.began = False
        self._handles: list[Any] = []

    def _began(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.began = True

    def __enter__(self) -> OptimizerSteps:
        self.began = False
        self._handles = [optimizer.register_step_pre_hook(self._began) for optimizer in self.optimizers]
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

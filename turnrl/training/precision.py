"""How training's forward and backward passes compute: mixed precision over float32 weights, and the
attention kernels they run on a GPU.

Shared by the stages of a run (SFT, RL) and by any trainer that wires the same components differently.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch.distributed.tensor import DTensor


def skip_cudnn_attention(device: torch.device) -> None:
    """Keep SDPA's own choice off cuDNN's attention kernels in this (training) process on a GPU.

    cuDNN builds a plan for every new shape, and training batches are padded to new lengths step after step:
    on an H100, the 0.5B RAGEN recipe's scoring and update took 1-2 s longer in the steps that met new lengths
    (steps of 5.3 to 8.0 s); with flash and memory-efficient attention, 5.4-5.5 s from the second step on.
    Packed rows ask for cuDNN's kernel themselves, at lengths that meet few shapes
    (:mod:`turnrl.training.packed_attention`, ``model.packed_attention``).
    """
    if device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)


def autocast(device: torch.device, dtype: torch.dtype) -> AbstractContextManager:
    """Mixed precision where the run's dtype asks for it (``model.dtype``; ``auto`` is bf16 on a GPU),
    over float32 weights; a no-op for float32.

    The cache of weight casts is off. Autocast keeps the low-precision copy of each weight until the
    outermost autocast region exits, and the SFT and PPO loops take optimizer steps inside one region:
    with the cache, every forward after the first would still see the first batch's weights (the
    float32 weights move, the copies the forward uses do not), which trained a 0.5B model into garbage.
    """
    if dtype == torch.float32:
        return torch.autocast(device.type, enabled=False)
    return torch.autocast(device.type, dtype=dtype, cache_enabled=False)


class WeightsCastOnce:
    """While open, the trainable weights of a model's linear layers are seen by their modules as copies in
    ``dtype``, cast once and again after each optimizer step (:meth:`refresh`), not by autocast in every pass.

    Why: under autocast each pass casts every float32 weight to bf16 (reading the weights, writing the copy), and
    its backward casts each weight's bf16 gradient to float32 before adding it to ``.grad`` (a second pass over
    float32 gradients). By the sizes, a 3B model moves about 74 GB of memory for these a pass (a pass takes 0.35
    s at ``vlm-3b``'s 8k tokens on an H200). Here autocast finds the copies already in its dtype; a hook adds each
    copy's gradient to its float32 weight's ``.grad`` as autograd accumulates it (one kernel, reading the bf16
    gradient) and drops the copy's. The numbers are the same to the bit: a copy is the cast autocast made, each
    ``.grad`` the float32 sum autograd made, in the same order. Written here because torch's mixed precision
    outside FSDP is autocast, which casts in every pass.

    Left alone: float32 runs (``dtype`` None or float32), weights sharded by FSDP (its own mixed precision casts
    them), frozen weights, and a weight that more than one module holds (a tied embedding and LM head: the
    embedding must keep looking up float32 rows).
    """

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype | None) -> None:
        self.model, self.dtype = model, dtype
        self._held: list[tuple[torch.nn.Module, torch.nn.Parameter, torch.Tensor, Any]] = []

    def _weights(self) -> list[tuple[torch.nn.Module, torch.nn.Parameter]]:
        if self.dtype is None or self.dtype == torch.float32:
            return []
        holders = Counter(id(p) for _, p in self.model.named_parameters(remove_duplicate=False))
        found = []
        for module in self.model.modules():
            weight = module.weight if isinstance(module, torch.nn.Linear) else None
            if isinstance(weight, torch.nn.Parameter) and weight.requires_grad and weight.dtype == torch.float32 \
                    and not isinstance(weight, DTensor) and holders[id(weight)] == 1:
                found.append((module, weight))
        return found

    def __enter__(self) -> WeightsCastOnce:
        for module, weight in self._weights():
            copy = torch.nn.Parameter(weight.detach().to(self.dtype))
            hook = copy.register_post_accumulate_grad_hook(_adds_gradient_to(weight))
            module._parameters["weight"] = copy
            self._held.append((module, weight, copy, hook))
        return self

    def refresh(self) -> None:
        """Cast the float32 weights into their copies again (after an optimizer step or a restore)."""
        with torch.no_grad():
            for _, weight, copy, _ in self._held:
                copy.copy_(weight)

    def __exit__(self, *exception: object) -> None:
        for module, weight, _, hook in self._held:
            hook.remove()
            module._parameters["weight"] = weight
        self._held = []


def _adds_gradient_to(weight: torch.Tensor) -> Callable[[torch.Tensor], None]:
    def add(copy: torch.Tensor) -> None:
        assert copy.grad is not None  # the hook runs once autograd has put it there
        if weight.grad is None:
            weight.grad = copy.grad.to(weight.dtype)
        else:
            weight.grad.add_(copy.grad)
        copy.grad = None
    return add

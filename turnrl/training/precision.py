"""How training's forward and backward passes compute: mixed precision over float32 weights, and the
attention kernels they run on a GPU.

Shared by the stages of a run (SFT, RL) and by any trainer that wires the same components differently.
"""

from __future__ import annotations

from contextlib import AbstractContextManager

import torch


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

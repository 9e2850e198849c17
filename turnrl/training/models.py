"""The models of a run: where they come from and how they run (loading itself is
:mod:`turnrl.models.loading`).

Shared by the stages of a run (SFT, RL) and by any recipe that wires the same
components differently; nothing here knows about the loop.
"""

from __future__ import annotations

import random
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import numpy as np
import torch

from turnrl.config import ModelConfig


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def step_seed(seed: int, step: int) -> int:
    """The seed of one step's sampling and shuffling: a function of (seed, step), so resume is exact."""
    return (seed * 1_000_003 + step) % 2**31


def base_model_path(config: ModelConfig) -> Path | str:
    """``model.path``, or the built-in model of ``model.builtin_preset`` (built on first use)."""
    if config.path is not None:
        return config.path
    from turnrl.models.builtin import builtin_model_path

    return builtin_model_path(config)


def enable_checkpointing(model: Any) -> None:
    """Recompute activations in the backward pass (the method's name changed in transformers 5)."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable()
    else:
        model.gradient_checkpointing_enable()


def skip_cudnn_attention(device: torch.device) -> None:
    """Keep SDPA off cuDNN's attention kernels in this (training) process on a GPU.

    cuDNN builds a plan for every new shape, and training batches are padded to new lengths step after step:
    on an H100, the 0.5B RAGEN recipe's scoring and update took 1-2 s longer in the steps that met new lengths
    (steps of 5.3 to 8.0 s); with flash and memory-efficient attention, 5.4-5.5 s from the second step on.
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

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


def autocast(device: torch.device, dtype: torch.dtype) -> AbstractContextManager:
    """bf16/fp16 autocast on a GPU when the run's dtype asks for it; a no-op otherwise."""
    if device.type == "cuda" and dtype != torch.float32:
        return torch.autocast("cuda", dtype=dtype)
    return torch.autocast("cpu", enabled=False)

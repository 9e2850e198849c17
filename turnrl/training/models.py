"""The models of a run: where they come from, how they load, how they run.

Shared by the stages of a run (SFT, RL) and by any recipe that wires the same
components differently; nothing here knows about the loop.
"""

from __future__ import annotations

import logging
import random
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoProcessor, AutoTokenizer, PreTrainedTokenizerBase

from turnrl.config import ModelConfig

logger = logging.getLogger(__name__)


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


def load_tokenizer(path: Path | str) -> PreTrainedTokenizerBase:
    """The model's tokenizer, with a pad token (its eos token when it has none)."""
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_processor(path: Path | str) -> Any | None:
    """The model's processor where it has one beyond its tokenizer (a VLM's image processor), else None.

    A processor that cannot load for want of a library (Qwen-VL processors need torchvision for their
    video part) is reported and left out: a text env still trains; an image env then stops with a clear
    error where the images would be processed.
    """
    try:
        processor = AutoProcessor.from_pretrained(path)
    except (OSError, ValueError, TypeError, KeyError):  # no processor files, or a tokenizer-only model
        return None
    except ImportError as error:
        logger.warning("the processor of %s cannot load, images cannot be processed: %s", path, error)
        return None
    return None if isinstance(processor, PreTrainedTokenizerBase) else processor


def load_causal_lm(path: Path | str, device: torch.device) -> Any:
    """A causal LM (or VLM) for training: float32 weights (AdamW's master copy; bf16 comes from autocast)."""
    model: Any = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.to(device)


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

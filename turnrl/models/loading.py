"""Loading a model, its tokenizer and its processor by path, text model or VLM alike, and readying it
to train (the path a run starts from, activation checkpointing, a frozen vision tower).

Everything is ``transformers``' own loading: a built-in model and a downloaded
checkpoint take the same path. A VLM is any checkpoint whose config has a
``vision_config``; it loads with ``AutoModelForImageTextToText`` (which maps
Qwen2-VL, Qwen2.5-VL and Qwen3-VL), a text model with ``AutoModelForCausalLM``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoProcessor,
    AutoTokenizer,
    PreTrainedTokenizerBase,
)

from turnrl.config import ModelConfig

logger = logging.getLogger(__name__)


def is_vision_language(path: Path | str) -> bool:
    """Whether the checkpoint at ``path`` is a VLM (its config has a vision part)."""
    return getattr(AutoConfig.from_pretrained(path), "vision_config", None) is not None


def load_model(path: Path | str, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
               attention: str | None = None) -> Any:
    """The causal LM or VLM at ``path`` on ``device``, with weights in ``dtype``.

    Args:
        attention: transformers' ``attn_implementation`` (``sdpa``, ``flex_attention``, ...); None: its default.
    """
    auto = AutoModelForImageTextToText if is_vision_language(path) else AutoModelForCausalLM
    options = {"attn_implementation": attention} if attention is not None else {}
    model: Any = auto.from_pretrained(path, dtype=dtype, **options)
    return model.to(device)


def load_tokenizer(path: Path | str) -> PreTrainedTokenizerBase:
    """The model's tokenizer, with a pad token (its eos token when it has none)."""
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_processor(path: Path | str, min_pixels: int | None = None, max_pixels: int | None = None) -> Any | None:
    """The model's processor where it has one beyond its tokenizer (a VLM's image processor), else None.

    ``min_pixels`` / ``max_pixels`` bound the size images are resized to (Qwen-VL processors: the
    number of pixels, a multiple of 28 x 28 per side pair); None keeps the checkpoint's. A processor
    that cannot load for want of a library is reported and left out: a text env still trains; an
    image env then stops with a clear error where the images would be processed.
    """
    sizes = {key: value for key, value in (("min_pixels", min_pixels), ("max_pixels", max_pixels)) if value}
    try:
        processor = AutoProcessor.from_pretrained(path, **sizes)
    except (OSError, ValueError, TypeError, KeyError):  # no processor files, or a tokenizer-only model
        return None
    except ImportError as error:
        logger.warning("the processor of %s cannot load, images cannot be processed: %s", path, error)
        return None
    if isinstance(processor, PreTrainedTokenizerBase):
        return None
    if processor.tokenizer.pad_token is None:
        processor.tokenizer.pad_token = processor.tokenizer.eos_token
    return processor


VISION_TOWERS = ("visual", "vision_tower", "vision_model")
"""Attribute names of a VLM's vision encoder on its base model (Qwen-VL: ``visual``; LLaVA-style: the others)."""


def vision_tower(model: Any) -> torch.nn.Module | None:
    """The vision encoder of a VLM (peft-wrapped or not), or None for a text model."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    for owner in (getattr(base, "base_model", None), base):
        for name in VISION_TOWERS:
            tower = getattr(owner, name, None)
            if isinstance(tower, torch.nn.Module):
                return tower
    return None


def freeze_vision_tower(model: Any) -> int:
    """Stop gradients into a VLM's vision encoder; returns the number of parameters frozen (0 for text models)."""
    tower = vision_tower(model)
    if tower is None:
        return 0
    tower.requires_grad_(False)
    return sum(p.numel() for p in tower.parameters())


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

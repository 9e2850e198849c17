"""Build a policy from its name: ``expert``, ``random``, ``builtin``, a model path, or ``openai:<model>``."""

from __future__ import annotations

import os
from typing import Any

from torch import nn

from turnrl.agent.formats import ResponseFormat
from turnrl.config import ConfigError, EvalConfig, ModelConfig
from turnrl.policy.base import Policy


def model_policy(
    model: nn.Module,
    tokenizer: Any,
    config: ModelConfig,
    max_batch_size: int,
    processor: Any | None = None,
    dtype: Any | None = None,
) -> Policy:
    """The generation backend for a loaded model, as ``model.backend`` asks.

    ``auto`` takes the engine on a GPU where it can run the model (Llama-family text models; Qwen2-VL, Qwen2.5-VL
    and Qwen3-VL) and transformers' ``generate`` otherwise: other architectures, and CPUs, where the engine was
    slower on the quickstart's short one-turn prompts (docs/engine.md). ``engine`` refuses a model it cannot run.
    ``dtype`` is the compute dtype (the run's mixed precision); None uses the weights' own.
    """
    from turnrl.policy.hf import HFPolicy

    engine = _engine_policy(model, tokenizer, config, max_batch_size, processor, dtype)
    if engine is not None:
        return engine
    return HFPolicy(model, tokenizer, max_batch_size=max_batch_size, processor=processor)  # type: ignore[arg-type]


def rollout_policies(
    model: nn.Module,
    tokenizer: Any,
    config: ModelConfig,
    batch_size: int,
    validation_batch_size: int,
    processor: Any | None = None,
    dtype: Any | None = None,
) -> tuple[Policy, Policy]:
    """The policies of a training run's rollouts and of its validation, both sampling from ``model``, as
    ``model.backend`` asks (see :func:`model_policy`).

    The engine batches continuously whatever the batch size, so one engine (and its one cache) serves
    both; transformers' ``generate`` gets a policy for each batch size: training's at most
    ``max(batch_size, validation_batch_size)`` prompts at once, validation's ``validation_batch_size``.
    """
    from turnrl.policy.hf import HFPolicy

    largest = max(batch_size, validation_batch_size)
    engine = _engine_policy(model, tokenizer, config, largest, processor, dtype)
    if engine is not None:
        return engine, engine
    return (HFPolicy(model, tokenizer, max_batch_size=largest, processor=processor),  # type: ignore[arg-type]
            HFPolicy(model, tokenizer, max_batch_size=validation_batch_size, processor=processor))  # type: ignore[arg-type]


def _engine_policy(
    model: nn.Module, tokenizer: Any, config: ModelConfig, max_batch_size: int, processor: Any | None, dtype: Any | None
) -> Policy | None:
    """The engine where ``model.backend`` asks for it and can have it, else None (transformers' ``generate``).

    Raises:
        ConfigError: ``model.backend=engine`` for a model the engine cannot run.
    """
    from turnrl.engine.families import UnsupportedModel
    from turnrl.policy.engine import EnginePolicy

    wanted = config.backend
    on_gpu = next(model.parameters()).device.type == "cuda"
    if wanted == "engine" or (wanted == "auto" and on_gpu):
        try:
            return EnginePolicy(model, tokenizer, config.engine, dtype=dtype, max_sequences=max_batch_size,
                                processor=processor)
        except UnsupportedModel as error:
            if wanted == "engine":
                raise ConfigError(f"model.backend=engine: {error}") from error
    return None


def load_model_policy(config: ModelConfig, path: str, max_batch_size: int) -> Policy:
    """Load the model at ``path`` (with its tokenizer and, for a VLM, its processor) and wrap it in the
    backend ``config.backend`` asks for (see :func:`model_policy`)."""
    from turnrl.models.devices import resolve_device, resolve_dtype
    from turnrl.models.loading import load_model, load_processor, load_tokenizer

    device = resolve_device(config.device)
    model = load_model(path, dtype=resolve_dtype(config.dtype, device), device=device).eval()
    processor = load_processor(path, config.min_pixels, config.max_pixels)
    return model_policy(model, load_tokenizer(path), config, max_batch_size=max_batch_size, processor=processor)


def make_policy(config: EvalConfig, fmt: ResponseFormat) -> Policy:
    """The policy ``config.policy`` names.

    Raises:
        ConfigError: an unknown name, a model path that does not exist, a hub id that cannot be fetched, or an
            ``openai:`` policy without ``base_url``.
    """
    name = config.policy
    max_actions = config.agent.max_actions_per_turn
    if name == "expert":
        from turnrl.policy.scripted import ExpertPolicy

        return ExpertPolicy(fmt, max_actions, seed=config.seeds.seed)
    if name == "random":
        from turnrl.policy.scripted import RandomPolicy

        return RandomPolicy(fmt, max_actions, seed=config.seeds.seed)
    if name.startswith("openai:"):
        from turnrl.policy.openai_http import OpenAIPolicy

        base_url = config.base_url or os.environ.get("OPENAI_BASE_URL")
        if not base_url:
            raise ConfigError("openai: policies need base_url=... (or $OPENAI_BASE_URL)")
        return OpenAIPolicy(
            base_url=base_url,
            model=name.removeprefix("openai:"),
            api_key=os.environ.get(config.api_key_env),
            concurrency=config.concurrency,
        )
    from turnrl.models.builtin import builtin_model_path
    from turnrl.models.loading import locate_model

    path = str(builtin_model_path(config.model)) if name == "builtin" else name
    if name != "builtin" and not os.path.exists(path) and "/" not in path:
        raise ConfigError(
            f"policy {name!r} is neither expert, random, builtin, openai:<model>, a model directory nor a hub id"
        )
    if name != "builtin":
        locate_model(path, "policy")  # a missing directory or an unreachable hub id: one line, before loading
    return load_model_policy(config.model, path, max_batch_size=config.batch_size)

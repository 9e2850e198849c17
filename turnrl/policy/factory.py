"""Build a policy: a model's generation backend by ``model.backend`` (:data:`POLICY_BACKENDS`: ``auto``,
``engine``, ``hf`` or ``my_package.module:my_backend``), and an evaluation's policy by name (``expert``,
``random``, ``builtin``, a model path, or ``openai:<model>``)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Protocol

from torch import nn

from turnrl.agent.formats import ResponseFormat
from turnrl.config import ConfigError, ModelConfig, check_registered
from turnrl.eval_config import EvalConfig
from turnrl.policy.interface import Policy
from turnrl.registry import Registry, check_callable


@dataclass(frozen=True)
class LoadedModel:
    """A loaded model and what a generation backend needs beside it."""

    model: nn.Module
    """The causal LM (or VLM), on its device."""
    tokenizer: Any
    config: ModelConfig
    """The run's ``model`` section (``config.engine``: the engine's settings)."""
    processor: Any | None = None
    """A VLM's processor; None for a text model."""
    dtype: Any | None = None
    """The compute dtype (the run's mixed precision); None uses the weights' own."""

    @property
    def on_gpu(self) -> bool:
        return next(self.model.parameters()).device.type == "cuda"


class PolicyBackend(Protocol):
    """What ``model.backend`` names: a policy that samples from ``loaded.model``, taking at most
    ``max_batch_size`` prompts at once (a backend that batches continuously, whose :meth:`Policy.streaming` is
    not None, serves training and validation with one policy)."""

    def __call__(self, loaded: LoadedModel, max_batch_size: int, /) -> Policy: ...


def as_policy_backend(obj: Any) -> PolicyBackend:
    """What ``model.backend=module:attr`` names, checked to be a :class:`PolicyBackend`.

    Raises:
        TypeError: a class (a :class:`Policy` class is built by a backend, not one), or a function that cannot
            take ``(loaded, max_batch_size)``, saying what is expected.
    """
    check_callable(obj, PolicyBackend, "a policy backend")
    return obj


POLICY_BACKENDS: Registry[PolicyBackend] = Registry("policy backend", coerce=as_policy_backend)
"""Every generation backend by name; ``model.backend`` takes a name or ``module:attr``."""


@POLICY_BACKENDS.register("hf")
def hf_backend(loaded: LoadedModel, max_batch_size: int) -> Policy:
    """transformers' ``generate``: any model, VLMs included."""
    from turnrl.policy.hf import HFPolicy

    return HFPolicy(loaded.model, loaded.tokenizer, max_batch_size=max_batch_size,  # type: ignore[arg-type]
                    processor=loaded.processor)


@POLICY_BACKENDS.register("engine")
def engine_backend(loaded: LoadedModel, max_batch_size: int) -> Policy:
    """The project's engine (KV cache kept across turns, continuous batching, CUDA graphs).

    Raises:
        ConfigError: a model the engine cannot run.
    """
    from turnrl.engine.families import UnsupportedModel

    try:
        return _engine(loaded, max_batch_size)
    except UnsupportedModel as error:
        raise ConfigError(f"model.backend=engine: {error}") from error


@POLICY_BACKENDS.register("auto")
def auto_backend(loaded: LoadedModel, max_batch_size: int) -> Policy:
    """The engine on a GPU where it can run the model (Llama-family text models; Qwen2-VL, Qwen2.5-VL and
    Qwen3-VL), transformers' ``generate`` otherwise: other architectures, and CPUs, where the engine was slower on
    the quickstart's short one-turn prompts (docs/engine.md)."""
    from turnrl.engine.families import UnsupportedModel

    if loaded.on_gpu:
        try:
            return _engine(loaded, max_batch_size)
        except UnsupportedModel:
            pass
    return hf_backend(loaded, max_batch_size)


def _engine(loaded: LoadedModel, max_batch_size: int) -> Policy:
    """An engine policy, with the families ``model.engine.families`` names added (UnsupportedModel if none runs
    the model)."""
    from turnrl.engine.families import add_families
    from turnrl.policy.engine import EnginePolicy

    add_families(loaded.config.engine.families)
    return EnginePolicy(loaded.model, loaded.tokenizer, loaded.config.engine, dtype=loaded.dtype,
                        max_sequences=max_batch_size, processor=loaded.processor)


def policy_backend(config: ModelConfig) -> PolicyBackend:
    """The backend ``config.backend`` names, after checking the engine families ``config.engine.families`` names.

    Raises:
        ConfigError: an unknown name (listing the registered ones), or a ``module:attr`` that cannot be imported.
    """
    check_model_choices(config)
    return check_registered("model.backend", config.backend, POLICY_BACKENDS)


def check_model_choices(config: ModelConfig) -> None:
    """Check the ``model`` keys that name registered objects: ``model.backend`` and ``model.engine.families``
    (the config layer sits below their registries, so :meth:`ModelConfig.validate` cannot).

    Raises:
        ConfigError: a name that is not registered (listing those that are) nor an importable ``module:attr``.
    """
    from turnrl.engine.families import ENGINE_FAMILIES

    check_registered("model.backend", config.backend, POLICY_BACKENDS)
    for name in config.engine.families:
        check_registered("model.engine.families", name, ENGINE_FAMILIES)


def model_policy(
    model: nn.Module,
    tokenizer: Any,
    config: ModelConfig,
    max_batch_size: int,
    processor: Any | None = None,
    dtype: Any | None = None,
) -> Policy:
    """The generation backend for a loaded model, as ``model.backend`` asks (:data:`POLICY_BACKENDS`).

    ``dtype`` is the compute dtype (the run's mixed precision); None uses the weights' own.
    """
    return policy_backend(config)(LoadedModel(model, tokenizer, config, processor, dtype), max_batch_size)


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

    A policy that batches continuously (the engine: its :meth:`Policy.streaming` is not None) serves both with
    one cache; any other gets a policy for each batch size: training's at most
    ``max(batch_size, validation_batch_size)`` prompts at once, validation's ``validation_batch_size``.
    """
    backend = policy_backend(config)
    loaded = LoadedModel(model, tokenizer, config, processor, dtype)
    policy = backend(loaded, max(batch_size, validation_batch_size))
    if policy.streaming() is not None:
        return policy, policy
    return policy, backend(loaded, validation_batch_size)


def load_model_policy(config: ModelConfig, path: str, max_batch_size: int) -> Policy:
    """Load the model at ``path`` (with its tokenizer and, for a VLM, its processor) and wrap it in the
    backend ``config.backend`` asks for (see :func:`model_policy`; an unknown backend fails before loading)."""
    from turnrl.models.devices import resolve_device, resolve_dtype
    from turnrl.models.loading import load_model, load_processor, load_tokenizer

    policy_backend(config)
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

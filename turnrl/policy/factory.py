"""Build a policy from its name: ``expert``, ``random``, ``builtin``, a model path, or ``openai:<model>``."""

from __future__ import annotations

import os

from turnrl.agent.formats import ResponseFormat
from turnrl.config import ConfigError, EvalConfig
from turnrl.policy.base import Policy


def make_policy(config: EvalConfig, fmt: ResponseFormat) -> Policy:
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
    from turnrl.policy.hf import HFPolicy

    path = str(builtin_model_path(config.model)) if name == "builtin" else name
    if name != "builtin" and not os.path.isdir(path) and "/" not in path:
        raise ConfigError(
            f"policy {name!r} is neither expert, random, builtin, openai:<model>, a model directory nor a hub id"
        )
    return HFPolicy.from_config(config.model, path, max_batch_size=config.batch_size)

"""What ``turnrl eval`` reads of a training recipe (or a run's ``config.yaml``) before it plays: the sections it has
no keys of, skipped; the recipe's validation temperature; its env; and which keys set a budget that the env would
otherwise give. Apart from the evaluation itself, so that ``turnrl config show --eval`` reads a recipe as ``turnrl
eval`` does without loading the rollout, the models and torch."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Any

import yaml

from turnrl.config import given_keys
from turnrl.eval_config import EvalConfig
from turnrl.files import parse_yaml
from turnrl.training.train_config import TrainConfig, ValidationConfig

BUDGET_KEYS = ("agent.max_turns", "agent.max_actions_per_episode")
"""The keys that give an evaluation its turn budget; unless one is set, the env says what a competent agent needs."""


def yaml_mapping(path: str | None) -> dict[str, Any]:
    """The top-level mapping of a YAML file; empty when there is none (no file, not YAML, not a mapping:
    :func:`turnrl.config.load_config` says what is wrong with it)."""
    if path is None or not Path(path).is_file():
        return {}
    try:
        data = parse_yaml(Path(path).read_text())
    except (yaml.YAMLError, UnicodeDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def config_env(config_path: str | None) -> str | None:
    """The ``env.id`` a YAML config names, or None."""
    env = yaml_mapping(config_path).get("env")
    return str(env["id"]) if isinstance(env, dict) and "id" in env else None


def training_sections() -> set[str]:
    """The top-level sections of a training recipe that ``turnrl eval`` has no keys of: reading a recipe (or a run's
    ``config.yaml``), it skips them."""
    return {f.name for f in fields(TrainConfig)} - {f.name for f in fields(EvalConfig)}


def at_validation_temperature(config_path: str | None, overrides: list[str]) -> list[str]:
    """The override that makes an evaluation with a training recipe (or a run's ``config.yaml``) sample at the
    recipe's validation temperature, as its validation did (it evaluates with the recipe's own env, agent and
    sampling settings otherwise); none where ``overrides`` set ``sampling.temperature`` or the config is no recipe."""
    data = yaml_mapping(config_path)
    if not training_sections() & set(data) or "sampling.temperature" in given_keys(None, overrides):
        return []
    validation = data.get("validation")
    temperature = validation.get("temperature") if isinstance(validation, dict) else None
    if not isinstance(temperature, (int, float)):
        temperature = ValidationConfig.temperature
    return [f"sampling.temperature={temperature}"]

"""What ``turnrl eval`` runs (:class:`EvalConfig`, the eval command's config as
:class:`~turnrl.training.train_config.TrainConfig` is the train command's), and the env variants of a
generalization evaluation (``turnrl eval --variants ragen``)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Optional

from turnrl.config import (
    AgentConfig,
    ConfigError,
    EnvConfig,
    ModelConfig,
    RewardsConfig,
    SamplingConfig,
    SeedConfig,
    check_finite_fields,
    check_range,
)


@dataclass
class VariantConfig:
    """One env variant of a generalization evaluation: the policy and its agent settings stay, the env changes."""

    name: str = "???"
    """Its row of the table and its folder under ``variants/`` (letters, digits, ``.``, ``_`` and ``-``)."""
    env: Optional[str] = None
    """The env id; None is ``env.id``, the env the policy was trained on."""
    settings: dict[str, Any] = field(default_factory=dict)
    """Env settings. For the trained env (``env.id``) they go over its settings (``env.val_settings``, else
    ``env.settings``), so ``{size: 8}`` changes the size alone; another env takes them alone."""


VARIANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
"""A variant's name: its folder under ``variants/``."""

VARIANT_SETS: dict[str, tuple[VariantConfig, ...]] = {
    # RAGEN's generalization claim: trained on 6x6 Sokoban with one box, evaluated as trained, on 8x8 rooms
    # with two boxes, on its alternative grid vocabulary (W . G C B A @) and on FrozenLake 4x4.
    # `ragen`: RAGEN's current code (mll-lab-nu/RAGEN 20daedc, config/envs.yaml): LargerSokoban's levels made
    # by 10 backward moves (search_depth: 10), FrozenLake 90% frozen with the intended move 80% of the time
    # (frozen_lake/config.py: p = 0.9; envs.yaml: success_rate: 0.8).
    "ragen": (
        VariantConfig("sokoban-6x6-1box", "Sokoban", {"size": 6, "num_boxes": 1}),
        VariantConfig("sokoban-8x8-2boxes", "Sokoban", {"size": 8, "num_boxes": 2, "search_depth": 10}),
        VariantConfig("sokoban-alt-vocab", "Sokoban", {"size": 6, "num_boxes": 1, "symbols": "alt"}),
        VariantConfig("frozenlake-4x4", "FrozenLake",
                      {"size": 4, "p_frozen": 0.9, "is_slippery": True, "success_rate": 0.8}),
    ),
    # `ragen-v1`: the RAGEN paper (arXiv 2504.20073, its v1 code): the same Sokoban, FrozenLake 80% frozen with
    # gymnasium's slip (the intended move 1/3 of the time).
    "ragen-v1": (
        VariantConfig("sokoban-6x6-1box", "Sokoban", {"size": 6, "num_boxes": 1}),
        VariantConfig("sokoban-8x8-2boxes", "Sokoban", {"size": 8, "num_boxes": 2, "search_depth": 10}),
        VariantConfig("sokoban-alt-vocab", "Sokoban", {"size": 6, "num_boxes": 1, "symbols": "alt"}),
        VariantConfig("frozenlake-4x4", "FrozenLake", {"size": 4, "p_frozen": 0.8, "is_slippery": True}),
    ),
}
"""Named lists of variants (``turnrl eval --variants ragen``)."""


@dataclass
class EvalConfig:
    """What ``turnrl eval`` runs."""

    env: EnvConfig = field(default_factory=EnvConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    sampling: SamplingConfig = field(default_factory=lambda: SamplingConfig(temperature=0.5))
    model: ModelConfig = field(default_factory=ModelConfig)
    seeds: SeedConfig = field(default_factory=SeedConfig)
    rewards: RewardsConfig = field(default_factory=RewardsConfig)
    policy: str = "expert"
    """``expert``, ``random``, ``builtin``, a model directory, or ``openai:<model>``."""
    base_url: Optional[str] = None
    """Endpoint of an OpenAI-compatible server for ``openai:`` policies (default: $OPENAI_BASE_URL)."""
    api_key_env: str = "OPENAI_API_KEY"
    """Environment variable that holds the API key for ``openai:`` policies."""
    concurrency: int = 8
    """Requests in flight at once for HTTP policies."""
    episodes: int = 32
    """Validation seeds evaluated."""
    samples_per_seed: int = 1
    """Episodes per seed (pass@k uses them)."""
    batch_size: int = 64
    """Episodes rolled out together."""
    out: Optional[str] = None
    """Output directory for summary.json and trajectories.jsonl; None writes nothing (``turnrl eval`` then
    picks ``runs/eval/<env>-<policy>-<time>``)."""
    variants: list[VariantConfig] = field(default_factory=list)
    """Env variants to evaluate the policy on, one row of a table each (``turnrl eval --variants ragen``: RAGEN's
    generalization set), with their trajectories in ``variants/<name>/``; empty evaluates ``env`` alone."""

    def validate(self) -> None:
        self.agent.validate()
        self.agent.validate_for_env(self.env.id)
        self.rewards.validate()
        self.sampling.validate()
        self.model.validate()
        self.seeds.validate()
        for key in ("episodes", "samples_per_seed", "batch_size", "concurrency"):
            check_range(key, getattr(self, key), 1)
        if self.episodes > self.seeds.val_size:
            raise ConfigError(f"episodes={self.episodes} exceeds the {self.seeds.val_size} validation seeds "
                              "(seeds.val_size)")
        seen: set[str] = set()
        for index, variant in enumerate(self.variants):
            if not VARIANT_NAME.fullmatch(variant.name):
                raise ConfigError(f"variants[{index}].name={variant.name!r} must be a folder name: letters, digits, "
                                  "'.', '_' and '-', starting with a letter or digit")
            if variant.name in seen:
                raise ConfigError(f"variants[{index}].name={variant.name!r} is used twice; give each variant its own")
            seen.add(variant.name)
            if variant.env is not None and not variant.env.strip():
                raise ConfigError(f"variants[{index}].env is empty; name an env, or leave it out for env.id")
        check_finite_fields(self)  # last: the keys with a check of their own say more than this

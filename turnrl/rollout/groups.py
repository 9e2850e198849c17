"""Env groups: ``n_groups x group_size`` episodes, one seed per group.

Groups are what GRPO-style estimators and StarPO-S filters compare within: the
episodes of a group play the same level (same seed) and differ only by the
policy's sampling. The training seed advances every step; validation seeds are
fixed and disjoint from training seeds (:class:`turnrl.envs.seeds.SeedSplits`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from turnrl.envs.contract import AgentEnv
from turnrl.envs.seeds import SeedSplits
from turnrl.rollout.runner import EpisodeSlot


class EnvGroups:
    """A pool of envs reused across steps, handed out as seeded slots.

    Args:
        make_env: builds one env (called ``n_groups * group_size`` times, lazily).
        n_groups: groups per batch.
        group_size: episodes per group.
        seeds: where training and validation seeds come from.
    """

    def __init__(self, make_env: Callable[[], AgentEnv], n_groups: int, group_size: int, seeds: SeedSplits) -> None:
        if n_groups < 1 or group_size < 1:
            raise ValueError(f"n_groups and group_size must be >= 1, got {n_groups} and {group_size}")
        self.make_env = make_env
        self.n_groups = n_groups
        self.group_size = group_size
        self.seeds = seeds
        self._envs: list[AgentEnv] = []

    @property
    def batch_size(self) -> int:
        return self.n_groups * self.group_size

    def _pool(self, size: int) -> list[AgentEnv]:
        while len(self._envs) < size:
            self._envs.append(self.make_env())
        return self._envs[:size]

    def train_slots(self, step: int, round: int = 0, rounds_per_step: int = 1,
                    first_group: int = 0) -> list[EpisodeSlot]:
        """The slots of training step ``step``: fresh seeds, one per group.

        A step that rolls out several rounds (dynamic sampling) takes ``rounds_per_step`` blocks of seeds
        and its round ``round`` the block's; groups are numbered from ``first_group``.
        """
        seeds = self.seeds.train_seeds(step * rounds_per_step + round, self.n_groups)
        slots = self._slots(seeds, self.group_size)
        for slot in slots:
            slot.group += first_group
        return slots

    def val_slots(
        self, n_seeds: int, samples_per_seed: int = 1, options: dict[str, Any] | None = None,
        envs: int | None = None,
    ) -> list[EpisodeSlot]:
        """The fixed validation slots: the first ``n_seeds`` validation seeds, ``samples_per_seed`` episodes each.

        ``envs``: the slots take that many envs in turn, one batch's: batches of that size play one after another
        and each episode resets its env with its seed, so 512 episodes in batches of 128 hold 128 simulators (or
        env-server sessions), not 512. None: an env a slot.
        """
        return self._slots(self.seeds.val_seeds(n_seeds), samples_per_seed, options, envs)

    def _slots(self, seeds: list[int], per_seed: int, options: dict[str, Any] | None = None,
               envs: int | None = None) -> list[EpisodeSlot]:
        count = len(seeds) * per_seed
        pool = self._pool(count if envs is None else min(count, envs))
        return [
            EpisodeSlot(env=pool[(g * per_seed + k) % len(pool)], seed=seed, group=g, sample=k, options=options)
            for g, seed in enumerate(seeds)
            for k in range(per_seed)
        ]

"""The sharded backend: each ``torchrun`` process plays its share of a step's groups, and every process gets the
whole step's trajectories, in the slots' order (what one process would have played)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from turnrl.chat.template_deltas import ChatTemplateDeltas
from turnrl.config import SamplingConfig
from turnrl.rewards import Rewards
from turnrl.rollout.runner import EpisodeSlot, Rollout, RolloutTimings
from turnrl.rollout.trajectory import Trajectory, sum_by_name
from turnrl.training import ranks
from turnrl.training.backends.backend import Played, PlayStep, StepRollout, WeightsVersion
from turnrl.training.backends.weights_check import PolicyWeights


class RankRewards:
    """A rollout's :class:`Rewards` whose ``metrics()`` are the mean over the processes that scored turns in
    the last rollout (counts, such as judge calls, are per process, as with Ray workers)."""

    def __init__(self, rewards: Rewards) -> None:
        self.rewards = rewards
        self.played = True

    def metrics(self) -> dict[str, float]:
        parts = [part for part, played in ranks.all_gather_objects((self.rewards.metrics(), self.played)) if played]
        keys = {key for part in parts for key in part}
        return {key: sum(part.get(key, 0.0) for part in parts) / len(parts) for key in keys}


def seed_process_sampling(rank: int, world: int) -> None:
    """Seed this process's sampling with a seed of its own, ``base + rank``, ``base`` drawn from torch's generator
    (which the trainer seeds alike on every process for the step), as the Ray workers and rollout processes are.

    Seeded alike, the processes would draw the same random numbers for the k-th rows of their batches (the engine
    takes one uniform a row and token): a group on one process would explore in lockstep with a group on another,
    and two groups of the same level would play the same tokens. Reproducible for a given number of processes; one
    process samples as the local backend does (not reseeded)."""
    base = int(torch.randint(0, 2**31 - world, (1,)))
    torch.manual_seed(base + rank)


class ShardedRollout:
    """A :class:`~turnrl.training.backends.backend.RolloutBackend` that plays this process's groups of the slots
    (group g on process g % world) and returns every process's trajectories, in the slots' order. Each process
    samples with a seed of its own (:func:`seed_process_sampling`): greedy rollouts are the local backend's, sampled
    ones are reproducible for a given number of processes.

    Timings are the slowest process's (the step waits for it); the policies' work counters are summed over the
    processes. Trajectories travel without the chat template object their token context refers to (the
    tokenizer): each process attaches its own. Its policy samples from the parallel strategy's unsharded copy
    of the actor, which the strategy refreshes from the shards before each rollout: :meth:`set_weights` notes the
    trainer's weights, and the next rollout checks that every process's policy computes with them (the trainer's
    side gathered from the shards: all processes take part) and stamps their version on its turns
    (:mod:`~turnrl.training.backends.weights_check`).
    """

    runs_ahead = False
    plays_on_trainer_policy = True

    def __init__(self, rollout: Rollout, tokenizer: Any, precision: Callable[[], AbstractContextManager]) -> None:
        self.rollout = rollout
        self.rewards = RankRewards(rollout.rewards)
        self.timings = RolloutTimings()
        self.tokenizer = tokenizer
        self.precision = precision
        self.deltas: Any = None  # the rollout's own, once it has played a trajectory
        self.weights = PolicyWeights(rollout.policy, f"sharded (process {ranks.rank()})")

    def run(self, slots: Sequence[EpisodeSlot], sampling: SamplingConfig) -> list[Trajectory]:
        self.weights.take()  # on every process, those with no group too: the trainer's side is a collective
        rank, world = ranks.rank(), ranks.world_size()
        mine = [i for i, slot in enumerate(slots) if slot.group % world == rank]
        # The processes' generators are set back as they were after the rollout: what the step draws next (its
        # updates' order of samples) stays alike on every process.
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        with torch.random.fork_rng(devices=devices, enabled=world > 1):
            if world > 1:
                seed_process_sampling(rank, world)
            played = self.rollout.run([slots[i] for i in mine], sampling) if mine else []
        local = self.rollout.timings if mine else RolloutTimings()
        self.rewards.played = bool(mine)
        for trajectory in played:
            if trajectory.tokens is not None:
                self.deltas = trajectory.tokens.deltas
                trajectory.tokens.deltas = None  # type: ignore[assignment]
        gathered = ranks.all_gather_objects((list(zip(mine, played)), local.generate_s, local.env_s,
                                             local.policy_work))
        self.timings = RolloutTimings(max(part[1] for part in gathered), max(part[2] for part in gathered),
                                      sum_by_name([part[3] for part in gathered]))
        by_slot = dict(pair for part in gathered for pair in part[0])
        trajectories = [by_slot[i] for i in range(len(slots))]
        if self.deltas is None and any(t.tokens is not None for t in trajectories):
            # This process has played nothing yet: the pieces its rollout would have used.
            self.deltas = ChatTemplateDeltas.for_tokenizer(self.tokenizer,
                                                           response_prefix=self.rollout.fmt.response_prefix)
        for trajectory in trajectories:
            if trajectory.tokens is not None:
                trajectory.tokens.deltas = self.deltas
        return trajectories

    def roll_out(self, step: int, play: PlayStep[Played]) -> StepRollout[Played]:
        self.weights.take()
        return StepRollout(play(self, step, self.precision()), self.weights.metrics())

    def set_weights(self, model: torch.nn.Module, version: WeightsVersion) -> dict[str, float]:
        self.weights.expect(model, version)
        return {}  # checked, and reported, by the rollout that plays with them

    def exclusive(self) -> AbstractContextManager[Any]:
        return nullcontext()

    def close(self) -> None:
        pass

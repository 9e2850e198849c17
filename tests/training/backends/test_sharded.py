"""The sharded backend in one process, its ranks stood in for: each process samples with numbers of its own, and
one process samples what the local backend does."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from turnrl.agent.formats import get_format
from turnrl.config import AgentConfig, SamplingConfig
from turnrl.envs import make
from turnrl.rollout.runner import EpisodeSlot, Rollout
from turnrl.rollout.trajectory import Trajectory
from turnrl.training import ranks
from turnrl.training.backends.sharded import ShardedRollout

SAMPLED = SamplingConfig(temperature=1.0, max_new_tokens=8)


def as_process(monkeypatch: pytest.MonkeyPatch, rank: int, world: int, slots: int = 2) -> None:
    """This process as ``rank`` of ``world``: the gather hands back its own part, and placeholders for the other
    ones of the ``slots`` (only this process's episodes are looked at)."""

    def gather(value: Any) -> list[Any]:
        pairs, generate_s, env_s, work = value
        mine = {index for index, _ in pairs}
        elsewhere = [(index, Trajectory(env_id="elsewhere", seed=-1, group=-1, sample=0))
                     for index in range(slots) if index not in mine]
        return [(pairs, generate_s, env_s, work), (elsewhere, 0.0, 0.0, {})]

    monkeypatch.setattr(ranks, "rank", lambda: rank)
    monkeypatch.setattr(ranks, "world_size", lambda: world)
    monkeypatch.setattr(ranks, "all_gather_objects", gather)


def one_level_twice() -> list[EpisodeSlot]:
    """Two groups of one episode on the same level: group 0 plays on process 0, group 1 on process 1."""
    return [EpisodeSlot(make("FrozenLake"), seed=7, group=group) for group in (0, 1)]


def responses(trajectory: Trajectory) -> list[list[int]]:
    return [turn.response_ids for turn in trajectory.turns]


@pytest.fixture
def runner(tiny_policy) -> Callable[[], Rollout]:
    agent = AgentConfig(format="no_think", max_turns=2)
    return lambda: Rollout(tiny_policy, get_format(agent.format), agent, env_id="FrozenLake")


def test_processes_sample_their_groups_with_numbers_of_their_own(runner, monkeypatch):
    """Seeded alike by the step, two processes drew the same numbers for their k-th rows: two groups of one level,
    one on each process, played the same tokens (what one process never does), so the groups of different
    processes explored in lockstep."""
    played = []
    for rank in (0, 1):
        as_process(monkeypatch, rank, 2)
        torch.manual_seed(1234)  # the step's seed, the same on every process
        trajectories = ShardedRollout(runner(), tokenizer=None, precision=torch.no_grad).run(one_level_twice(), SAMPLED)
        played.append(responses(trajectories[rank]))
    assert played[0] and played[1]
    assert played[0] != played[1]
    torch.manual_seed(1234)
    local = runner().run(one_level_twice(), SAMPLED)
    assert responses(local[0]) != responses(local[1])  # one process: two rows, two draws


def test_one_process_samples_what_the_local_backend_does(runner, monkeypatch):
    as_process(monkeypatch, 0, 1)
    torch.manual_seed(1234)
    sharded = ShardedRollout(runner(), tokenizer=None, precision=torch.no_grad).run(one_level_twice(), SAMPLED)
    torch.manual_seed(1234)
    local = runner().run(one_level_twice(), SAMPLED)
    assert [responses(t) for t in sharded] == [responses(t) for t in local]

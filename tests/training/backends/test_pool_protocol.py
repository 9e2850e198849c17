"""Trainer 0's end of the rollout processes' protocol on a stand-in channel (no processes): a rollout process that
has gone between two exchanges is named in a :class:`RolloutWorkerError`, the error the run's stop path handles."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import pytest
import torch

from turnrl.config import SamplingConfig
from turnrl.rollout.ray_workers import RolloutWorkerError
from turnrl.rollout.runner import EpisodeSlot
from turnrl.training import wire
from turnrl.training.backends.pool_protocol import PoolGroups, ProcessPool, Ready, Start, TensorSpec


class Done:
    def wait(self, timeout: Any = None) -> bool:
        return True


class Channel:
    """The pool's messages group as trainer 0 sees it: each rollout process answers ``Start`` with ``Ready``; a send
    to one that has ``gone`` fails as gloo's does when the other end has closed its connection."""

    def __init__(self) -> None:
        self.inbox: dict[int, list[torch.Tensor]] = defaultdict(list)
        self.gone: set[int] = set()

    def send(self, tensors: list[torch.Tensor], to: int, tag: int) -> Done:
        if to in self.gone:
            raise RuntimeError("[gloo/transport/tcp/pair.cc:598] Connection closed by peer [127.0.0.1]:40123")
        (tensor,) = tensors
        if tensor.dtype == torch.uint8 and isinstance(wire.loads(tensor), Start):
            answer = wire.dumps(Ready({"pid": 100 + to, "host": "here", "device": "cpu", "dtype": "float32"}))
            self.inbox[to] += [torch.tensor([len(answer)], dtype=torch.long), answer]
        return Done()

    def recv(self, tensors: list[torch.Tensor], source: int, tag: int) -> Done:
        tensors[0].copy_(self.inbox[source].pop(0))
        return Done()


@pytest.fixture
def pool(tiny_tokenizer) -> tuple[ProcessPool, Channel]:
    channel = Channel()
    groups = PoolGroups(channel, channel, rank=0, size=3, device=torch.device("cpu"), timeout_s=5.0)
    return ProcessPool(groups, None, tiny_tokenizer, "", trainers=1), channel  # type: ignore[arg-type]


def test_a_rollout_process_gone_before_a_batch_is_named(pool):
    processes, channel = pool
    channel.gone.add(2)
    slots = [EpisodeSlot(None, seed=5, group=group) for group in (0, 1)]  # type: ignore[arg-type]
    with pytest.raises(RolloutWorkerError, match=r"rollout process 2 \(rank 2, pid 102 on here, cpu\).*Connection "
                                                 r"closed by peer.*Resume the run") as raised:
        processes.run(slots, SamplingConfig())
    assert raised.value.worker == 2


def test_a_rollout_process_gone_before_a_transfer_of_weights_is_named(pool):
    processes, channel = pool
    channel.gone.add(1)
    with pytest.raises(RolloutWorkerError, match=r"rollout process 1 \(rank 1, pid 101") as raised:
        processes.send_weights(3, [TensorSpec("w", (2,), torch.float32)], iter([torch.zeros(2)]))
    assert raised.value.worker == 1

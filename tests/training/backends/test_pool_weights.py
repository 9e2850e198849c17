"""The trainer's side of the rollout processes' weights (:class:`PoolCopy`) without processes: a transfer that fails
part-way still makes every tensor whole on trainer 0, as the other trainer ranks do (each one a collective of
theirs), so that they all go on to share the error instead of waiting in a gather trainer 0 never joins."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import pytest
import torch

from turnrl.rollout.ray_workers import RolloutWorkerError
from turnrl.training.backends import pool_weights
from turnrl.training.backends.backend import WeightsVersion
from turnrl.training.backends.pool_protocol import TensorSpec
from turnrl.training.backends.pool_weights import PoolCopy


class DiesAfterOneTensor:
    """Trainer 0's pool whose rollout process dies once the first tensor of a transfer has gone."""

    processes = [1]

    def send_weights(self, version: int, tensors: Sequence[TensorSpec], values: Iterator[torch.Tensor],
                     to: Sequence[int] | None = None) -> None:
        next(values)
        raise RolloutWorkerError("the transfer of weights to rollout process 1 failed (Connection closed by peer)",
                                 worker=1)


@pytest.mark.parametrize("every", [True, False], ids=["first", "update"])
def test_a_transfer_that_fails_part_way_still_takes_part_in_every_gather(monkeypatch, every):
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    made: list[torch.Tensor] = []

    def whole(tensor: torch.Tensor) -> torch.Tensor:
        made.append(tensor)
        return tensor.detach()

    monkeypatch.setattr(pool_weights, "whole", whole)
    copy = PoolCopy(None, torch.float32, torch.device("cpu"))  # another trainer rank: it makes every tensor
    copy.send(model, WeightsVersion(1, 1), every=every)
    on_other_ranks = list(made)
    made.clear()
    copy = PoolCopy(DiesAfterOneTensor(), torch.float32, torch.device("cpu"))  # type: ignore[arg-type]
    with pytest.raises(RolloutWorkerError, match="rollout process 1"):
        copy.send(model, WeightsVersion(1, 1), every=every)
    assert len(on_other_ranks) == 4
    assert [id(t) for t in made] == [id(t) for t in on_other_ranks]

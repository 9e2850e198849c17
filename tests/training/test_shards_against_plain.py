"""PPO epochs on data-parallel shards against one process: the processes' gradients, averaged as FSDP averages
them, are the one process's gradients, and their reduced metrics its metrics.

The processes are threads of this one, each with its own copy of the models, whose sums and maxima over the
processes (:class:`~turnrl.training.ppo.Shard`'s ``reduce`` and ``most``) meet at a barrier: the rows each
process takes, the weight-0 passes of a process with fewer passes than another and the weights of each pass's
loss are those of a real run, without starting a process (real processes under FSDP2:
tests/training/parallel/test_fsdp2.py). Five rows over two processes leave one process a row short, one row has
no trained token, and the packed passes (a budget of 12 tokens) take rows longest first.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.training.test_ppo import update_inputs
from turnrl.training.algorithm_config import AlgorithmConfig
from turnrl.training.batch import Batch, Sample, collate
from turnrl.training.model_passes import ValueModel
from turnrl.training.packed_attention import ATTENTION
from turnrl.training.ppo import PASS_FILL, Shard, UpdateInputs, ppo_epochs
from turnrl.training.train_config import OptimConfig

WORLD = 2
LOSS_MASKS = ([0, 0, 1, 1, 1, 1, 1, 0], [0, 0, 0, 1], [0, 0, 0, 0, 0], [0, 1, 0, 1, 1, 0], [0, 0, 1, 1, 1, 1, 0, 1, 1])
"""Five rows of 4 to 9 tokens with 5, 1, 0, 3 and 6 trained ones."""
PER_PROCESS_METRICS = ("actor/grad_norm", "critic/grad_norm")
"""The norm of a process's own gradient (FSDP's is the averaged gradient's): not compared."""


class GradientRecorder(torch.optim.Optimizer):
    """An optimizer whose steps keep a copy of the gradients and change nothing (the weights stay where they
    started, so every step's gradients are comparable)."""

    def __init__(self, params: Sequence[torch.nn.Parameter]) -> None:
        super().__init__(list(params), {})
        self.steps: list[list[torch.Tensor]] = []

    def step(self, closure: Callable[[], Any] | None = None) -> None:
        self.steps.append([p.grad.clone() if p.grad is not None else torch.zeros_like(p)
                           for group in self.param_groups for p in group["params"]])


class ThreadRanks:
    """Sums and maxima over ``world`` threads, each calling with its rank: what torch.distributed's all-reduce
    gives processes."""

    def __init__(self, world: int) -> None:
        self.barrier = threading.Barrier(world, timeout=60)
        self.given: list[Any] = [None] * world

    def combine(self, rank: int, value: Any, how: Callable[[list[Any]], Any]) -> Any:
        self.given[rank] = value
        self.barrier.wait()
        out = how(list(self.given))
        self.barrier.wait()  # every rank has read before any writes the next value
        return out

    def shard(self, rank: int) -> Shard:
        def sums(dicts: list[dict[str, float]]) -> dict[str, float]:
            return {key: sum(d.get(key, 0.0) for d in dicts) for key in {k for d in dicts for k in d}}

        return Shard(rank, len(self.given), reduce=lambda d: self.combine(rank, d, sums),
                     most=lambda n: self.combine(rank, n, max))


@pytest.fixture(scope="module")
def models(tiny_model_dir):
    actor = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation=ATTENTION)
    critic = ValueModel(copy.deepcopy(actor.base_model))
    torch.nn.init.normal_(critic.value_head.weight, std=0.5, generator=torch.Generator().manual_seed(5))
    return actor, critic


def five_rows(vocab: int) -> Batch:
    gen = torch.Generator().manual_seed(4)
    samples = [Sample(torch.randint(0, vocab, (len(m),), generator=gen).tolist(), m, [0.0] * len(m), [len(m) - 1],
                      [0.0], episode=k, group=0) for k, m in enumerate(LOSS_MASKS)]
    return collate(samples, pad_id=0)


def train(models, inputs: UpdateInputs, config: AlgorithmConfig, shard: Shard | None
          ) -> tuple[dict[str, float], list[list[torch.Tensor]], list[list[torch.Tensor]]]:
    """One process's epochs on its own copies of the models: its metrics and each optimizer step's gradients."""
    actor, critic = (copy.deepcopy(model) for model in models)
    actor_opt, critic_opt = GradientRecorder(actor.parameters()), GradientRecorder(critic.parameters())
    metrics = ppo_epochs(actor, critic, inputs, config, OptimConfig(grad_clip=1e9), actor_opt, critic_opt, 1.0,
                         torch.Generator().manual_seed(0), shard)
    return metrics, actor_opt.steps, critic_opt.steps


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize("passes", [dict(micro_batch_size=1), dict(micro_batch_tokens=12)], ids=["rows", "packed"])
def test_shards_of_a_mini_batch_average_to_the_gradients_and_metrics_of_one_process(models, aggregation, passes):
    inputs = update_inputs(*models, five_rows(models[0].config.vocab_size))
    settings = dict(mini_batch_size=3, ppo_epochs=1, loss_aggregation=aggregation, entropy_coef=0.01, kl_coef=0.1)
    plain, plain_actor, plain_critic = train(models, inputs, AlgorithmConfig(**settings, micro_batch_size=3), None)
    ranks = ThreadRanks(WORLD)
    sharded = AlgorithmConfig(**settings, **passes)
    with ThreadPoolExecutor(WORLD) as pool:
        runs = [future.result() for future in
                [pool.submit(train, models, inputs, sharded, ranks.shard(rank)) for rank in range(WORLD)]]
    assert len(plain_actor) == len(plain_critic) == 2  # mini-batches of 3 rows and 2 rows
    for process, (metrics, actor_steps, critic_steps) in enumerate(runs):
        assert len(actor_steps) == len(critic_steps) == 2, process
        # The plain run's passes are of rows; the packed shards' also say how full their passes were, over both.
        assert metrics.keys() - {PASS_FILL} == plain.keys(), process
        assert (PASS_FILL in metrics) == ("micro_batch_tokens" in passes), process
        assert metrics.get(PASS_FILL) == runs[0][0].get(PASS_FILL), process
        for key, value in plain.items():
            if key not in PER_PROCESS_METRICS:
                assert metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-7), (process, key)
    for name, plain_steps, which in (("actor", plain_actor, 1), ("critic", plain_critic, 2)):
        for step, expected in enumerate(plain_steps):
            for index, grad in enumerate(expected):
                averaged = sum(run[which][step][index] for run in runs) / WORLD
                tolerance = 1e-5 * float(grad.abs().max()) + 1e-7
                assert float((averaged - grad).abs().max()) <= tolerance, (name, step, index)
    assert any(float(grad.abs().max()) > 0 for grad in plain_actor[0])

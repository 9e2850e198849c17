"""Adding an advantage estimator is this file: one registered function with typed parameters, and its tests.

Nothing else in turnrl changes for it: the config accepts its name and checks its parameters, the advantages
of a batch come from it in both sample modes, and the trainer reads what it needs and logs its metrics.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from turnrl.algorithms import broadcast_to_tokens
from turnrl.algorithms.estimators import EpisodeView, Estimate, SharedSettings, estimator
from turnrl.config import ConfigError, load_config
from turnrl.training.batch_advantages import compute_advantages
from turnrl.training.batch import Sample, collate
from turnrl.training.train_config import TrainConfig


@dataclass(frozen=True)
class BatchBaselineParams:
    scale: float = 1.0
    """Multiplies every advantage."""


@estimator("test_batch_baseline", needs=("episode_weights",), params=BatchBaselineParams)
def batch_baseline(view: EpisodeView, shared: SharedSettings, params: BatchBaselineParams) -> Estimate:
    """REINFORCE with the batch's mean return as the baseline: every token of episode ``i`` gets
    ``scale * (R_i - mean_j R_j)``. No critic, no groups."""
    scores = view.rewards.sum(1)
    advantages = broadcast_to_tokens(params.scale * (scores - scores.mean()), view.mask)
    return Estimate(advantages, advantages, {"batch_return_mean": float(scores.mean())})


# --------------------------------------------------------------------------- its tests
def test_the_config_takes_its_name_and_parameters():
    config = load_config(TrainConfig, None, ["algorithm.advantage=test_batch_baseline",
                                             "algorithm.estimator_params.test_batch_baseline.scale=2",
                                             "groups.group_size=1"])  # it compares no groups
    assert config.algorithm.params == BatchBaselineParams(scale=2.0)
    assert not config.algorithm.uses_critic


def test_a_mistyped_parameter_names_the_parameters_it_takes():
    with pytest.raises(ConfigError, match=r"estimator_params\.test_batch_baseline\.scael .*scale"):
        load_config(TrainConfig, None, ["algorithm.advantage=test_batch_baseline",
                                        "algorithm.estimator_params.test_batch_baseline.scael=2"])


def episodes(mode: str):
    """Two episodes of two one-token turns, returns 1 and 3, as whole trajectories or as turn samples."""
    rewards = {0: [0.0, 1.0], 1: [1.0, 2.0]}
    if mode == "trajectory":
        samples = [Sample([5, 5, 5, 5], [0, 1, 0, 1], [0.0] * 4, [1, 3], r, episode=e, group=e)
                   for e, r in rewards.items()]
    else:
        samples = [Sample([5, 5], [0, 1], [0.0, 0.0], [1], [r[t]], episode=e, group=e, turn=t)
                   for e, r in rewards.items() for t in range(2)]
    return collate(samples, pad_id=0)


@pytest.mark.parametrize("mode", ["trajectory", "turn"])
def test_compute_advantages_runs_it(mode):
    batch = episodes(mode)
    config = load_config(TrainConfig, None, ["algorithm.advantage=test_batch_baseline",
                                             "algorithm.estimator_params.test_batch_baseline.scale=0.5",
                                             f"algorithm.sample_mode={mode}",
                                             "algorithm.loss_aggregation=seq-mean-token-mean"]).algorithm
    out = compute_advantages(batch, config)
    expected = {0: 0.5 * (1.0 - 2.0), 1: 0.5 * (3.0 - 2.0)}
    for row in range(len(batch)):
        sampled = out.advantages[row][batch.loss_mask[row] == 1]
        assert sampled.tolist() == pytest.approx([expected[int(batch.episode[row])]] * len(sampled))
    assert out.metrics == {"actor/batch_return_mean": pytest.approx(2.0)}
    # It declared episode weights: in turn mode under seq-mean-token-mean each turn sample weighs its
    # share of its episode's tokens, times samples per episode (here 1 each).
    if mode == "turn":
        assert torch.equal(out.sample_weights, torch.ones(4))
    else:
        assert out.sample_weights is None


def test_the_trainer_trains_with_it_and_logs_its_metric(tiny_model_dir, tmp_path):
    import json

    from turnrl.training.commands import train

    overrides = [f"model.path={tiny_model_dir}", "model.device=cpu", "model.dtype=float32",
                 "run.tensorboard=false", f"run.output_dir={tmp_path}", "run.steps=1", "env.id=FrozenLake",
                 "agent.format=no_think", "agent.max_turns=2", "sampling.max_new_tokens=8", "groups.n_groups=2",
                 "groups.group_size=2", "validation.episodes=2", "algorithm.mini_batch_size=4",
                 "algorithm.micro_batch_size=2", "algorithm.advantage=test_batch_baseline",
                 "algorithm.sample_mode=turn"]
    train(load_config(TrainConfig, None, overrides))
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    steps = [record for record in map(json.loads, lines) if "rollout/success" in record]
    assert steps and all("actor/batch_return_mean" in record for record in steps)
    assert not (tmp_path / "run" / "checkpoints" / "step_000001" / "critic").exists()

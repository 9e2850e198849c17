"""The passes that only score (old log-probs, the reference's, the critic's values): cut by their own token budget
(``algorithm.score_micro_batch_tokens``), they score every token as the update's micro-batches do."""

from __future__ import annotations

import pytest

from tests.training.reference_run import assert_same_metrics, run_config, step_records, train_in_process
from turnrl.config import ConfigError
from turnrl.training import ppo
from turnrl.training.ppo import MicroBatching


def test_scoring_passes_take_their_own_token_budget_or_else_the_updates(tiny_model_dir, tmp_path):
    plain = run_config(tiny_model_dir, tmp_path, "plain").algorithm
    assert MicroBatching.scoring(plain) == MicroBatching.of(plain) == MicroBatching(2, 0)
    own = run_config(tiny_model_dir, tmp_path, "own", "algorithm.score_micro_batch_tokens=4096").algorithm
    assert MicroBatching.scoring(own) == MicroBatching(2, 4096) and MicroBatching.of(own) == MicroBatching(2, 0)
    packed = run_config(tiny_model_dir, tmp_path, "packed", "algorithm.micro_batch_tokens=256").algorithm
    assert MicroBatching.scoring(packed) == MicroBatching(2, 256)
    with pytest.raises(ConfigError, match="algorithm.score_micro_batch_tokens"):
        run_config(tiny_model_dir, tmp_path, "bad", "algorithm.score_micro_batch_tokens=-1")


def test_a_run_scoring_in_larger_packed_passes_trains_as_the_plain_run(tiny_model_dir, tmp_path, monkeypatch):
    """PPO with a critic, a KL and recomputed old log-probs: the old log-probs, the reference's and the values in
    one packed pass each (the whole batch fits 4,096 tokens) against padded passes of two samples; every step's
    losses and metrics the same to rounding."""
    scored = ("run.steps=2", "algorithm.kl_coef=0.1", "algorithm.old_logprobs=recompute")
    plain = step_records(train_in_process(tiny_model_dir, tmp_path, "plain", *scored))
    passes: list[int] = []
    split = MicroBatching.split

    def counted(self, index, lengths):
        parts = split(self, index, lengths)
        passes.append(len(parts))
        return parts

    monkeypatch.setattr(ppo.MicroBatching, "split", counted)
    packed = step_records(train_in_process(tiny_model_dir, tmp_path, "packed", *scored,
                                           "algorithm.score_micro_batch_tokens=4096"))
    assert 1 in passes and 2 in passes  # the scoring passes take the whole batch; the update's, two samples
    assert plain.keys() == packed.keys() and "actor/kl_ref" in plain[1]
    for step in plain:
        assert_same_metrics(plain[step], packed[step])


def test_with_sampler_log_probs_the_actor_runs_no_scoring_pass():
    """The sampler's log-probs are PPO's old ones and the update measures their drift: scoring without a KL or a
    critic runs nothing (an actor that fails when called would show a pass)."""
    from contextlib import nullcontext

    import torch

    from tests.training.test_ppo import model_batch
    from turnrl.training.algorithm_config import AlgorithmConfig
    from turnrl.training.scoring import score_batch

    class NoPass(torch.nn.Module):
        def forward(self, *args, **kwargs):
            raise AssertionError("the actor ran a scoring pass")

    batch = model_batch(64)
    scores = score_batch(batch, NoPass(), None, None, AlgorithmConfig(kl_coef=0.0), 1.0, nullcontext())
    assert scores.old_logprobs is batch.sampler_logprobs and "actor/logprob_mismatch" not in scores.metrics
    assert scores.ref_logprobs is None and scores.values is None

"""Partial rollouts in the asynchronous backend (``distributed.partial_rollouts``) on the tiny model: with no weights
published mid-batch they are the full rollouts; weights published mid-batch reach the episodes in flight from their
next turn (their earlier turns keep their version and log-probs, the importance weights are each token's own), and
the engine's keys and values of the old weights are computed again."""

from __future__ import annotations

from contextlib import AbstractContextManager

import pytest
import torch

from tests.training.backends.test_asynchronous import TIS, async_config, backend, run_steps
from turnrl.algorithms.losses import truncated_importance_weights
from turnrl.config import ConfigError
from turnrl.engine.llm_engine import weights_version
from turnrl.engine.weights import model_checksum
from turnrl.rollout.runner import Rollout
from turnrl.rollout.trajectory import Trajectory
from turnrl.training.backends.asynchronous import turn_staleness
from turnrl.training.backends.backend import EpisodeRunner, WeightsVersion
from turnrl.training.ppo import MicroBatching, batched_logprobs
from turnrl.training.scoring import make_batch
from turnrl.training.trainer import Trainer

PARTIAL = "distributed.partial_rollouts=true"
# Measurements of the machine rather than of the run (the asynchronous backend's among them).
TIMED = ("timing/", "throughput/", "startup/", "memory/", "async/wait_rollout_s", "async/wait_weights_s",
         "async/publish_s", "async/queue_size")


def test_partial_rollouts_need_the_asynchronous_backend_and_rounds(tmp_path):
    with pytest.raises(ConfigError, match="set distributed.async_rollout=true"):
        async_config(tmp_path, tmp_path, 0, PARTIAL, "distributed.async_rollout=false")
    with pytest.raises(ConfigError, match="agent.wait_for_turns=false has no rounds"):
        async_config(tmp_path, tmp_path, 0, PARTIAL, "agent.wait_for_turns=false", "model.backend=engine")
    async_config(tmp_path, tmp_path, 0, PARTIAL)


def test_partial_rollouts_with_no_weights_published_mid_batch_are_the_full_rollouts(tiny_model_dir, tmp_path):
    """With ``max_staleness=0`` a batch is played before the update that publishes the next weights: no weights
    arrive mid-batch, and the run is the same run, trajectories, metrics and the backend's own counts."""
    full = run_steps(Trainer(async_config(tiny_model_dir, tmp_path, 0, name="full")), 3)
    partial = run_steps(Trainer(async_config(tiny_model_dir, tmp_path, 0, PARTIAL, name="partial")), 3)
    for step, (one, two) in enumerate(zip(full, partial)):
        assert [t.to_json() for t in one.trajectories] == [t.to_json() for t in two.trajectories], step
        assert {k: v for k, v in one.metrics.items() if not k.startswith(TIMED)} == \
            {k: v for k, v in two.metrics.items() if not k.startswith(TIMED)}, step
        assert two.metrics["async/weight_switches"] == 0 and two.metrics["async/turns_behind_mean"] == 0
        assert two.metrics["async/turns_newer_weights_frac"] == 0
    assert full[2].metrics["batch/samples"] > 0  # it trained on every step


def new_actor_weights(trainer: Trainer) -> None:
    """Change the trainer's actor as an update would, and hand it to the backend as the weights after step 1."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in trainer.actor.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
    backend(trainer).set_weights(trainer.actor, WeightsVersion(steps=1, updates=1))


def play_publishing_at_turn_one(trainer: Trainer, reused: list[int]):
    """A ``play`` of a step's groups that publishes new weights just before the second round of turns (as the
    trainer does when its update ends while the batch plays); ``reused`` gets the engine's count of prompt tokens
    read from its cache before each round and at the end."""
    engine = backend(trainer).runner.policy.engine  # type: ignore[attr-defined]

    def play(runner: EpisodeRunner, step: int, precision: AbstractContextManager) -> list[Trajectory]:
        assert isinstance(runner, Rollout)

        def on_turn(turn: int, active: int) -> None:
            reused.append(engine.stats.reused_tokens)
            if turn == 1:
                new_actor_weights(trainer)

        with precision:
            played = runner.run(trainer.train_groups.train_slots(step), trainer.config.sampling, on_turn=on_turn)
        reused.append(engine.stats.reused_tokens)
        return played

    return play


def turn_tokens(batch, row: int) -> list[torch.Tensor]:
    """Each turn's sampled positions in ``batch``'s ``row`` (a whole-trajectory sample)."""
    ends = [int(end) for end in batch.turn_end_index[row] if end >= 0]
    sampled = batch.loss_mask[row].nonzero().flatten()
    starts = [-1, *ends[:-1]]
    return [sampled[(sampled > start) & (sampled <= end)] for start, end in zip(starts, ends)]


def test_weights_published_mid_batch_reach_the_episodes_from_their_next_turn(tiny_model_dir, tmp_path):
    trainer = Trainer(async_config(tiny_model_dir, tmp_path, 1, *TIS, PARTIAL, "model.backend=engine",
                                   "agent.max_turns=3", "run.steps=2"))
    rollout = backend(trainer)
    engine = rollout.runner.policy.engine  # type: ignore[attr-defined]
    reused: list[int] = []
    try:
        # The thread starts at step 1: its batch may sample with the weights of step 0 (one update behind).
        step = rollout.roll_out(1, play_publishing_at_turn_one(trainer, reused))
    finally:
        trainer.close()
    trajectories: list[Trajectory] = step.played

    # Each turn records the weights that sampled it: the first round the old ones, the later rounds the new ones.
    versions = [[turn.weights_version for turn in t.turns] for t in trajectories]
    assert all(v == [0, 1, 1][:len(v)] for v in versions), versions
    assert any(len(v) > 1 for v in versions), "no episode played past its first turn"
    turns = [n for v in versions for n in v]
    assert step.metrics["async/weight_switches"] == 1
    assert step.metrics["async/staleness"] == 1 and step.metrics["async/weights_version"] == 0  # the oldest turn
    assert step.metrics["async/turns_newer_weights_frac"] == pytest.approx(turns.count(1) / len(turns))
    assert step.metrics["async/turns_behind_mean"] == pytest.approx(turns.count(0) / len(turns))

    # The engine computes with the trainer's new weights: the rollout copy took them, the engine its buffers,
    # and the check after the switch compared their checksums.
    assert all(torch.equal(a, b) for a, b in zip(rollout.copy.parameters(), trainer.actor.parameters()))
    assert engine._version == weights_version(rollout.copy)
    assert engine.weights.checksum().agrees(model_checksum(trainer.actor, engine.weights.checksum().dtype))
    assert rollout.checked.check.last is not None and rollout.checked.check.last.version.updates == 1

    # The update's importance weights are each token's own: the turns sampled after the switch agree with the
    # trainer's log-probs (their whole prompt computed with the new weights, none of the old keys and values
    # reused), the first turns do not, and the batch holds each token's sampler log-prob.
    config = trainer.config
    batch = make_batch(trajectories, list(range(len(trajectories))), config.algorithm.sample_mode,
                       trainer.tokenizer.pad_token_id, trainer.device)
    with torch.no_grad(), trainer.precision():
        trainer_logprobs = batched_logprobs(trainer.actor, batch, MicroBatching.of(config.algorithm),
                                            config.sampling.temperature)
    weights = truncated_importance_weights(trainer_logprobs, batch.sampler_logprobs, batch.loss_mask,
                                           config.algorithm.tis_cap)
    old_gaps, new_gaps = [], []
    for row, trajectory in enumerate(trajectories):
        for turn, positions in zip(trajectory.turns, turn_tokens(batch, row)):
            assert batch.sampler_logprobs[row, positions].tolist() == pytest.approx(turn.response_logprobs)
            gap = (trainer_logprobs[row, positions] - batch.sampler_logprobs[row, positions]).abs().max()
            (new_gaps if turn.weights_version == 1 else old_gaps).append(float(gap))
            if turn.weights_version == 1:
                assert torch.allclose(weights[row, positions], torch.ones(len(positions)), atol=1e-3)
    assert max(new_gaps) < 1e-4 and min(old_gaps) > 1e-3, (new_gaps, old_gaps)

    # No prompt token of the round after the switch was read from the cache; the round after it reads the
    # previous turns' tokens there again (the cache is kept across turns as long as the weights stay).
    reused_by_round = [after - before for before, after in zip(reused, reused[1:])]
    assert reused_by_round[0] == 0  # the first turn: nothing cached yet
    assert reused_by_round[1] == 0, "keys and values of the old weights were reused after the switch"
    assert reused_by_round[2] > 0


def test_without_partial_rollouts_the_batch_finishes_on_its_weights(tiny_model_dir, tmp_path):
    trainer = Trainer(async_config(tiny_model_dir, tmp_path, 1, *TIS, "model.backend=engine", "agent.max_turns=3",
                                   "run.steps=2"))
    rollout = backend(trainer)
    reused: list[int] = []
    try:
        step = rollout.roll_out(1, play_publishing_at_turn_one(trainer, reused))
        assert rollout.weights is not None and rollout.weights.held(0) == 0  # taken at the next batch
    finally:
        trainer.close()
    assert {turn.weights_version for t in step.played for turn in t.turns} == {0}
    assert step.metrics["async/weight_switches"] == 0 and step.metrics["async/turns_behind_mean"] == 1
    assert step.metrics["async/turns_newer_weights_frac"] == 0
    assert reused[2] - reused[1] > 0  # the cache of the first turn was read by the second


def test_turn_staleness_counts_turns_by_the_version_that_sampled_them():
    assert turn_staleness(5, 4, {4: 6, 5: 2}) == {"async/turns_behind_mean": 0.75,
                                                  "async/turns_newer_weights_frac": 0.25}
    assert turn_staleness(5, 5, {}) == {}

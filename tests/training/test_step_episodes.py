"""The step's episodes: the rollout's roofline shares read off its counters; the episodes that group statistics
count (the filter's, dynamic sampling's and the advantages' alike)."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch

from tests.rollout.test_runner import CounterEnv, TokenPolicy
from turnrl.agent.formats import ParsedResponse, get_format
from turnrl.config import AgentConfig
from turnrl.envs.seeds import SeedSplits
from turnrl.models import build_tokenizer
from turnrl.rollout.context import EpisodeTokens
from turnrl.rollout.groups import EnvGroups
from turnrl.rollout.runner import Rollout
from turnrl.rollout.trajectory import DONE, ERROR, Trajectory, TurnRecord
from turnrl.training.algorithm_config import AlgorithmConfig, FilterConfig
from turnrl.training.batch_advantages import compute_advantages
from turnrl.training.scoring import make_batch
from turnrl.training.step_episodes import dynamic_sample, rollout_roofline, select_trajectories, varied_groups
from turnrl.training.train_config import GroupsConfig, TrainConfig


def test_the_rollouts_roofline_is_its_work_over_its_device_seconds_at_the_peaks():
    metrics = {"generation/prefill_flops": 3e14, "timing/prefill_device_s": 0.5,
               "generation/decode_bytes": 6e12, "timing/decode_device_s": 2.5}
    shares = rollout_roofline(metrics, flops_peak=1e15, bandwidth=4e12)
    assert shares == pytest.approx({"throughput/prefill_roofline": 3e14 / (0.5 * 1e15),
                                    "throughput/decode_roofline": 6e12 / (2.5 * 4e12)})


@pytest.mark.parametrize(("metrics", "flops_peak", "bandwidth"), [
    ({}, 1e15, 4e12),  # a policy that counts no device work (transformers' generate, a server)
    ({"generation/prefill_flops": 3e14, "timing/prefill_device_s": 0.5,
      "generation/decode_bytes": 6e12, "timing/decode_device_s": 2.5}, None, None),  # a CPU: no peaks
])
def test_no_share_is_made_up_without_device_time_or_a_peak(metrics, flops_peak, bandwidth):
    assert rollout_roofline(metrics, flops_peak, bandwidth) == {}


# --------------------------------------------------------------------------- errored episodes in their groups
TEXTS = ["<answer>win</answer> count=0 Count up with inc; say win to finish."] * 4


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(TEXTS, vocab_size=300)


def episode(tokenizer, group: int, sample: int, reward: float, status: str = DONE) -> Trajectory:
    """A one-turn episode as the rollout records it, its token-exact context included."""
    ids = tokenizer.encode("<answer>win</answer>", add_special_tokens=False) + [tokenizer.eos_token_id]
    tokens = EpisodeTokens(tokenizer)
    tokens.start("Win.", "count=0")
    tokens.add_response(ids, [0.0] * len(ids))
    turn = TurnRecord(index=0, observation="count=0", response="<answer>win</answer>", response_ids=ids,
                      response_logprobs=[0.0] * len(ids), finish_reason="stop",
                      parsed=ParsedResponse(actions=("win",), fields={}, format_ok=True),
                      rewards={"env": reward}, reward=reward)
    return Trajectory(env_id="Counter", seed=100 + group, group=group, sample=sample, turns=[turn], status=status,
                      error="env step failed" if status == ERROR else None, tokens=tokens)


def errored_rollout(tokenizer) -> list[Trajectory]:
    """Group 0: its episodes with outcomes all score 1 and only its errored episode's partial reward (0) differs;
    group 1: outcomes 0, 1, 1 and no error; group 2: outcomes 0 and 1 beside an errored episode."""
    return [episode(tokenizer, 0, 0, 1.0), episode(tokenizer, 0, 1, 1.0), episode(tokenizer, 0, 2, 0.0, ERROR),
            episode(tokenizer, 1, 0, 0.0), episode(tokenizer, 1, 1, 1.0), episode(tokenizer, 1, 2, 1.0),
            episode(tokenizer, 2, 0, 0.0), episode(tokenizer, 2, 1, 1.0), episode(tokenizer, 2, 2, 0.5, ERROR)]


def test_an_errored_episodes_partial_reward_moves_no_groups_filter_score(tokenizer):
    trajectories = errored_rollout(tokenizer)
    # Scored with its errored episode, group 0 ties group 1 (std 0.577) and wins on its smaller id: a kept group
    # whose trained episodes all score alike. Over the outcomes its spread is 0 and group 2's (0.707) is the top.
    keep, metrics = select_trajectories(trajectories, FilterConfig(method="top_k", value=1))
    assert keep == [6, 7]
    keep, metrics = select_trajectories(trajectories, FilterConfig(method="none", drop_zero_variance=True))
    assert keep == [3, 4, 5, 6, 7]
    assert metrics["filter/kept_ratio"] == pytest.approx(2 / 3)
    assert metrics["rollout/zero_variance_groups"] == pytest.approx(1 / 3)
    assert metrics["rollout/in_group_reward_std"] == pytest.approx((0 + 0.5773502691896258 + 0.7071067811865476) / 3)


def test_the_filter_dynamic_sampling_and_the_grpo_baseline_count_the_same_episodes(tokenizer):
    trajectories = errored_rollout(tokenizer)
    keep, _ = select_trajectories(trajectories, FilterConfig(method="none", drop_zero_variance=True))
    assert sorted({trajectories[i].group for i in keep}) == varied_groups(trajectories) == [1, 2]
    batch = make_batch(trajectories, keep, "trajectory", tokenizer.pad_token_id, torch.device("cpu"))
    advantages = compute_advantages(batch, AlgorithmConfig(advantage="grpo")).advantages
    by_hand = {3: -2 / 3 ** 0.5, 4: 1 / 3 ** 0.5, 5: 1 / 3 ** 0.5,  # (r - 2/3) / 0.577
               6: -0.5 ** 0.5, 7: 0.5 ** 0.5}  # (r - 1/2) / 0.707: the errored 0.5 is no part of the mean
    for row, index in enumerate(keep):
        sampled = advantages[row][batch.loss_mask[row] != 0]
        assert torch.allclose(sampled, torch.full_like(sampled, by_hand[index]), atol=1e-5)


def test_no_episode_with_an_outcome_skips_the_step(tokenizer):
    trajectories = [episode(tokenizer, 0, k, float(k), ERROR) for k in range(2)]
    keep, metrics = select_trajectories(trajectories, FilterConfig(method="top_k", value=1, on_empty="keep_all"))
    assert keep == [] and metrics["filter/skipped_step"] == 1.0 and varied_groups(trajectories) == []


class PlannedCounter(CounterEnv):
    """A counter whose episode the policy plays by its ``plan``: ``win`` (reward 1), ``inc`` (0.1) or ``fail``
    (the env raises at its first step: an errored episode)."""

    def __init__(self, plan: str) -> None:
        super().__init__(fail_step=1 if plan == "fail" else None)
        self.plan = "inc" if plan == "fail" else plan


def test_dynamic_sampling_trains_a_varied_group_without_its_errored_episode(tokenizer):
    plans = iter(["win", "win", "fail",  # outcomes alike beside the error: not varied
                  "win", "inc", "fail"])  # outcomes that differ beside the error: varied
    groups = EnvGroups(lambda: PlannedCounter(next(plans)), n_groups=2, group_size=3, seeds=SeedSplits())
    policy = TokenPolicy(tokenizer, lambda request: f"<answer>{request.env.plan}</answer>")
    agent = AgentConfig(format="no_think", max_turns=1)
    rollout = Rollout(policy, get_format("no_think"), agent, "Counter")
    config = TrainConfig(agent=agent, groups=GroupsConfig(n_groups=2, group_size=3),
                         algorithm=AlgorithmConfig(advantage="grpo", dynamic_sampling=True,
                                                   dynamic_sampling_rounds=0))
    output, keep = dynamic_sample(rollout, groups, 0, config, nullcontext())
    assert [t.status for t in output.trajectories].count(ERROR) == 2
    assert keep == [3, 4] and all(output.trajectories[i].trainable for i in keep)
    assert output.metrics["rollout/dynamic_kept_groups"] == 1.0
    assert output.metrics["rollout/zero_variance_groups"] == 0.5

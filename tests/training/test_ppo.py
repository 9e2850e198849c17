"""The update half of a step: advantages wired from a batch, and the PPO epochs (accumulation, skipping)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from turnrl.algorithms import (
    bilevel_gae,
    broadcast_to_tokens,
    grpo_advantages,
    masked_gae,
    place_rewards,
    reinforce_pp_advantages,
    rloo_advantages,
    turn_gae,
    whiten,
)
from turnrl.training.batch import Sample, collate
from turnrl.training.config import ADVANTAGES, AlgorithmConfig, OptimConfig
from turnrl.training.forward import ValueModel, token_logprobs
from turnrl.training.ppo import (
    UpdateInputs,
    batched_logprobs,
    batched_values,
    compute_advantages,
    episode_scores,
    ppo_epochs,
    turn_lambda_returns,
)

# Distinct values for every discount, so that a parameter wired to the wrong place changes the result.
DISCOUNTS = dict(gamma=0.97, lam=0.9, gamma_turn=0.8, lambda_turn=0.7, gamma_token=0.95, lambda_token=0.85)


def config(**overrides) -> AlgorithmConfig:
    return AlgorithmConfig(**{**DISCOUNTS, **overrides})


# --------------------------------------------------------------------------- batches
def trajectory_batch():
    """Episodes with several turns, observation gaps and padding; two groups, one of three and one of two."""
    gen = torch.Generator().manual_seed(0)
    rows = [  # (loss mask, turn ends, turn rewards, group)
        ([0, 0, 1, 1, 1, 0, 0, 1, 1, 0, 1, 1, 1], [4, 8, 12], [0.5, -0.1, 1.0], 0),
        ([0, 1, 1, 0, 0, 1], [2, 5], [0.0, 2.0], 0),
        ([0, 0, 0, 1, 1, 1, 1, 0, 1], [6, 8], [1.0, 0.0], 0),
        ([0, 1, 1, 1, 0, 1, 1, 0, 0, 1, 1], [3, 6, 10], [-0.1, -0.1, 0.3], 1),
        ([0, 0, 1, 1], [3], [0.7], 1),
    ]
    samples = [
        Sample(torch.randint(0, 100, (len(m),), generator=gen).tolist(), m, [-0.5 * k for k in m], ends, rewards,
               episode=e, group=g)
        for e, (m, ends, rewards, g) in enumerate(rows)
    ]
    batch = collate(samples, pad_id=0)
    values = torch.randn(batch.input_ids.shape, generator=gen) * batch.loss_mask
    return batch, values


def turn_batch():
    """Turn samples of three episodes (ids 0, 3 and 5, as after filtering) in a shuffled order."""
    gen = torch.Generator().manual_seed(1)
    episodes = {0: (0, [1.0, 0.0, 2.0]), 3: (0, [0.5, 0.5]), 5: (1, [-0.1, 0.0, 0.0, 1.0])}  # group, turn rewards
    samples = []
    for episode, (group, rewards) in episodes.items():
        for turn, reward in enumerate(rewards):
            prompt, response = 3 + turn, 2 + (turn + episode) % 3
            mask = [0] * prompt + [1] * response
            samples.append(Sample(torch.randint(0, 100, (len(mask),), generator=gen).tolist(), mask,
                                  [-0.3] * prompt + [-0.2] * response, [len(mask) - 1], [reward],
                                  episode=episode, group=group, turn=turn))
    order = torch.randperm(len(samples), generator=gen).tolist()
    batch = collate([samples[i] for i in order], pad_id=0)
    values = torch.randn(batch.input_ids.shape, generator=gen) * batch.loss_mask
    return batch, values, episodes


# --------------------------------------------------------------------------- trajectory mode
@pytest.mark.parametrize("placement", ["per_turn", "episode_end"])
@pytest.mark.parametrize("whiten_advantages", [True, False])
@pytest.mark.parametrize("estimator", ["gae", "bilevel_gae", "turn_gae", "reinforce_pp"])
def test_token_estimators_equal_the_algorithm_called_by_hand(estimator, placement, whiten_advantages):
    batch, values = trajectory_batch()
    cfg = config(advantage=estimator, reward_placement=placement, whiten_advantages=whiten_advantages)
    mask, ends = batch.loss_mask, batch.turn_end_mask
    rewards = place_rewards(batch.turn_rewards, batch.turn_end_index, batch.input_ids.shape[1], mode=placement)
    if estimator == "reinforce_pp":
        expected = reinforce_pp_advantages(rewards, mask, gamma=0.97)
    else:
        if estimator == "gae":
            adv, ret = masked_gae(rewards, values, mask, gamma=0.97, lam=0.9)
        elif estimator == "bilevel_gae":
            adv, ret = bilevel_gae(rewards, values, mask, ends, gamma_turn=0.8, lambda_turn=0.7,
                                   gamma_token=0.95, lambda_token=0.85)
        else:
            adv, ret = turn_gae(rewards, values, mask, ends, gamma=0.8, lam=0.7)
        expected = (whiten(adv, mask) * mask if whiten_advantages else adv, ret)
    advantages, returns = compute_advantages(batch, values if estimator != "reinforce_pp" else None, cfg)
    assert torch.allclose(advantages, expected[0], atol=1e-6)
    assert torch.allclose(returns, expected[1], atol=1e-6)
    assert not advantages[mask == 0].any() and not returns[mask == 0].any()


@pytest.mark.parametrize("estimator", ["grpo", "drgrpo", "rloo"])
def test_group_estimators_equal_the_algorithm_called_by_hand(estimator):
    batch, _ = trajectory_batch()
    scores = batch.turn_rewards.sum(1)
    if estimator == "rloo":
        seq = rloo_advantages(scores, batch.group)
    else:
        seq = grpo_advantages(scores, batch.group, norm_by_std=estimator == "grpo")
    expected = broadcast_to_tokens(seq, batch.loss_mask)
    advantages, returns = compute_advantages(batch, None, config(advantage=estimator))
    assert torch.allclose(advantages, expected, atol=1e-6) and torch.equal(returns, advantages)
    assert advantages[0][batch.loss_mask[0] == 1].unique().numel() == 1  # one advantage per episode


def test_critic_estimators_without_values_fail_loudly():
    batch, _ = trajectory_batch()
    with pytest.raises((AssertionError, ValueError), match="critic"):
        compute_advantages(batch, None, config(advantage="gae"))
    turns, _, _ = turn_batch()
    with pytest.raises(ValueError, match="critic"):
        compute_advantages(turns, None, config(advantage="bilevel_gae", sample_mode="turn"))


def test_episode_scores_sum_every_turn_of_the_episode():
    batch, _, episodes = turn_batch()
    totals = {e: sum(rewards) for e, (_, rewards) in episodes.items()}
    assert torch.allclose(episode_scores(batch), torch.tensor([totals[int(e)] for e in batch.episode]))


# --------------------------------------------------------------------------- turn mode
def loop_turn_gae(batch, end_values, gamma, lam):
    """Plain GAE over each episode's turns: ``{(episode, turn): (A_t, A_t + V_t)}``."""
    per_episode: dict[int, dict[int, tuple[float, float]]] = {}
    for row in range(len(batch)):
        per_episode.setdefault(int(batch.episode[row]), {})[int(batch.turn[row])] = (
            float(batch.turn_rewards[row, 0]), float(end_values[row]))
    out = {}
    for episode, turns in per_episode.items():
        last, next_value = 0.0, 0.0
        for t in sorted(turns, reverse=True):
            reward, value = turns[t]
            last = reward + gamma * next_value - value + gamma * lam * last
            out[episode, t] = (last, last + value)
            next_value = value
    return out


def end_values_of(batch, values):
    return values[torch.arange(len(batch)), batch.turn_end_index[:, 0]]


def test_turn_lambda_returns_equal_a_loop_over_episodes_and_turns():
    batch, values, _ = turn_batch()
    end_values = end_values_of(batch, values)
    expected = loop_turn_gae(batch, end_values, 0.8, 0.7)
    returns = turn_lambda_returns(batch, end_values, gamma=0.8, lam=0.7)
    for row in range(len(batch)):
        assert math.isclose(float(returns[row]), expected[int(batch.episode[row]), int(batch.turn[row])][1],
                            abs_tol=1e-5)


@pytest.mark.parametrize(
    "estimator, gamma, lam", [("gae", 0.97, 0.9), ("bilevel_gae", 0.8, 0.7), ("turn_gae", 0.8, 0.7)]
)
def test_turn_mode_advantage_at_each_turn_end_is_the_turn_level_advantage(estimator, gamma, lam):
    batch, values, _ = turn_batch()
    cfg = config(advantage=estimator, sample_mode="turn", whiten_advantages=False)
    advantages, returns = compute_advantages(batch, values, cfg)
    expected = loop_turn_gae(batch, end_values_of(batch, values), gamma, lam)
    rows = torch.arange(len(batch))
    ends = batch.turn_end_index[:, 0]
    for row in range(len(batch)):
        a_t, r_t = expected[int(batch.episode[row]), int(batch.turn[row])]
        assert math.isclose(float(advantages[row, ends[row]]), a_t, abs_tol=1e-5)
        assert math.isclose(float(returns[row, ends[row]]), r_t, abs_tol=1e-5)
    assert not advantages[batch.loss_mask == 0].any()
    assert advantages[rows, ends].abs().sum() > 0


def test_turn_mode_episode_end_placement_pays_the_episode_total_at_its_last_turn():
    batch, values, episodes = turn_batch()
    last_turn = {e: len(rewards) - 1 for e, (_, rewards) in episodes.items()}
    moved = copy.deepcopy(batch)
    for row in range(len(batch)):
        episode = int(batch.episode[row])
        total = sum(episodes[episode][1])
        moved.turn_rewards[row, 0] = total if int(batch.turn[row]) == last_turn[episode] else 0.0
    cfg = config(advantage="turn_gae", sample_mode="turn", reward_placement="episode_end", whiten_advantages=False)
    advantages, returns = compute_advantages(batch, values, cfg)
    expected = compute_advantages(moved, values, config(advantage="turn_gae", sample_mode="turn",
                                                        whiten_advantages=False))
    assert torch.allclose(advantages, expected[0], atol=1e-6) and torch.allclose(returns, expected[1], atol=1e-6)
    per_turn = compute_advantages(batch, values, config(advantage="turn_gae", sample_mode="turn",
                                                        whiten_advantages=False))
    assert not torch.allclose(advantages, per_turn[0], atol=1e-3)  # with gamma_turn < 1 the placement matters


@pytest.mark.parametrize("estimator", ["grpo", "drgrpo", "rloo"])
def test_turn_mode_group_estimators_give_every_turn_its_episodes_group_advantage(estimator):
    batch, _, episodes = turn_batch()
    # Groups compare episodes, not turn samples: an episode with more turns must not weigh more.
    by_group: dict[int, list[tuple[int, float]]] = {}
    for episode, (group, rewards) in episodes.items():
        by_group.setdefault(group, []).append((episode, sum(rewards)))
    expected = {}
    for members in by_group.values():
        scores = [s for _, s in members]
        mean = sum(scores) / len(scores)
        std = math.sqrt(sum((s - mean) ** 2 for s in scores) / (len(scores) - 1)) if len(scores) > 1 else 0.0
        for episode, score in members:
            if estimator == "grpo":
                expected[episode] = (score - mean) / (std + 1e-6)
            elif estimator == "drgrpo":
                expected[episode] = score - mean
            else:
                n = len(scores)
                expected[episode] = (score - (sum(scores) - score) / (n - 1)) if n > 1 else 0.0
    # Each turn sample is weighted by (mean turns per episode) / (turns of its episode),
    # so that every episode counts once however many turns it took.
    turns = {e: sum(int(x) == e for x in batch.episode) for e in episodes}
    mean_turns = sum(turns.values()) / len(turns)
    advantages, _ = compute_advantages(batch, None, config(advantage=estimator, sample_mode="turn"))
    for row in range(len(batch)):
        episode = int(batch.episode[row])
        tokens = advantages[row][batch.loss_mask[row] == 1]
        want = expected[episode] * mean_turns / turns[episode]
        assert torch.allclose(tokens, torch.full_like(tokens, want), atol=1e-5)


def test_turn_mode_group_advantages_sum_to_zero_over_turn_samples():
    batch, _, _ = turn_batch()
    advantages, _ = compute_advantages(batch, None, config(advantage="grpo", sample_mode="turn"))
    per_sample = (advantages * batch.loss_mask).sum(1) / batch.loss_mask.sum(1)
    for group in batch.group.unique():
        assert abs(float(per_sample[batch.group == group].sum())) < 1e-4


def test_turn_mode_reinforce_pp_credits_later_turns_without_a_critic():
    batch, _, _ = turn_batch()
    cfg = config(advantage="reinforce_pp", sample_mode="turn")
    advantages, returns = compute_advantages(batch, None, cfg)
    expected = loop_turn_gae(batch, torch.zeros(len(batch)), gamma=0.97, lam=1.0)  # V = 0: discounted return-to-go
    for row in range(len(batch)):
        end = int(batch.turn_end_index[row, 0])
        assert math.isclose(float(returns[row, end]), expected[int(batch.episode[row]), int(batch.turn[row])][1],
                            abs_tol=1e-5)
    assert torch.allclose(advantages, whiten(returns, batch.loss_mask), atol=1e-6)


# --------------------------------------------------------------------------- KL in the reward
def test_kl_in_reward_is_subtracted_from_the_token_rewards():
    batch, values = trajectory_batch()
    kl = torch.rand(batch.input_ids.shape, generator=torch.Generator().manual_seed(3))
    cfg = config(advantage="gae", kl_coef=0.2, kl_in_reward=True, whiten_advantages=False)
    rewards = place_rewards(batch.turn_rewards, batch.turn_end_index, batch.input_ids.shape[1])
    expected = masked_gae(rewards - 0.2 * kl * batch.loss_mask, values, batch.loss_mask, gamma=0.97, lam=0.9)
    advantages, returns = compute_advantages(batch, values, cfg, kl)
    assert torch.allclose(advantages, expected[0], atol=1e-6) and torch.allclose(returns, expected[1], atol=1e-6)
    without = compute_advantages(batch, values, config(advantage="gae", kl_coef=0.2, whiten_advantages=False), kl)
    assert torch.allclose(without[0], compute_advantages(batch, values, config(advantage="gae",
                                                          whiten_advantages=False))[0])
    assert not torch.allclose(without[0], advantages, atol=1e-3)


@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
def test_kl_in_reward_lowers_the_episode_scores_of_group_estimators(estimator):
    batch, _ = trajectory_batch()
    kl = torch.rand(batch.input_ids.shape, generator=torch.Generator().manual_seed(4))
    scores = batch.turn_rewards.sum(1) - 0.2 * (kl * batch.loss_mask).sum(1)
    seq = rloo_advantages(scores, batch.group) if estimator == "rloo" else grpo_advantages(scores, batch.group)
    advantages, _ = compute_advantages(batch, None, config(advantage=estimator, kl_coef=0.2, kl_in_reward=True), kl)
    assert torch.allclose(advantages, broadcast_to_tokens(seq, batch.loss_mask), atol=1e-5)


# --------------------------------------------------------------------------- forward passes without grad
@pytest.fixture
def actor(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)


@pytest.fixture
def critic(actor):
    critic = ValueModel(copy.deepcopy(actor.base_model))
    torch.nn.init.normal_(critic.value_head.weight, std=0.5, generator=torch.Generator().manual_seed(5))
    return critic


def model_batch(vocab: int):
    """Four samples with 5, 1, 0 and 3 trained tokens, right-padded."""
    gen = torch.Generator().manual_seed(2)
    masks = [[0, 0, 1, 1, 1, 1, 1, 0], [0, 0, 0, 1], [0, 0, 0, 0, 0], [0, 1, 0, 1, 1, 0]]
    samples = [Sample(torch.randint(0, vocab, (len(m),), generator=gen).tolist(), m, [0.0] * len(m), [len(m) - 1],
                      [0.0], episode=k, group=0) for k, m in enumerate(masks)]
    return collate(samples, pad_id=0)


def test_batched_forward_passes_equal_one_pass_over_the_batch(actor, critic):
    batch = model_batch(actor.config.vocab_size)
    with torch.no_grad():
        full, _ = token_logprobs(actor, batch.input_ids, batch.attention_mask, batch.loss_mask, 0.8)
        values = critic(batch.input_ids, batch.attention_mask) * batch.loss_mask
    assert torch.allclose(batched_logprobs(actor, batch, 1, 0.8), full, atol=1e-6)
    assert torch.allclose(batched_logprobs(actor, batch, 3, 0.8), full, atol=1e-6)
    assert torch.allclose(batched_values(critic, batch, 3), values, atol=1e-6)


# --------------------------------------------------------------------------- PPO epochs
def update_inputs(actor, critic, batch, seed=0):
    gen = torch.Generator().manual_seed(seed)
    mask = batch.loss_mask
    noise = lambda: torch.randn(batch.input_ids.shape, generator=gen) * mask  # noqa: E731
    old = batched_logprobs(actor, batch, 4, 1.0) + 0.3 * noise()  # ratios off 1: some tokens clip
    values = batched_values(critic, batch, 4)
    return UpdateInputs(batch, old, noise(), noise(), values + 0.2 * noise(), old + 0.1 * noise())


def run_epochs(actor, critic, inputs, cfg, optim=None, actor_optimizer=True, critic_optimizer=True):
    actor_opt = torch.optim.SGD(actor.parameters(), lr=0.5) if actor_optimizer else None
    critic_opt = torch.optim.SGD(critic.parameters(), lr=0.5) if critic_optimizer else None
    return ppo_epochs(actor, critic, inputs, cfg, optim or OptimConfig(grad_clip=1e9), actor_opt, critic_opt, 1.0,
                      torch.Generator().manual_seed(0))


def params(module):
    return {name: p.detach().clone() for name, p in module.named_parameters()}


def assert_same_update(got: torch.Tensor, expected: torch.Tensor, name: str) -> None:
    """Equal up to float32 rounding: within 1e-5 of the largest change of the tensor (plus the rounding of
    parameters near 1, such as norm weights)."""
    tolerance = 1e-5 * float(expected.abs().max()) + 1e-6
    assert float((got - expected).abs().max()) <= tolerance, name


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_micro_batch_accumulation_equals_one_big_batch(actor, critic, aggregation):
    batch = model_batch(actor.config.vocab_size)
    inputs = update_inputs(actor, critic, batch)
    start_actor, start_critic = params(actor), params(critic)
    updates = []
    for micro in (1, 4):
        a, c = copy.deepcopy(actor), copy.deepcopy(critic)
        cfg = config(mini_batch_size=4, micro_batch_size=micro, loss_aggregation=aggregation, entropy_coef=0.01,
                     kl_coef=0.1, ppo_epochs=1)
        metrics = run_epochs(a, c, inputs, cfg)
        assert metrics["actor/skipped_steps"] == 0 and metrics["critic/skipped_steps"] == 0
        updates.append(({n: p - start_actor[n] for n, p in params(a).items()},
                        {n: p - start_critic[n] for n, p in params(c).items()}))
    (actor_micro, critic_micro), (actor_big, critic_big) = updates
    for name, delta in actor_big.items():
        assert_same_update(actor_micro[name], delta, name)
    for name, delta in critic_big.items():
        assert_same_update(critic_micro[name], delta, name)
    assert sum(float(d.abs().sum()) for d in actor_big.values()) > 0
    assert sum(float(d.abs().sum()) for d in critic_big.values()) > 0


def test_gradient_norm_above_the_threshold_skips_and_counts_every_step(actor, critic):
    batch = model_batch(actor.config.vocab_size)
    inputs = update_inputs(actor, critic, batch)
    before_actor, before_critic = params(actor), params(critic)
    cfg = config(mini_batch_size=2, micro_batch_size=1, ppo_epochs=2)
    metrics = run_epochs(actor, critic, inputs, cfg, OptimConfig(grad_clip=1.0, skip_grad_norm_above=1e-9))
    assert metrics["actor/skipped_steps"] == 4 and metrics["critic/skipped_steps"] == 4  # 2 epochs x 2 mini-batches
    assert metrics["actor/grad_norm"] > 1e-9
    assert all(torch.equal(p, before_actor[n]) for n, p in params(actor).items())
    assert all(torch.equal(p, before_critic[n]) for n, p in params(critic).items())
    assert all(p.grad is None for p in actor.parameters())


def test_non_finite_loss_skips_only_its_own_step(actor, critic):
    batch = model_batch(actor.config.vocab_size)
    inputs = update_inputs(actor, critic, batch)
    inputs.advantages[0, 3] = float("nan")  # a trained token of sample 0
    inputs.returns[3, 3] = float("inf")  # a trained token of sample 3
    before_actor, before_critic = params(actor), params(critic)
    metrics = run_epochs(actor, critic, inputs, config(mini_batch_size=1, micro_batch_size=1))
    assert metrics["actor/skipped_steps"] == 1 and metrics["critic/skipped_steps"] == 1
    after_actor, after_critic = params(actor), params(critic)
    assert all(bool(torch.isfinite(p).all()) for p in [*after_actor.values(), *after_critic.values()])
    assert any(not torch.equal(p, before_actor[n]) for n, p in after_actor.items())  # the other steps ran
    assert any(not torch.equal(p, before_critic[n]) for n, p in after_critic.items())


def test_without_an_actor_optimizer_only_the_critic_trains(actor, critic):
    batch = model_batch(actor.config.vocab_size)
    inputs = update_inputs(actor, critic, batch)
    before_actor, before_critic = params(actor), params(critic)
    metrics = run_epochs(actor, critic, inputs, config(mini_batch_size=4, micro_batch_size=2), actor_optimizer=False)
    assert all(torch.equal(p, before_actor[n]) for n, p in params(actor).items())
    assert all(p.grad is None for p in actor.parameters())
    assert any(not torch.equal(p, before_critic[n]) for n, p in params(critic).items())
    assert "losses/value" in metrics and not any(k.startswith("actor/") or k == "losses/policy" for k in metrics)


def test_actor_only_update_leaves_no_critic_metrics(actor):
    batch = model_batch(actor.config.vocab_size)
    old = batched_logprobs(actor, batch, 4, 1.0)
    inputs = UpdateInputs(batch, old, batch.loss_mask.clone(), batch.loss_mask.clone())
    before = params(actor)
    metrics = ppo_epochs(actor, None, inputs, config(mini_batch_size=4, micro_batch_size=4), OptimConfig(),
                         torch.optim.SGD(actor.parameters(), lr=0.1), None, 1.0, torch.Generator().manual_seed(0))
    assert not any(k.startswith("critic/") for k in metrics)
    assert metrics["losses/policy"] < 0  # positive advantages at ratio 1: loss -1 per token
    assert any(not torch.equal(p, before[n]) for n, p in params(actor).items())


@pytest.mark.parametrize("estimator", ADVANTAGES)
@pytest.mark.parametrize("sample_mode", ["trajectory", "turn"])
def test_every_configurable_estimator_runs_in_both_sample_modes(estimator, sample_mode):
    batch, values = trajectory_batch() if sample_mode == "trajectory" else turn_batch()[:2]
    cfg = config(advantage=estimator, sample_mode=sample_mode)
    advantages, returns = compute_advantages(batch, values if cfg.uses_critic else None, cfg)
    assert advantages.shape == returns.shape == batch.input_ids.shape
    assert bool(torch.isfinite(advantages).all()) and advantages[batch.loss_mask == 1].abs().sum() > 0
    assert not advantages[batch.loss_mask == 0].any()

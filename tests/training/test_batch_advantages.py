"""Advantages of a batch: each estimator wired as called by hand, and the same episode getting the
same advantages in both sample modes (with KL in the reward, both placements, every discount)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from turnrl.algorithms import (
    bilevel_gae,
    broadcast_to_tokens,
    grpo_advantages,
    masked_gae,
    place_rewards,
    ppo_policy_loss,
    reinforce_pp_advantages,
    rloo_advantages,
    turn_gae,
    whiten,
)
from turnrl.algorithms.estimators import estimator_names, get_estimator
from turnrl.training.algorithm_config import AlgorithmConfig
from turnrl.training.batch import Sample, collate
from turnrl.training.batch_advantages import compute_advantages, episode_view, turn_sample_weights

# Distinct values for every discount, so that a parameter wired to the wrong place changes the result.
DISCOUNTS = dict(gamma_turn=0.8, lambda_turn=0.7, gamma_token=0.95, lambda_token=0.85)
GROUP = ("grpo", "drgrpo", "rloo")
ADVANTAGES = ("gae", "bilevel_gae", "turn_gae", "grpo", "drgrpo", "rloo", "reinforce_pp", "gigpo")


def config(**overrides) -> AlgorithmConfig:
    return AlgorithmConfig(**{**DISCOUNTS, **overrides})


def test_every_built_in_estimator_is_registered():
    module = "turnrl.algorithms.estimators"
    built_in = {name for name in estimator_names() if get_estimator(name).fn.__module__ == module}
    assert built_in == set(ADVANTAGES)


# --------------------------------------------------------------------------- one set of episodes, two sample modes
# Episode id -> (group, [(observation tokens, response tokens, turn reward), ...]). Ids skip numbers as after
# filtering; 10.1 is a float32 total that once broke group statistics.
EPISODES = {
    0: (0, [(3, 2, 0.5), (2, 3, -0.1), (1, 1, 1.0)]),
    3: (0, [(4, 1, 0.0), (2, 2, 2.0)]),
    4: (1, [(2, 3, -0.1), (3, 2, -0.1), (2, 2, 0.0), (1, 3, 10.1)]),
    7: (1, [(5, 2, 10.1)]),
    8: (0, [(2, 4, 1.0), (2, 1, 0.0)]),
}


@dataclass
class Mode:
    """A batch of the episodes in one sample mode, with values and KL on its sampled tokens."""

    batch: object
    values: torch.Tensor
    kl: torch.Tensor

    def per_episode(self, per_token: torch.Tensor) -> dict[int, list[float]]:
        """Each episode's sampled tokens' entries, in turn order."""
        rows = sorted(range(len(self.batch)), key=lambda r: (int(self.batch.turn[r])))
        out: dict[int, list[float]] = {}
        for row in rows:
            picked = per_token[row][self.batch.loss_mask[row] == 1].tolist()
            out.setdefault(int(self.batch.episode[row]), []).extend(picked)
        return out


def state_key(turn: int) -> str:
    """The env state a turn starts from: two states, so that anchor groups of several turns form (GiGPO)."""
    return f"state-{turn % 2}"


def both_modes(seed: int = 0) -> tuple[Mode, Mode]:
    """The same episodes as whole-trajectory samples and as shuffled turn samples.

    The critic's value and the KL of each sampled token are the same in both modes (they are inputs here),
    so any difference in the advantages comes from the wiring.
    """
    gen = torch.Generator().manual_seed(seed)
    trajectory, turns = [], []
    values = {"trajectory": [], "turn": []}
    kls = {"trajectory": [], "turn": []}
    for episode, (group, spec) in EPISODES.items():
        ids, mask, ends, v_row, kl_row = [], [], [], [], []
        for turn, (n_obs, n_resp, reward) in enumerate(spec):
            response_values = torch.randn(n_resp, generator=gen).tolist()
            response_kl = torch.rand(n_resp, generator=gen).tolist()
            # turn sample: the prompt (earlier turns and this observation, any length) + the response
            prompt = 2 + 3 * turn
            turns.append(Sample([5] * (prompt + n_resp), [0] * prompt + [1] * n_resp, [-0.1] * (prompt + n_resp),
                                [prompt + n_resp - 1], [reward], episode=episode, group=group, turn=turn,
                                turn_state_keys=[state_key(turn)]))
            values["turn"].append([0.0] * prompt + response_values)
            kls["turn"].append([0.0] * prompt + response_kl)
            # trajectory: observation, response, one closing token
            ids += [5] * (n_obs + n_resp + 1)
            mask += [0] * n_obs + [1] * n_resp + [0]
            ends.append(len(mask) - 2)
            v_row += [0.0] * n_obs + response_values + [0.0]
            kl_row += [0.0] * n_obs + response_kl + [0.0]
        trajectory.append(Sample(ids, mask, [-0.1] * len(ids), ends, [r for _, _, r in spec], episode=episode,
                                 group=group, turn_state_keys=[state_key(t) for t in range(len(spec))]))
        values["trajectory"].append(v_row)
        kls["trajectory"].append(kl_row)
    order = torch.randperm(len(turns), generator=gen).tolist()
    turns = [turns[i] for i in order]
    values["turn"] = [values["turn"][i] for i in order]
    kls["turn"] = [kls["turn"][i] for i in order]

    def build(samples, name):
        batch = collate(samples, pad_id=0)
        pad = lambda rows: torch.tensor([r + [0.0] * (batch.input_ids.shape[1] - len(r)) for r in rows])  # noqa: E731
        return Mode(batch, pad(values[name]), pad(kls[name]))

    return build(trajectory, "trajectory"), build(turns, "turn")


def assert_same_per_episode(a: dict[int, list[float]], b: dict[int, list[float]]) -> None:
    assert a.keys() == b.keys()
    for episode in a:
        assert len(a[episode]) == len(b[episode])
        for x, y in zip(a[episode], b[episode]):
            assert math.isclose(x, y, rel_tol=1e-5, abs_tol=1e-5), (episode, a[episode], b[episode])


@pytest.mark.parametrize("estimator", ADVANTAGES)
@pytest.mark.parametrize("placement", ["per_turn", "episode_end"])
@pytest.mark.parametrize("kl_in_reward", [False, True])
def test_the_same_episode_gets_the_same_advantages_in_both_sample_modes(estimator, placement, kl_in_reward):
    trajectory, turns = both_modes()
    results = []
    for mode, name in ((trajectory, "trajectory"), (turns, "turn")):
        cfg = config(advantage=estimator, reward_placement=placement, sample_mode=name, kl_coef=0.3,
                     kl_in_reward=kl_in_reward)
        out = compute_advantages(mode.batch, cfg, mode.values if cfg.uses_critic else None, mode.kl)
        assert not out.advantages[mode.batch.loss_mask == 0].any() and not out.returns[mode.batch.loss_mask == 0].any()
        results.append((mode.per_episode(out.advantages), mode.per_episode(out.returns)))
    assert_same_per_episode(results[0][0], results[1][0])
    assert_same_per_episode(results[0][1], results[1][1])


def one_episode_two_turns(mode: str):
    """One episode, two turns of 2 tokens, env reward 0, V = 0, KL = 1 a token."""
    if mode == "trajectory":
        samples = [Sample([5] * 6, [1, 1, 0, 0, 1, 1], [0.0] * 6, [1, 5], [0.0, 0.0], episode=0, group=0)]
    else:
        samples = [Sample([5] * (p + 2), [0] * p + [1, 1], [0.0] * (p + 2), [p + 1], [0.0], episode=0, group=0, turn=t)
                   for t, p in enumerate((1, 4))]
    batch = collate(samples, pad_id=0)
    return batch, torch.zeros(batch.input_ids.shape), batch.loss_mask.clone()


@pytest.mark.parametrize("mode", ["trajectory", "turn"])
@pytest.mark.parametrize(
    ("estimator", "first_turn"),
    [("gae", [-2.0, -1.5]), ("turn_gae", [-2.0, -2.0]), ("bilevel_gae", [-1.5, -1.0]), ("reinforce_pp", [-2.0, -1.5])],
)
def test_kl_of_later_turns_reaches_earlier_turns_in_both_modes(mode, estimator, first_turn):
    # KL 1 a token at kl_coef 0.5 is a reward of -0.5 a token; all discounts 1, no whitening.
    batch, values, kl = one_episode_two_turns(mode)
    cfg = AlgorithmConfig(advantage=estimator, sample_mode=mode, kl_coef=0.5, kl_in_reward=True,
                          whiten_advantages=False)
    out = compute_advantages(batch, cfg, values if cfg.uses_critic else None, kl)
    target = out.returns if estimator == "reinforce_pp" else out.advantages  # REINFORCE++ whitens its advantages
    first_row = 0 if mode == "trajectory" else int((batch.turn == 0).nonzero())
    got = target[first_row][batch.loss_mask[first_row] == 1].tolist()[:2]
    assert got == pytest.approx(first_turn)


# --------------------------------------------------------------------------- each family as called by hand
@pytest.mark.parametrize("placement", ["per_turn", "episode_end"])
@pytest.mark.parametrize("whiten_advantages", [True, False])
@pytest.mark.parametrize("estimator", ["gae", "bilevel_gae", "turn_gae", "reinforce_pp"])
def test_token_estimators_equal_the_algorithm_called_by_hand(estimator, placement, whiten_advantages):
    mode, _ = both_modes(1)
    batch, values = mode.batch, mode.values
    cfg = config(advantage=estimator, reward_placement=placement, whiten_advantages=whiten_advantages)
    mask, ends = batch.loss_mask, batch.turn_end_mask
    rewards = place_rewards(batch.turn_rewards.double(), batch.turn_end_index, batch.input_ids.shape[1], mode=placement)
    if estimator == "reinforce_pp":
        expected = reinforce_pp_advantages(rewards, mask, 0.95, turn_end_mask=ends, gamma_turn=0.8)
    else:
        if estimator == "gae":
            adv, ret = masked_gae(rewards, values, mask, 0.95, 0.85, turn_end_mask=ends, gamma_turn=0.8,
                                  lambda_turn=0.7)
        elif estimator == "bilevel_gae":
            adv, ret = bilevel_gae(rewards, values, mask, ends, gamma_turn=0.8, lambda_turn=0.7,
                                   gamma_token=0.95, lambda_token=0.85)
        else:
            adv, ret = turn_gae(rewards, values, mask, ends, gamma=0.8, lam=0.7)
        # Turn-level GAE whitens with its turns' statistics (one entry a turn), as VAGEN's turn-wise GAE does.
        stats = ends if estimator == "turn_gae" else None
        expected = (whiten(adv, mask, stats_mask=stats) if whiten_advantages else adv, ret)
    out = compute_advantages(batch, cfg, values if estimator != "reinforce_pp" else None)
    assert out.advantages.dtype == out.returns.dtype == torch.float32 and out.sample_weights is None
    assert torch.allclose(out.advantages, expected[0].float(), atol=1e-6)
    assert torch.allclose(out.returns, expected[1].float(), atol=1e-6)


@pytest.mark.parametrize("estimator", GROUP)
def test_group_estimators_equal_the_algorithm_called_by_hand(estimator):
    mode, _ = both_modes(2)
    batch = mode.batch
    scores = batch.turn_rewards.double().sum(1)
    if estimator == "rloo":
        seq = rloo_advantages(scores, batch.group)
    else:
        seq = grpo_advantages(scores, batch.group, norm_by_std=estimator == "grpo")
    out = compute_advantages(batch, config(advantage=estimator))
    assert torch.allclose(out.advantages, broadcast_to_tokens(seq, batch.loss_mask).float(), atol=1e-6)
    assert torch.equal(out.returns, out.advantages)


def test_kl_in_reward_lowers_the_episode_scores_of_group_estimators():
    mode, _ = both_modes(3)
    batch, kl = mode.batch, mode.kl
    scores = batch.turn_rewards.double().sum(1) - 0.2 * (kl * batch.loss_mask).double().sum(1)
    out = compute_advantages(batch, config(advantage="grpo", kl_coef=0.2, kl_in_reward=True), kl=kl)
    assert torch.allclose(out.advantages, broadcast_to_tokens(grpo_advantages(scores, batch.group),
                                                              batch.loss_mask).float(), atol=1e-5)
    without = compute_advantages(batch, config(advantage="grpo", kl_coef=0.2), kl=kl)  # KL as a loss term only
    assert torch.allclose(without.advantages, compute_advantages(batch, config(advantage="grpo")).advantages)


def test_critic_estimators_without_values_fail_loudly():
    trajectory, turns = both_modes()
    for mode, name in ((trajectory, "trajectory"), (turns, "turn")):
        for estimator in ("gae", "bilevel_gae", "turn_gae"):
            with pytest.raises(ValueError, match="critic"):
                compute_advantages(mode.batch, config(advantage=estimator, sample_mode=name))


def test_a_group_of_equal_float32_scores_gets_no_advantage():
    # Three episodes of one group, each a single turn worth 10.1: their GRPO advantage is exactly 0.
    samples = [Sample([5, 5], [0, 1], [0.0, 0.0], [1], rewards, episode=e, group=0)
               for e, rewards in enumerate(([10.1], [10.1], [10.1]))]
    out = compute_advantages(collate(samples, pad_id=0), config(advantage="grpo"))
    assert out.advantages.abs().max() == 0


@pytest.mark.parametrize("mode", ["trajectory", "turn"])
def test_equal_totals_split_differently_across_turns_get_no_advantage(mode):
    # Sokoban-like: five steps of -0.1 and a +10.9, cut into two turns at different points. Every
    # total is 10.4; summed in float32 the totals differed by ~1e-7 and GRPO amplified that to +-0.23.
    splits = [(1, 5), (2, 4), (3, 3), (4, 2)]
    samples = []
    for episode, (first, second) in enumerate(splits):
        rewards = [-0.1] * first, [-0.1] * (second - 1) + [10.9]
        turn_rewards = [sum(rewards[0]), sum(rewards[1])]
        if mode == "trajectory":
            samples.append(Sample([5] * 4, [1, 1, 1, 1], [0.0] * 4, [1, 3], turn_rewards, episode=episode, group=0))
        else:
            samples += [Sample([5, 5], [0, 1], [0.0, 0.0], [1], [reward], episode=episode, group=0, turn=t)
                        for t, reward in enumerate(turn_rewards)]
    out = compute_advantages(collate(samples, pad_id=0), config(advantage="grpo", sample_mode=mode))
    assert out.advantages.abs().max() < 1e-6


def test_a_turn_that_ends_on_an_unsampled_token_is_refused():
    sample = Sample([5, 5, 5], [0, 1, 0], [0.0] * 3, [2], [1.0], episode=0, group=0)
    with pytest.raises(ValueError, match="sampled token"):
        compute_advantages(collate([sample], pad_id=0), config(advantage="grpo"))


# --------------------------------------------------------------------------- turn mode's loss weights
def test_turn_mode_group_estimators_weigh_each_episode_once_in_the_loss():
    # Under seq-mean-token-mean a turn sample weighs its share of its episode's sampled tokens, times the
    # samples per episode of the batch; the other aggregations need no weights (turn_sample_weights).
    trajectory, turns = both_modes()
    out = compute_advantages(turns.batch, config(advantage="grpo", sample_mode="turn",
                                                 loss_aggregation="seq-mean-token-mean"))
    weights = turn_sample_weights(turns.batch, "seq-mean-token-mean")
    assert torch.equal(out.sample_weights, weights)
    tokens = {e: sum(n for _, n, _ in spec) for e, (_, spec) in EPISODES.items()}
    mean_turns = len(turns.batch) / len(EPISODES)
    for row in range(len(turns.batch)):
        episode = int(turns.batch.episode[row])
        share = float(turns.batch.loss_mask[row].sum()) / tokens[episode]
        assert float(weights[row]) == pytest.approx(mean_turns * share)
    assert float(weights.mean()) == pytest.approx(1.0)
    for aggregation in ("token-mean", "seq-mean-token-sum"):
        cfg = config(advantage="grpo", sample_mode="turn", loss_aggregation=aggregation)
        assert compute_advantages(turns.batch, cfg).sample_weights is None
    cfg = config(advantage="gae", sample_mode="turn", loss_aggregation="seq-mean-token-mean")
    assert compute_advantages(turns.batch, cfg, turns.values).sample_weights is None
    cfg = config(advantage="grpo", loss_aggregation="seq-mean-token-mean")
    assert compute_advantages(trajectory.batch, cfg).sample_weights is None


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize("estimator", ["grpo", "gigpo"])
def test_turn_samples_give_the_trajectory_policy_gradient_of_the_same_episodes(estimator, aggregation):
    # The policy loss as the PPO epochs build it, differentiated by each sampled token's log-prob (ratio 1).
    trajectory, turns = both_modes()
    gradients = []
    for mode, name in ((trajectory, "trajectory"), (turns, "turn")):
        batch = mode.batch
        out = compute_advantages(batch, config(advantage=estimator, sample_mode=name, loss_aggregation=aggregation))
        logprobs = torch.full(batch.loss_mask.shape, -1.0, requires_grad=True)
        loss, _ = ppo_policy_loss(logprobs, logprobs.detach(), out.advantages, batch.loss_mask,
                                  aggregation=aggregation, sample_weights=out.sample_weights)
        loss.backward()
        gradients.append(mode.per_episode(logprobs.grad))
    assert any(g != 0 for grads in gradients[0].values() for g in grads)
    # seq-mean-token-sum divides by the samples: the turn mode's gradient is the trajectory mode's times E / N.
    scale = len(turns.batch) / len(trajectory.batch) if aggregation == "seq-mean-token-sum" else 1.0
    assert_same_per_episode(gradients[0], {e: [g * scale for g in grads] for e, grads in gradients[1].items()})


# --------------------------------------------------------------------------- the episode view
def test_episode_view_lays_turn_samples_end_to_end_in_turn_order():
    _, turns = both_modes()
    view = episode_view(turns.batch)
    lengths = {e: sum(n for _, n, _ in spec) for e, (_, spec) in EPISODES.items()}
    assert view.mask.sum(1).tolist() == [lengths[e] for e in sorted(EPISODES)]
    assert view.turn_end.sum(1).tolist() == [len(EPISODES[e][1]) for e in sorted(EPISODES)]
    assert view.group.tolist() == [EPISODES[e][0] for e in sorted(EPISODES)]
    # the values placed in the view come back unchanged
    back = view.to_batch(view.place(turns.values), turns.values.shape)
    assert torch.equal(back, turns.values * turns.batch.loss_mask)
    # rewards sit on each turn's last token, in turn order
    row = sorted(EPISODES).index(4)
    assert view.rewards[row][view.turn_end[row]].tolist() == pytest.approx([-0.1, -0.1, 0.0, 10.1])
    assert view.rewards.dtype == torch.float64


def test_gigpo_gives_each_turns_tokens_the_turns_advantage_as_called_by_hand():
    from turnrl.algorithms import gigpo_advantages

    trajectory, _ = both_modes()
    cfg = config(advantage="gigpo", estimator_params={"gigpo": {"gamma": 0.9, "step_weight": 0.5}})
    out = compute_advantages(trajectory.batch, cfg)
    ids = list(EPISODES)
    turns = max(len(spec) for _, spec in EPISODES.values())
    rewards = torch.zeros(len(ids), turns, dtype=torch.float64)
    states = torch.full((len(ids), turns), -1)
    for row, episode in enumerate(ids):
        for turn, (_, _, reward) in enumerate(EPISODES[episode][1]):
            rewards[row, turn] = reward
            states[row, turn] = turn % 2
    valid = states >= 0
    groups = torch.tensor([EPISODES[e][0] for e in ids])
    per_turn, _ = gigpo_advantages(rewards, valid, states, groups, gamma=0.9, step_weight=0.5)
    got = trajectory.per_episode(out.advantages)
    for row, episode in enumerate(ids):
        expected = [float(per_turn[row, turn]) for turn, (_, n_resp, _) in enumerate(EPISODES[episode][1])
                    for _ in range(n_resp)]
        assert got[episode] == pytest.approx(expected, abs=1e-6)


def test_anchored_share_counts_the_turns_that_share_a_start_state_with_another_turn_of_their_group():
    from turnrl.algorithms import anchored_share

    states = torch.tensor([[0, 1, -1], [0, 2, 2], [0, -1, -1]])
    groups = torch.tensor([0, 0, 1])
    # group 0: state 0 twice, state 1 once, state 2 twice; group 1: state 0 once -> 4 of 6 known turns
    assert anchored_share(states, groups) == pytest.approx(4 / 6)


def test_episode_view_rows_hold_only_their_sampled_tokens_from_column_0():
    """No gap and no stray column: an episode's turn samples follow each other, whatever the order of the batch."""
    for mode in both_modes():
        view = episode_view(mode.batch)
        lengths = view.mask.sum(1)
        assert view.mask.shape[1] == int(lengths.max())
        assert torch.equal(view.mask, torch.arange(view.mask.shape[1])[None, :] < lengths[:, None])


def test_a_turn_that_ends_at_column_0_is_a_turn_with_its_reward():
    """Only -1 marks a padding turn: a one-token response at the very start still ends a turn."""
    sample = Sample([5, 5, 5], [1, 0, 1], [0.0] * 3, [0, 2], [1.0, 2.0], episode=0, group=0)
    view = episode_view(collate([sample], pad_id=0))
    assert view.turn_end.tolist() == [[True, True]]
    assert view.rewards.tolist() == [[1.0, 2.0]]


def test_episode_view_lays_out_each_turns_state_in_turn_order_only_when_asked():
    one_token = dict(input_ids=[5, 5], loss_mask=[0, 1], sampler_logprobs=[0.0, 0.0], turn_ends=[1], turn_rewards=[0.0])
    samples = [Sample(**one_token, episode=0, group=0, turn=1, turn_state_keys=["b"]),
               Sample(**one_token, episode=0, group=0, turn=0, turn_state_keys=["a"]),
               Sample(**one_token, episode=1, group=0, turn=0, turn_state_keys=["a"])]
    batch = collate(samples, pad_id=0)  # state ids in order of first sight: b 0, a 1
    assert episode_view(batch, with_turn_states=True).turn_states.tolist() == [[1, 0], [1, -1]]
    assert episode_view(batch).turn_states is None


def test_a_batch_of_one_sample_per_episode_needs_no_turn_weights():
    trajectory, _ = both_modes()
    assert turn_sample_weights(trajectory.batch, "seq-mean-token-mean") is None

"""The update half of a step: forward passes without gradient and the PPO epochs (accumulation, skipping)."""

from __future__ import annotations

import copy
import dataclasses
import weakref

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM

from tests.algorithms import reference as ref
from turnrl.config import ConfigError
from turnrl.training.algorithm_config import AlgorithmConfig
from turnrl.training import ppo
from turnrl.training.batch import Sample, collate
from turnrl.training.model_passes import ValueModel, token_logprobs
from turnrl.training.packed_attention import ATTENTION
from turnrl.training.ppo import (
    MicroBatching,
    UpdateInputs,
    batched_logprobs,
    batched_values,
    best_fit_passes,
    ppo_epochs,
    restore_actor_state,
    save_actor_state,
)
from turnrl.training.train_config import OptimConfig


def config(**overrides) -> AlgorithmConfig:
    return AlgorithmConfig(**overrides)


# --------------------------------------------------------------------------- packed passes
def next_fit_passes(rows: list[int], lengths: list[int], budget: int) -> list[list[int]]:
    """The plain rule best fit improves on: rows longest first, a pass closed when the next overflows it."""
    passes: list[list[int]] = []
    used = 0
    for row in sorted(rows, key=lambda r: -lengths[r]):
        if not passes or used + lengths[row] > budget:
            passes.append([])
            used = 0
        passes[-1].append(row)
        used += lengths[row]
    return passes


def test_best_fit_fills_the_room_a_pass_leaves_with_a_shorter_row():
    """Rows of 8, 6, 5 and 4 tokens, budget 12: the 4 joins the 8 (room 4), the 5 the 6; next fit would run
    [8], [6, 5], [4]. Ties go to the pass opened first; a row over the budget runs alone."""
    lengths = torch.tensor([6, 8, 4, 5])
    assert best_fit_passes([0, 1, 2, 3], lengths, 12) == [[1, 2], [0, 3]]
    assert best_fit_passes([0, 1, 2, 3], torch.tensor([5, 5, 2, 20]), 12) == [[3], [0, 1, 2]]
    assert best_fit_passes([0, 1, 2], torch.tensor([3, 3, 3]), 6) == [[0, 1], [2]]
    assert best_fit_passes([], lengths, 12) == []


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(1, 60), max_size=40), st.integers(1, 64))
def test_best_fit_passes_hold_every_row_once_within_the_budget_in_no_more_passes_than_next_fit(lengths, budget):
    rows = list(range(len(lengths)))
    passes = best_fit_passes(rows, torch.tensor(lengths, dtype=torch.long), budget)
    assert sorted(row for part in passes for row in part) == rows
    for part in passes:
        assert part and (len(part) == 1 or sum(lengths[row] for row in part) <= budget)
        assert [lengths[row] for row in part] == sorted((lengths[row] for row in part), reverse=True)
    assert len(passes) <= len(next_fit_passes(rows, lengths, budget))


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
    assert torch.allclose(batched_logprobs(actor, batch, MicroBatching(1), 0.8), full, atol=1e-6)
    assert torch.allclose(batched_logprobs(actor, batch, MicroBatching(3), 0.8), full, atol=1e-6)
    assert torch.allclose(batched_values(critic, batch, MicroBatching(3)), values, atol=1e-6)


# --------------------------------------------------------------------------- PPO epochs
def update_inputs(actor, critic, batch, seed=0):
    gen = torch.Generator().manual_seed(seed)
    mask = batch.loss_mask
    noise = lambda: torch.randn(batch.input_ids.shape, generator=gen) * mask  # noqa: E731
    old = batched_logprobs(actor, batch, MicroBatching(4), 1.0) + 0.3 * noise()  # ratios off 1: some tokens clip
    values = batched_values(critic, batch, MicroBatching(4))
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


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_packed_micro_batches_update_as_one_padded_batch(tiny_model_dir, aggregation):
    """Passes packed by a budget of 12 tokens (one with two rows end to end) accumulate the update of one padded
    pass over the mini-batch: actor and critic, with entropy and KL terms."""
    actor = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation=ATTENTION)
    critic = ValueModel(copy.deepcopy(actor.base_model))
    torch.nn.init.normal_(critic.value_head.weight, std=0.5, generator=torch.Generator().manual_seed(5))
    inputs = update_inputs(actor, critic, model_batch(actor.config.vocab_size))
    start_actor, start_critic = params(actor), params(critic)
    updates = []
    for rows, tokens in ((4, 0), (1, 12)):
        a, c = copy.deepcopy(actor), copy.deepcopy(critic)
        run_epochs(a, c, inputs, config(mini_batch_size=4, micro_batch_size=rows, micro_batch_tokens=tokens,
                                        loss_aggregation=aggregation, entropy_coef=0.01, kl_coef=0.1, ppo_epochs=1))
        updates.append({**{f"actor.{n}": p - start_actor[n] for n, p in params(a).items()},
                        **{f"critic.{n}": p - start_critic[n] for n, p in params(c).items()}})
    padded, packed = updates
    for name, delta in padded.items():
        assert_same_update(packed[name], delta, name)
    assert sum(float(d.abs().sum()) for d in padded.values()) > 0


def test_pass_fill_is_the_share_of_the_packed_passes_budget_their_rows_fill(tiny_model_dir):
    """Rows of 8, 6, 5 and 4 tokens under a 12-token budget go in two passes ([8, 4], [6, 5]) each epoch: 23
    tokens of 24; passes of rows (no token budget) log no fill."""
    actor = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation=ATTENTION)
    critic = ValueModel(copy.deepcopy(actor.base_model))
    inputs = update_inputs(actor, critic, model_batch(actor.config.vocab_size))
    packed = run_epochs(actor, critic, inputs, config(mini_batch_size=4, micro_batch_tokens=12, ppo_epochs=2))
    assert packed["actor/pass_fill"] == pytest.approx(23 / 24)
    assert "actor/pass_fill" not in run_epochs(actor, critic, inputs, config(mini_batch_size=4, micro_batch_size=2))


@pytest.mark.parametrize("tokens", [0, 12], ids=["passes of one row", "packed passes of 12 tokens"])
@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_each_loss_side_metric_is_its_per_token_formula_over_the_mini_batch(tiny_model_dir, aggregation, tokens):
    """One mini-batch of the four samples (5, 1, 0 and 3 trained tokens) in passes of one row, or packed by a
    budget of 12 tokens (rows of 8 and 4 together, then 6 and 5), read before its optimizer step: every loss and
    diagnostic is the plain per-token formula of tests/algorithms/reference.py over the mini-batch's tokens, from
    one padded pass of the untouched models over the whole batch. The policy loss carries truncated importance
    weights (some capped), the total its entropy bonus and reference KL."""
    actor = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation=ATTENTION)
    critic = ValueModel(copy.deepcopy(actor.base_model))
    torch.nn.init.normal_(critic.value_head.weight, std=0.5, generator=torch.Generator().manual_seed(5))
    batch = with_sampler_logprobs(actor, model_batch(actor.config.vocab_size))
    inputs = update_inputs(actor, critic, batch)
    cap, entropy_coef, kl_coef = 1.05, 0.01, 0.1
    cfg = config(mini_batch_size=4, micro_batch_size=1, micro_batch_tokens=tokens, ppo_epochs=1,
                 loss_aggregation=aggregation, tis_cap=cap, old_logprobs="recompute", entropy_coef=entropy_coef,
                 kl_coef=kl_coef, kl_kind="k3")
    assert [len(p) for p in MicroBatching.of(cfg).split(torch.arange(4), batch.attention_mask.sum(1))] == \
        ([2, 2] if tokens else [1, 1, 1, 1])
    with torch.no_grad():
        logprobs, entropy = token_logprobs(actor, batch.input_ids, batch.attention_mask, batch.loss_mask, 1.0,
                                           with_entropy=True)
        values = critic(batch.input_ids, batch.attention_mask)
    metrics = run_epochs(copy.deepcopy(actor), copy.deepcopy(critic), inputs, cfg)

    mask = batch.loss_mask.bool()
    tokens = lambda fn, *xs: torch.tensor(  # noqa: E731
        [[float(fn(*row)) for row in zip(*rows)] for rows in zip(*(x.tolist() for x in xs))], dtype=torch.float64)
    tis = tokens(lambda old, sampled: ref.ref_tis_weight(old, sampled, cap), inputs.old_logprobs,
                 batch.sampler_logprobs)
    policy = [tokens(lambda lp, old, adv, k=k: ref.ref_ppo_token(lp, old, adv, 0.2, 0.28, 3.0)[k], logprobs,
                     inputs.old_logprobs, inputs.advantages) for k in range(4)]
    value = [tokens(lambda v, old, ret, k=k: ref.ref_value_token(v, old, ret, 0.5)[k], values, inputs.old_values,
                    inputs.returns) for k in range(3)]
    kl = tokens(lambda lp, reference: ref.ref_kl(lp, reference, "k3"), logprobs, inputs.ref_logprobs)
    by_loss = lambda x: ref.ref_aggregate(x, mask, aggregation)  # noqa: E731
    by_token = lambda x: ref.ref_aggregate(x, mask, "token-mean")  # noqa: E731
    expected = {
        "losses/policy": by_loss(policy[0] * tis), "actor/clip_frac": by_token(policy[1]),
        "actor/dual_clip_frac": by_token(policy[2]), "actor/approx_kl": by_token(policy[3]),
        "actor/tis_weight_mean": by_token(tis), "actor/tis_capped": by_token((tis >= cap).double()),
        "actor/entropy": by_loss(entropy), "actor/kl_ref": by_loss(kl),
        "losses/value": by_loss(value[0]), "critic/clip_frac": by_token(value[1]), "critic/error": by_token(value[2]),
    }
    expected["losses/actor_total"] = (expected["losses/policy"] - entropy_coef * expected["actor/entropy"]
                                      + kl_coef * expected["actor/kl_ref"])
    for key, want in expected.items():
        assert metrics[key] == pytest.approx(want, rel=1e-5, abs=1e-6), key
    assert 0 < expected["actor/tis_capped"] < 1 and expected["actor/clip_frac"] > 0  # the cases the formulas split


@pytest.mark.parametrize("aggregation", ["seq-mean-token-mean", "seq-mean-token-sum"])
def test_token_mean_metrics_and_the_target_kl_do_not_depend_on_the_micro_batch_size(actor, critic, aggregation):
    """Under a sequence-mean loss the clip fractions and the approximate KL stay token means of the mini-batch:
    micro-batches of one sample (5, 1, 0 and 3 tokens) give what one pass gives, and so does the target-KL stop
    that reads the KL. One mini-batch, read before its optimizer step."""
    batch = model_batch(actor.config.vocab_size)
    inputs = update_inputs(actor, critic, batch)
    keys = ("actor/approx_kl", "actor/clip_frac", "actor/dual_clip_frac", "critic/clip_frac", "critic/error")
    epochs = dict(mini_batch_size=4, ppo_epochs=1, loss_aggregation=aggregation)
    whole = run_epochs(copy.deepcopy(actor), copy.deepcopy(critic), inputs, config(**epochs, micro_batch_size=4))
    micro = run_epochs(copy.deepcopy(actor), copy.deepcopy(critic), inputs, config(**epochs, micro_batch_size=1))
    for key in keys:
        assert micro[key] == pytest.approx(whole[key], rel=1e-5, abs=1e-7), key
    target = whole["actor/approx_kl"] * 0.999 / 1.5  # the whole mini-batch is just past it
    for size in (4, 1):
        stopped = run_epochs(copy.deepcopy(actor), copy.deepcopy(critic), inputs,
                             config(**epochs, micro_batch_size=size, target_kl=target))
        assert stopped["actor/kl_stopped"] == 1.0, size


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


def test_the_actor_gradient_norm_is_measured_before_clipping(actor, critic):
    """``actor/grad_norm`` is the norm the update had, whatever the clip (RAGEN's collapse shows as its spikes)."""
    batch = model_batch(actor.config.vocab_size)
    inputs = update_inputs(actor, critic, batch)
    cfg = config(mini_batch_size=4, micro_batch_size=4, ppo_epochs=1)  # one optimizer step
    clipped, unclipped = (run_epochs(copy.deepcopy(actor), copy.deepcopy(critic), inputs, cfg,
                                     OptimConfig(grad_clip=clip))["actor/grad_norm"] for clip in (1e-6, 1e9))
    assert clipped == pytest.approx(unclipped) and clipped > 1e-3


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
    old = batched_logprobs(actor, batch, MicroBatching(4), 1.0)
    inputs = UpdateInputs(batch, old, batch.loss_mask.clone(), batch.loss_mask.clone())
    before = params(actor)
    metrics = ppo_epochs(actor, None, inputs, config(mini_batch_size=4, micro_batch_size=4), OptimConfig(),
                         torch.optim.SGD(actor.parameters(), lr=0.1), None, 1.0, torch.Generator().manual_seed(0))
    assert not any(k.startswith("critic/") for k in metrics)
    assert metrics["losses/policy"] < 0  # positive advantages at ratio 1: loss -1 per token
    assert any(not torch.equal(p, before[n]) for n, p in params(actor).items())


# --------------------------------------------------------------------------- target KL
def test_a_mini_batch_past_the_target_kl_stops_the_actor_before_its_step_and_the_critic_trains_on(actor, critic):
    """The old log-probs are 0.3-nats noise off the policy: the first mini-batch's approximate KL is past any
    small target, so the actor takes no step at all; the critic takes all four."""
    batch = model_batch(actor.config.vocab_size)
    inputs = update_inputs(actor, critic, batch)
    before_actor, before_critic = params(actor), params(critic)
    metrics = run_epochs(actor, critic, inputs, config(mini_batch_size=2, micro_batch_size=1, ppo_epochs=2,
                                                       target_kl=1e-3))
    assert metrics["actor/approx_kl"] > 1.5e-3
    assert metrics["actor/kl_stopped"] == 1.0 and metrics["actor/optimizer_steps"] == 0.0
    assert "actor/grad_norm" not in metrics
    assert all(torch.equal(p, before_actor[n]) for n, p in params(actor).items())
    assert all(p.grad is None for p in actor.parameters())
    assert any(not torch.equal(p, before_critic[n]) for n, p in params(critic).items())


def test_the_target_kl_stops_at_the_first_mini_batch_the_policy_has_moved_past_it(actor, critic):
    """Old log-probs the policy's own: the first mini-batch is at KL 0 and steps; the step moves the policy
    (SGD at 0.5), and the next mini-batch, past the target, stops the actor. A target never reached is no
    target: the same update as none."""
    batch = model_batch(actor.config.vocab_size)
    inputs = update_inputs(actor, critic, batch)
    inputs.old_logprobs = batched_logprobs(actor, batch, MicroBatching(4), 1.0)
    epochs = dict(mini_batch_size=2, micro_batch_size=1, ppo_epochs=2)
    stopped = run_epochs(copy.deepcopy(actor), copy.deepcopy(critic), inputs, config(**epochs, target_kl=1e-6))
    assert stopped["actor/kl_stopped"] == 1.0 and stopped["actor/optimizer_steps"] == 1.0
    models = [(copy.deepcopy(actor), copy.deepcopy(critic)) for _ in range(2)]
    never, none = (run_epochs(a, c, inputs, config(**epochs, target_kl=target))
                   for (a, c), target in zip(models, (1e9, None), strict=True))
    assert never["actor/kl_stopped"] == 0.0 and never["actor/optimizer_steps"] == none["actor/optimizer_steps"] == 4
    assert "actor/kl_stopped" not in none
    for (name, p), q in zip(models[0][0].named_parameters(), models[1][0].parameters(), strict=True):
        assert torch.equal(p, q), name


def test_the_target_kl_must_be_positive():
    with pytest.raises(ConfigError, match="algorithm.target_kl"):
        config(target_kl=0.0).validate()


# --------------------------------------------------------------------------- rollback
def adam_epochs(actor, inputs, cfg):
    """The actor alone under Adam (whose state a rollback must put back too); its metrics and optimizer."""
    optimizer = torch.optim.Adam(actor.parameters(), lr=0.05)
    metrics = ppo_epochs(actor, None, inputs, cfg, OptimConfig(grad_clip=1e9), optimizer, None, 1.0,
                         torch.Generator().manual_seed(0))
    return metrics, optimizer


def own_policy_inputs(actor, critic):
    """Old log-probs the policy's own: the update's first passes read KL 0, and every optimizer step moves it."""
    batch = model_batch(actor.config.vocab_size)
    inputs = update_inputs(actor, critic, batch)
    inputs.old_logprobs = batched_logprobs(actor, batch, MicroBatching(4), 1.0)
    return inputs


@pytest.mark.parametrize("epochs", [dict(mini_batch_size=2, ppo_epochs=2), dict(mini_batch_size=4, ppo_epochs=1)],
                         ids=["read by the next mini-batch", "read after the last step"])
def test_a_step_past_the_rollback_bound_is_undone_with_its_optimizer_state(actor, critic, epochs):
    """The first optimizer step moves the policy past a tiny bound: the next mini-batch's passes (or, where it
    was the update's only step, a pass after it) read that, and the actor is as it was, Adam's state too."""
    inputs = own_policy_inputs(actor, critic)
    before = params(actor)
    metrics, optimizer = adam_epochs(actor, inputs, config(micro_batch_size=1, rollback_kl=1e-6, **epochs))
    assert metrics["actor/rolled_back"] == 1.0 and metrics["actor/optimizer_steps"] == 1.0
    assert all(torch.equal(p, before[n]) for n, p in params(actor).items())
    assert not optimizer.state  # as before its first step
    assert all(p.grad is None for p in actor.parameters())


def test_a_rollback_bound_never_reached_is_the_update_without_one(actor, critic):
    actor.double()  # the copies move where later tensors live, and with it the CPU kernels' rounding: kept tiny
    inputs = own_policy_inputs(actor, critic)
    cfg = dict(mini_batch_size=2, micro_batch_size=1, ppo_epochs=2)
    (never, never_optimizer), (none, none_optimizer) = (adam_epochs(a, inputs, config(**cfg, rollback_kl=bound))
                                                        for a, bound in ((actor, 1e9), (copy.deepcopy(actor), None)))
    assert never["actor/rolled_back"] == 0.0 and "actor/rolled_back" not in none
    assert never["actor/optimizer_steps"] == none["actor/optimizer_steps"] == 4
    for (p, q) in zip(never_optimizer.param_groups[0]["params"], none_optimizer.param_groups[0]["params"],
                      strict=True):
        torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(never_optimizer.state[p]["exp_avg"], none_optimizer.state[q]["exp_avg"],
                                   rtol=1e-9, atol=1e-12)


def test_an_undone_optimizer_step_leaves_the_state_it_was_taken_from(actor):
    """Two Adam steps, then a third undone, then a fourth: the weights of two steps and that fourth alone."""
    ids = torch.randint(0, actor.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(4))

    def train(model, undo: bool) -> None:
        trained = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.Adam(trained, lr=0.01)
        for scale in (1.0, 2.0, 50.0, 3.0):
            if scale == 50.0:
                if not undo:
                    continue
                saved = save_actor_state(trained, optimizer)
            optimizer.zero_grad()
            (model(input_ids=ids).logits.square().mean() * scale).backward()
            optimizer.step()
            if scale == 50.0:
                restore_actor_state(saved, trained, optimizer)

    undone, never = copy.deepcopy(actor), actor
    train(undone, undo=True)
    train(never, undo=False)
    for (name, p), q in zip(undone.named_parameters(), never.parameters(), strict=True):
        assert torch.equal(p, q), name


def test_each_rollback_copy_is_taken_after_the_last_one_is_freed(actor, critic, monkeypatch):
    """The copy before each optimizer step (weights and Adam's moments, three times the trained weights in float32)
    replaces the last one: the last one is gone when the next is made, so the update never holds two."""
    inputs = own_policy_inputs(actor, critic)
    made: list[weakref.ref] = []
    held_at_each_copy = []
    save = ppo.save_actor_state

    def counted(params, optimizer):
        held_at_each_copy.append(sum(tensor.nbytes for ref in made if (tensor := ref()) is not None))
        state = save(params, optimizer)
        made.extend(weakref.ref(tensor) for tensor in state.weights)
        made.extend(weakref.ref(value) for saved in state.optimizer_state if saved for value in saved.values()
                    if torch.is_tensor(value))
        return state

    monkeypatch.setattr(ppo, "save_actor_state", counted)
    metrics, _ = adam_epochs(actor, inputs, config(mini_batch_size=2, micro_batch_size=1, ppo_epochs=2,
                                                   rollback_kl=1e9))
    assert metrics["actor/optimizer_steps"] == 4
    assert held_at_each_copy == [0, 0, 0, 0]


def test_the_rollback_bound_must_be_positive():
    with pytest.raises(ConfigError, match="algorithm.rollback_kl"):
        config(rollback_kl=0.0).validate()


# --------------------------------------------------------------------------- the sampler's drift
def with_sampler_logprobs(actor, batch, seed=3):
    """``batch`` with sampler log-probs near the actor's own (the drift of another forward: kernels, rounding)."""
    noise = torch.randn(batch.input_ids.shape, generator=torch.Generator().manual_seed(seed)) * batch.loss_mask
    sampled = (batched_logprobs(actor, batch, MicroBatching(4), 1.0) + 0.05 * noise) * batch.loss_mask
    return dataclasses.replace(batch, sampler_logprobs=sampled)


@pytest.mark.parametrize("micro", [1, 2])
def test_the_update_measures_the_drift_from_the_sampler_over_its_first_mini_batch_before_any_step(actor, critic,
                                                                                                    micro):
    """With the sampler's log-probs as the old ones, the first mini-batch's passes run under the weights that
    sampled: the drift is their token mean of |training log-prob - sampler log-prob|, over the rows the first
    shuffle put first, as a plain pass of the untouched actor over those rows gives it."""
    batch = with_sampler_logprobs(actor, model_batch(actor.config.vocab_size))
    first = torch.randperm(len(batch), generator=torch.Generator().manual_seed(0))[:2]  # run_epochs' generator
    rows = batch.select(first)
    with torch.no_grad():
        plain, _ = token_logprobs(actor, rows.input_ids, rows.attention_mask, rows.loss_mask, 1.0)
    expected = float(((plain - rows.sampler_logprobs).abs() * rows.loss_mask).sum() / rows.loss_mask.sum())
    inputs = dataclasses.replace(update_inputs(actor, critic, batch), old_logprobs=batch.sampler_logprobs)
    cfg = config(mini_batch_size=2, micro_batch_size=micro, ppo_epochs=2, old_logprobs="sampler")
    metrics = run_epochs(copy.deepcopy(actor), copy.deepcopy(critic), inputs, cfg)
    assert metrics["actor/optimizer_steps"] == 4  # the later passes ran under moved weights, and are not counted
    assert metrics["actor/logprob_mismatch"] == pytest.approx(expected, rel=1e-5, abs=1e-7)
    assert expected > 1e-3


def test_recomputed_old_log_probs_leave_the_drift_to_the_scoring_pass(actor, critic):
    batch = with_sampler_logprobs(actor, model_batch(actor.config.vocab_size))
    inputs = dataclasses.replace(update_inputs(actor, critic, batch), old_logprobs=batch.sampler_logprobs)
    metrics = run_epochs(actor, critic, inputs, config(mini_batch_size=2, micro_batch_size=1,
                                                        old_logprobs="recompute"))
    assert "actor/logprob_mismatch" not in metrics

"""Losses: hand-computed cases, per-token loop references, gradients."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.algorithms import reference as ref
from turnrl.algorithms import (
    AGGREGATIONS,
    aggregate,
    entropy_bonus,
    kl_in_reward,
    kl_penalty,
    ppo_policy_loss,
    value_loss,
)
from turnrl.algorithms.losses import PolicyLossInputs, PolicyLossSettings, ppo_loss

F64 = torch.float64


def t(rows, dtype=F64):
    return torch.tensor(rows, dtype=dtype)


def close(actual, expected, tol=1e-9):
    actual = torch.as_tensor(actual).to(F64)
    expected = torch.as_tensor(expected, dtype=F64).expand_as(actual)
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol)


# --- aggregate --------------------------------------------------------------


def test_aggregate_by_hand():
    x = t([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [9.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])  # last row empty
    close(aggregate(x, mask, "token-mean"), 10.0 / 4)
    close(aggregate(x, mask, "seq-mean-token-mean"), (2.0 + 4.0) / 2)
    close(aggregate(x, mask, "seq-mean-token-sum"), (6.0 + 4.0) / 2)
    for mode in AGGREGATIONS:
        assert aggregate(x, torch.zeros(3, 3), mode).item() == 0.0
    with pytest.raises(ValueError):
        aggregate(x, mask, "mean")


def test_aggregate_ignores_inf_and_nan_outside_the_mask():
    x = t([[1.0, float("inf")], [float("nan"), 3.0]])
    mask = torch.tensor([[True, False], [False, True]])
    for mode in AGGREGATIONS:
        assert torch.isfinite(aggregate(x, mask, mode))


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), b=st.integers(1, 5), s=st.integers(1, 20), mode=st.sampled_from(AGGREGATIONS))
def test_aggregate_matches_reference(seed, b, s, mode):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(b, s, generator=gen, dtype=F64)
    mask = torch.rand(b, s, generator=gen) < 0.5
    close(aggregate(x, mask, mode), ref.ref_aggregate(x, mask, mode))


# --- PPO policy loss --------------------------------------------------------


def test_ppo_policy_loss_by_hand():
    # ratios 1.5 (A>0: clipped at 1.28), 0.5 (A>0: unclipped), 5 (A<0: dual clip 3),
    # 0.7 (A<0: clipped at 0.8), and a masked-out token.
    ratio = t([[1.5, 0.5, 5.0, 0.7, 2.0]])
    adv = t([[1.0, 2.0, -1.0, -2.0, 100.0]])
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    old = torch.zeros(1, 5, dtype=F64)
    new = ratio.log().requires_grad_()
    loss, stats = ppo_policy_loss(new, old, adv, mask)
    per_token = [-1.28, -1.0, 3.0, 1.6]
    close(loss, sum(per_token) / 4)
    close(stats.clip_frac, 2 / 4)  # tokens 0 and 3 take the clipped term
    close(stats.dual_clip_frac, 1 / 4)
    loss.backward()
    # clipped and dual-clipped tokens carry no gradient; the others -A * r / n
    close(new.grad, t([[0.0, -2.0 * 0.5 / 4, 0.0, 0.0, 0.0]]))


def test_ppo_dual_clip_can_be_disabled_and_is_validated():
    new, old = t([[math.log(5.0)]]), t([[0.0]])
    adv, mask = t([[-1.0]]), torch.ones(1, 1)
    close(ppo_policy_loss(new, old, adv, mask, dual_clip=None)[0], 5.0)
    with pytest.raises(ValueError):
        ppo_policy_loss(new, old, adv, mask, dual_clip=1.0)


def test_ppo_approx_kl_is_zero_on_policy_and_positive_off_policy():
    gen = torch.Generator().manual_seed(0)
    lp = torch.randn(4, 8, generator=gen, dtype=F64)
    mask = torch.ones(4, 8)
    _, stats = ppo_policy_loss(lp, lp.clone(), torch.randn(4, 8, generator=gen, dtype=F64), mask)
    close(stats.approx_kl, 0.0)
    close(stats.clip_frac, 0.0)
    _, stats = ppo_policy_loss(lp + 0.1 * torch.randn(4, 8, generator=gen, dtype=F64), lp, lp, mask)
    assert stats.approx_kl > 0


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    b=st.integers(1, 4),
    s=st.integers(1, 16),
    dual=st.sampled_from([None, 3.0]),
    mode=st.sampled_from(AGGREGATIONS),
)
def test_ppo_policy_loss_matches_reference(seed, b, s, dual, mode):
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, s, generator=gen, dtype=F64) * 3
    new = old + torch.randn(b, s, generator=gen, dtype=F64) * 0.5
    adv = torch.randn(b, s, generator=gen, dtype=F64)
    mask = torch.rand(b, s, generator=gen) < 0.7
    loss, _ = ppo_policy_loss(new, old, adv, mask, 0.2, 0.28, dual, mode)
    per_token = torch.tensor(
        [
            [ref.ref_ppo_token_loss(n, o, a, 0.2, 0.28, dual) for n, o, a in zip(nr, orow, ar)]
            for nr, orow, ar in zip(new.tolist(), old.tolist(), adv.tolist())
        ],
        dtype=F64,
    )
    close(loss, ref.ref_aggregate(per_token, mask, mode))


# --- value loss -------------------------------------------------------------


def test_value_loss_by_hand():
    values = t([[1.0, 0.0, 2.0]]).requires_grad_()
    old = t([[0.0, 0.0, 0.0]])
    returns = t([[0.0, 1.0, 2.0]])
    mask = torch.tensor([[1, 1, 0]])
    # token 0: moved 1.0 from old (clip 0.5 -> 0.5): errors 1 vs 0.25 -> 1 (unclipped wins)
    # token 1: no move: error 1 both ways
    loss, stats = value_loss(values, old, returns, mask, clip=0.5)
    close(loss, 0.5 * (1.0 + 1.0) / 2)
    close(stats.clip_frac, 0.0)
    close(stats.error, 1.0)
    # returns behind the old value: the clipped prediction is the worse one
    loss, stats = value_loss(t([[1.0]]), t([[0.0]]), t([[3.0]]), torch.ones(1, 1), clip=0.5)
    close(loss, 0.5 * 2.5**2)
    close(stats.clip_frac, 1.0)
    loss, _ = value_loss(t([[1.0]]), t([[0.0]]), t([[3.0]]), torch.ones(1, 1), clip=None)
    close(loss, 0.5 * 2.0**2)


def test_values_within_the_clip_range_are_never_counted_as_clipped():
    """Inside the range the clipped prediction ``old + (values - old)`` is the prediction up to rounding; the
    loss and the clip share are the unclipped ones exactly, whatever the rounding does."""
    gen = torch.Generator().manual_seed(0)
    old = torch.randn(64, 32, generator=gen)
    values = (old + 0.3 * torch.rand(64, 32, generator=gen) - 0.15).requires_grad_()
    returns = torch.randn(64, 32, generator=gen)
    mask = torch.ones(64, 32)
    rounded = old + (values.detach() - old) != values.detach()
    assert rounded.any()  # the case the check is for
    loss, stats = value_loss(values, old, returns, mask, clip=0.2)
    assert float(stats.clip_frac) == 0.0
    assert float(loss) == float(0.5 * ((values - returns) ** 2).mean())


# --- KL ---------------------------------------------------------------------


def test_kl_penalty_matches_reference_and_properties():
    gen = torch.Generator().manual_seed(1)
    lp = torch.randn(3, 7, generator=gen, dtype=F64)
    rp = torch.randn(3, 7, generator=gen, dtype=F64)
    lp[0, 0], rp[0, 0] = 0.0, -50.0  # extreme: clamped
    for kind in ("k1", "k2", "k3"):
        got = kl_penalty(lp, rp, kind)
        want = torch.tensor([[ref.ref_kl(a, b, kind) for a, b in zip(ra, rb)]
                             for ra, rb in zip(lp.tolist(), rp.tolist())], dtype=F64)
        close(got, want)
        close(kl_penalty(lp, lp, kind), torch.zeros_like(lp))
    assert (kl_penalty(lp, rp, "k3") >= 0).all()
    close(kl_penalty(t([[0.0]]), t([[math.log(2.0)]]), "k3"), 2.0 - math.log(2.0) - 1.0)
    with pytest.raises(ValueError):
        kl_penalty(lp, rp, "k4")


def test_kl_in_reward():
    rewards = t([[0.0, 1.0, 0.0]])
    kl = t([[0.5, 0.2, 9.0]]).requires_grad_()
    out = kl_in_reward(rewards, kl, 0.1, torch.tensor([[1, 1, 0]]))
    close(out, t([[-0.05, 0.98, 0.0]]))
    assert not out.requires_grad


# --- entropy ----------------------------------------------------------------


def test_entropy_bonus_aggregates_like_the_losses():
    h = torch.rand(2, 4)
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0]])
    for mode in AGGREGATIONS:
        close(entropy_bonus(h, mask, mode), aggregate(h, mask, mode))


# --- nothing outside the mask reaches a gradient --------------------------------

NON_FINITE = [float("nan"), float("inf"), -float("inf")]


@pytest.mark.parametrize("bad", NON_FINITE)
@pytest.mark.parametrize("where", ["values", "old_values", "returns"])
def test_value_loss_gradient_ignores_non_finite_values_outside_the_mask(bad, where):
    v = torch.zeros(1, 2, requires_grad=True)
    inputs = {"values": v, "old_values": torch.zeros(1, 2), "returns": torch.tensor([[1.0, 0.0]])}
    if where == "values":
        inputs["values"] = v + torch.tensor([[0.0, bad]])
    else:
        inputs[where] = inputs[where] + torch.tensor([[0.0, bad]])
    loss, stats = value_loss(**inputs, loss_mask=torch.tensor([[1, 0]]))
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(stats.error)
    assert v.grad.tolist() == [[-1.0, 0.0]]


@pytest.mark.parametrize("bad", NON_FINITE)
@pytest.mark.parametrize("where", ["logprobs", "old_logprobs", "advantages"])
def test_policy_loss_gradient_ignores_non_finite_values_outside_the_mask(bad, where):
    lp = torch.zeros(1, 2, requires_grad=True)
    inputs = {"logprobs": lp, "old_logprobs": torch.zeros(1, 2), "advantages": torch.ones(1, 2)}
    inputs[where] = inputs[where] + torch.tensor([[0.0, bad]])
    loss, stats = ppo_policy_loss(**inputs, loss_mask=torch.tensor([[1, 0]]))
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(x) for x in stats)
    assert lp.grad.tolist() == [[-1.0, 0.0]]


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
@pytest.mark.parametrize("bad", NON_FINITE)
def test_kl_gradient_ignores_non_finite_logprobs_outside_the_mask(kind, bad):
    lp = torch.tensor([[-1.0, bad]], requires_grad=True)
    mask = torch.tensor([[1, 0]])
    kl = kl_penalty(lp, torch.tensor([[-2.0, -1.0]]), kind=kind, mask=mask)
    aggregate(kl, mask).backward()
    assert torch.isfinite(kl).all() and kl[0, 1] == 0
    assert torch.isfinite(lp.grad).all() and lp.grad[0, 1] == 0


def test_sample_weights_scale_each_samples_policy_loss():
    gen = torch.Generator().manual_seed(0)
    lp, old, adv = (torch.randn(3, 4, generator=gen) for _ in range(3))
    mask = torch.ones(3, 4)
    weights = torch.tensor([0.5, 2.0, 1.0])
    for mode in AGGREGATIONS:
        weighted, _ = ppo_policy_loss(lp, old, adv, mask, aggregation=mode, sample_weights=weights)
        per_row = [ppo_policy_loss(lp[i : i + 1], old[i : i + 1], adv[i : i + 1], mask[i : i + 1], aggregation=mode)[0]
                   for i in range(3)]
        expected = sum(w * x for w, x in zip(weights, per_row)) / 3
        close(weighted, expected, tol=1e-6)


# --- wide random inputs against the per-token references --------------------------------


STATS_TOL = 1e-6
"""The loss stats are float32 diagnostics (token means): their relative rounding is about 6e-8."""


def wide_batch(seed: int, b: int, s: int, spread: float):
    """Log-probs whose ratios reach far outside any clip range (``spread`` 30: past the clamp at 20),
    advantages of both signs with exact zeros, and a mask with empty rows."""
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, s, generator=gen, dtype=F64) * 5
    new = old + torch.randn(b, s, generator=gen, dtype=F64) * spread
    adv = torch.randn(b, s, generator=gen, dtype=F64) * 2
    adv[torch.rand(b, s, generator=gen) < 0.1] = 0.0
    mask = torch.rand(b, s, generator=gen) < 0.7
    mask[torch.rand(b, generator=gen) < 0.25] = False
    return gen, new, old, adv, mask


def per_token(fn, *tensors):
    """``fn`` applied to each token's entries, as nested lists."""
    return [[fn(*xs) for xs in zip(*rows)] for rows in zip(*(x.tolist() for x in tensors))]


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    b=st.integers(1, 5),
    s=st.integers(1, 24),
    spread=st.sampled_from([0.05, 1.0, 30.0]),
    clip=st.sampled_from([(0.2, 0.28), (3e-4, 4e-4)]),
    dual=st.sampled_from([None, 3.0]),
    mode=st.sampled_from(AGGREGATIONS),
    weighted=st.booleans(),
)
def test_ppo_policy_loss_its_stats_and_gradient_match_the_per_token_reference(
    seed, b, s, spread, clip, dual, mode, weighted
):
    """Every aggregation, with and without sample and token weights (truncated importance weights), clip ranges
    of PPO and GSPO's width, the dual clip on and off, log-ratios past the clamp at 20."""
    gen, new, old, adv, mask = wide_batch(seed, b, s, spread)
    sample_w = torch.rand(b, generator=gen, dtype=F64) * 2 if weighted else None
    token_w = torch.rand(b, s, generator=gen, dtype=F64) * 2 if weighted else None
    lp = new.clone().requires_grad_()
    loss, stats = ppo_policy_loss(lp, old, adv, mask, *clip, dual, mode, sample_weights=sample_w,
                                  token_weights=token_w)
    loss.backward()
    tokens = per_token(lambda n, o, a: ref.ref_ppo_token(n, o, a, *clip, dual), new, old, adv)
    scale = torch.ones(b, s, dtype=F64)
    if weighted:
        scale = sample_w[:, None] * token_w
    losses = t([[x[0] for x in row] for row in tokens]) * scale
    close(loss, ref.ref_aggregate(losses, mask, mode))
    # The stats are token means over the mask, whatever the aggregation and the weights; float32 diagnostics.
    flags = [t([[float(x[k]) for x in row] for row in tokens]) for k in (1, 3, 2)]  # clip, KL, dual clip
    for got, want in zip(stats, flags, strict=True):
        close(got, ref.ref_aggregate(want, mask, "token-mean"), tol=STATS_TOL)
    # Gradient: -A r where the unclipped term is active and the log-ratio inside the clamp, else 0.
    def token_grad(n, o, a):
        token_loss, _, dual_active, _ = ref.ref_ppo_token(n, o, a, *clip, dual)
        log_ratio = n - o
        unclipped = -a * math.exp(log_ratio)
        active = abs(log_ratio) < 20 and not dual_active and unclipped == token_loss
        return unclipped if active else 0.0
    grads = t(per_token(token_grad, new, old, adv)) * scale * ref.ref_aggregate_weights(mask, mode)
    close(lp.grad, grads)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    b=st.integers(1, 5),
    s=st.integers(1, 24),
    spread=st.sampled_from([0.1, 1.0, 10.0]),
    clip=st.sampled_from([None, 0.2, 0.5]),
    mode=st.sampled_from(AGGREGATIONS),
)
def test_value_loss_its_stats_and_gradient_match_the_per_token_reference(seed, b, s, spread, clip, mode):
    gen = torch.Generator().manual_seed(seed)
    old = torch.randn(b, s, generator=gen, dtype=F64)
    values = old + torch.randn(b, s, generator=gen, dtype=F64) * spread
    returns = old + torch.randn(b, s, generator=gen, dtype=F64) * spread
    mask = torch.rand(b, s, generator=gen) < 0.7
    mask[torch.rand(b, generator=gen) < 0.25] = False
    v = values.clone().requires_grad_()
    loss, stats = value_loss(v, old, returns, mask, clip, mode)
    loss.backward()
    tokens = per_token(lambda x, o, r: ref.ref_value_token(x, o, r, clip), values, old, returns)
    close(loss, ref.ref_aggregate(t([[x[0] for x in row] for row in tokens]), mask, mode))
    for k, got in ((1, stats.clip_frac), (2, stats.error)):  # float32 diagnostics
        want = t([[float(x[k]) for x in row] for row in tokens])
        close(got, ref.ref_aggregate(want, mask, "token-mean"), tol=STATS_TOL)
    # d/dv of 0.5 (v - R)^2 where the unclipped error counts; the clipped prediction carries no gradient.
    grads = t(per_token(lambda x, o, r: 0.0 if ref.ref_value_token(x, o, r, clip)[1] else x - r, values, old, returns))
    close(v.grad, grads * ref.ref_aggregate_weights(mask, mode))


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), b=st.integers(1, 5), s=st.integers(1, 24), spread=st.sampled_from([0.1, 30.0]),
       masked=st.booleans())
def test_kl_penalty_of_every_kind_matches_the_reference_on_wide_inputs(seed, b, s, spread, masked):
    _, lp, ref_lp, _, mask = wide_batch(seed, b, s, spread)
    for kind in ("k1", "k2", "k3"):
        want = t(per_token(lambda a, r, kind=kind: ref.ref_kl(a, r, kind), lp, ref_lp))
        if masked:
            close(kl_penalty(lp, ref_lp, kind, mask), torch.where(mask, want, 0.0))
        else:
            close(kl_penalty(lp, ref_lp, kind), want)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10_000), b=st.integers(1, 5), s=st.integers(1, 24), coef=st.sampled_from([0.0, 0.05, 1.0]))
def test_kl_in_reward_matches_a_loop(seed, b, s, coef):
    _, rewards, kl, _, mask = wide_batch(seed, b, s, 1.0)
    got = kl_in_reward(rewards, kl, coef, mask)
    want = [[r - coef * k if m else r for r, k, m in zip(rr, kr, mr)]
            for rr, kr, mr in zip(rewards.tolist(), kl.tolist(), mask.tolist())]
    close(got, t(want))


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10_000), b=st.integers(1, 5), s=st.integers(1, 24), mode=st.sampled_from(AGGREGATIONS))
def test_entropy_bonus_matches_the_aggregation_reference(seed, b, s, mode):
    _, _, _, _, mask = wide_batch(seed, b, s, 1.0)
    entropy = torch.rand(b, s, generator=torch.Generator().manual_seed(seed), dtype=F64) * 5
    close(entropy_bonus(entropy, mask, mode), ref.ref_aggregate(entropy, mask, mode))


# --------------------------------------------------------------------------- from a user's package
def test_a_policy_loss_from_a_users_package_is_named_module_attr_and_trains(tmp_path, monkeypatch, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from turnrl.config import load_config
    from turnrl.training.batch import Sample, collate
    from turnrl.training.ppo import UpdateInputs, ppo_epochs
    from turnrl.training.train_config import OptimConfig, TrainConfig

    (tmp_path / "user_loss_ext.py").write_text(
        "import torch\n"
        "from turnrl.algorithms.losses import PolicyLossStats, aggregate\n\n"
        "CALLS = []\n\n"
        "def seven_plus_pg(inputs, settings):\n"
        "    CALLS.append(settings.aggregation)\n"
        "    pg = aggregate(-inputs.advantages * inputs.logprobs, inputs.loss_mask, settings.aggregation)\n"
        "    zero = torch.zeros(())\n"
        "    return pg - pg.detach() + 7.0, PolicyLossStats(zero, zero, zero)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    config = load_config(TrainConfig, None, ["algorithm.policy_loss=user_loss_ext:seven_plus_pg",
                                             "algorithm.loss_aggregation=seq-mean-token-sum",
                                             "algorithm.entropy_coef=0"]).algorithm
    actor = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    batch = collate([Sample([3, 4, 5, 6], [0, 1, 1, 1], [0.0] * 4, [3], [1.0], episode=k, group=0) for k in range(2)],
                    pad_id=0)
    zeros = torch.zeros(batch.input_ids.shape)
    inputs = UpdateInputs(batch, zeros, torch.ones(batch.input_ids.shape), zeros)
    before = [p.detach().clone() for p in actor.parameters()]
    metrics = ppo_epochs(actor, None, inputs, config, OptimConfig(grad_clip=1e9),
                         torch.optim.SGD(actor.parameters(), lr=0.1), None, 1.0, torch.Generator().manual_seed(0))
    import user_loss_ext

    assert metrics["losses/policy"] == pytest.approx(7.0) and user_loss_ext.CALLS[0] == "seq-mean-token-sum"
    assert any(not torch.equal(b, p) for b, p in zip(before, actor.parameters()))  # its gradient trained the actor
    with pytest.raises(ValueError, match=r"algorithm.policy_loss='ppoo' is not allowed; choose one of \['ppo'\]"):
        load_config(TrainConfig, None, ["algorithm.policy_loss=ppoo"])


@pytest.mark.parametrize(
    ("attr", "got"),
    [("Settings", "got the class user_wrong_loss_ext:Settings, not a function or an instance"),
     ("three_arguments", r"got user_wrong_loss_ext:three_arguments\(inputs, settings, scale\), which cannot take "
                         r"those arguments \(missing a required argument: 'scale'\)")],
)
def test_a_module_attr_that_is_not_a_policy_loss_fails_at_config_load(tmp_path, monkeypatch, attr, got):
    from turnrl.config import ConfigError, load_config
    from turnrl.training.train_config import TrainConfig

    (tmp_path / "user_wrong_loss_ext.py").write_text(
        "from dataclasses import dataclass\n\n"
        "@dataclass\n"
        "class Settings:\n"
        "    scale: float = 1.0\n\n"
        "def three_arguments(inputs, settings, scale):\n"
        "    return None\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError) as info:
        load_config(TrainConfig, None, [f"algorithm.policy_loss=user_wrong_loss_ext:{attr}"])
    assert (f"algorithm.policy_loss='user_wrong_loss_ext:{attr}': a policy loss must be a function or callable "
            "object taking (inputs, settings) and returning tuple[torch.Tensor, PolicyLossStats] "
            "(turnrl.algorithms.losses.PolicyLoss); ") in str(info.value)
    info.match(got)


def test_an_update_resolves_the_policy_loss_once_not_in_every_micro_batch(monkeypatch, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from turnrl.algorithms.losses import POLICY_LOSSES
    from turnrl.training.algorithm_config import AlgorithmConfig
    from turnrl.training.batch import Sample, collate
    from turnrl.training.ppo import UpdateInputs, ppo_epochs
    from turnrl.training.train_config import OptimConfig

    looked_up = []
    get = POLICY_LOSSES.get

    def counted_get(name):
        looked_up.append(name)
        return get(name)

    monkeypatch.setattr(POLICY_LOSSES, "get", counted_get)  # the registry's own lookup, counted
    config = AlgorithmConfig(ppo_epochs=2, mini_batch_size=2, micro_batch_size=1)
    actor = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    batch = collate([Sample([3, 4, 5, 6], [0, 1, 1, 1], [0.0] * 4, [3], [1.0], episode=k, group=0) for k in range(2)],
                    pad_id=0)
    zeros = torch.zeros(batch.input_ids.shape)
    metrics = ppo_epochs(actor, None, UpdateInputs(batch, zeros, torch.ones(batch.input_ids.shape), zeros), config,
                         OptimConfig(), torch.optim.SGD(actor.parameters(), lr=0.1), None, 1.0,
                         torch.Generator().manual_seed(0))
    assert metrics["actor/optimizer_steps"] == 2.0  # two epochs of one mini-batch, each of two micro-batches
    assert looked_up == ["ppo"]


# --- boundaries and settings -----------------------------------------------------------


def test_a_ratio_exactly_at_the_dual_clip_bound_is_not_dual_clipped():
    """The dual clip replaces the loss only where it exceeds the bound: at a tie the token keeps the unclipped
    term's gradient ``-A r`` and does not count in ``dual_clip_frac`` (as in ``ref_ppo_token``)."""
    dual_clip = math.exp(1.0)
    new = t([[1.0]]).requires_grad_()  # log-ratio 1: r = e, the bound itself
    assert torch.exp(new.detach()).item() == dual_clip  # the tie this test is about
    loss, stats = ppo_policy_loss(new, t([[0.0]]), t([[-1.0]]), torch.ones(1, 1), dual_clip=dual_clip)
    loss.backward()
    close(loss, dual_clip)
    close(stats.dual_clip_frac, 0.0)
    close(new.grad, t([[dual_clip]]))  # d(-A r)/d logprob = -A r


def test_token_weights_carry_no_gradient_from_the_policy_loss():
    gen = torch.Generator().manual_seed(3)
    lp = torch.randn(2, 5, generator=gen, dtype=F64).requires_grad_()
    weights = (torch.rand(2, 5, generator=gen, dtype=F64) + 0.5).requires_grad_()
    loss, _ = ppo_policy_loss(lp, lp.detach() + 0.1, torch.randn(2, 5, generator=gen, dtype=F64), torch.ones(2, 5),
                              token_weights=weights)
    loss.backward()
    assert lp.grad is not None and weights.grad is None


def test_the_registered_ppo_loss_applies_every_setting():
    """``ppo_loss`` with non-default clip range, dual clip and aggregation, and sample and token weights: the
    per-token reference with those settings."""
    gen, new, old, adv, mask = wide_batch(5, 4, 8, 1.0)
    sample_w = torch.rand(4, generator=gen, dtype=F64) + 0.5
    token_w = torch.rand(4, 8, generator=gen, dtype=F64) + 0.5
    settings = PolicyLossSettings(clip_low=0.1, clip_high=0.15, dual_clip=2.0, aggregation="seq-mean-token-sum")
    loss, _ = ppo_loss(PolicyLossInputs(new, old, adv, mask, sample_w, token_w), settings)
    tokens = per_token(lambda n, o, a: ref.ref_ppo_token(n, o, a, 0.1, 0.15, 2.0)[0], new, old, adv)
    want = ref.ref_aggregate(t(tokens) * sample_w[:, None] * token_w, mask, "seq-mean-token-sum")
    close(loss, want)


def test_a_value_exactly_clip_away_from_the_old_value_is_not_clipped():
    """``|v - old| == clip``: the prediction is inside the range (``ref_value_token``), although
    ``old + (v - old)`` rounds to 0.8999999999999999 here and its error would be the larger."""
    values, old, returns = t([[0.9]]).requires_grad_(), t([[0.2]]), t([[1.0]])
    assert (values.detach() - old).abs().item() == 0.7  # exactly the clip
    loss, stats = value_loss(values, old, returns, torch.ones(1, 1), clip=0.7)
    loss.backward()
    close(stats.clip_frac, 0.0)
    assert loss.item() == 0.5 * (0.9 - 1.0) ** 2  # the unclipped error, to the last bit
    close(values.grad, t([[0.9 - 1.0]]))


def test_equal_clipped_and_unclipped_value_errors_keep_the_unclipped_gradient():
    """v = 2 moved 2 from old = 0 (clip 0.5: v_clip = 0.5); R = 1.25 lies halfway, so both errors are 0.5625.
    The clipped term counts only where it is strictly larger."""
    values = t([[2.0]]).requires_grad_()
    loss, stats = value_loss(values, t([[0.0]]), t([[1.25]]), torch.ones(1, 1), clip=0.5)
    loss.backward()
    close(loss, 0.5 * 0.5625)
    close(stats.clip_frac, 0.0)
    close(values.grad, t([[0.75]]))  # v - R


def test_k3_kl_of_an_infinite_log_ratio_is_the_clamp_bound():
    """A log-prob of -inf on either side: the log-ratio clamps to 20 before the exp, so k3 is its bound 10,
    never NaN."""
    inf = float("inf")
    got = kl_penalty(t([[-inf, 0.0]]), t([[0.0, -inf]]), "k3")
    close(got, t([[ref.ref_kl(-inf, 0.0, "k3"), ref.ref_kl(0.0, -inf, "k3")]]))
    close(got, t([[10.0, 10.0]]))

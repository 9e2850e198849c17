"""The estimator registry: what each built-in estimator declares, and what registration and a call refuse.

The built-in estimators' numbers are checked here against the plain loops of reference.py on random episode
views, and against the algorithms called by hand on batches in tests/training/test_batch_advantages.py;
tests/training/test_adding_an_estimator.py adds one from outside.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.algorithms import reference as ref
from tests.algorithms.test_gigpo import reference as gigpo_reference
from turnrl.algorithms.estimators import (
    EpisodeView,
    Estimate,
    GiGPOParams,
    NoParams,
    SharedSettings,
    estimator,
    estimator_names,
    get_estimator,
)


@pytest.mark.parametrize(
    ("name", "critic", "needs", "params"),
    [
        ("gae", True, set(), NoParams),
        ("bilevel_gae", True, set(), NoParams),
        ("turn_gae", True, set(), NoParams),
        ("grpo", False, {"groups", "episode_weights"}, NoParams),
        ("drgrpo", False, {"groups", "episode_weights"}, NoParams),
        ("rloo", False, {"groups", "episode_weights"}, NoParams),
        ("reinforce_pp", False, set(), NoParams),
        ("gigpo", False, {"turn_states", "groups", "episode_weights"}, GiGPOParams),
    ],
)
def test_each_built_in_estimator_declares_what_it_needs(name, critic, needs, params):
    spec = get_estimator(name)
    assert (spec.name, spec.critic, set(spec.needs), spec.params) == (name, critic, needs, params)


def test_an_unknown_name_lists_the_registered_ones():
    with pytest.raises(ValueError, match=r"no estimator named 'ppo'; registered: \[.*'gae'.*'gigpo'"):
        get_estimator("ppo")


def test_registration_refuses_a_taken_name_an_unknown_need_and_untyped_params():
    def noop(view: EpisodeView, shared: SharedSettings, params: NoParams) -> Estimate:
        return Estimate(view.rewards, view.rewards)

    with pytest.raises(ValueError, match="already registered"):
        estimator("gae")(noop)
    with pytest.raises(ValueError, match="unknown needs"):
        estimator("test_unknown_need", needs=("values",))(noop)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="dataclass"):
        estimator("test_untyped_params", params=dict)(noop)
    assert get_estimator("gae").fn is not noop
    assert "test_unknown_need" not in estimator_names() and "test_untyped_params" not in estimator_names()


def view(values: bool = False, turn_states: bool = False) -> EpisodeView:
    """Two episodes of two one-token turns, rewards on the last turn."""
    mask = torch.ones(2, 2, dtype=torch.bool)
    index = (torch.tensor([0, 0, 1, 1]), torch.tensor([0, 1, 0, 1]))
    return EpisodeView(
        rewards=torch.tensor([[0.0, 1.0], [0.0, 0.0]], dtype=torch.float64),
        values=torch.zeros(2, 2) if values else None,
        mask=mask,
        turn_end=mask.clone(),
        group=torch.tensor([0, 0]),
        sample_index=index,
        view_index=index,
        turn_states=torch.tensor([[0, 1], [0, 2]]) if turn_states else None,
    )


def test_a_call_checks_that_the_view_holds_what_the_estimator_needs():
    with pytest.raises(ValueError, match="critic"):
        get_estimator("gae")(view(), SharedSettings())
    assert get_estimator("gae")(view(values=True), SharedSettings()).advantages.shape == (2, 2)
    with pytest.raises(ValueError, match="env state"):
        get_estimator("gigpo")(view(), SharedSettings())
    with pytest.raises(TypeError, match="GiGPOParams"):
        get_estimator("gigpo")(view(turn_states=True), SharedSettings(), NoParams())


def test_gigpo_reports_the_share_of_its_turns_in_anchor_groups():
    # Both episodes start from state 0 (an anchor group of two); their second turns differ.
    out = get_estimator("gigpo")(view(turn_states=True), SharedSettings(), GiGPOParams(gamma=1.0))
    assert out.metrics == {"gigpo_anchored_turns": pytest.approx(0.5)}


def test_params_check_their_own_ranges():
    with pytest.raises(ValueError, match="gamma"):
        GiGPOParams(gamma=1.5)


# --------------------------------------------------------------------------- from a user's package
def test_an_estimator_from_a_users_package_is_named_module_attr_in_the_config(tmp_path, monkeypatch):
    from turnrl.config import load_config
    from turnrl.training.batch import Sample, collate
    from turnrl.training.batch_advantages import compute_advantages
    from turnrl.training.train_config import TrainConfig

    (tmp_path / "user_estimator_ext.py").write_text(
        "from turnrl.algorithms import broadcast_to_tokens\n"
        "from turnrl.algorithms.estimators import Estimate\n\n"
        "def return_itself(view, shared, params):\n"
        "    advantages = broadcast_to_tokens(10.0 * view.rewards.sum(1), view.mask)\n"
        "    return Estimate(advantages, advantages)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    config = load_config(TrainConfig, None, ["algorithm.advantage=user_estimator_ext:return_itself",
                                             "groups.group_size=1"]).algorithm
    assert not config.uses_critic
    batch = collate([Sample([5, 5, 5], [0, 1, 1], [0.0] * 3, [2], [r], episode=e, group=e)
                     for e, r in enumerate([1.0, 3.0])], pad_id=0)
    advantages = compute_advantages(batch, config).advantages
    assert advantages[batch.loss_mask == 1].tolist() == [10.0, 10.0, 30.0, 30.0]
    with pytest.raises(ValueError, match=r"algorithm.advantage='grpoo' is not allowed; .*did you mean grpo\?"):
        load_config(TrainConfig, None, ["algorithm.advantage=grpoo"])


@pytest.mark.parametrize(
    ("attr", "got"),
    [("Settings", "got the class user_wrong_estimator_ext:Settings, not a function or an instance"),
     ("two_arguments", r"got user_wrong_estimator_ext:two_arguments\(view, shared\), which cannot take those "
                       "arguments")],
)
def test_a_module_attr_that_is_not_an_estimator_fails_at_config_load(tmp_path, monkeypatch, attr, got):
    from turnrl.config import ConfigError, load_config
    from turnrl.training.train_config import TrainConfig

    (tmp_path / "user_wrong_estimator_ext.py").write_text(
        "from dataclasses import dataclass\n\n"
        "@dataclass\n"
        "class Settings:\n"
        "    gamma: float = 1.0\n\n"
        "def two_arguments(view, shared):\n"
        "    return None\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError) as info:
        load_config(TrainConfig, None, [f"algorithm.advantage=user_wrong_estimator_ext:{attr}"])
    assert (f"algorithm.advantage='user_wrong_estimator_ext:{attr}': an advantage estimator must be a function or "
            "callable object taking (view, shared, params) and returning Estimate "
            "(turnrl.algorithms.estimators.EstimatorFn); ") in str(info.value)
    info.match(got)


def test_a_callable_object_is_an_estimator_named_by_its_class(tmp_path, monkeypatch):
    (tmp_path / "user_callable_estimator_ext.py").write_text(
        "from turnrl.algorithms.estimators import Estimate\n\n"
        "class Zero:\n"
        "    def __call__(self, view, shared, params):\n"
        "        return Estimate(0 * view.rewards, 0 * view.rewards)\n\n"
        "ZERO = Zero()\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = get_estimator("user_callable_estimator_ext:ZERO")
    assert spec.name == "user_callable_estimator_ext:Zero" and not spec.critic
    assert spec(view(), SharedSettings()).advantages.abs().sum() == 0


# --------------------------------------------------------------------------- each estimator against the plain loops
def random_view(seed: int, e: int, n: int) -> EpisodeView:
    """Left-aligned episodes of 0 to n tokens, turns ending at random and always at the last token, turn rewards
    at the ends plus a small per-token term (a KL in the reward), random groups and start states."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, n + 1, (e,), generator=gen)
    mask = torch.arange(n)[None, :] < lengths[:, None]
    turn_end = (torch.rand(e, n, generator=gen) < 0.2) & mask
    turn_end[torch.arange(e), (lengths - 1).clamp(min=0)] |= lengths > 0
    rewards = torch.where(turn_end, torch.randn(e, n, generator=gen, dtype=torch.float64), 0.0)
    rewards = rewards + torch.where(mask, 0.01 * torch.randn(e, n, generator=gen, dtype=torch.float64), 0.0)
    n_turns = turn_end.sum(1)
    states = torch.randint(-1, 3, (e, max(1, int(n_turns.max()))), generator=gen)
    states[torch.arange(states.shape[1])[None, :] >= n_turns[:, None]] = -1
    index = mask.nonzero(as_tuple=True)
    return EpisodeView(rewards, torch.randn(e, n, generator=gen, dtype=torch.float64) * mask, mask, turn_end,
                       torch.randint(0, 3, (e,), generator=gen), index, index, states)


def reference_estimate(name: str, v: EpisodeView, shared: SharedSettings, gigpo: GiGPOParams):
    """``(advantages, returns)`` of the named estimator from the plain loops of tests/algorithms/reference.py."""
    turns = (shared.gamma_turn, shared.lambda_turn)
    tokens = (shared.gamma_token, shared.lambda_token)
    whitened = lambda adv, stats=None: ref.ref_whiten_with(adv, v.mask, v.mask if stats is None else stats) \
        if shared.whiten_advantages else adv  # noqa: E731
    if name == "gae":
        adv, ret = ref.ref_masked_gae(v.rewards, v.values, v.mask, *tokens, v.turn_end, *turns)
        return whitened(adv), ret
    if name == "bilevel_gae":
        adv, ret = ref.ref_bilevel_gae(v.rewards, v.values, v.mask, v.turn_end, *turns, *tokens)
        return whitened(adv), ret
    if name == "turn_gae":  # whitened over one entry a turn, its end (VAGEN's turn-wise GAE)
        adv, ret = ref.ref_turn_gae(v.rewards, v.values, v.mask, v.turn_end, *turns)
        return whitened(adv, v.turn_end & v.mask), ret
    if name == "reinforce_pp":
        return ref.ref_reinforce_pp(v.rewards, v.mask, shared.gamma_token, v.turn_end, shared.gamma_turn)
    if name in ("grpo", "drgrpo", "rloo"):
        totals = v.rewards.sum(1)
        per_episode = ref.ref_rloo(totals, v.group) if name == "rloo" else \
            ref.ref_grpo(totals, v.group, 1e-6, norm_by_std=name == "grpo")
        adv = ref.ref_broadcast(per_episode, v.mask)
        return adv, adv
    assert name == "gigpo"
    rewards, ends, mask = v.rewards.tolist(), v.turn_end.tolist(), v.mask.tolist()
    per_turn, turn_of = [], []  # each episode's turn rewards, and the turn of each of its tokens
    for row_r, row_e, row_m in zip(rewards, ends, mask):
        sums, of, turn = [0.0] * v.turn_states.shape[1], [], 0
        for r, end, m in zip(row_r, row_e, row_m):
            of.append(turn if m else None)
            if m:
                sums[turn] += r
                turn += end
        per_turn.append(sums)
        turn_of.append(of)
    lengths = v.turn_end.sum(1).tolist()
    turn_adv = gigpo_reference(per_turn, lengths, v.turn_states.tolist(), v.group.tolist(), gigpo.gamma,
                               gigpo.step_weight, gigpo.norm_by_std, episode_stats=gigpo.episode_stats)
    adv = torch.tensor([[0.0 if t is None else turn_adv[e][t] for t in of] for e, of in enumerate(turn_of)],
                       dtype=torch.float64)
    return adv, adv


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), e=st.integers(1, 8), n=st.integers(1, 40), whiten=st.booleans(),
       gigpo=st.sampled_from([GiGPOParams(), GiGPOParams(gamma=0.5, step_weight=0.3, norm_by_std=True,
                                                         episode_stats="turns")]))
def test_every_built_in_estimator_equals_its_plain_loop_reference(seed, e, n, whiten, gigpo):
    """Distinct discounts for every setting, so that one wired to the wrong place changes the result; empty
    episodes, groups of one and single-token turns come up."""
    shared = SharedSettings(gamma_token=0.97, lambda_token=0.9, gamma_turn=0.8, lambda_turn=0.7,
                            whiten_advantages=whiten)
    v = random_view(seed, e, n)
    for name in ("gae", "bilevel_gae", "turn_gae", "reinforce_pp", "grpo", "drgrpo", "rloo", "gigpo"):
        got = get_estimator(name)(v, shared, gigpo if name == "gigpo" else None)
        want_adv, want_ret = reference_estimate(name, v, shared, gigpo)
        torch.testing.assert_close(got.advantages.double(), want_adv, rtol=1e-7, atol=1e-7, msg=name)
        torch.testing.assert_close(got.returns.double(), want_ret, rtol=1e-7, atol=1e-7, msg=name)

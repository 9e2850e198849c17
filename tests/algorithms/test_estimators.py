"""The estimator registry: what each built-in estimator declares, and what registration and a call refuse.

The built-in estimators' numbers are checked against the algorithms called by hand in
tests/training/test_batch_advantages.py; tests/training/test_adding_an_estimator.py adds one from outside.
"""

from __future__ import annotations

import pytest
import torch

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
    from turnrl.training.batch_advantages import compute_advantages
    from turnrl.training.batch import Sample, collate
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

"""Policy backends by name or ``module:attr`` (``model.backend``), and the engine families a run adds by
``model.engine.families``."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from turnrl.config import ConfigError, EngineConfig, ModelConfig, load_config
from turnrl.engine.families import ENGINE_FAMILIES
from turnrl.policy.engine import EnginePolicy
from turnrl.policy.factory import POLICY_BACKENDS, model_policy, rollout_policies
from turnrl.policy.hf import HFPolicy
from turnrl.training.train_config import TrainConfig


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def test_the_built_in_backends_are_registered_names():
    assert POLICY_BACKENDS.names() == ("hf", "engine", "auto")


def test_a_backend_from_a_users_package_is_named_module_attr_in_the_config(tmp_path, monkeypatch, model,
                                                                           tiny_tokenizer):
    (tmp_path / "user_backend_ext.py").write_text(
        "from turnrl.policy.hf import HFPolicy\n\n"
        "class CountingPolicy(HFPolicy):\n"
        "    pass\n\n"
        "def counting(loaded, max_batch_size):\n"
        "    return CountingPolicy(loaded.model, loaded.tokenizer, max_batch_size=max_batch_size)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    config = load_config(TrainConfig, None, ["model.backend=user_backend_ext:counting"]).model
    train, val = rollout_policies(model, tiny_tokenizer, config, batch_size=16, validation_batch_size=8)
    assert type(train).__name__ == type(val).__name__ == "CountingPolicy" and isinstance(train, HFPolicy)
    assert (train.max_batch_size, val.max_batch_size) == (16, 8)  # it batches whole batches: one per size
    single = model_policy(model, tiny_tokenizer, config, max_batch_size=4)
    assert type(single).__name__ == "CountingPolicy" and single.max_batch_size == 4


def test_an_unknown_backend_names_the_registered_ones_at_load_time():
    with pytest.raises(ConfigError, match=r"model.backend='engin' is not allowed; choose one of \['hf', 'engine', "
                                          r"'auto'\]; did you mean engine\?"):
        load_config(TrainConfig, None, ["model.backend=engin"])
    with pytest.raises(ConfigError, match="model.backend='no_such_module_ext:x': .*cannot import module"):
        model_policy(torch.nn.Linear(1, 1), None, ModelConfig(backend="no_such_module_ext:x"), max_batch_size=1)


@pytest.mark.parametrize(
    ("attr", "got"),
    [("CountingPolicy", "got the class user_wrong_backend_ext:CountingPolicy, not a function or an instance"),
     ("one_argument", r"got user_wrong_backend_ext:one_argument\(loaded\), which cannot take those arguments "
                      r"\(too many positional arguments\)")],
)
def test_a_module_attr_that_is_not_a_backend_fails_at_config_load(tmp_path, monkeypatch, attr, got):
    (tmp_path / "user_wrong_backend_ext.py").write_text(
        "from turnrl.policy.hf import HFPolicy\n\n"
        "class CountingPolicy(HFPolicy):\n"  # the policy class, where the backend that builds one is meant
        "    pass\n\n"
        "def one_argument(loaded):\n"
        "    return CountingPolicy(loaded.model, loaded.tokenizer)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError) as info:
        load_config(TrainConfig, None, [f"model.backend=user_wrong_backend_ext:{attr}"])
    assert (f"model.backend='user_wrong_backend_ext:{attr}': a policy backend must be a function or callable object "
            "taking (loaded, max_batch_size) and returning Policy (turnrl.policy.factory.PolicyBackend); "
            ) in str(info.value)
    info.match(got)


def test_an_engine_family_from_a_users_package_is_named_module_attr_in_the_config(tmp_path, monkeypatch, model,
                                                                                  tiny_tokenizer):
    (tmp_path / "user_family_ext.py").write_text(
        "from turnrl.engine.families import Family\n\n"
        "RENAMED_QWEN2 = Family('RenamedQwen2', ('renamed_qwen2',), sliding_window='use_sliding_window')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    renamed = copy.deepcopy(model)
    renamed.config.model_type = "renamed_qwen2"  # a model type no built-in family runs
    with pytest.raises(ConfigError, match="not 'renamed_qwen2'"):
        model_policy(renamed, tiny_tokenizer, ModelConfig(backend="engine"), max_batch_size=4)
    config = load_config(TrainConfig, None, ["model.backend=engine",
                                             "model.engine.families=[user_family_ext:RENAMED_QWEN2]"]).model
    policy = model_policy(renamed, tiny_tokenizer, config, max_batch_size=4)
    assert isinstance(policy, EnginePolicy) and "RenamedQwen2" in ENGINE_FAMILIES
    with pytest.raises(ConfigError, match="model.engine.families='user_family_ext:NOPE': .*has no attribute"):
        load_config(TrainConfig, None, ["model.engine.families=[user_family_ext:NOPE]"])
    assert EngineConfig().families == []

"""Keys written with a source system's name (RAGEN, VAGEN, verl, SkyRL) get the turnrl key that does their work; other
unknown keys get the close turnrl keys, matched on the whole key written."""

from __future__ import annotations

from pathlib import Path

import pytest

from turnrl.config import ConfigError, config_keys, load_config
from turnrl.config_messages import SOURCE_SETTINGS, setting_keys, source_settings_table
from turnrl.eval_config import EvalConfig
from turnrl.training.train_config import TrainConfig

FIDELITY = Path(__file__).resolve().parents[1] / "docs" / "fidelity.md"


def train_error(overrides: list[str], path: Path | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(TrainConfig, path, overrides)
    return str(info.value)


@pytest.mark.parametrize(("override", "wanted", "wrong"), [
    # Each read "did you mean" a wrong key, or named only the unknown section ("Key 'generator' not in ...").
    ("max_actions_per_traj=10", ["agent.max_actions_per_episode"], "agent.max_actions_per_turn"),
    ("algorithm.use_kl_loss=false", ["algorithm.kl_coef=0", "algorithm.kl_in_reward"], "algorithm.policy_loss"),
    ("algorithm.bi_level_gae=true", ["algorithm.advantage=gae", "algorithm.advantage=bilevel_gae"],
     "algorithm.ratio_level"),
    ("algorithm.adv_estimator=grpo", ["turnrl's algorithm.advantage"], "algorithm.estimator_params"),
    ("algorithm.lam=1.0", ["algorithm.lambda_token"], "did you mean algorithm"),
    ("algorithm.high_level_gamma=0.95", ["algorithm.gamma_turn"], "did you mean"),
    ("agent.enable_think=false", ["agent.format=ragen_no_think", "agent.format=ragen"], "did you mean"),
    ("algorithm.norm_adv_by_std_in_grpo=false", ["algorithm.advantage=drgrpo"], "did you mean"),
    ("algorithm.filter.strategy=top_p", ["algorithm.filter.method"], "algorithm.filter.metric"),
    ("generator.max_turns=15", ["SkyRL's generator.max_turns is turnrl's agent.max_turns"], "did you mean"),
    ("agent_proxy.max_turn=5", ["RAGEN's agent_proxy.max_turn is turnrl's agent.max_turns"], "did you mean"),
    ("trainer.algorithm.use_kl_loss=false", ["algorithm.kl_coef=0"], "did you mean"),
    ("actor_rollout_ref.rollout.max_model_len=2048", ["model.engine.max_seq_len", "agent.max_context_tokens"],
     "did you mean"),
    ("actor_rollout_ref.actor.optim.lr=1e-6", ["optim.actor_lr"], "optim.critic_lr"),
    ("data.train_batch_size=8", ["groups.n_groups", "groups.group_size"], "sft.data"),
    ("trainer.total_training_steps=3", ["run.steps"], "did you mean"),
    ("rollout_manager.window_size=5", ["VAGEN's rollout_manager.window_size is turnrl's agent.max_context_window",
                                       "N + 1"], "did you mean"),
    ("env1.env_config.prompt_format=free_think", ["VAGEN's ENV.env_config.prompt_format is turnrl's agent.format"],
     "did you mean"),
])
def test_a_source_systems_name_gets_the_turnrl_key_that_does_its_work(override, wanted, wrong):
    message = train_error([override])
    key = override.split("=")[0]
    assert message.startswith(f"unknown config key {key!r}: "), "the whole key written, not its first part"
    assert all(text in message for text in wanted) and wrong not in message
    assert "\n" not in message and message.endswith("`turnrl config show` lists every key with its default")


def test_every_turnrl_key_of_the_table_exists_and_every_value_it_writes_loads():
    # A renamed key or a retired value would leave the hint pointing at nothing.
    keys = {item.key for item in config_keys(TrainConfig)}
    for setting in SOURCE_SETTINGS:
        named = setting_keys(setting)
        assert named and setting.turnrl.startswith(named[0][0]), setting
        for key, value in named:
            assert key in keys, f"{setting.name}: {key} is not a config key"
            if value is not None:
                load_config(TrainConfig, None, [f"{key}={value}"])


@pytest.mark.parametrize("setting", SOURCE_SETTINGS, ids=lambda setting: f"{setting.source}:{setting.name}")
def test_every_name_of_the_table_and_its_short_forms_get_their_row(setting):
    # A source name that is also a turnrl key would never reach the hint; one that another row shadows neither.
    # ENV stands for any env tag: a RAGEN user writes the tag of the env they train on.
    forms = [setting.name.replace("ENV", "CoordSokoban"), *setting.short]
    for form in forms:
        assert f"turnrl's {setting.turnrl}" in train_error([f"{form}=1"]), form


def test_a_typo_of_a_turnrl_key_still_gets_the_close_keys():
    assert "did you mean algorithm.clip_high" in train_error(["algorithm.clip_hihg=0.3"])
    assert "did you mean agent.max_turns" in train_error(["agent.max_turn=3"])
    assert "algorithm.clip_high" in train_error(["clip_ratio_high=0.3"])


def test_an_unknown_section_is_matched_with_its_leaf():
    # close_keys got the unknown section alone ("foo"), so the mistyped leaf below it found nothing.
    assert "did you mean sampling.temperature" in train_error(["foo.temprature=0.5"])


def test_a_config_file_with_a_source_section_names_the_key_inside_it(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text("generator:\n  max_turns: 15\n")
    assert train_error([], path).startswith("unknown config key 'generator.max_turns': SkyRL's generator.max_turns "
                                            "is turnrl's agent.max_turns")


def test_a_hint_whose_keys_the_config_lacks_gives_way_to_the_close_keys():
    # turnrl eval has no algorithm section: algorithm.kl_coef would be another unknown key.
    with pytest.raises(ConfigError) as info:
        load_config(EvalConfig, None, ["algorithm.use_kl_loss=false"])
    message = str(info.value)
    assert "algorithm.kl_coef" not in message and "unknown config key 'algorithm.use_kl_loss'" in message


def test_a_text_key_takes_a_value_that_yaml_cannot_read_as_written():
    # RAGEN's action separator read "the value is not valid YAML": `|` starts a YAML block scalar.
    assert load_config(TrainConfig, None, ["agent.action_separator=||"]).agent.action_separator == "||"
    message = train_error(["env.settings.separator=||"])
    assert message.endswith("for the text as written, quote it: env.settings.separator='||'")
    assert load_config(TrainConfig, None, ["env.settings.separator='||'"]).env.settings == {"separator": "||"}
    assert "quote it" not in train_error(["agent.max_turns=[1"])
    assert train_error(["agent_proxy.action_sep=||"]).startswith(
        "unknown config key 'agent_proxy.action_sep': RAGEN's agent_proxy.action_sep is turnrl's "
        "agent.action_separator")


def test_a_context_window_below_one_says_that_null_keeps_every_turn():
    assert train_error(["agent.max_context_window=-1"]) == (
        "agent.max_context_window=-1 is out of range; allowed: [1, inf], or null to keep every turn (RAGEN's -1)")
    assert load_config(TrainConfig, None, ["agent.max_context_window=null"]).agent.max_context_window is None


def test_the_docs_render_the_table():
    text = FIDELITY.read_text()
    section = text.split("\n## Source settings by name\n", 1)[1].split("\n## ", 1)[0]
    assert source_settings_table() in section

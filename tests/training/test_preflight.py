"""The checks before a run writes or loads anything: one-line errors naming the key at fault."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from tests.envs.toy_envs import Corridor
from tests.training.trainer_runs import config
from turnrl.config import ConfigError, load_config
from turnrl.training.commands import train
from turnrl.training.preflight import preflight
from turnrl.training.train_config import TrainConfig


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["env.id=Chess"], "unknown env 'Chess'"),
        (["env.settings.sizee=4"], "no setting sizee"),
        (["env.settings.size=abc"], "env.settings.size='abc' is refused by FrozenLake: size must be an int"),
        (["env.id=Sokoban", "env.settings.size=abc"], "env.settings.size='abc'"),
        (["env.val_settings={size: 1}"], "size"),
        # Judged at reset (a board given there may reach further), so by the first reset, not the build.
        (["env.id=Game2048", "env.settings={size: 3, target_tile: 2048}"],
         "env.id='Game2048' with env.settings={'size': 3, 'target_tile': 2048}: its first reset refused them: "
         "target_tile=2048 can never be made on a 3x3 board"),
        (["env.id=Game2048", "env.settings={size: 3, target_tile: 8}", "env.val_settings={size: 3, target_tile: 4096}"],
         "env.val_settings={'size': 3, 'target_tile': 4096}: its first reset refused them"),
        (["sft.enabled=true", "sft.data=nowhere.jsonl"], "sft.data='nowhere.jsonl'"),
        (["sft.enabled=true", "sft.data=BROKEN"], "expected a JSON object"),
        (["run.wandb_project=x"], "pip install wandb"),
        (["model.path=./runs/old/sft/model"], "model.path='./runs/old/sft/model' does not exist"),
        # Demos played on validation levels: validation would score levels the model was fine-tuned on.
        (["sft.enabled=true", "sft.seed_start=9000"], "sft.seed_start=9000: the 2000 demos' seeds [9000, 11000) "
                                                       "overlap the validation seeds [0, 10000)"),
    ],
)
def test_a_run_that_cannot_work_stops_before_writing_or_loading_anything(overrides, needle, tmp_path, monkeypatch):
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"messages": [{"role": "user", "content": "hi"}]}\nnot json\n')
    overrides = [o.replace("BROKEN", str(broken)) for o in overrides]
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else
                        real_find_spec(name, *a))
    # No model of this name exists: a check that came after loading would fail there instead.
    with pytest.raises(ConfigError, match=re.escape(needle)) as info:
        train(config("nobody/no-model", tmp_path / "runs", *overrides))
    assert "\n" not in str(info.value)
    assert not (tmp_path / "runs").exists()


def test_a_resume_without_checkpoint_leaves_the_run_untouched(tmp_path):
    run = tmp_path / "runs" / "old"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text("run: {name: old}\n")
    with pytest.raises(ConfigError, match="holds no checkpoint"):
        train(config("nobody/no-model", tmp_path / "runs", f"resume={run}"))
    assert (run / "config.yaml").read_text() == "run: {name: old}\n"
    with pytest.raises(ConfigError, match="no such run directory"):
        train(config("nobody/no-model", tmp_path / "runs", f"resume={tmp_path / 'nothing'}"))


def test_a_new_run_says_which_model_it_starts_from(tmp_path, tiny_model_dir, capsys):
    preflight(config(tiny_model_dir, tmp_path / "runs"))
    assert capsys.readouterr().out == f"model: {tiny_model_dir} (from a local directory)\n"
    preflight(config(None, tmp_path / "runs", "model.builtin_preset=tiny"))
    assert capsys.readouterr().out.startswith("model: the built-in 'tiny' preset, built from a config with random "
                                              "weights\n")


def test_a_mistyped_builtin_preset_is_the_only_line_and_says_what_was_meant(tmp_path, capsys):
    """``model.builtin_preset=smol`` printed "the built-in 'smol' preset, built from a config" before its error,
    with no hint: now the error alone, with the close names."""
    with pytest.raises(ConfigError, match=r"model.builtin_preset='smol' is not a built-in model; did you mean "
                                          r"small\?") as info:
        train(config(None, tmp_path / "runs", "model.builtin_preset=smol"))
    assert "\n" not in str(info.value)
    assert capsys.readouterr().out == ""
    assert not (tmp_path / "runs").exists()


def test_a_recipe_that_expects_a_pretrained_model_says_so_when_it_has_none(tmp_path, capsys):
    """configs/ragen_sokoban.yaml without model.path: the run starts (a smoke run is allowed) and says at once
    that it trains the built-in model from random weights."""
    recipe = Path(__file__).resolve().parents[2] / "configs" / "ragen_sokoban.yaml"
    preflight(load_config(TrainConfig, recipe, [f"run.output_dir={tmp_path}"]))
    line = capsys.readouterr().out.replace("\n", " ")
    assert "model: the built-in 'small' preset, built from a config with random weights; this recipe expects a " \
           "pretrained model (model.path=ORG/NAME or a model directory" in line
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


def test_a_hub_id_that_cannot_be_fetched_stops_the_run_at_once(unreachable_hub, tmp_path):
    with pytest.raises(ConfigError, match="the hub cannot be reached") as info:
        train(config("Qwen/Qwen2.5-0.5B-Instruct", tmp_path / "runs"))
    assert "\n" not in str(info.value)
    assert not (tmp_path / "runs").exists()


def test_an_sft_stage_that_stopped_before_its_model_holds_no_run(tmp_path, tiny_model_dir):
    """An SFT refused by its memory check or out of memory leaves ``sft/`` without a model: rerunning it with the
    change it was told must not need ``run.overwrite``."""
    (tmp_path / "run" / "sft").mkdir(parents=True)
    (tmp_path / "run" / "sft" / "metrics.jsonl").write_text("")
    for stage in ("train", "sft"):
        preflight(config(tiny_model_dir, tmp_path, "sft.enabled=true"), stage=stage)
    (tmp_path / "run" / "sft" / "model").mkdir()
    for stage in ("train", "sft"):
        with pytest.raises(ConfigError, match=r"already holds a run \(sft\)") as info:
            preflight(config(tiny_model_dir, tmp_path, "sft.enabled=true"), stage=stage)
        # `turnrl sft` then `turnrl train` into the same name: the way on from its SFT model was not said.
        hint = f"start RL from its SFT model in a new run (model.path={tmp_path / 'run' / 'sft' / 'model'} "
        assert (hint in str(info.value)) == (stage == "train")


def test_demo_seeds_are_checked_only_where_demos_are_played(tmp_path, tiny_model_dir):
    apart = ["sft.seed_start=0", "sft.episodes=100", "seeds.val_start=100", "seeds.train_start=10100"]
    preflight(config(tiny_model_dir, tmp_path / "runs", "sft.enabled=true", *apart))  # [0, 100) then [100, ...)
    preflight(config(tiny_model_dir, tmp_path / "runs", "sft.seed_start=0"))  # no SFT stage: no demos
    chats = tmp_path / "chats.jsonl"
    chats.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n')
    preflight(config(tiny_model_dir, tmp_path / "runs", "sft.enabled=true", "sft.seed_start=0", f"sft.data={chats}"))
    with pytest.raises(ConfigError, match="put sft.seed_start at or above 10000"):
        preflight(config(tiny_model_dir, tmp_path / "runs", "sft.seed_start=0"), stage="sft")


CHAT = '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}'


@pytest.mark.parametrize(("lines", "needle"), [
    (['{"messages": [{"role": "user", "content": "hi"}]}'], "line 1 has the roles ['user']"),
    ([CHAT, "", '{"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}'],
     "line 3 has the roles ['user', 'user']"),
    (['{"messages": [{"role": "system", "content": "s"}, {"role": "assistant", "content": "yo"}]}'],
     "line 1 has the roles ['system', 'assistant']"),
])
def test_sft_chats_that_sft_cannot_learn_from_stop_before_the_model_loads(lines, needle, tmp_path, tiny_model_dir):
    # SFT refused them once the model had loaded, with a ValueError traceback.
    chats = tmp_path / "chats.jsonl"
    chats.write_text("\n".join(lines) + "\n")
    with pytest.raises(ConfigError) as info:
        preflight(config(tiny_model_dir, tmp_path / "runs", f"sft.data={chats}"), stage="sft")
    assert needle in str(info.value) and "then user and assistant messages in turn" in str(info.value)
    chats.write_text(f"{CHAT}\n\n" + '{"messages": [{"role": "system", "content": "s"}, ' + CHAT[14:] + "\n")
    preflight(config(tiny_model_dir, tmp_path / "runs", f"sft.data={chats}"), stage="sft")


def test_sft_data_that_is_no_file_of_text_says_what_to_give(tmp_path, tiny_model_dir):
    # These quoted Python's own words ("[Errno 21] Is a directory", "'utf-8' codec can't decode byte 0xff").
    (tmp_path / "binary.jsonl").write_bytes(b"\xff\xfe\x00")
    for data, needle in ((tmp_path / "none.jsonl", "does not exist"), (tmp_path, "is a folder"),
                         (tmp_path / "binary.jsonl", "is not UTF-8 text (byte 0)")):
        with pytest.raises(ConfigError) as info:
            preflight(config(tiny_model_dir, tmp_path / "runs", f"sft.data={data}"), stage="sft")
        assert str(info.value) == f"sft.data={str(data)!r} {needle}; give a JSONL file of chats, one " \
                                  '{"messages": [{"role": "user", ...}, {"role": "assistant", ...}]} a line'


class RaisesOnReset(Corridor):
    """A user env whose setting of the wrong type fails in its own arithmetic at reset (a TypeError)."""

    def __init__(self, budget=8):
        super().__init__()
        self.budget = budget

    def reset(self, *, seed=None, options=None):
        self.left = self.budget - 1
        return super().reset(seed=seed, options=options)


def test_a_user_env_whose_first_reset_raises_is_one_line_naming_the_settings_and_the_line(tmp_path):
    # A TypeError was a traceback through the preflight (only a ValueError was taken for a refusal).
    with pytest.raises(ConfigError) as info:
        train(config("nobody/no-model", tmp_path / "runs", "env.id=tests.training.test_preflight:RaisesOnReset",
                     "env.settings.budget=abc"))
    line = RaisesOnReset.reset.__code__.co_firstlineno + 1
    assert str(info.value) == (
        "env.id='tests.training.test_preflight:RaisesOnReset' with env.settings={'budget': 'abc'}: its first reset "
        "raised TypeError: unsupported operand type(s) for -: 'str' and 'int' (raised in reset at "
        f"test_preflight.py:{line}); check the settings' types and values against the env's constructor")
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(("overrides", "needle"), [
    (["model.builtin_preset=tiny"], "env.id='Sokoban' with env.settings observes images, but "
                                    "model.builtin_preset=tiny is a text-only model, which would play blind: use a "
                                    "vision-language model (a vlm-* model.builtin_preset, or a Qwen2-VL, Qwen2.5-VL "
                                    "or Qwen3-VL model.path) or the env's text mode (env.settings.mode=text)"),
    (["model.path=TINY"], "model.path='TINY' is a text-only model"),
    (["env.settings.mode=text", "env.val_settings={mode: image}", "model.builtin_preset=tiny"],
     "with env.val_settings observes images"),
])
def test_an_image_env_with_a_text_only_model_stops_before_the_model_loads(overrides, needle, tmp_path,
                                                                          tiny_model_dir, monkeypatch):
    """It stopped at the first validation, after the model was built and the run directory written (and a second
    try was then refused for the directory it had written)."""
    from turnrl.models import builtin

    monkeypatch.setattr(builtin, "builtin_model_path", lambda *a: pytest.fail("the model was built"))
    overrides = [o.replace("TINY", str(tiny_model_dir)) for o in overrides]
    with pytest.raises(ConfigError) as info:
        train(config(None, tmp_path / "runs", "env.id=Sokoban", "env.settings.mode=image", *overrides))
    assert needle.replace("TINY", str(tiny_model_dir)) in str(info.value)
    assert not (tmp_path / "runs").exists()


def test_an_image_env_with_a_vlm_passes_the_check(tmp_path):
    from turnrl.training.preflight import _check_model_sees

    run = config(None, tmp_path / "runs", "env.id=Sokoban", "env.settings.mode=image", "model.builtin_preset=vlm-tiny")
    _check_model_sees(run, None, ["env.settings"])
    _check_model_sees(config(None, tmp_path, "model.builtin_preset=tiny"), None, [])  # no images: any model


class BareReset(Corridor):
    """A user env whose reset returns the observation alone (Gymnasium's envs before 0.26 did)."""

    def reset(self, *, seed=None, options=None):
        return super().reset(seed=seed, options=options)[0]


class LongText(Corridor):
    def observation(self):
        return {"text": "#" * 9000}


class ZeroBound(Corridor):
    """A user env whose bound on an observation's text can hold nothing."""

    def max_text_length(self):
        return 0


class LongTextOwnBound(LongText):
    """Its texts of 9,000 characters are under the bound it declares."""

    def max_text_length(self):
        return 32_768


@pytest.mark.parametrize(("env", "says"), [
    ("BareReset", "reset() must return (observation, info), got a dict: {'text': "),
    ("ZeroBound", "its max_text_length() cannot be used: ValueError: max_text_length() must return an int >= 1 (the "
                  "characters an observation's text may hold), got an int: 0"),
    ("LongText", "its first observation cannot be played: an observation's text may hold 8192 characters, got 9000; "
                 "an env whose texts need more returns its bound from max_text_length()"),
])
def test_a_user_env_whose_first_reset_answers_what_the_rollout_refuses_is_told_what_it_returned(env, says, tmp_path):
    """It said "its first reset refused them: not enough values to unpack (expected 2, got 1)", blaming the
    settings, and a text the rollout refuses let every episode of the run fail."""
    env_id = f"tests.training.test_preflight:{env}"
    with pytest.raises(ConfigError) as info:
        train(config("nobody/no-model", tmp_path / "runs", f"env.id={env_id}", "env.settings.length=6"))
    message = str(info.value)
    assert message.startswith(f"env.id={env_id!r}: {says}") and "\n" not in message
    assert message.endswith(f"; `turnrl check-env {env_id}` lists all that the env breaks of the contract")
    assert "settings" not in message and "refused" not in message
    assert not (tmp_path / "runs").exists()


def test_a_user_envs_text_under_the_bound_it_declares_passes_the_check():
    """9,000 characters, refused under the default bound above, are played under the env's own."""
    from turnrl.training.preflight import _first_reset

    env_id = "tests.training.test_preflight:LongTextOwnBound"
    assert _first_reset(LongTextOwnBound(), env_id, "env.settings", {}) is False

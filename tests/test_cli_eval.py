"""The ``turnrl eval`` command: its outputs, configs and recipes, checkpoints and runs, env variants, and its
one-line errors."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.cli_runs import QUICKSTART, error_exit, run_main
from turnrl.cli import main
from turnrl.config import load_config
from turnrl.eval_config import EvalConfig


def test_eval_command_writes_summary_and_trajectories(tmp_path):
    out = tmp_path / "eval"
    argv = ["eval", "--env", "FrozenLake", "--policy", "expert", "--episodes", "3", "--out", str(out),
            "agent.max_turns=20", "agent.max_actions_per_episode=20"]
    assert main(argv) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["episodes"] == 3 and summary["success_rate"] == 1.0
    assert summary["env"] == "FrozenLake" and summary["policy"] == "expert"
    assert len((out / "trajectories.jsonl").read_text().splitlines()) == 3


def test_eval_plays_the_episodes_its_config_or_an_override_gives_unless_the_option_says(tmp_path, monkeypatch):
    # --episodes's default (32) replaced an eval YAML's `episodes:` and an `episodes=N` override without a word.
    played: list[int] = []
    monkeypatch.setattr("turnrl.evaluate.run_eval", lambda config, **_: played.append(config.episodes) or {})
    recipe = tmp_path / "eval.yaml"
    recipe.write_text("env: {id: FrozenLake}\nepisodes: 5\n")
    out = ["--out", str(tmp_path / "eval")]
    assert main(["eval", "--config", str(recipe), "--policy", "expert", *out]) == 0
    assert main(["eval", "--env", "FrozenLake", "--policy", "expert", "episodes=7", *out]) == 0
    assert main(["eval", "--config", str(recipe), "--policy", "expert", "--episodes", "3", *out]) == 0
    assert main(["eval", "--env", "FrozenLake", "--policy", "expert", *out]) == 0
    assert played == [5, 7, 3, EvalConfig().episodes]


def test_eval_takes_a_training_recipe_for_its_env_and_agent_settings(tmp_path):
    out = tmp_path / "eval"
    recipe = Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml"
    argv = ["eval", "--env", "FrozenLake", "--policy", "expert", "--episodes", "2", "--out", str(out),
            "--config", str(recipe)]
    assert main(argv) == 0
    trajectory = json.loads((out / "trajectories.jsonl").read_text().splitlines()[0])
    assert trajectory["system_prompt"].startswith("FrozenLake: reach G without falling into O.")


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--env", "Nope", "--policy", "expert"], "unknown env 'Nope'"),
        (["--env", "FrozenLake", "--policy", "expert", "env.settings.colour=red"], "no setting colour"),
        (["--env", "FrozenLake", "--policy", "expert", "env.settings.size=abc"], "size"),
        (["--env", "FrozenLake", "--policy", "nosuch"], "nosuch"),
        (["--env", "FrozenLake", "--policy", "expert", "agent.format=bogus"], "agent.format"),
        (["--env", "FrozenLake", "--policy", "expert", "agent.max_turn=3"], "agent.max_turn"),
        (["--env", "FrozenLake", "--policy", "expert", "seeds.train_start=5"], "seeds.train_start"),
    ],
)
def test_eval_bad_setting_is_a_clean_error(extra, needle, tmp_path):
    assert needle in error_exit(["eval", "--episodes", "2", "--out", str(tmp_path / "out"), *extra])
    assert not (tmp_path / "out" / "summary.json").exists()


def test_eval_without_out_writes_a_run_folder_and_takes_the_env_budget(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["eval", "--env", "Maze2D", "--policy", "expert", "--episodes", "3"]) == 0
    (folder,) = (tmp_path / "runs" / "eval").iterdir()
    assert folder.name.startswith("Maze2D-expert-")
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["success_rate"] == 1.0 and summary["budget"]["from"] == "env"
    assert f"wrote runs/eval/{folder.name}/summary.json" in capsys.readouterr().out
    # A budget given on the command line (or in --config) is kept.
    out = tmp_path / "explicit"
    main(["eval", "--env", "Maze2D", "--policy", "expert", "--episodes", "3", "--out", str(out), "agent.max_turns=2"])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["budget"] == {"max_turns": 2, "max_actions_per_episode": 10, "from": "config"}
    assert summary["cut_by_budget"] == 3


@pytest.mark.parametrize(
    ("policy", "needle"),
    [
        ("/nonexistent", "policy='/nonexistent' does not exist"),
        ("runs/quikstart/checkpoints/step_000039/actor", "did you mean runs/quickstart/checkpoints/step_000039/actor"),
        ("runs/quickstart", "is a run directory, not a model"),
        ("Qwen/Qwen2.5-0.5B-Instruct", "nor in the local Hugging Face cache, and the hub cannot be reached"),
    ],
)
def test_eval_of_a_model_that_is_not_there_is_one_line(policy, needle, unreachable_hub, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "quickstart" / "checkpoints" / "step_000039" / "actor").mkdir(parents=True)
    message = error_exit(["eval", "--env", "FrozenLake", "--policy", policy, "--episodes", "2", "--out", "out"])
    assert needle in message and "\n" not in message
    assert not (tmp_path / "out").exists()


@pytest.fixture
def run_with_checkpoint(tmp_path, tiny_model_dir) -> Path:
    """A run directory as ``turnrl train`` leaves it: config.yaml (the quickstart's recipe, with its own short
    system prompt) beside checkpoints/step_000001/actor (the tiny model)."""
    import shutil

    run = tmp_path / "runs" / "quickstart"
    shutil.copytree(tiny_model_dir, run / "checkpoints" / "step_000001" / "actor")
    shutil.copy(QUICKSTART, run / "config.yaml")
    return run


def test_eval_of_a_checkpoint_takes_its_run_s_config_and_says_so(run_with_checkpoint, tmp_path, monkeypatch, capsys):
    policy = run_with_checkpoint / "checkpoints" / "step_000001" / "actor"
    argv = ["eval", "--env", "FrozenLake", "--policy", str(policy), "--episodes", "2", "--out", str(tmp_path / "out"),
            "model.device=cpu"]
    assert main(argv) == 0
    assert f"with the run's config {run_with_checkpoint / 'config.yaml'}" in " ".join(capsys.readouterr().out.split())
    trajectory = json.loads((tmp_path / "out" / "trajectories.jsonl").read_text().splitlines()[0])
    assert trajectory["system_prompt"] == "FrozenLake: reach G without falling into O."
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["budget"] == {"max_turns": 8, "max_actions_per_episode": 8, "from": "config"}


def test_eval_of_a_run_passes_over_a_latest_checkpoint_whose_actor_is_damaged(run_with_checkpoint, tmp_path, capsys):
    import shutil

    damaged = run_with_checkpoint / "checkpoints" / "step_000002"
    shutil.copytree(run_with_checkpoint / "checkpoints" / "step_000001", damaged)
    weights = damaged / "actor" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:5000])  # a copy cut short
    (run_with_checkpoint / "checkpoints" / "latest").write_text("step_000002")
    argv = ["eval", "--env", "FrozenLake", "--policy", str(run_with_checkpoint), "--episodes", "1", "--out",
            str(tmp_path / "out"), "model.device=cpu"]
    assert main(argv) == 0
    assert f"evaluating {run_with_checkpoint / 'checkpoints' / 'step_000001' / 'actor'}" in " ".join(
        capsys.readouterr().out.split())


def test_eval_into_a_training_runs_directory_is_refused_and_changes_nothing(run_with_checkpoint):
    before = {path: path.read_bytes() for path in run_with_checkpoint.rglob("*") if path.is_file()}
    with pytest.raises(SystemExit) as stop:
        main(["eval", "--env", "FrozenLake", "--policy", "random", "--episodes", "1", "--out",
              str(run_with_checkpoint)])
    assert str(stop.value) == (f"error: out={str(run_with_checkpoint)!r} is a training run's directory (it holds "
                               "checkpoints), whose config.yaml and summary.json the evaluation would replace; give "
                               f"another folder (such as {run_with_checkpoint / 'eval'})")
    assert {path: path.read_bytes() for path in run_with_checkpoint.rglob("*") if path.is_file()} == before


@pytest.mark.parametrize("with_env", [False, True])
@pytest.mark.parametrize(("content", "said"), [
    (bytes(range(256)) * 4, "not UTF-8 text"),
    (b"env: " + b"[" * 500 + b"]" * 500, "nested deeper than Python can read"),
], ids=["random bytes", "nested too deep"])
def test_eval_of_a_config_that_is_not_text_says_so_in_one_line(with_env, content, said, tmp_path, monkeypatch,
                                                                capsys, default_recursion_limit):
    """A run's config.yaml of random bytes, or of lists nested past the YAML parser's recursion (its RecursionError
    was a traceback): one line naming the file, with or without --env."""
    damaged = tmp_path / "config.yaml"
    damaged.write_bytes(content)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stop:
        main(["eval", "--policy", "random", "--config", str(damaged)] + (["--env", "FrozenLake"] if with_env else []))
    assert str(stop.value).startswith("error: config file") and said in str(stop.value)
    assert "\n" not in str(stop.value)


def test_eval_variants_from_a_yaml_file_print_one_table(tmp_path, monkeypatch, capsys):
    listing = tmp_path / "variants.yaml"
    listing.write_text("- {name: small, env: Sokoban, settings: {size: 5}}\n- {name: lake, env: FrozenLake}\n")
    monkeypatch.chdir(tmp_path)
    code, printed = run_main(["eval", "--policy", "expert", "--variants", str(listing), "--episodes", "2"],
                             monkeypatch, capsys)
    assert code == 0
    (folder,) = (tmp_path / "runs" / "eval").iterdir()
    assert folder.name.startswith("variants-expert-")
    summary = json.loads((folder / "summary.json").read_text())
    assert [(row["variant"], row["env"], row["success_rate"]) for row in summary["variants"]] == [
        ("small", "Sokoban", 1.0), ("lake", "FrozenLake", 1.0)]
    table = printed[printed.index("expert on 2 env variants"):]
    assert "variant" in table and "format valid" in table and "mean turns" in table
    assert re.search(r"small\s+│ Sokoban\s+│ size=5\s+│\s+2 │\s+1\.000 │", table), table
    nested = tmp_path / "nested.yaml"
    nested.write_text("variants: [{name: lake, env: FrozenLake, settings: {size: 3}}]\n")
    out = tmp_path / "nested"
    assert main(["eval", "--policy", "expert", "--variants", str(nested), "--episodes", "1", "--out", str(out)]) == 0
    assert json.loads((out / "summary.json").read_text())["variants"][0]["settings"] == {"size": 3}


@pytest.mark.parametrize(("argv", "needle"), [
    (["--variants", "nosuch"], "--variants 'nosuch' is neither a named list (ragen, ragen-v1) nor a YAML file"),
    (["--variants", "{bad}"], "neither a named list"),
    ([], "no env to evaluate on: pass --env ENV, --variants ragen"),
    (["--variants", "ragen", "variants.0.settings.size=8"], "override 'variants.0.settings.size=8' sets an item of a "
                                                             "list by its index"),
])
def test_eval_without_an_env_or_with_bad_variants_is_a_clean_error(argv, needle, tmp_path):
    assert needle in error_exit(["eval", "--policy", "expert", "--episodes", "1", "--out", str(tmp_path / "o"), *argv])
    assert not (tmp_path / "o").exists()


def test_eval_variants_file_that_holds_no_list_is_a_clean_error(tmp_path):
    listing = tmp_path / "variants.yaml"
    for text, needle in (("3\n", "must hold a list of variants"), ("[unclosed\n", "not a YAML file"),
                         ("variants: []\n", "must hold a list of variants")):
        listing.write_text(text)
        assert needle in error_exit(["eval", "--policy", "expert", "--variants", str(listing)])


def test_eval_of_a_training_recipe_takes_its_env_and_samples_at_its_validation_temperature(tmp_path):
    recipe = Path(__file__).resolve().parents[1] / "configs" / "ragen_sokoban.yaml"
    out = tmp_path / "eval"
    assert main(["eval", "--config", str(recipe), "--policy", "expert", "--episodes", "1", "--out", str(out)]) == 0
    config = load_config(EvalConfig, out / "config.yaml")
    assert (config.env.id, config.env.settings) == ("Sokoban", {"size": 6, "num_boxes": 1})
    assert config.sampling.temperature == 0.5 and config.sampling.max_new_tokens == 128  # validation's, recipe's
    assert main(["eval", "--config", str(recipe), "--policy", "expert", "--episodes", "1", "--out", str(out),
                 "sampling.temperature=0.8"]) == 0
    assert load_config(EvalConfig, out / "config.yaml").sampling.temperature == 0.8


def test_eval_of_another_env_than_the_recipes_leaves_the_recipes_env_settings_behind(tmp_path):
    recipe = Path(__file__).resolve().parents[1] / "configs" / "ragen_sokoban.yaml"  # Sokoban: size, num_boxes
    out = tmp_path / "eval"
    assert main(["eval", "--config", str(recipe), "--env", "FrozenLake", "--policy", "expert", "--episodes", "1",
                 "--out", str(out), "env.settings.size=3"]) == 0
    config = load_config(EvalConfig, out / "config.yaml")
    assert (config.env.id, config.env.settings, config.agent.format) == ("FrozenLake", {"size": 3}, "ragen")


def test_eval_out_that_is_a_file_is_refused_before_playing(tmp_path, monkeypatch, capsys):
    # It played every episode, then lost them to a FileExistsError traceback when writing.
    out = tmp_path / "summary.txt"
    out.write_text("kept")
    with pytest.raises(SystemExit) as info:
        main(["eval", "--env", "Bandit", "--policy", "random", "--episodes", "1", "--out", str(out)])
    assert str(info.value.code) == f"error: out={str(out)!r} is a file; give the folder the evaluation writes to"
    assert out.read_text() == "kept"


def test_eval_variants_file_of_binary_bytes_is_one_line(tmp_path):
    (tmp_path / "v.yaml").write_bytes(b"\x00\xff\xfe")
    with pytest.raises(SystemExit) as info:
        main(["eval", "--env", "Bandit", "--policy", "random", "--variants", str(tmp_path / "v.yaml")])
    assert str(info.value.code).startswith(f"error: --variants {tmp_path / 'v.yaml'}: not a YAML file (")



@pytest.mark.parametrize("with_env", [[], ["--env", "FrozenLake"]])
def test_eval_of_a_run_that_saved_no_model_says_so(with_env, tmp_path):
    # It said "no env to evaluate on", and with --env that the run "is a directory without config.json".
    run = tmp_path / "nosave"
    run.mkdir()
    (run / "config.yaml").write_text("env:\n  id: FrozenLake\n")
    (run / "metrics.jsonl").write_text("")
    message = error_exit(["eval", "--policy", str(run), *with_env])
    assert message == (f"error: --policy {run} is a run that holds no model: no checkpoint (it saved none: "
                       "run.save_at_end=false, run.save_every=0, or it stopped before the first) and no sft/model; "
                       "give a run that saved one, or a model directory")


def test_eval_of_a_text_model_on_an_image_env_is_one_line(tmp_path):
    # A ValueError traceback from the rollout's first turn.
    message = error_exit(["eval", "--env", "Sokoban", "--policy", "builtin", "--episodes", "1",
                          "--out", str(tmp_path / "eval"), "env.settings.mode=image"])
    assert message == ("error: SokobanEnv observes images, but the policy is a text-only model, which would play "
                       "blind: use a vision-language model (a vlm-* model.builtin_preset, or a Qwen2-VL, Qwen2.5-VL "
                       "or Qwen3-VL model.path) or the env's text mode (env.settings.mode=text)")

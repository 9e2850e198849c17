"""The ``turnrl`` command: envs, play, render, check-env, config, memory, train and the servers' options, in
process and as a real subprocess (``eval``: tests/test_cli_eval.py)."""

from __future__ import annotations

import argparse
import io
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from PIL import Image

from tests.cli_runs import QUICKSTART, TURNRL, error_exit, run_main, run_turnrl
from turnrl.cli import (
    build_parser,
    gib_arg,
    gpu_counts,
    main,
    pack,
    parse_settings,
    seed_arg,
    setting_lines,
)
from turnrl.config import config_keys
from turnrl.envs import make
from turnrl.envs.catalog import env_class, env_names, gym_id
from turnrl.envservice.options import count
from turnrl.training.train_config import TrainConfig


# --------------------------------------------------------------------------- envs
def test_envs_lists_every_env_with_its_modes_on_one_line(monkeypatch, capsys):
    code, out = run_main(["envs"], monkeypatch, capsys)
    assert code == 0
    lines = out.splitlines()
    for name in env_names():
        row = [line for line in lines if gym_id(name) in line]
        assert len(row) == 1, f"{gym_id(name)} not shown whole on one line:\n{out}"
        assert ", ".join(env_class(name).modes) in row[0]


def test_envs_subprocess_in_a_narrow_terminal_shows_whole_ids():
    result = run_turnrl("envs")
    assert result.returncode == 0, result.stderr
    for name in env_names():
        assert gym_id(name) in result.stdout


# --------------------------------------------------------------------------- play
def test_play_text_mode_hint_invalid_action_and_solved_episode(monkeypatch, capsys, tmp_path):
    env = make("FrozenLake")
    env.reset(seed=0)
    plan = env.solve()
    assert len(plan) >= 2
    stdin = "\n".join([":hint", "Jump", *plan, "Up", ""])
    code, out = run_main(["play", "FrozenLake", "--seed", "0", "--out", str(tmp_path)], monkeypatch, capsys, stdin)
    assert code == 0
    assert env.instructions().split()[0] in out
    assert f"solver: {plan}" in out
    assert out.count("(invalid action)") == 1
    assert f"Episode over: solved after {len(plan) + 1} steps, return 1" in out
    # The episode ended: the extra "Up" after the last plan step was never read as an action.
    assert out.count("action> ") == len(plan) + 2
    assert not list(tmp_path.iterdir()), "text mode writes no images"


def test_play_reset_restarts_the_seed_and_quit_stops(monkeypatch, capsys):
    stdin = "Right\n:reset\n:quit\nDown\n"
    code, out = run_main(["play", "FrozenLake", "--seed", "0"], monkeypatch, capsys, stdin)
    assert code == 0
    start = make("FrozenLake").reset(seed=0)[0]["text"]
    assert out.count(start) == 2  # shown at the start and again after :reset
    assert out.count("action> ") == 3  # Down after :quit is never read
    assert "Episode over" not in out


def test_play_end_of_input_ends_the_session_cleanly(monkeypatch, capsys):
    code, out = run_main(["play", "Bandit", "--seed", "1"], monkeypatch, capsys, "")
    assert code == 0 and "action> " in out


def test_play_image_mode_writes_one_png_per_observation(monkeypatch, capsys, tmp_path):
    env = make("Sokoban", mode="image")
    first, _ = env.reset(seed=1)
    plan = env.solve()
    stdin = "\n".join([":hint", "Jump", *plan, ""])
    code, out = run_main(
        ["play", "Sokoban", "--seed", "1", "--out", str(tmp_path), "mode=image"], monkeypatch, capsys, stdin
    )
    assert code == 0
    assert "Episode over: solved" in out
    pngs = sorted(tmp_path.glob("turn_*.png"))
    assert [p.name for p in pngs] == [f"turn_{i:03d}.png" for i in range(len(plan) + 2)]
    np.testing.assert_array_equal(np.asarray(Image.open(pngs[0]).convert("RGB")), first["image"])
    for png in pngs:
        assert Image.open(png).size == (first["image"].shape[1], first["image"].shape[0])


def test_play_subprocess_driven_through_stdin(tmp_path):
    env = make("FrozenLake")
    env.reset(seed=3)
    plan = env.solve()
    result = run_turnrl("play", "FrozenLake", "--seed", "3", stdin="\n".join([":hint", "jump", *plan]) + "\n")
    assert result.returncode == 0, result.stderr
    assert f"solver: {plan}" in result.stdout
    assert "(invalid action)" in result.stdout
    assert "Episode over: solved" in result.stdout


def test_sigusr1_prints_every_threads_stack_while_the_command_waits_and_the_command_goes_on(tmp_path):
    """``kill -USR1 PID`` on a command blocked in C (here ``play`` waiting for its input): the stacks come out on
    stderr at once, and the command then ends as it would have."""
    out, err = tmp_path / "out", tmp_path / "err"
    env = dict(os.environ, COLUMNS="80", OMP_NUM_THREADS="1")
    with out.open("w") as stdout, err.open("w") as stderr:
        process = subprocess.Popen([str(TURNRL), "play", "FrozenLake", "--seed", "3"], stdin=subprocess.PIPE,
                                   stdout=stdout, stderr=stderr, text=True, env=env)
        try:
            deadline = time.monotonic() + 60
            while "G" not in out.read_text():  # the board: it now waits for a move
                assert process.poll() is None and time.monotonic() < deadline, err.read_text()
                time.sleep(0.05)
            process.send_signal(signal.SIGUSR1)
            while "most recent call first" not in err.read_text():
                assert process.poll() is None and time.monotonic() < deadline, err.read_text()
                time.sleep(0.05)
            assert process.stdin is not None
            process.stdin.close()  # end of input: the session ends cleanly
            assert process.wait(timeout=60) == 0, err.read_text()
        finally:
            process.kill()
    stacks = err.read_text()
    assert "Current thread" in stacks and "cli.py" in stacks, stacks


def test_settings_after_options_reach_the_env(monkeypatch, capsys, tmp_path):
    code, out = run_main(["play", "FrozenLake", "--seed", "2", "--out", str(tmp_path), "mode=image", "size=6"],
                         monkeypatch, capsys, ":quit\n")
    assert code == 0
    frame = Image.open(tmp_path / "turn_000.png")
    assert frame.size == make("FrozenLake", mode="image", size=6).reset(seed=2)[0]["image"].shape[1::-1]


@pytest.mark.parametrize(
    "argv", [["play", "FrozenLake", "--bogus"], ["envs", "size=4"], ["play", "FrozenLake", "-o", "x"]]
)
def test_unknown_options_and_stray_words_are_usage_errors(argv, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["play", "Nope"], "unknown env 'Nope'"),
        (["play", "FrozenLake", "size=abc"], "size"),
        (["play", "FrozenLake", "foo=1"], "no setting foo"),
        (["play", "FrozenLake", "mode=bogus"], "bogus"),
        (["play", "FrozenLake", "size"], "key=value"),
        (["play", "FrozenLake", "=4"], "'=4' is not of the form key=value"),
        # A value that is not YAML ended in PyYAML's traceback.
        (["play", "FrozenLake", "size=["], "setting 'size=[': the value is not valid YAML"),
        (["check-env", "FrozenLake", "size={"], "setting 'size={': the value is not valid YAML"),
    ],
)
def test_play_bad_env_or_setting_is_a_clean_error(argv, needle, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    assert needle in error_exit(argv)


# --------------------------------------------------------------------------- render
@pytest.mark.parametrize("name", env_names())
def test_render_writes_the_first_frame_as_png(name, tmp_path, capsys):
    out = tmp_path / "frame.png"
    assert main(["render", name, "--seed", "4", "-o", str(out)]) == 0
    expected = make(name, mode="image").reset(seed=4)[0]["image"]
    image = Image.open(out)
    assert image.format == "PNG"
    assert image.size == (expected.shape[1], expected.shape[0])
    np.testing.assert_array_equal(np.asarray(image.convert("RGB")), expected)
    assert f"{expected.shape[1]}x{expected.shape[0]}" in capsys.readouterr().out


def test_render_honours_settings(tmp_path):
    small, large = tmp_path / "small.png", tmp_path / "large.png"
    main(["render", "FrozenLake", "-o", str(small), "size=4"])
    main(["render", "FrozenLake", "-o", str(large), "size=8"])
    assert Image.open(large).size[0] == 2 * Image.open(small).size[0]


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["render", "Nope", "-o", "x.png"], "unknown env 'Nope'"),
        (["render", "FrozenLake", "-o", "x.png", "mode=text"], "observes no image"),
        (["render", "FrozenLake", "-o", "x.png", "size=abc"], "size"),
        (["render", "FrozenLake", "-o", "x.png", "colour=red"], "no setting colour"),
    ],
)
def test_render_bad_env_or_setting_is_a_clean_error(argv, needle, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert needle in error_exit(argv)
    assert not (tmp_path / "x.png").exists()


def test_render_subprocess_error_has_no_traceback(tmp_path):
    result = run_turnrl("render", "Nope", "-o", "x.png", cwd=tmp_path)
    assert result.returncode == 1
    assert "error: unknown env 'Nope'" in result.stderr
    assert "Traceback" not in result.stderr


def test_render_takes_an_env_from_any_module(tmp_path, capsys):
    # toy_envs.Corridor has text observations only: a clean error, not a KeyError
    assert "observes no image" in error_exit(["render", "tests.envs.toy_envs:Corridor", "-o", str(tmp_path / "c.png")])
    bare = "tests.envs.toy_envs:BrokenBareReset"  # not "not enough values to unpack"
    assert error_exit(["render", bare, "-o", str(tmp_path / "c.png")]) == (
        f"error: {bare}: reset() must return (observation, info), got a dict: {{'text': '___P_'}}; `turnrl "
        f"check-env {bare}` lists all that the env breaks of the contract")


# --------------------------------------------------------------------------- check-env
def test_check_env_passes_a_built_in_env(monkeypatch, capsys):
    code, out = run_main(["check-env", "Sokoban", "size=7", "num_boxes=2"], monkeypatch, capsys)
    assert code == 0 and "passes" in out and "note" not in out


def test_check_env_says_gymnasiums_warnings_as_plain_notes(monkeypatch, capsys, recwarn):
    """They came as Python warnings in terminal colours, each with the checker's file and line, of spaces turnrl
    never reads (a Gymnasium env wrapped for its frames)."""
    code, out = run_main(["check-env", "gym:CartPole-v1"], monkeypatch, capsys)
    notes = [line for line in out.splitlines() if line.startswith("note:")]
    assert code == 0 and notes == [
        "note: Gymnasium's checker warns (of the wrapped env's own spaces: turnrl observes its frames): A Box "
        f"observation space {end} value is {value}. This is probably too {too}."
        for end, value, too in (("minimum", "-infinity", "low"), ("maximum", "infinity", "high"))]
    assert "\x1b" not in capsys.readouterr().err and not [w for w in recwarn if "gymnasium" in w.filename]


def test_check_env_names_what_a_broken_env_gets_wrong(monkeypatch, capsys):
    code, out = run_main(["check-env", "tests.envs.toy_envs:BrokenIgnoresSeed"], monkeypatch, capsys)
    assert code == 1 and "fails the turnrl env contract" in out and "seed" in out


def test_check_env_of_a_stochastic_env(monkeypatch, capsys):
    argv = ["check-env", "FrozenLake", "is_slippery=true"]
    assert run_main([*argv, "--stochastic"], monkeypatch, capsys)[0] == 0


def test_check_env_bad_id_is_a_clean_error():
    assert "unknown env 'Nope'" in error_exit(["check-env", "Nope"])


def test_a_module_class_env_imports_from_the_folder_the_command_runs_in(tmp_path):
    """The docs' ``my_package`` next to where the user types: the ``turnrl`` script (unlike ``python -m``)
    starts without the current folder on the import path, and once failed with "No module named 'my_package'"."""
    docs = (Path(__file__).resolve().parents[1] / "docs" / "extending.md").read_text()
    env_code = next(block for block in re.findall(r"```python\n(.*?)```", docs, re.S) if "class CorridorEnv" in block)
    package = tmp_path / "my_package"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "envs.py").write_text(env_code)
    result = run_turnrl("check-env", "my_package.envs:CorridorEnv", "length=6", cwd=tmp_path)
    assert result.returncode == 0 and "passes" in result.stdout, result.stdout + result.stderr
    played = run_turnrl("play", "my_package.envs:CorridorEnv", stdin=":hint\n:quit\n", cwd=tmp_path)
    assert played.returncode == 0 and "solver: [" in played.stdout, played.stdout + played.stderr


# --------------------------------------------------------------------------- eval








# --------------------------------------------------------------------------- rough edges a new user hits
def test_envs_fits_80_columns_keeps_settings_whole_and_shows_allowed_values(monkeypatch):
    result = run_turnrl("envs")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80
    words = {word for line in lines for word in line.split()}
    for name in env_names():
        for setting in setting_lines(name):
            head = setting.split(" ", 1)[0]  # name=default, never folded
            assert head in words, f"{head} cut in:\n{result.stdout}"
    assert "symbols='ragen' (ragen|alt|coords|grid_coords|vagen)" in result.stdout
    assert "reward_on='reach' (reach|stop)" in result.stdout
    assert "task='place' (align|place|stack|drawer)" in result.stdout  # from the Literal type of the setting


def test_pack_never_splits_an_item():
    items = ["a=1", "bb=22", "a_very_long_setting='x' (x|y|z)", "c=3"]
    lines = pack(items, 20, first="  s: ", rest="     ")
    assert lines == ["  s: a=1  bb=22", "     a_very_long_setting='x' (x|y|z)", "     c=3"]
    assert pack([], 20, "x", "y") == []


def test_play_reads_wasd_and_arrow_keys_as_directions(monkeypatch, capsys):
    """W/A/S/D are up/left/down/right: d is Right (it once was Down, FrozenLake's first letter)."""
    env = make("FrozenLake")
    env.reset(seed=0)
    plan = env.solve()
    keys = {"Up": "w", "Down": "\x1b[B", "Left": "a", "Right": "d"}
    stdin = "\n".join(keys[action] for action in plan) + "\n"
    code, out = run_main(["play", "FrozenLake", "--seed", "0"], monkeypatch, capsys, stdin)
    assert code == 0 and "(invalid action)" not in out
    assert f"Episode over: solved after {len(plan)} steps" in out
    assert "Keys: w=Up, a=Left, s=Down, d=Right or the arrow keys." in out


def test_play_writes_frames_only_where_asked_or_to_a_temporary_folder(monkeypatch, capsys, tmp_path):
    """Image frames go to --out, else to a new temporary folder the game names, never into the folder the
    command runs in (it once made play_<env>_<seed>/ there)."""
    here, temporary = tmp_path / "here", tmp_path / "tmp"
    here.mkdir()
    temporary.mkdir()
    monkeypatch.chdir(here)
    monkeypatch.setattr(tempfile, "tempdir", str(temporary))
    code, out = run_main(["play", "Sokoban", "--seed", "1", "mode=image"], monkeypatch, capsys, "Up\n:quit\n")
    assert code == 0 and list(here.iterdir()) == []
    (folder,) = temporary.iterdir()
    assert folder.name.startswith("turnrl-play-Sokoban-1-") and f"frames go to {folder}" in out
    assert sorted(p.name for p in folder.iterdir()) == ["turn_000.png", "turn_001.png"]
    code, out = run_main(["play", "Sokoban", "--seed", "1", "--out", "frames", "mode=image"], monkeypatch, capsys,
                         ":quit\n")
    assert [p.name for p in here.iterdir()] == ["frames"] and (here / "frames" / "turn_000.png").is_file()


def test_play_ctrl_c_ends_the_game_without_a_traceback(monkeypatch, capsys):
    def interrupted(prompt=""):
        raise KeyboardInterrupt

    monkeypatch.setattr("builtins.input", interrupted)
    assert main(["play", "FrozenLake"]) == 0
    assert "bye" in capsys.readouterr().out


@pytest.mark.parametrize("command", ["play", "render", "check-env"])
def test_a_negative_seed_is_a_usage_error_of_the_command(command, capsys):
    with pytest.raises(SystemExit) as info:
        main([command, "FrozenLake", "--seed", "-3", *(["-o", "x.png"] if command == "render" else [])])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"usage: turnrl {command}" in err and "negative" in err


def test_render_without_an_extension_writes_a_png_and_a_bad_one_is_named(tmp_path, capsys):
    assert main(["render", "FrozenLake", "-o", str(tmp_path / "frame")]) == 0
    assert Image.open(tmp_path / "frame.png").format == "PNG"
    assert "frame.png" in capsys.readouterr().out
    assert "'.xyz'" in error_exit(["render", "FrozenLake", "-o", str(tmp_path / "frame.xyz")])
    assert not (tmp_path / "frame.xyz").exists()


def test_version_and_every_option_has_help(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out.strip() == "turnrl 0.1.0"

    def check(parser, where):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, child in action.choices.items():
                    check(child, f"{where} {name}")
            elif not isinstance(action, argparse._HelpAction | argparse._VersionAction):
                assert action.help, f"{where} {action.dest} has no help"

    check(build_parser(), "turnrl")


def test_a_wrong_option_prints_the_usage_of_its_subcommand(capsys):
    with pytest.raises(SystemExit) as info:
        main(["eval", "--env", "FrozenLake", "--policy", "expert", "--bogus"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: turnrl eval") and "--bogus" in err


def test_config_show_lists_every_key_with_its_value_and_doc(monkeypatch, capsys):
    code, out = run_main(["config", "show"], monkeypatch, capsys)
    assert code == 0
    shown = {line.split(":", 1)[0] for line in out.splitlines() if line and not line.startswith("#")}
    assert shown == {item.key for item in config_keys(TrainConfig)}
    assert "agent.max_turns: 5  # Model responses per episode" in out
    assert "run.keep_checkpoints: 0  # Keep only the newest N checkpoints" in out
    recipe = Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml"
    code, out = run_main(["config", "show", "--config", str(recipe), "run.steps=7"], monkeypatch, capsys)
    assert "run.name: 'quickstart'" in out and "run.steps: 7" in out
    code, out = run_main(["config", "show", "--eval"], monkeypatch, capsys)
    assert "policy: 'expert'" in out and "run.steps" not in out
    assert "did you mean agent.max_turns" in error_exit(["config", "show", "agent.max_turn=3"])


def test_config_show_eval_of_a_training_recipe_shows_what_eval_reads_of_it(monkeypatch, capsys, tmp_path):
    # It refused the recipe's first training section ("Key 'run' not in 'EvalConfig'"), where `turnrl eval
    # --config` skips those sections and samples at the recipe's validation temperature.
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("run: {steps: 3}\nenv: {id: Sokoban}\nsampling: {temperature: 1.0}\n"
                      "validation: {temperature: 0.25}\n")
    code, out = run_main(["config", "show", "--eval", "--config", str(recipe)], monkeypatch, capsys)
    assert code == 0 and "env.id: 'Sokoban'" in out and "sampling.temperature: 0.25" in out and "run." not in out
    code, out = run_main(["config", "show", "--eval", "--config", str(recipe), "sampling.temperature=0"],
                         monkeypatch, capsys)
    assert "sampling.temperature: 0.0" in out




@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["env.id=Chess"], "unknown env 'Chess'"),
        (["env.settings.sizee=4"], "no setting sizee"),
        (["env.id=Sokoban", "env.settings.size=abc"], "env.settings.size='abc'"),
        (["sft.enabled=true", "sft.data=missing.jsonl"], "sft.data='missing.jsonl'"),
        (["agent.max_turn=3"], "did you mean agent.max_turns"),
    ],
)
def test_train_errors_are_one_clean_line_before_anything_is_written(overrides, needle, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    message = error_exit(["train", "model.path=no_model", *overrides])
    assert needle in message
    assert not (tmp_path / "runs").exists()


def test_train_resume_of_a_folder_that_is_not_a_run(tmp_path):
    assert "not a run directory" in error_exit(["train", f"resume={tmp_path}"])


def test_train_on_several_processes_launches_them_without_loading_the_models(tmp_path):
    """``distributed.nproc_per_node=N`` starts N processes that each load the models; the launcher before them
    reads the config only (transformers' model classes took it seconds to import, every distributed start)."""
    code = (
        "import sys\n"
        "from turnrl import cli\n"
        "cli.launch_processes = lambda nproc, config, overrides: print('launch', nproc) or 0\n"
        f"status = cli.main(['train', 'model.device=cpu', 'run.output_dir={tmp_path}', "
        "'distributed.nproc_per_node=2'])\n"
        "print(sorted(m for m in ('transformers', 'turnrl.models', 'turnrl.training.commands') if m in sys.modules))\n"
        "sys.exit(status)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split("\n")[:2] == ["launch 2", "[]"]


def test_serve_policy_takes_model_settings_and_names_a_bad_one(monkeypatch):
    assert "dtypo" in error_exit(["serve-policy", "--model", "nowhere", "dtypo=bfloat16"])
    assert "model.dtype" in error_exit(["serve-policy", "--model", "nowhere", "model.dtype=float8"])


@settings(max_examples=300, deadline=None)
@given(text=st.text())
def test_seed_and_count_arguments_take_any_text(text):
    for parse in (seed_arg, count):
        try:
            value = parse(text)
        except argparse.ArgumentTypeError as error:
            assert str(error)
        else:
            assert value >= 0


_SETTING_WORDS = st.text("ab.=[]{}$,:0 1'\"-", max_size=12)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.one_of(st.text(), _SETTING_WORDS, _SETTING_WORDS.map("size=".__add__)), max_size=3))
@example(["[=1"])  # OmegaConf's IndexError: a key it cannot split
@example(["a=${"])  # OmegaConf's GrammarParseError: an interpolation it cannot read
@example(["a=[1]", "a.x=2"])  # int()'s ValueError: a list's index that is no number
@example(["a=[1]", "a.5=2"])  # OmegaConf's ConfigIndexError: past the list's end
@example(["a." * 3000 + "b=1"])  # RecursionError: a key 3,000 names deep
def test_any_settings_words_are_settings_or_a_clean_exit(words):
    """``key=value`` words of play, render and check-env: a dict, or a SystemExit naming the setting at fault."""
    try:
        parsed = parse_settings(words)
    except SystemExit as exit_:
        assert str(exit_.code).startswith(("error: setting ", "error: settings ")), exit_.code
        return
    assert isinstance(parsed, dict) and (parsed or not words)


@settings(max_examples=100, deadline=None)
@given(st.one_of(st.text(), st.text("0123456789,- ")))
def test_any_gpu_counts_text_is_counts_or_an_argument_error(text):
    try:
        counts = gpu_counts(text)
    except argparse.ArgumentTypeError as error:
        assert "GPU counts" in str(error), error
        return
    assert counts and all(isinstance(count, int) and count >= 1 for count in counts)


@settings(max_examples=100, deadline=None)
@given(st.one_of(st.text(), st.text("0123456789.-+eEinfa_ ")))
def test_any_gpu_memory_text_is_gib_above_0_or_an_argument_error(text):
    try:
        gib = gib_arg(text)
    except argparse.ArgumentTypeError as error:
        assert "GiB" in str(error), error
        return
    assert math.isfinite(gib) and gib > 0


# --------------------------------------------------------------------------- models not there, busy ports




@pytest.mark.parametrize(
    ("model", "needle"),
    [("runs/nothere", "--model='runs/nothere' does not exist"),
     ("nobody/nothere", "--model='nobody/nothere' is neither a local directory nor in the local Hugging Face cache")],
)
def test_serve_policy_of_a_model_that_is_not_there_is_one_line(model, needle, unreachable_hub, tmp_path,
                                                               monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    message = error_exit(["serve-policy", "--model", model, "--port", "0"])
    assert needle in message and "\n" not in message
    assert "serving" not in capsys.readouterr().out


def test_serve_policy_on_a_busy_port_stops_before_the_model_loads(monkeypatch, capsys):
    import socket

    import turnrl.serve.policy as server

    def never(*args, **kwargs):
        raise AssertionError("the model loaded although the port is busy")

    monkeypatch.setattr(server, "load_policy", never)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        message = error_exit(["serve-policy", "--model", "builtin:tiny", "--port", str(port)])
    assert message == f"error: port {port} on 127.0.0.1 is in use (another server, or a serve-policy still " \
                      "running); pick a free one with --port N, or stop what listens there"
    assert "serving" not in capsys.readouterr().out
    assert "not an address" in error_exit(["serve-policy", "--model", "builtin:tiny", "--host", "no.such.host."])


def test_train_from_a_hub_id_without_internet_is_one_line_and_writes_nothing(unreachable_hub, tmp_path):
    message = error_exit(["train", "--config", str(QUICKSTART), "model.path=Qwen/Qwen2.5-0.5B-Instruct",
                          f"run.output_dir={tmp_path / 'runs'}"])
    assert "model.path='Qwen/Qwen2.5-0.5B-Instruct' is neither a local directory nor in the local Hugging Face " \
           "cache, and the hub cannot be reached" in message
    assert not (tmp_path / "runs").exists()


# --------------------------------------------------------------------------- a checkpoint keeps its run's prompts








# --------------------------------------------------------------------------- eval on env variants












def test_memory_estimates_a_recipe_on_several_gpu_counts_without_a_gpu(monkeypatch, capsys, builtin_dir):
    argv = ["memory", "--config", "configs/ragen_sokoban.yaml", "--gpus", "1,4", "--gpu-gib", "79.2",
            "model.builtin_preset=tiny", f"model.builtin_dir={builtin_dir}"]
    code, out = run_main(argv, monkeypatch, capsys)
    assert code == 0, out
    assert "the built-in 'tiny': " in out and "M parameters" in out
    assert "  1 GPU: fits (" in out and "  4 GPUs: fits (" in out
    code, out = run_main([*argv[:6], "0.001", *argv[7:]], monkeypatch, capsys)  # a GPU of 1 MiB
    assert code == 1 and "1 GPU: does not fit" in out and "turn on " in out
    code, out = run_main([*argv, "run.gpu_share=0.000001"], monkeypatch, capsys)  # its share of 79.2 GiB: 83 KiB
    assert code == 1 and "run.gpu_share=1e-06 is 0.0 GiB" in out and "1 GPU: does not fit" in out


@pytest.mark.parametrize("gpus", ["0", "two", "1,,2"])
def test_memory_refuses_gpu_counts_that_are_not_counts(gpus, monkeypatch):
    with pytest.raises(SystemExit) as info:
        main(["memory", "--gpus", gpus])
    assert info.value.code == 2


@pytest.mark.parametrize("gib", ["-5", "0", "nan", "inf", "lots"])
def test_memory_refuses_a_gpu_memory_that_is_not_a_positive_number(gib, monkeypatch, capsys):
    # A negative or NaN memory was estimated against ("of the GPU's nan GiB") instead of refused.
    with pytest.raises(SystemExit) as info:
        main(["memory", "--gpu-gib", gib])
    assert info.value.code == 2
    assert "argument --gpu-gib: " in capsys.readouterr().err




@pytest.mark.parametrize("port", ["-1", "70000", "http"])
def test_serve_policy_refuses_a_port_that_is_not_one(port, capsys):
    # -1 reached the server, which blamed --host ("is not an address to listen on").
    with pytest.raises(SystemExit) as info:
        main(["serve-policy", "--model", "builtin", "--port", port])
    assert info.value.code == 2 and "argument --port: " in capsys.readouterr().err


def test_serve_policy_hands_its_body_deadlines_to_the_server(monkeypatch):
    import turnrl.serve.policy as policy

    handed = {}
    monkeypatch.setattr(policy, "serve", lambda **kwargs: handed.update(kwargs))
    main(["serve-policy", "--model", "builtin", "--body-timeout-s", "600", "--body-stall-s", "inf"])
    assert (handed["body_timeout_s"], handed["body_stall_s"]) == (600.0, float("inf"))
    main(["serve-policy", "--model", "builtin"])
    assert (handed["body_timeout_s"], handed["body_stall_s"]) == (policy.DEFAULT_BODY_TIMEOUT_S,
                                                               policy.DEFAULT_BODY_STALL_S)


@pytest.mark.parametrize("value", ["0", "-1", "nan", "soon"])
def test_serve_policy_refuses_a_body_deadline_that_is_no_time(value, capsys):
    with pytest.raises(SystemExit) as info:
        main(["serve-policy", "--model", "builtin", "--body-stall-s", value])
    assert info.value.code == 2 and "argument --body-stall-s: " in capsys.readouterr().err




def test_train_refuses_two_runs_to_resume(tmp_path):
    # The first run's config.yaml was read and the last run's checkpoints resumed.
    with pytest.raises(SystemExit) as info:
        main(["train", f"resume={tmp_path / 'a'}", f"resume={tmp_path / 'b'}"])
    assert str(info.value.code) == f"error: resume= is given 2 times ({tmp_path / 'a'}, {tmp_path / 'b'}); give one run"


def test_play_commands_are_never_moves_and_an_unknown_one_says_so(monkeypatch, capsys):
    """``:help`` and ``q`` were stepped as actions (reward -0.1, invalid action each); an unknown ``:word`` too."""
    stdin = ":help\n:jump\n?\nq\nDown\n"
    code, out = run_main(["play", "FrozenLake", "--seed", "0"], monkeypatch, capsys, stdin)
    assert code == 0
    assert "reward" not in out and "(invalid action)" not in out  # no step was taken
    assert out.count("Commands: :hint") == 4  # the start, :help, the unknown :jump and ?
    assert "unknown command :jump; no step taken" in out
    assert out.count("action> ") == 4  # Down after q is never read


def test_play_an_action_named_like_a_command_stays_an_action():
    from turnrl.play import play_command

    assert play_command("q", ["Up", "Down"]) == "quit" and play_command(" :HELP ", None) == "help"
    assert play_command("q", ["q", "w"]) is None and play_command("Up", ["Up"]) is None
    assert play_command(":teleport", ["Up"]) == "unknown" and play_command("Jump", ["Up"]) is None


def test_resume_of_a_checkpoint_folder_names_its_run(tmp_path):
    """A checkpoint keeps a copy of its run's config.yaml; resuming it would lock and write inside the checkpoint,
    so it is refused with the run to resume."""
    checkpoint = tmp_path / "run" / "checkpoints" / "step_000002"
    checkpoint.mkdir(parents=True)
    (checkpoint / "config.yaml").write_text("run:\n  name: run\n")
    (checkpoint / "trainer_state.pt").write_bytes(b"")
    expected = f"is a checkpoint, not a run directory: resume the run \\(resume={tmp_path / 'run'}\\)"
    with pytest.raises(SystemExit, match=expected):
        main(["train", f"resume={checkpoint}"])
    assert sorted(p.name for p in checkpoint.iterdir()) == ["config.yaml", "trainer_state.pt"]


def test_render_into_a_path_under_a_file_is_one_line(tmp_path):
    # mkdir of the image's folder raised FileExistsError as a traceback.
    (tmp_path / "notes.txt").write_text("kept")
    message = error_exit(["render", "FrozenLake", "-o", str(tmp_path / "notes.txt" / "frame.png")])
    assert "cannot write the image there" in message and "give a file path in a folder" in message
    assert "\n" not in message and (tmp_path / "notes.txt").read_text() == "kept"


def test_memory_of_a_model_path_that_is_not_there_says_so_as_train_does(tmp_path):
    # It quoted the hub client ("Repo id must be in the form 'repo_name' or 'namespace/repo_name'").
    message = error_exit(["memory", f"model.path={tmp_path / 'no_model'}"])
    assert message == (f"error: model.path={str(tmp_path / 'no_model')!r} does not exist; give a model directory "
                       "(with config.json) or a Hugging Face hub id (org/name)")


def test_train_resume_of_what_is_not_a_run_says_which_folder_to_give(tmp_path):
    (tmp_path / "config.txt").write_text("")
    run = "give the folder `turnrl train` wrote (run.output_dir/run.name, e.g. runs/quickstart)"
    assert error_exit(["train", f"resume={tmp_path / 'gone'}"]) == \
        f"error: resume={str(tmp_path / 'gone')!r} does not exist; {run}"
    assert error_exit(["train", "resume="]) == f"error: resume='' does not exist; {run}"
    assert error_exit(["train", f"resume={tmp_path / 'config.txt'}"]) == \
        f"error: resume={str(tmp_path / 'config.txt')!r} is a file, not a run directory; {run}, the one that holds " \
        "config.yaml"
    assert error_exit(["train", f"resume={tmp_path}"]).endswith(f"(it has no config.yaml); {run}")
